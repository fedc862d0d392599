"""Multivariate long-horizon forecasting with an encoder-decoder whose cross attention is any registered one.

``data``: the datasets, splits, standardisation and windows. ``model``: the Informer-style forecaster.
``baselines``: repeat-last, seasonal naive, DLinear. ``experiment``: one cell trained and scored, and sweeps of
cells recorded in a results file (``lavo forecast``).
"""
