"""How sharp a head Performer's stabilised fast forms follow: outputs and gradients against the float64 log-space
reference, as the queries' and keys' scale grows (DESIGN, "Performer's range"):

    python tests/performer_range.py

Head dimension 64, 256 features, 128 tokens, 2 heads; one row per scale, form and dtype. "largest logit" is the
largest ``|q . k| / sqrt(D)`` of the draw, the logit softmax attention would see.
"""
from __future__ import annotations

import torch

from lavo.ops.performer import (orthogonal_random_features, performer_attention, performer_attention_causal,
                                performer_attention_log_space)

SCALES = (2, 4, 6, 8, 10, 11, 12, 15)


def errors(q, k, v, projection, *, causal, dtype):
    """Largest output difference from the reference, and whether every gradient is finite."""
    inputs = [t.detach().to(dtype).requires_grad_() for t in (q, k, v)]
    out = (performer_attention_causal(*inputs, projection.to(dtype))[0] if causal
           else performer_attention(*inputs, projection.to(dtype)))
    reference = performer_attention_log_space(q, k, v, projection, causal=causal)
    out.sum().backward()
    return (out.double() - reference).abs().max().item(), all(t.grad.isfinite().all().item() for t in inputs)


def main():
    projection = orthogonal_random_features(256, 64, torch.Generator().manual_seed(0)).double()
    print("| scale | largest logit | form | dtype | largest output error | gradients finite |")
    print("|---:|---:|---|---|---:|---|")
    for scale in SCALES:
        g = torch.Generator().manual_seed(scale)
        q, k = (scale * torch.randn(1, 128, 2, 64, generator=g, dtype=torch.float64) for _ in range(2))
        v = torch.randn(1, 128, 2, 64, generator=g, dtype=torch.float64)
        logit = torch.einsum("bthd,bshd->bhts", q, k).abs().max().item() / 8
        for causal in (False, True):
            for dtype in (torch.float32, torch.float64):
                error, finite = errors(q, k, v, projection, causal=causal, dtype=dtype)
                print(f"| {scale} | {logit:.0f} | {'causal' if causal else 'non-causal'} | "
                      f"{str(dtype).removeprefix('torch.')} | {error:.1e} | {'yes' if finite else 'no'} |")


if __name__ == "__main__":
    main()
