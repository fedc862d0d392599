"""Pure tensor functions, one subpackage per mechanism. Layout ``[B, T, H, D]`` (batch, time, heads, head dim).

Each mechanism's ``naive`` module is its reference (the paper's equations as loops) beside the fast form(s);
``common`` holds what several mechanisms share.
"""
from .lavo import (code_cross_attention, code_cross_attention_naive, lavo_attention, lavo_attention_cached,
                   lavo_attention_naive, lavo_decode_step, memory_read, orthogonal_basis, project)
from .local import local_attention, local_attention_chunk, local_attention_naive

__all__ = [
    "orthogonal_basis", "lavo_attention", "lavo_attention_cached", "lavo_decode_step", "local_attention",
    "local_attention_chunk", "code_cross_attention", "memory_read", "project", "lavo_attention_naive",
    "local_attention_naive", "code_cross_attention_naive",
]
