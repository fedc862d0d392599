"""Collect experiments/listops/runs/*/results.json into results.json, the accuracy table beside the published
numbers (tables.md and REPORT.md) and the plot of validation accuracy against steps.

    python experiments/listops/report.py experiments/listops
"""
from __future__ import annotations

import json
import re
import sys
from pathlib import Path

from lavo.files import write_json, write_text
from lavo.listops import ListOpsSpec, make_splits
from lavo.report import line_plot, markdown_table

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from report_tools import fill  # noqa: E402  (experiments/ is not a package)

# ListOps test accuracy (%) as published. LRA: Tay et al. 2020 (arXiv 2011.04006), Table 1, ListOps column.
LRA_TABLE_1 = {"softmax": ("Transformer", 36.37), "local": ("Local Attention", 15.82),
               "performer": ("Performer", 18.01)}
# The other rows of LRA Table 1, for the spread of the transformers there.
LRA_OTHERS = {"Sparse Trans.": 17.07, "Longformer": 35.63, "Linformer": 35.70, "Reformer": 37.27,
              "Sinkhorn Trans.": 33.67, "Synthesizer": 36.99, "BigBird": 36.05, "Linear Trans.": 16.13}
# S4 (Gu et al. 2022, arXiv 2111.00396, Table 4): the state-space model family s4d belongs to.
S4_TABLE_4 = ("S4", 59.60)


def collect(exp: Path) -> dict:
    """``{run name: its results.json}`` in run.sh's order, each with ``wall_seconds`` (the whole process, data
    generation included) from wall_times.jsonl."""
    walls = {}
    if (exp / "wall_times.jsonl").exists():
        for line in (exp / "wall_times.jsonl").read_text().splitlines():
            entry = json.loads(line)
            walls[entry["what"].removeprefix("listops ")] = entry["wall_s"]
    order = re.findall(r"^listops_run (\S+)", (exp / "run.sh").read_text(), re.M)
    runs = {}
    for name in order:
        path = exp / "runs" / name / "results.json"
        if path.exists():
            runs[name] = json.loads(path.read_text()) | {"wall_seconds": walls.get(name)}
    return runs


def percent(x: float) -> str:
    return f"{100 * x:.1f}"


def published(name: str, attention: str) -> str:
    if name == "s4d":
        return f"{S4_TABLE_4[1]:.2f} ({S4_TABLE_4[0]}, S4 paper Table 4)"
    if name in LRA_TABLE_1:
        label, value = LRA_TABLE_1[name]
        return f"{value:.2f} ({label})"
    return "—"


# validation accuracy a model must reach to count as past the plateau at the majority class (about 15-17%)
PAST_PLATEAU = 0.25


def first_step_past_plateau(curve: list[dict]) -> str:
    steps = [point["step"] for point in curve if point["valid_accuracy"] >= PAST_PLATEAU]
    return f"{steps[0]:,}" if steps else "never"


def accuracy_table(runs: dict) -> str:
    header = ["model", "parameters", "wall s", "train s", "valid acc % (final)", "valid acc % (best)", "test acc %",
              "majority-class test %", f"first step at >= {100 * PAST_PLATEAU:.0f}% valid", "published ListOps %"]
    rows = [[name, f"{r['parameters']:,}", r["wall_seconds"] or "—", f"{r['train_seconds']:.0f}", percent(r["valid_accuracy"]),
             percent(r["best_valid_accuracy"]), percent(r["test_accuracy"]), percent(r["test_majority_accuracy"]),
             first_step_past_plateau(r["curve"]), published(name, r["run"]["attention"])] for name, r in runs.items()]
    return markdown_table(header, rows)


def others_table() -> str:
    rows = [[name, f"{value:.2f}"] for name, value in LRA_OTHERS.items()]
    return markdown_table(["LRA Table 1 model", "ListOps %"], rows)


def setup_table(runs: dict) -> str:
    first = next(iter(runs.values()))["run"]
    spec = first["spec"]
    rows = [["sequence length (tokens)", f"{spec['min_length']}-{spec['max_length']}", "500-2,000"],
            ["max depth / max arguments", f"{spec['max_depth']} / {spec['max_args']}", "10 / 10"],
            ["train / valid / test sequences", f"{first['train_size']:,} / {first['valid_size']:,} / "
             f"{first['test_size']:,}", "96,000 / 2,000 / 2,000"],
            ["layers x width (heads)", f"{first['depth']} x {first['dim']} ({first['heads']})", "6 x 512 (8)"],
            ["pooling", "mean over real tokens", "CLS token"],
            ["steps x batch", f"{first['steps']:,} x {first['batch_size']}", "5,000 x 32"],
            ["mean train length (tokens)", f"{next(iter(runs.values()))['mean_train_length']:.0f}", "—"]]
    return markdown_table(["setting", "here", "LRA (data script; base_listops_config.py)"], rows)


def plot(exp: Path, runs: dict) -> Path | None:
    series = {name: [(p["step"], 100 * p["valid_accuracy"]) for p in r["curve"]] for name, r in runs.items()}
    first = next(iter(runs.values()))["run"]
    valid = make_splits({"valid": first["valid_size"]}, first["seed"], ListOpsSpec(**first["spec"]))["valid"]
    floor = 100 * valid.majority_accuracy()
    return line_plot(series, exp / "listops.png", xlabel="training step", ylabel="validation accuracy (%)",
                     title="ListOps: validation accuracy during training", logx=False,
                     hline=(floor, f"majority class (seed {first['seed']})"),
                     dashed=[name for name in runs if name.startswith("lavo-")])


def main(exp: Path) -> None:
    runs = collect(exp)
    if not runs:
        raise SystemExit(f"no finished runs under {exp / 'runs'}")
    write_json(exp / "results.json", runs)
    plot(exp, runs)
    tables = {"accuracy": accuracy_table(runs), "setup": setup_table(runs), "lra": others_table()}
    write_text(exp / "tables.md", "".join(f"## {k}\n\n{v}\n\n" for k, v in tables.items()))
    fill(exp / "REPORT.md", tables)
    print(f"{exp}: results.json, listops.png, tables.md ({len(runs)} runs)")


if __name__ == "__main__":
    main(Path(sys.argv[1]))
