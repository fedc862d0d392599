"""The tables and plots of experiments/gpu_scale/REPORT.md, from the prepared corpus, the plan, the results files
(mean and spread over seeds) and the CPU-scale experiments' results.json; a run without results shows as
"not run".

    python experiments/gpu_scale/report.py            # fills REPORT.md between its BEGIN/END markers
"""
from __future__ import annotations

import json
import statistics
import sys
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path[:0] = [str(HERE.parents[1]), str(HERE.parent), str(HERE)]  # lavo, report_tools, run

from lavo.report import line_plot, markdown_table  # noqa: E402
from report_tools import PAPER_8K, fill  # noqa: E402

import run as driver  # noqa: E402

NOT_RUN = "not run"


def corpus_table(plan: dict, data_dir: Path) -> str | None:
    """Documents and tokens per source and split of the prepared corpus; None when it is not prepared here."""
    from lavo.data import DataError, prepare, tokens_by_part
    data = plan["base"]["data"]
    try:
        prepared = prepare(data["source"], data["tokenizer"], data_dir, fetch=False, log=lambda *a: None)
    except DataError:
        return None
    train, valid = tokens_by_part(prepared.train), tokens_by_part(prepared.valid)
    total = len(prepared.train)
    held_out = {part: [d["name"].split("/", 1)[1] for d in prepared.valid.documents if d["name"].startswith(part + "/")]
                for part in train}
    rows = [[part, f"{train[part][0]:,}", f"{train[part][1]:,}", f"{100 * train[part][1] / total:.1f}%",
             ", ".join(held_out[part]), f"{valid[part][1]:,}"] for part in train]
    rows.append(["**all**", f"{len(prepared.train.documents):,}", f"{total:,}", "100%",
                 f"{len(prepared.valid.documents)} documents", f"{len(prepared.valid):,}"])
    version = prepared.manifest["provenance"]["python"]["python"]
    return markdown_table(["source", "training documents", "training tokens", "share of training",
                           "held-out documents", "held-out tokens"], rows, align="lrrrlr",
                          notes=[f"tokenizer {data['tokenizer']} trained on the training documents of all three; "
                                 f"corpus {prepared.manifest['fingerprint'][:12]}; code from CPython {version}"])


def models_table(plan: dict) -> str:
    """Each planned model: attention, options, positions and parameters (vocabulary 4,096), and the budget."""
    from lavo.model import build_model, count_parameters
    train = plan["base"]["train"]
    budget = (f"{train['steps']} x {train['batch_size']} x {train['train_length']} = "
              f"{train['steps'] * train['batch_size'] * train['train_length']:,}")
    rows, seen = [], set()
    for run in driver.planned_runs(plan):
        if run.model in seen:
            continue
        seen.add(run.model)
        config = driver.run_config(run, HERE / "runs")
        model = config.model
        rows.append([run.model, model["attention"], json.dumps(model.get("attention_options", {})),
                     model.get("position", "none"), f"{count_parameters(build_model(config.model_config(4096))):,}",
                     budget])
    return markdown_table(["model", "attention", "options", "position", "parameters", "steps x batch x L = tokens"],
                          rows, align="llllrr")


def seeds_of(results: dict[str, dict], model: str) -> list[dict]:
    return [r for r in results.values() if r["model"] == model]


def mean_spread(values: list[float]) -> str:
    """``mean ± standard deviation (n)`` over seeds; the value alone for one seed."""
    if not values:
        return NOT_RUN
    if len(values) == 1:
        return f"{values[0]:.2f} (1)"
    return f"{statistics.mean(values):.2f} ± {statistics.stdev(values):.2f} ({len(values)})"


def scores(run: dict, part: str, key: str = "eval") -> dict:
    """A run's scores on held-out ``part`` by length: its main evaluation (``eval``) or its long one
    (``long_eval``); empty where it has none (not scored, or its long evaluation failed)."""
    found = run.get(key) or {}
    return found.get(part) or {}


def ppl_values(runs: list[dict], part: str, length: int, key: str = "eval") -> list[float]:
    return [scores(r, part, key)[str(length)]["ppl"] for r in runs if str(length) in scores(r, part, key)]


def ppl_table(plan: dict, results: dict, models: list[str], part: str, lengths: list[int], key: str = "eval") -> str:
    """One row per model: perplexity at each length, mean ± sd over seeds, and 16x / 1x (of ``key``'s scores)."""
    train_length = plan["base"]["train"]["train_length"]
    rows = []
    for model in models:
        runs = seeds_of(results, model)
        cells = [mean_spread(ppl_values(runs, part, length, key)) for length in lengths]
        ratios = [scores(r, part, key)[str(lengths[-1])]["ppl"] / scores(r, part, key)[str(lengths[0])]["ppl"]
                  for r in runs if {str(lengths[0]), str(lengths[-1])} <= set(scores(r, part, key))]
        rows.append([model, *cells, mean_spread(ratios)])
    header = ["model"] + [f"{length:,} ({length // train_length}x)" for length in lengths]
    return markdown_table(header + [f"{lengths[-1] // lengths[0]}x / 1x"], rows)


CPU_ABLATIONS = ("ablation", "memory_lm")  # the CPU-scale experiments that trained this plan's ablation variants


def cpu_results(experiment: str) -> dict:
    """The committed results.json of the CPU-scale ``experiments/<experiment>``."""
    return json.loads((HERE.parent / experiment / "results.json").read_text())


def cpu_ablation() -> dict:
    """The CPU-scale point of each ablation variant: ``{variant: (ppl at 1x, longest / 1x, longest multiple)}``
    from the committed results.json of ``experiments/ablation`` and ``experiments/memory_lm`` (same base run)."""
    points = {}
    for name in CPU_ABLATIONS:
        cpu = cpu_results(name)
        short = str(cpu["train_length"])
        for model, ppl in cpu["ppl"].items():
            longest = max(ppl, key=int)
            points.setdefault(model, (ppl[short], ppl[longest] / ppl[short], int(longest) // cpu["train_length"]))
    return points


def ablation_table(plan: dict, results: dict) -> str:
    """Each ablation beside full LAVO and the local branch alone, at 1x and 16x, on both held-out sets, with
    the CPU-scale point of the same variant (experiments/ablation and experiments/memory_lm)."""
    train_length = plan["base"]["train"]["train_length"]
    longest = max(plan["eval"]["multiples"]) * train_length
    models = ["lavo", *plan["ablation"], "local"]
    cpu = cpu_ablation()
    header = ["variant"] + [f"{part} {length // train_length}x" for part in plan["eval"]["sets"]
                            for length in (train_length, longest)] + ["CPU scale: ppl at 1x", "CPU scale: longest / 1x"]
    rows = [[model] + [mean_spread(ppl_values(seeds_of(results, model), part, length))
                       for part in plan["eval"]["sets"] for length in (train_length, longest)]
            + ([f"{cpu[model][0]:.2f}", f"{cpu[model][1]:.2f} ({cpu[model][2]}x)"] if model in cpu else ["—", "—"])
            for model in models]
    return markdown_table(header, rows, notes=[
        "CPU scale: experiments/ablation and experiments/memory_lm (one seed each, trained at 256 on Austen alone, "
        "scored on held-out Persuasion); the paper quotes its ablation qualitatively (removing context dissection "
        "costs far more than removing the position bias)"])


def scale_table(plan: dict, results: dict) -> str:
    """16x / 1x at this scale (books) beside the CPU-scale point (Austen, 16x / 1x) and the paper (2x / 1x)."""
    cpu = cpu_results("lm_extrapolation")
    cpu_length = cpu["train_length"]
    train_length = plan["base"]["train"]["train_length"]
    longest = max(plan["eval"]["multiples"]) * train_length
    rows = []
    for model in plan["models"]:
        runs = seeds_of(results, model)
        ours = [r["eval"]["books"][str(longest)]["ppl"] / r["eval"]["books"][str(train_length)]["ppl"]
                for r in runs if str(longest) in r["eval"]["books"]]
        small = cpu["ppl"].get(model)
        paper = PAPER_8K.get(model, {})
        rows.append([model, mean_spread(ours),
                     f"{small[str(cpu_length)]:.2f}" if small else "—",
                     f"{small[str(16 * cpu_length)] / small[str(cpu_length)]:.2f}" if small else "—",
                     f"{paper['1']:.2f}" if "1" in paper else "—",
                     f"{paper['2'] / paper['1']:.2f}" if "2" in paper else "—"])
    return markdown_table(["model", "this plan: books 16x / 1x", f"CPU scale: ppl at 1x ({cpu_length})",
                           "CPU scale: 16x / 1x", "paper: ppl at 8K (1x)", "paper: 2x / 1x"], rows,
                          notes=[f"CPU scale: experiments/lm_extrapolation ({cpu['params']['lavo']:,} parameters, "
                                 f"{cpu['tokens_seen']:,} tokens of Austen, held-out Persuasion); paper: PG-19, "
                                 "trained at 8K"])


def spend_table(results_dir: Path, results: dict) -> str:
    calls = driver.past_calls(results_dir)
    wall: dict[str, float] = {}  # the workers of one call share its wall time
    for c in calls:
        key = c.get("call") or c["started"]
        wall[key] = max(wall.get(key, 0.0), c["wall_s"])
    utilization = [c["gpu_utilization"] for c in calls if c.get("gpu_utilization") is not None]
    tokens = sum(r["tokens"] for r in results.values())
    ended = {c.get("call") or c["started"] for c in calls if "ended" in c}
    rows = [["GPU calls", len(wall)], ["calls ended by their time limit", len(ended)],
            ["GPU minutes (the calls' wall time)", f"{sum(wall.values()) / 60:.1f}"],
            ["GPU utilisation, mean over the calls (nvidia-smi)",
             f"{statistics.mean(utilization):.0f}%" if utilization else "not measured"],
            ["runs finished", len(results)], ["training tokens, all runs", f"{tokens:,}"],
            ["training minutes, all runs", f"{sum(r['train_seconds'] for r in results.values()) / 60:.1f}"],
            ["scoring minutes, all runs", f"{sum(r['eval_seconds'] for r in results.values()) / 60:.1f}"]]
    return markdown_table(["what", "amount"], rows)


def status_table(plan: dict, results_dir: Path, results: dict) -> str:
    """Every planned run by what became of it: scored, failed in some call (with the last reason), recorded with
    other settings (to redo), or not run yet; so that no mean hides which seeds it is over."""
    recorded = driver.finished_results(results_dir)
    failures = {name: reason for call in driver.past_calls(results_dir)
                for name, reason in call.get("failed", {}).items()}
    long_failures = {name: record["long_eval"]["failed"] for name, record in results.items()
                     if "failed" in record.get("long_eval", {})}
    groups: dict[str, list[str]] = {}
    for run in driver.planned_runs(plan):
        status = ("scored, but not its long evaluation" if run.name in long_failures
                  else "scored" if run.name in results else "failed" if run.name in failures
                  else "recorded with other settings (to redo)" if run.name in recorded else "not run yet")
        reason = long_failures.get(run.name) or (failures[run.name] if status == "failed" else None)
        groups.setdefault(status, []).append(f"{run.name} ({reason})" if reason else run.name)
    return markdown_table(["status", "runs", "which"], [[status, len(names), ", ".join(names)]
                                                        for status, names in groups.items()])


def plots(plan: dict, results: dict) -> None:
    """Mean perplexity over seeds against evaluation length, one plot per held-out set."""
    train_length = plan["base"]["train"]["train_length"]
    for part in plan["eval"]["sets"]:
        series = {}
        for model in plan["models"]:
            runs = seeds_of(results, model)
            lengths = sorted({int(k) for r in runs for k in scores(r, part)})
            series[model] = [(length, statistics.mean(ppl_values(runs, part, length))) for length in lengths
                             if ppl_values(runs, part, length)]
        line_plot(series, HERE / f"{part}.png", xlabel="evaluation length (tokens)", ylabel="perplexity (log scale)",
                  title=f"held-out {part}: small preset, trained at L={train_length}, mean over seeds", logy=True,
                  vline=(train_length, "training length"), length_ticks=True)


def main() -> None:
    plan = driver.load_plan()
    results_dir = HERE / "results"
    results = driver.current_results(results_dir, driver.planned_runs(plan))
    train_length = plan["base"]["train"]["train_length"]
    lengths = [int(m * train_length) for m in plan["eval"]["multiples"]]
    tables = {f"ppl-{part}": ppl_table(plan, results, list(plan["models"]), part, lengths)
              for part in plan["eval"]["sets"]}
    tables |= {f"long-{part}": ppl_table(plan, results, plan["long_eval"]["models"], part,
                                         plan["long_eval"]["lengths"], "long_eval") for part in plan["eval"]["sets"]}
    tables |= {"models": models_table(plan), "ablation": ablation_table(plan, results),
               "scale": scale_table(plan, results),
               "spend": spend_table(results_dir, results), "status": status_table(plan, results_dir, results)}
    corpus = corpus_table(plan, HERE.parents[1] / plan["base"]["data"]["data_dir"])
    if corpus is not None:
        tables["corpus"] = corpus
    if results:
        plots(plan, results)
    fill(HERE / "REPORT.md", tables)
    print(f"filled {', '.join(tables)} in {HERE / 'REPORT.md'}; {len(results)} runs have results")


if __name__ == "__main__":
    main()
