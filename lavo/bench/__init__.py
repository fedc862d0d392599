"""Efficiency benchmark: ``python -m lavo.bench --help`` (or ``lavo bench``).

Four sections, each selectable with ``--sections``:

``attention`` (:mod:`.attention`)
    Every registered attention layer (``dim = H * D``, with its projections) and two raw ops, the
    :func:`~lavo.ops.lavo_attention` op and ``scaled_dot_product_attention(is_causal=True)`` (SDPA): forward
    (under ``no_grad``) and forward + backward time and peak memory against the sequence length. Quadratic
    mechanisms stop at ``--max-quadratic-length``. ``ratio`` is the time over SDPA's at the same length and pass.
``decode`` (:mod:`.decode`)
    Per-token step time and cache bytes against the context length for causal layers with a decoding form.
``model`` (:mod:`.model`)
    Training throughput (tokens/s; forward, loss, backward, clipping, AdamW step) and peak memory of the whole
    language model for a preset, per attention.
``flops`` (:mod:`.flops`)
    LAVO's own FLOPs counted analytically (:func:`~lavo.bench.flops.lavo_flops`), divided by the measured op
    time, against the rate of a large square matmul measured in the same run.

How one measurement is taken is in :mod:`.measure`; :mod:`.runner` runs them in order and skips what would be too
slow; :mod:`.settings` holds the defaults, :mod:`.output` the tables, plots and JSON, :mod:`.cli` the command line.
"""
