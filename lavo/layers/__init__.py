"""One module per mechanism; :mod:`lavo.registry` names them."""
from .base import AttentionLayer, Mechanism
from .lavo import LavoAttention, LavoCrossAttention

__all__ = ["AttentionLayer", "Mechanism", "LavoAttention", "LavoCrossAttention"]
