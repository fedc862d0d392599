"""Long-short attention (Transformer-LS, Zhu et al., 2021): a sliding window plus dynamic low-rank projections.

``naive``: the reference, each query's keys and landmarks listed one by one. ``blocked``: the fast form.
"""
from .blocked import longshort_attention
from .naive import longshort_attention_naive

__all__ = ["longshort_attention", "longshort_attention_naive"]
