"""Attention with bounded-memory control (ABC, Peng et al., 2022), learned-control variant.

``naive``: the reference, one query at a time. ``chunked``: the fast form (causal: prefix sums a chunk of
positions at a time, which are also the decoding cache) and the cross form (the memory written from a source).
"""
from .chunked import ABCCache, abc_attention, abc_cross_attention
from .naive import abc_attention_naive, abc_cross_attention_naive

__all__ = ["abc_attention", "abc_attention_naive", "abc_cross_attention", "abc_cross_attention_naive", "ABCCache"]
