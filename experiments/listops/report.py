"""Collect experiments/listops/runs/MODEL/seedS/results.json into results.json, the per-model accuracy over seeds
beside the published numbers, the per-run details (tables.md and REPORT.md) and the plot of validation accuracy
against steps, one panel per model and a line per seed.

    python experiments/listops/report.py experiments/listops
"""
from __future__ import annotations

import json
import re
import statistics
import sys
from pathlib import Path

from lavo.files import write_json, write_text
from lavo.listops import ListOpsSpec, make_splits
from lavo.report import markdown_table, panel_plot

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from report_tools import experiment_folder, fill, wall_times  # noqa: E402  (experiments/ is not a package)

# ListOps test accuracy (%) as published. LRA: Tay et al. 2020 (arXiv 2011.04006), Table 1, ListOps column.
LRA_TABLE_1 = {"softmax": ("Transformer", 36.37), "local": ("Local Attention", 15.82),
               "performer": ("Performer", 18.01)}
# The other rows of LRA Table 1, for the spread of the transformers there.
LRA_OTHERS = {"Sparse Trans.": 17.07, "Longformer": 35.63, "Linformer": 35.70, "Reformer": 37.27,
              "Sinkhorn Trans.": 33.67, "Synthesizer": 36.99, "BigBird": 36.05, "Linear Trans.": 16.13}
# S4 (Gu et al. 2022, arXiv 2111.00396, Table 4): the state-space model family s4d belongs to.
S4_TABLE_4 = ("S4", 59.60)
# validation accuracy a model must reach to count as past the plateau at the majority class (about 15-17%)
PAST_PLATEAU = 0.25


def model_order(exp: Path) -> list[str]:
    """The model names of run.sh's MODELS, in its order."""
    return re.findall(r'^\s+"([\w-]+)\s', (exp / "run.sh").read_text(), re.M)


def collect(exp: Path) -> dict[str, dict[int, dict]]:
    """``{model: {seed: its results.json}}`` for the finished runs, models in run.sh's order and seeds ascending,
    each run with ``wall_seconds`` (the whole process, data generation included) from wall_times.jsonl."""
    walls = {entry["what"].removeprefix("listops "): entry["wall_s"] for entry in wall_times(exp)}
    runs = {}
    for model in model_order(exp):
        by_seed = {}
        for path in (exp / "runs" / model).glob("seed*/results.json"):
            result = json.loads(path.read_text())
            by_seed[result["run"]["seed"]] = result | {"wall_seconds": walls.get(f"{model}/{path.parent.name}")}
        if by_seed:
            runs[model] = dict(sorted(by_seed.items()))
    return runs


def mean_std(values: list[float]) -> tuple[float, float | None]:
    """Mean and sample standard deviation (n - 1 in the denominator; None for a single value)."""
    return statistics.mean(values), statistics.stdev(values) if len(values) > 1 else None


def first_step_past_plateau(curve: list[dict]) -> int | None:
    """The first validation step at or above PAST_PLATEAU; None when the run never got there."""
    return next((point["step"] for point in curve if point["valid_accuracy"] >= PAST_PLATEAU), None)


def summarize(by_seed: dict[int, dict]) -> dict:
    """One model over its seeds: test accuracy (per seed, mean, sample std), the majority-class floor per seed
    and the first step past the plateau per seed (None: never), with how many seeds got past it."""
    mean, std = mean_std([result["test_accuracy"] for result in by_seed.values()])
    exits = {seed: first_step_past_plateau(result["curve"]) for seed, result in by_seed.items()}
    return {"test_accuracy": {seed: result["test_accuracy"] for seed, result in by_seed.items()},
            "test_accuracy_mean": mean, "test_accuracy_std": std,
            "test_majority_accuracy": {seed: result["test_majority_accuracy"] for seed, result in by_seed.items()},
            "first_step_past_plateau": exits, "seeds_past_plateau": sum(step is not None for step in exits.values())}


def floors(runs: dict[str, dict[int, dict]]) -> dict[int, float]:
    """``{seed: majority-class test accuracy}``; the same for every model of a seed (its splits are)."""
    found = {}
    for by_seed in runs.values():
        for seed, result in by_seed.items():
            if found.setdefault(seed, result["test_majority_accuracy"]) != result["test_majority_accuracy"]:
                raise ValueError(f"seed {seed}: runs disagree on the test split's majority class")
    return dict(sorted(found.items()))


def percent(x: float | None) -> str:
    return "—" if x is None else f"{100 * x:.1f}"


def mean_pm_std(mean: float, std: float | None) -> str:
    return f"{percent(mean)} ± {percent(std)}"


def per_seed(values: dict[int, object], seeds: list[int], show) -> str:
    """``values`` in the order of ``seeds``, ``—`` for a seed without a run, joined by `` / ``."""
    return " / ".join(show(values[seed]) if seed in values else "—" for seed in seeds)


def step(value: int | None) -> str:
    return "never" if value is None else f"{value:,}"


def published(name: str) -> str:
    if name == "s4d":
        return f"{S4_TABLE_4[1]:.2f} ({S4_TABLE_4[0]}, S4 paper Table 4)"
    if name in LRA_TABLE_1:
        label, value = LRA_TABLE_1[name]
        return f"{value:.2f} ({label})"
    return "—"


def accuracy_table(runs: dict[str, dict[int, dict]]) -> str:
    floor = floors(runs)
    seeds = list(floor)
    named = " / ".join(map(str, seeds))
    header = ["model", "test acc % (mean ± std)", f"test acc % (seeds {named})", "seeds past the plateau",
              f"first step at >= {100 * PAST_PLATEAU:.0f}% valid (seeds {named})", "published ListOps %"]
    rows = [["majority class (the floor)", mean_pm_std(*mean_std(list(floor.values()))),
             per_seed(floor, seeds, percent), "—", "—", "—"]]
    for name, by_seed in runs.items():
        summary = summarize(by_seed)
        rows.append([name, mean_pm_std(summary["test_accuracy_mean"], summary["test_accuracy_std"]),
                     per_seed(summary["test_accuracy"], seeds, percent),
                     f"{summary['seeds_past_plateau']} of {len(by_seed)}",
                     per_seed(summary["first_step_past_plateau"], seeds, step), published(name)])
    return markdown_table(header, rows)


def runs_table(runs: dict[str, dict[int, dict]]) -> str:
    header = ["model", "seed", "parameters", "wall s", "train s", "valid acc % (final)", "valid acc % (best)",
              "test acc %", "majority-class test %", f"first step at >= {100 * PAST_PLATEAU:.0f}% valid"]
    rows = [[name, seed, f"{r['parameters']:,}", r["wall_seconds"] or "—", f"{r['train_seconds']:.0f}",
             percent(r["valid_accuracy"]), percent(r["best_valid_accuracy"]), percent(r["test_accuracy"]),
             percent(r["test_majority_accuracy"]), step(first_step_past_plateau(r["curve"]))]
            for name, by_seed in runs.items() for seed, r in by_seed.items()]
    return markdown_table(header, rows)


def cost_table(exp: Path) -> str:
    walls = [entry["wall_s"] for entry in wall_times(exp)]
    return markdown_table(["runs", "wall s in all", "hours", "shortest run s", "longest run s"],
                          [[len(walls), f"{sum(walls):,}", f"{sum(walls) / 3600:.1f}", min(walls), max(walls)]])


def others_table() -> str:
    rows = [[name, f"{value:.2f}"] for name, value in LRA_OTHERS.items()]
    return markdown_table(["LRA Table 1 model", "ListOps %"], rows)


def setup_table(runs: dict[str, dict[int, dict]]) -> str:
    result = next(iter(next(iter(runs.values())).values()))
    first = result["run"]
    spec = first["spec"]
    rows = [["sequence length (tokens)", f"{spec['min_length']}-{spec['max_length']}", "500-2,000"],
            ["max depth / max arguments", f"{spec['max_depth']} / {spec['max_args']}", "10 / 10"],
            ["train / valid / test sequences", f"{first['train_size']:,} / {first['valid_size']:,} / "
             f"{first['test_size']:,}", "96,000 / 2,000 / 2,000"],
            ["layers x width (heads)", f"{first['depth']} x {first['dim']} ({first['heads']})", "6 x 512 (8)"],
            ["pooling", "mean over real tokens", "CLS token"],
            ["steps x batch", f"{first['steps']:,} x {first['batch_size']}", "5,000 x 32"],
            ["mean train length (tokens)", f"{result['mean_train_length']:.0f}", "—"]]
    return markdown_table(["setting", "here", "LRA (data script; base_listops_config.py)"], rows)


def plot(exp: Path, runs: dict[str, dict[int, dict]]) -> Path | None:
    panels = {name: {f"seed {seed}": [(p["step"], 100 * p["valid_accuracy"]) for p in r["curve"]]
                     for seed, r in by_seed.items()} for name, by_seed in runs.items()}
    settings = next(iter(next(iter(runs.values())).values()))["run"]
    valid_floors = {f"seed {seed}": 100 * make_splits({"valid": settings["valid_size"]}, seed,
                                                      ListOpsSpec(**settings["spec"]))["valid"].majority_accuracy()
                    for seed in floors(runs)}
    return panel_plot(panels, exp / "listops.png", xlabel="training step", ylabel="valid accuracy (%)",
                      title="ListOps: validation accuracy during training, a line per seed "
                            "(dotted: that seed's majority class)", hlines=valid_floors, columns=5)


def main(exp: Path) -> None:
    runs = collect(exp)
    if not runs:
        raise SystemExit(f"no finished runs under {exp / 'runs'}")
    write_json(exp / "results.json", {name: {"summary": summarize(by_seed), "runs": by_seed}
                                      for name, by_seed in runs.items()})
    plot(exp, runs)
    tables = {"accuracy": accuracy_table(runs), "runs": runs_table(runs), "cost": cost_table(exp),
              "setup": setup_table(runs), "lra": others_table()}
    write_text(exp / "tables.md", "".join(f"## {k}\n\n{v}\n\n" for k, v in tables.items()))
    fill(exp / "REPORT.md", tables)
    print(f"{exp}: results.json, listops.png, tables.md ({sum(map(len, runs.values()))} runs of {len(runs)} models)")


if __name__ == "__main__":
    main(experiment_folder(sys.argv[1:], "report.py EXPERIMENT_DIR (experiments/listops)"))
