"""cosFormer (Qin et al., 2022): ReLU features with a cos re-weighting of the distance.

``naive``: the reference, explicit weights. ``features``: the feature map and the fast forms over
:mod:`lavo.ops.feature_attention`, the cross form among them.
"""
from .features import (CosformerCache, cosformer_attention, cosformer_attention_causal, cosformer_cross_attention,
                       cosformer_features)
from .naive import cosformer_attention_naive, cosformer_cross_attention_naive

__all__ = ["cosformer_attention", "cosformer_attention_causal", "cosformer_attention_naive", "cosformer_features",
           "cosformer_cross_attention", "cosformer_cross_attention_naive", "CosformerCache"]
