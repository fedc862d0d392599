"""Full softmax attention (Vaswani et al., 2017), optionally with rotary position embedding.

``naive``: the reference, with explicit rotation matrices. ``sdpa``: through ``scaled_dot_product_attention``.
``rotary``: RoPE applied to queries and keys.
"""
from .naive import rotation_matrix, softmax_attention_naive
from .rotary import apply_rotary, rotary_angles
from .sdpa import softmax_attention

__all__ = ["softmax_attention", "softmax_attention_naive", "apply_rotary", "rotary_angles", "rotation_matrix"]
