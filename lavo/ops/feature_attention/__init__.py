r"""Attention through positive feature maps, ``o_t = phi(q_t) S / phi(q_t) z``: what Performer and cosFormer share.

``naive``: the explicit ``[T, S]`` weights. ``prefix_sums``: by associativity (non-causal) and by chunked prefix
sums (causal).
"""
from .naive import feature_attention_naive
from .prefix_sums import causal_feature_attention, check_sums, feature_attention

__all__ = ["feature_attention", "causal_feature_attention", "feature_attention_naive", "check_sums"]
