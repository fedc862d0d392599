"""LAVO: local window attention plus an orthogonal memory of its outputs (Zhang et al., 2023).

``naive``: the paper's equations as loops, the reference (read it first). ``basis``: the orthonormal bases.
``memory``: projection onto the basis and the chunked memory read. ``blocked``: the full op, a window at a time.
``decoding``: the causal op continued from a constant-size cache. ``step``: one decoding step on a fixed-layout
cache, updated in place (``step_kernel``: the same step as one Triton kernel). ``cross``: cross attention through
the memory.
"""
from .basis import orthogonal_basis
from .blocked import lavo_attention
from .cross import code_cross_attention
from .decoding import lavo_attention_cached
from .memory import memory_read, project
from .naive import code_cross_attention_naive, lavo_attention_naive, memory_read_naive
from .step import lavo_decode_step

__all__ = ["orthogonal_basis", "lavo_attention", "lavo_attention_cached", "lavo_decode_step",
           "code_cross_attention",
           "memory_read", "project", "lavo_attention_naive", "code_cross_attention_naive", "memory_read_naive"]
