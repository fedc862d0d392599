"""Sliding-window attention with a relative-position bias: LAVO's local branch, also a baseline of its own.

``naive``: the reference, one query at a time. ``blocked``: the fast form (blocks of ``w`` queries against their
neighbouring keys, a hand-written backward). ``decoding``: a chunk of queries against cached keys.
"""
from .blocked import block_bias, blocked_local_attention, from_blocks, local_attention, real_tokens, to_blocks
from .decoding import keep_visible, local_attention_chunk, visible_keys, visible_length
from .naive import local_attention_naive

__all__ = ["local_attention", "local_attention_chunk", "local_attention_naive", "keep_visible", "visible_keys",
           "visible_length", "block_bias", "blocked_local_attention", "to_blocks", "from_blocks", "real_tokens"]
