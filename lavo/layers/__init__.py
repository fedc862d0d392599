"""One module per mechanism; :mod:`lavo.registry` names them."""
from .base import AttentionLayer, CrossAttentionLayer, Mechanism, after_optimizer_step
from .lavo import LavoAttention, LavoCrossAttention

__all__ = ["AttentionLayer", "CrossAttentionLayer", "Mechanism", "LavoAttention", "LavoCrossAttention",
           "after_optimizer_step"]
