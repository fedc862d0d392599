"""LAVO: linear attention via orthogonal memory (Zhang et al., 2023)."""
from . import ops
from .cache import LavoCache
from .layers import LavoAttention, LavoCrossAttention, Mechanism
from .registry import (available_attentions, available_cross_attentions, build_attention, build_cross_attention,
                       register_attention)

__version__ = "0.1.0"
__all__ = ["ops", "LavoCache", "LavoAttention", "LavoCrossAttention", "Mechanism", "available_attentions",
           "available_cross_attentions", "build_attention", "build_cross_attention", "register_attention"]
