"""One module per attention mechanism; importing this package registers them all."""
from .base import AttentionLayer
from .lavo import LavoAttention, LavoCrossAttention

__all__ = ["AttentionLayer", "LavoAttention", "LavoCrossAttention"]
