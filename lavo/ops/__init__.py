"""Pure tensor functions. Layout ``[B, T, H, D]`` (batch, time, heads, head dim) throughout."""
from .basis import orthogonal_basis
from .lavo import empty_cache, lavo_attention, lavo_attention_cached
from .local import local_attention, local_attention_chunk
from .memory import code_cross_attention, memory_read, project
from .naive import code_cross_attention_naive, lavo_attention_naive, local_attention_naive

__all__ = [
    "orthogonal_basis", "lavo_attention", "lavo_attention_cached", "empty_cache", "local_attention",
    "local_attention_chunk", "code_cross_attention", "memory_read", "project", "lavo_attention_naive",
    "local_attention_naive", "code_cross_attention_naive",
]
