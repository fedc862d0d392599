"""FAVOR+ (Performer, Choromanski et al., 2021): softmax attention through positive orthogonal random features.

``naive``: the references, the explicit weights and the same weights in log space. ``features``: the feature map
and the fast forms over :mod:`lavo.ops.feature_attention`.
"""
from .features import (PerformerCache, favor_exponents, orthogonal_random_features, performer_attention,
                       performer_attention_causal)
from .naive import performer_attention_log_space, performer_attention_naive

__all__ = ["performer_attention", "performer_attention_causal", "performer_attention_naive",
           "performer_attention_log_space", "orthogonal_random_features", "favor_exponents", "PerformerCache"]
