"""The forecasting tables and plots from results.json: MSE and MAE (mean ± std over the seeds that finished) per
dataset, method and horizon, wins against the baselines, wall time, and one forecast against the truth per
dataset; and, when results_400steps.json (run_longer.sh) exists, its cells beside seed 0 of the main run. Tables
go to tables.md and into REPORT.md between its ``<!-- BEGIN name -->`` / ``<!-- END name -->`` markers.

    python experiments/forecasting/report.py experiments/forecasting
"""
from __future__ import annotations

import json
import statistics
import sys
from collections import defaultdict
from pathlib import Path

from lavo.files import write_text
from lavo.report import line_plot, markdown_table

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from report_tools import experiment_folder, fill  # noqa: E402  (experiments/ is not a package)

DATASETS = ("weather_nc", "weather_nyc", "elecdemand")
CROSS = ("softmax", "lavo", "abc", "performer", "cosformer")
BASELINES = ("repeat_last", "seasonal_naive", "dlinear")
EXAMPLE_HORIZON = 192
LONG_INPUT = 336  # the second input length of the protocol
PLOTTED = ("softmax", "lavo", "dlinear", "seasonal_naive")  # more lines than these hide the truth
LONGER = "results_400steps.json"  # the longer-budget check of run_longer.sh


def gather(cells: dict) -> dict:
    """``(data, input, horizon, method) -> [cell, ...]`` over seeds."""
    grouped = defaultdict(list)
    for key, cell in cells.items():
        data, input_len, horizon, method, _ = key.split("|")
        grouped[data, int(input_len[1:]), int(horizon[1:]), method].append(cell)
    return grouped


def summary(runs: list[dict], metric: str) -> tuple[float, float]:
    values = [run[metric] for run in runs]
    return statistics.mean(values), statistics.stdev(values) if len(values) > 1 else 0.0


def horizons_of(grouped: dict, data: str, input_len: int) -> list[int]:
    return sorted({h for d, L, h, _ in grouped if d == data and L == input_len})


def score_table(grouped: dict, data: str, input_len: int) -> str:
    """Rows: methods; columns: MSE and MAE at each horizon. The best transformer of a column is bold, and every
    baseline better than it in italics."""
    horizons = horizons_of(grouped, data, input_len)
    header = ["method"] + [f"{metric} {h}" for h in horizons for metric in ("MSE", "MAE")]
    best = {}
    for h in horizons:
        for metric in ("mse", "mae"):
            scores = {m: summary(grouped[data, input_len, h, m], metric)[0]
                      for m in CROSS + BASELINES if grouped.get((data, input_len, h, m))}
            transformers = [m for m in CROSS if m in scores]
            leader = min(transformers, key=scores.get) if transformers else None
            best[h, metric] = (leader, scores[leader] if leader else float("-inf"))
    rows = []
    for method in CROSS + BASELINES:
        row = [method]
        for h in horizons:
            for metric in ("mse", "mae"):
                runs = grouped.get((data, input_len, h, method))
                if not runs:
                    row.append("—")
                    continue
                mean, std = summary(runs, metric)
                trained = "steps" in runs[0]  # the other baselines are deterministic
                text = f"{mean:.3f}" + (f" ± {std:.3f}" if len(runs) > 1 and trained else "")
                leader, leader_score = best[h, metric]
                if method == leader:
                    text = f"**{text}**"
                elif method in BASELINES and mean < leader_score:
                    text = f"*{text}*"
                row.append(text)
        rows.append(row)
    seeds = sorted({len(runs) for (d, L, _, m), runs in grouped.items() if d == data and L == input_len
                    and m in CROSS})
    notes = [f"mean ± std over {'/'.join(map(str, seeds))} seeds (the seeds that finished); repeat_last and "
             "seasonal_naive are deterministic. Bold: the best transformer of the column; italics: a baseline "
             "better than every transformer."]
    return markdown_table(header, rows, notes=notes)


def verdict_table(grouped: dict, input_len: int) -> str:
    """Per dataset and horizon: the best transformer, the best baseline, and who wins (MSE)."""
    rows = []
    for data in DATASETS:
        for h in horizons_of(grouped, data, input_len):
            mse = {m: summary(runs, "mse")[0] for m in CROSS + BASELINES
                   if (runs := grouped.get((data, input_len, h, m)))}
            transformers, baselines = [m for m in CROSS if m in mse], [m for m in BASELINES if m in mse]
            if not transformers or not baselines:
                continue
            t, b = min(transformers, key=mse.get), min(baselines, key=mse.get)
            lavo_rank = sorted(transformers, key=mse.get).index("lavo") + 1 if "lavo" in mse else None
            spread = summary(grouped[data, input_len, h, t], "mse")[1]
            winner = "transformer" if mse[t] < mse[b] else "baseline"
            rows.append([data, h, f"{t} {mse[t]:.3f} ± {spread:.3f}", f"{b} {mse[b]:.3f}",
                         winner + (" (within the seed std)" if abs(mse[t] - mse[b]) < spread else ""),
                         f"{mse['lavo'] / mse['softmax']:.3f}" if "lavo" in mse and "softmax" in mse else "—",
                         f"{lavo_rank} of {len(transformers)}" if lavo_rank else "—"])
    return markdown_table(["data", "horizon", "best transformer (MSE)", "best baseline (MSE)", "winner",
                           "LAVO / softmax MSE", "LAVO's rank"], rows)


def ranking_table(grouped: dict, input_len: int) -> str:
    """Per transformer, over every (dataset, horizon): its mean rank among the transformers by mean MSE, how often
    it is the best, how often it beats the best baseline, and its MSE relative to softmax (geometric mean)."""
    ranks, best, beats, ratios = defaultdict(list), defaultdict(int), defaultdict(int), defaultdict(list)
    for data in DATASETS:
        for h in horizons_of(grouped, data, input_len):
            mse = {m: summary(runs, "mse")[0] for m in CROSS + BASELINES
                   if (runs := grouped.get((data, input_len, h, m)))}
            order = sorted((m for m in CROSS if m in mse), key=mse.get)
            if len(order) < len(CROSS):
                continue
            best[order[0]] += 1
            baseline = min(mse[m] for m in BASELINES if m in mse)
            for rank, method in enumerate(order, 1):
                ranks[method].append(rank)
                beats[method] += mse[method] < baseline
                ratios[method].append(mse[method] / mse["softmax"])
    cells = len(ranks["softmax"])
    rows = [[m, f"{statistics.mean(ranks[m]):.2f}", f"{best[m]} of {cells}", f"{beats[m]} of {cells}",
             f"{statistics.geometric_mean(ratios[m]):.3f}"] for m in CROSS if ranks[m]]
    return markdown_table(["cross attention", "mean rank (1 = best)", "best transformer", "beats every baseline",
                           "MSE / softmax's (geometric mean)"], rows)


def wall_table(grouped: dict, input_len: int) -> str:
    """Mean wall seconds of a cell (training and scoring every test window), over datasets and seeds."""
    horizons = sorted({h for _, L, h, _ in grouped if L == input_len})
    rows = []
    for method in CROSS + ("dlinear",):
        row = [method]
        for h in horizons:
            walls = [c["wall_s"] for (d, L, hh, m), runs in grouped.items() if L == input_len and hh == h
                     and m == method for c in runs]
            row.append(f"{statistics.mean(walls):.1f}" if walls else "—")
        steps = [c["steps"] for (d, L, hh, m), runs in grouped.items() if L == input_len and m == method
                 for c in runs]
        row.append(f"{statistics.mean(steps):.0f}" if steps else "—")
        rows.append(row)
    return markdown_table(["method"] + [f"H {h} (s)" for h in horizons] + ["mean steps"], rows)


def longer_table(main: dict, longer: dict) -> str:
    """Every cell of the longer run beside the same cell (seed 0) of the main run: MSE, MAE, rank among the
    transformers of its horizon (by MSE), steps taken, the step of the best validation score and whether early
    stopping ended training before the step limit."""
    budgets = [run["settings"]["max_steps"] for run in (main, longer)]

    def rank(cells: dict, key: str) -> str:
        data, input_len, horizon, method, seed = key.split("|")
        if method not in CROSS:
            return "—"
        mse = {m: cells[k]["mse"] for m in CROSS if (k := "|".join((data, input_len, horizon, m, seed))) in cells}
        return str(sorted(mse, key=mse.get).index(method) + 1)

    def stopped(cell: dict, budget: int) -> str:
        return "yes" if cell["steps"] < budget else "no"

    rows = []
    for key, cell in longer["cells"].items():
        data, input_len, horizon, method, seed = key.split("|")
        before = main["cells"][key]
        rows.append([data, horizon[1:], method,
                     *(f"{run[metric]:.3f}" for metric in ("mse", "mae") for run in (before, cell)),
                     f"{rank(main['cells'], key)} → {rank(longer['cells'], key)}",
                     " → ".join(f"{run['steps']} ({run['best_step']})" for run in (before, cell)),
                     f"{stopped(before, budgets[0])} → {stopped(cell, budgets[1])}"])
    a, b = budgets
    return markdown_table(["data", "horizon", "method", f"MSE {a}", f"MSE {b}", f"MAE {a}", f"MAE {b}",
                           "rank (MSE)", "steps (best)", "stopped early"], rows,
                          notes=[f"seed 0 of results.json (at most {a} steps) → {LONGER} (at most {b} steps), "
                                 "the same early-stopping rule; rank among the five transformers of the horizon; "
                                 "steps taken and, in brackets, the step of the best validation score (the weights "
                                 "kept)."])


def facts_table(grouped: dict, main: dict, longer: dict | None, input_len: int) -> str:
    """The figures the reading quotes that no other table shows: LAVO against softmax in standard errors of the
    difference of their means, how the 80-step budget ended the transformer cells, and, from the longer check,
    how they ended with 400 steps and where LAVO and the best transformer then stand."""
    gaps = []
    for data in DATASETS:
        for h in horizons_of(grouped, data, input_len):
            lavo, softmax = grouped.get((data, input_len, h, "lavo")), grouped.get((data, input_len, h, "softmax"))
            if lavo and softmax and len(lavo) > 1 and len(softmax) > 1:
                (m1, s1), (m2, s2) = summary(lavo, "mse"), summary(softmax, "mse")
                gaps.append((abs(m1 - m2) / (s1 ** 2 / len(lavo) + s2 ** 2 / len(softmax)) ** 0.5, data, h))
    budget = main["settings"]["max_steps"]
    cells = [c for (d, L, h, m), runs in grouped.items() if L == input_len and m in CROSS for c in runs]
    rows = []
    if gaps:
        most, data, h = max(gaps)
        rows.append(["LAVO against softmax: largest difference of the mean MSEs, in standard errors",
                     f"{most:.1f} ({data}, {h})"])
    rows += [[f"transformer cells (input {input_len}) ended by early stopping before step {budget}",
              f"{sum(c['steps'] < budget for c in cells)} of {len(cells)}"],
             ["... with their best validation score at their last evaluation",
              f"{sum(c['best_step'] == c['steps'] for c in cells)} of {len(cells)}"]]
    if longer is not None:
        limit = longer["settings"]["max_steps"]
        trained = [(key, c) for key, c in longer["cells"].items() if key.split("|")[3] in CROSS]
        stopped = [c["steps"] for _, c in trained if c["steps"] < limit]
        rows.append([f"longer check: transformer cells ended by early stopping before step {limit}",
                     f"{len(stopped)} of {len(trained)}, after {min(stopped)} to {max(stopped)} steps" if stopped
                     else f"0 of {len(trained)}"])
        horizons = sorted({key.split("|")[2] for key, _ in trained})
        lavo_best = ahead = 0
        for h in horizons:
            mse = {key.split("|")[3]: c["mse"] for key, c in longer["cells"].items() if key.split("|")[2] == h}
            best = min((m for m in CROSS if m in mse), key=mse.get)
            lavo_best += best == "lavo"
            ahead += "dlinear" in mse and mse[best] < mse["dlinear"]
        rows += [["longer check: horizons where LAVO is the best transformer", f"{lavo_best} of {len(horizons)}"],
                 ["longer check: horizons where the best transformer beats DLinear", f"{ahead} of {len(horizons)}"]]
    return markdown_table(["what", "value"], rows)


def plot_examples(grouped: dict, exp: Path, input_len: int) -> list[Path]:
    """One plot per dataset: the example variable's last inputs, the truth and the forecasts of :data:`PLOTTED`
    (seed 0; every method's example forecast is in results.json)."""
    paths = []
    for data in DATASETS:
        examples = {m: runs[0]["example"] for m in PLOTTED
                    if (runs := grouped.get((data, input_len, EXAMPLE_HORIZON, m))) and "example" in runs[0]}
        if not examples:
            continue
        first = next(iter(examples.values()))
        history = first["history"]
        series = {"input": [(i - len(history), y) for i, y in enumerate(history)],
                  "truth": [(i, y) for i, y in enumerate(first["truth"])]}
        for method, example in examples.items():
            series[method] = [(i, y) for i, y in enumerate(example["forecast"])]
        path = line_plot(series, exp / f"forecast_{data}.png", xlabel="step (0 = first forecast step)",
                         ylabel=f"{first['column']} (standardised)", logx=False,
                         title=f"{data}: test window at step {first['window_start']}, horizon {EXAMPLE_HORIZON}",
                         dashed=BASELINES)
        paths.append(path)
    return paths


def main(exp: Path) -> None:
    results = json.loads((exp / "results.json").read_text())
    grouped = gather(results["cells"])
    input_len = 96
    tables = {f"scores-{data}": score_table(grouped, data, input_len) for data in DATASETS
              if horizons_of(grouped, data, input_len)}
    tables |= {f"scores-{data}-input{LONG_INPUT}": score_table(grouped, data, LONG_INPUT) for data in DATASETS
               if horizons_of(grouped, data, LONG_INPUT)}
    tables["verdict"] = verdict_table(grouped, input_len)
    tables["ranking"] = ranking_table(grouped, input_len)
    tables["wall"] = wall_table(grouped, input_len)
    longer = json.loads((exp / LONGER).read_text()) if (exp / LONGER).exists() else None
    if longer is not None:
        tables["longer"] = longer_table(results, longer)
    tables["facts"] = facts_table(grouped, results, longer, input_len)
    write_text(exp / "tables.md", "".join(f"## {name}\n\n{table}\n\n" for name, table in tables.items()))
    fill(exp / "REPORT.md", tables)
    plots = plot_examples(grouped, exp, input_len)
    print(f"{exp}: {len(results['cells'])} cells; tables.md, {', '.join(p.name for p in plots)}")


if __name__ == "__main__":
    main(experiment_folder(sys.argv[1:], "report.py EXPERIMENT_DIR (experiments/forecasting)"))
