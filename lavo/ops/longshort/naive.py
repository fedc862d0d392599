r"""Long-short attention with each query's window keys and landmarks listed one by one: the reference of
:mod:`.blocked`. Quadratic; small inputs only."""
from __future__ import annotations

import torch


def layer_norm_written_out(x, weight, bias, eps=1e-5):
    """``x [..., H, D]`` normalised over its ``H D`` features: ``(x - mean) / sqrt(var + eps) * weight + bias``."""
    flat = x.reshape(*x.shape[:-2], -1)
    mean = flat.mean(-1, keepdim=True)
    variance = ((flat - mean) ** 2).mean(-1, keepdim=True)
    return ((flat - mean) / torch.sqrt(variance + eps) * weight + bias).reshape(x.shape)


def longshort_attention_naive(q, k, v, projection, *, window, causal=True, padding_mask=None, scale=None,
                              dual_norm=None):
    """Reference for :func:`longshort_attention`: each query's keys and landmarks listed one by one."""
    B, T, H, D = q.shape
    if dual_norm is None:
        short = long = lambda x: x  # noqa: E731
    else:
        (short_weight, short_bias), (long_weight, long_bias) = dual_norm
        short = lambda x: layer_norm_written_out(x, short_weight, short_bias)  # noqa: E731
        long = lambda x: layer_norm_written_out(x, long_weight, long_bias)  # noqa: E731
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
            keys, values = torch.einsum("jhr,jhd->rhd", p, k[b, j]), torch.einsum("jhr,jhd->rhd", p, v[b, j])
            return long(keys).transpose(0, 1), long(values).transpose(0, 1)  # [H, r, D]

        segments = [landmarks(s * window, (s + 1) * window) for s in range(-(-T // window))]
        everything = landmarks(0, T)
        for t in range(T):
            if not mask[b, t]:
                continue
            c = t // window
            hi = t + 1 if causal else (c + 2) * window
            j = [i for i in range(max(0, (c - 1) * window), min(hi, T)) if mask[b, i]]
            far = [s for s in segments[:c] if s is not None] if causal else [everything]
            keys = torch.cat([short(k[b, j]).transpose(0, 1)] + [s[0] for s in far], 1)  # [H, keys, D]
            values = torch.cat([short(v[b, j]).transpose(0, 1)] + [s[1] for s in far], 1)
            weights = (torch.einsum("hd,hjd->hj", q[b, t], keys) * scale).softmax(-1)
            out[b, t] = torch.einsum("hj,hjd->hd", weights, values)
    return out
