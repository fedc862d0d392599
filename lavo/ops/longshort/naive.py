r"""Long-short attention with each query's window keys and landmarks listed one by one: the reference of
:mod:`.blocked`. Quadratic; small inputs only."""
from __future__ import annotations

import torch


def longshort_attention_naive(q, k, v, projection, *, window, causal=True, padding_mask=None, scale=None):
    """Reference for :func:`longshort_attention`: each query's keys and landmarks listed one by one."""
    B, T, H, D = q.shape
    scale = D ** -0.5 if scale is None else scale
    mask = torch.ones(B, T, dtype=torch.bool) if padding_mask is None else padding_mask
    out = torch.zeros_like(q)
    for b in range(B):
        def landmarks(lo, hi):
            """[H, r, D] keys and values of the real positions in [lo, hi), or None when there are none."""
            j = [i for i in range(lo, min(hi, T)) if mask[b, i]]
            if not j:
                return None
            p = torch.einsum("jhd,hdr->jhr", k[b, j], projection).softmax(0)
            return torch.einsum("jhr,jhd->hrd", p, k[b, j]), torch.einsum("jhr,jhd->hrd", p, v[b, j])

        segments = [landmarks(s * window, (s + 1) * window) for s in range(-(-T // window))]
        everything = landmarks(0, T)
        for t in range(T):
            if not mask[b, t]:
                continue
            c = t // window
            hi = t + 1 if causal else (c + 2) * window
            j = [i for i in range(max(0, (c - 1) * window), min(hi, T)) if mask[b, i]]
            far = [s for s in segments[:c] if s is not None] if causal else [everything]
            keys = torch.cat([k[b, j].transpose(0, 1)] + [s[0] for s in far], 1)  # [H, keys, D]
            values = torch.cat([v[b, j].transpose(0, 1)] + [s[1] for s in far], 1)
            weights = (torch.einsum("hd,hjd->hj", q[b, t], keys) * scale).softmax(-1)
            out[b, t] = torch.einsum("hj,hjd->hd", weights, values)
    return out
