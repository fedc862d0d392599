"""What the probes over trained LMs (context use, passkey) share: the run arguments and each run's held-out
(and training) tokens, read with the run's own tokenizer."""
from __future__ import annotations

import argparse
from pathlib import Path
from typing import Iterator


def run_parser(description: str) -> argparse.ArgumentParser:
    """A parser with the runs to probe, ``--data-dir`` (default: each run's own) and ``--out``."""
    parser = argparse.ArgumentParser(description=description)
    parser.add_argument("runs", nargs="+", help="trained run directories")
    parser.add_argument("--data-dir", default=None, help="where the runs' data is, if not where they trained")
    parser.add_argument("--out", required=True)
    return parser


def load_runs(runs: list[str], data_dir: str | None, splits: tuple[str, ...]) -> Iterator[tuple]:
    """``(name, model, config, tokenizer, {split: tokens})`` for each run directory, loaded one at a time."""
    from lavo.data import split_tokens
    from lavo.run import load_run

    for run in runs:
        model, config, tokenizer = load_run(run)
        where = data_dir or config.data.data_dir
        tokens = {s: split_tokens(config.data.source, where, config.data.holdout, s, tokenizer) for s in splits}
        yield Path(run).name, model, config, tokenizer, tokens
