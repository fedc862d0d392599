"""Probe 1's plots and tables from its results.json: accuracy against the gap, one plot per number of pairs, and
the tables of REPORT.md (between its ``<!-- BEGIN name -->`` / ``<!-- END name -->`` markers).

    python experiments/recall/report.py experiments/recall [REPORT.md]

Table names start with the folder's name (``recall-pairs1``, ``single-pairs1``, ``recall-cost``, ...), so the
sweeps of several folders can fill one report.
"""
from __future__ import annotations

import json
import sys
from pathlib import Path

from lavo.files import write_text
from lavo.model import build_model
from lavo.report import line_plot, markdown_table

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from report_tools import experiment_folder, fill  # noqa: E402  (experiments/ is not a package)

STATE_CONTEXT = 4096  # decoding-state bytes are quoted at this context


def accuracy_table(result: dict, pairs: int) -> str:
    window = result["config"]["window"]
    gaps = result["config"]["gaps"]
    header = ["model"] + [f"gap {g} ({g / window:g}w)" for g in gaps]
    rows = [[name] + [f"{record['accuracy'][f'{pairs},{g}']:.2f}" for g in gaps]
            for name, record in result["models"].items()]
    return markdown_table(header, rows)


def state_bytes(config: dict, settings: dict, vocab_size: int) -> int:
    """Decoding-cache bytes of the whole model (batch 1, float32) after ``STATE_CONTEXT`` tokens."""
    model_settings = {k: v for k, v in settings.items() if k != "train"}  # "train": the model's training settings
    model = build_model({"vocab_size": vocab_size, **config["model"], **model_settings})
    return sum(block.attention.cache_nbytes(1, STATE_CONTEXT) for block in model.blocks)


def cost_table(result: dict) -> str:
    config = result["config"]
    vocab_size = sum(config["vocabulary"].values())
    rows = [[name, json.dumps({k: v for k, v in record["settings"].items() if k != "attention"}),
             f"{record['parameters']:,}",
             f"{record['train_seconds']:.0f}", f"{record['final_loss']:.3f}",
             f"{state_bytes(config, record['settings'], vocab_size):,}"]
            for name, record in result["models"].items()]
    return markdown_table(["model", "settings", "params", "training time (s)", "final loss",
                           f"decoding state at {STATE_CONTEXT} tokens (bytes)"], rows, align="llrrrr")


def speed_table(speed: dict) -> str:
    settings = speed["settings"]
    rows = [[name, f"{row['train_step_s']:.3f}", f"{row['decode_step_ms']:.2f}", f"{row['state_bytes']:,}"]
            for name, row in speed["layers"].items()]
    return markdown_table(["layer", f"forward + backward, T={settings['length']:,} (s)", "one decoding step (ms)",
                           "decoding state (bytes)"], rows)


def plots(exp: Path, result: dict) -> None:
    window = result["config"]["window"]
    for pairs in result["config"]["pairs"]:
        series = {name: [(g, record["accuracy"][f"{pairs},{g}"]) for g in result["config"]["gaps"]]
                  for name, record in result["models"].items()}
        series["chance"] = [(g, result["chance"]) for g in result["config"]["gaps"]]
        title = f"multi-query associative recall, {pairs} pair{'s' if pairs > 1 else ''}"
        line_plot(series, exp / f"recall_pairs{pairs}.png", xlabel="filler tokens between pairs and queries",
                  ylabel="recall accuracy", title=title, vline=(window, "window"), dashed=["chance"])


def main(argv: list[str]) -> None:
    exp = experiment_folder(argv, "report.py EXPERIMENT_DIR [REPORT.md] (experiments/recall, or its single/)")
    report = Path(argv[1]) if len(argv) > 1 else exp / "REPORT.md"
    result = json.loads((exp / "results.json").read_text())
    plots(exp, result)
    tables = {f"pairs{p}": accuracy_table(result, p) for p in result["config"]["pairs"]}
    tables["cost"] = cost_table(result)
    if (exp / "speed.json").exists():
        tables["speed"] = speed_table(json.loads((exp / "speed.json").read_text()))
    tables = {f"{exp.name}-{name}": table for name, table in tables.items()}
    write_text(exp / "tables.md", "".join(f"## {k}\n\n{v}\n\n" for k, v in tables.items()))
    fill(report, tables)


if __name__ == "__main__":
    main(sys.argv[1:])
