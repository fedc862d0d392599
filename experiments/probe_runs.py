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
    """``(name, model, config, tokenizer, {split: tokens})`` for each run directory, loaded one at a time; the
    documents are checked against those the run recorded, as `lavo eval` checks them."""
    from lavo.data import tokenize
    from lavo.evaluate import run_documents
    from lavo.run import load_run, recorded_documents

    for run in runs:
        model, config, tokenizer = load_run(run)
        tokens = {s: tokenize(run_documents(config, s, data_dir, recorded=recorded_documents(run)), tokenizer)
                  for s in splits}
        yield Path(run).name, model, config, tokenizer, tokens
