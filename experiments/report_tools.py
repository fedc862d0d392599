"""Helpers for the experiments: collect results.json, draw the plot, and write the tables into REPORT.md.

    python experiments/report_tools.py results experiments/<name>   # results.json + plot + tables
    python experiments/report_tools.py tables experiments/<name>    # tables only (from results.json)

Tables go into REPORT.md between ``<!-- BEGIN name -->`` and ``<!-- END name -->`` markers, so no number in a
report is typed by hand.
"""
from __future__ import annotations

import json
import re
import sys
from pathlib import Path

from lavo.files import write_json, write_text
from lavo.report import line_plot, markdown_table

# Paper (arXiv 2312.11135), PG-19, trained at 8K; perplexity at 8K / 12K / 16K where the paper gives them.
PAPER_8K = {
    "lavo": {"1": 19.43, "1.5": 19.41, "2": 19.40},
    "softmax-rope": {"1": 15.09, "2": 34.84},
    "local": {"1": 19.73, "2": 22.16},
    "abc": {"1": 31.53, "2": 147.43},
    "longshort": {"1": 15.52, "2": 26.06},
    "s4d": {"1": 15.78, "2": 51.96},
}
PAPER_NAMES = {"lavo": "LAVO", "softmax-rope": "FlashAttention + RoPE", "local": "Local", "abc": "ABC",
               "longshort": "LongShort", "s4d": "S4D"}


def read_jsonl(path: Path) -> list[dict]:
    if not path.exists():
        return []
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


def wall_times(exp: Path) -> list[dict]:
    """The wall time of each finished step of an experiment's queue (``wall_times.jsonl``, appended by
    common.sh): a step stopped and resumed counts its stopped attempts too; a step run again from scratch after it
    finished counts its latest run only, not both."""
    finished, stopped = {}, {}
    for entry in read_jsonl(exp / "wall_times.jsonl"):
        what, seconds = entry["what"], entry["wall_s"] + stopped.pop(entry["what"], 0)
        if entry.get("finished", True):  # lines written before attempts were marked were finished ones
            finished[what] = {"what": what, "wall_s": seconds}
        else:
            stopped[what] = seconds
    return list(finished.values())


def collect(exp: Path) -> dict:
    evaluation = json.loads((exp / "eval" / "all" / "results.json").read_text())
    ppl, params, tokens, steps, train_wall, loss = {}, {}, {}, {}, {}, {}
    scored = set()
    for name, run in evaluation["runs"].items():
        run = Path(run)
        per_length = evaluation["results"][name]
        ppl[name] = {length: round(v["ppl"], 3) for length, v in sorted(per_length.items(), key=lambda x: int(x[0]))}
        scored |= {v["tokens"] for v in per_length.values()}
        final = [m for m in read_jsonl(run / "metrics.jsonl") if m.get("final")][-1]
        params[name], tokens[name], steps[name] = final["parameters"], final["tokens"], final["step"]
        train_wall[name], loss[name] = final["elapsed"], round(final["loss"], 4)
    config = json.loads((Path(next(iter(evaluation["runs"].values()))) / "config.json").read_text())
    train_length = config["train"]["train_length"]
    if len(set(tokens.values())) != 1:
        raise SystemExit(f"token budgets differ: {tokens}")
    result = {
        "train_length": train_length,
        "tokens_seen": next(iter(tokens.values())),
        "ppl": ppl,
        "params": params,
        "steps": next(iter(steps.values())),
        "batch_size": config["train"]["batch_size"],
        "scored_tokens": sorted(scored),
        "split": evaluation["split"],
        "final_train_loss": loss,
        "train_seconds": train_wall,
        "wall_times": wall_times(exp),
        "model": {k: v for k, v in config["model"].items() if k not in ("attention", "attention_options")},
        "options": {name: json.loads((Path(run) / "config.json").read_text())["model"]
                    for name, run in evaluation["runs"].items()},
    }
    result["options"] = {name: {"attention": m["attention"], "attention_options": m["attention_options"],
                                "position": m["position"]} for name, m in result["options"].items()}
    return result


def plot(exp: Path, result: dict) -> Path:
    series = {name: [(int(length), value) for length, value in per_length.items()]
              for name, per_length in result["ppl"].items()}
    return line_plot(series, exp / f"{exp.name}.png", xlabel="evaluation length (tokens)",
                     ylabel="held-out perplexity (log scale)", logy=True,
                     title=f"{exp.name}: trained at L={result['train_length']}, {result['tokens_seen']:,} tokens",
                     vline=(result["train_length"], "training length"))


def fmt(x: float) -> str:
    return f"{x:,.2f}" if x < 1000 else f"{x:,.0f}"


def ppl_table(result: dict) -> str:
    L = result["train_length"]
    lengths = list(next(iter(result["ppl"].values())))
    header = ["model", "params"] + [f"{int(k):,} ({int(k) / L:g}x)" for k in lengths]
    rows = [[name, f"{result['params'][name]:,}"] + [fmt(v) for v in per_length.values()]
            for name, per_length in result["ppl"].items()]
    return markdown_table(header, rows)


def ratio_table(result: dict, multiples: list[str], paper_columns: bool = False) -> str:
    """ppl at k L divided by ppl at L (1.00 = flat), ours beside the paper's where it has the numbers."""
    L = result["train_length"]
    header = ["model"] + [f"{m}x / 1x" for m in multiples]
    if paper_columns:
        header += ["paper 8K ppl", "paper 1.5x / 1x", "paper 2x / 1x"]
    rows = []
    for name, per_length in result["ppl"].items():
        base = per_length[str(L)]
        cells = [f"{per_length[str(int(float(m) * L))] / base:.2f}" if str(int(float(m) * L)) in per_length else "-"
                 for m in multiples]
        paper = PAPER_8K.get(name, {})
        p1 = paper.get("1")
        if paper_columns:
            cells.append(f"{p1:.2f}" if p1 else "-")
            cells.append(f"{paper['1.5'] / p1:.2f}" if "1.5" in paper else "-")
            cells.append(f"{paper['2'] / p1:.2f}" if "2" in paper else "-")
        rows.append([name] + cells)
    return markdown_table(header, rows)


def paper_table() -> str:
    rows = [[name, f"{PAPER_8K[key]['1']:.2f}", PAPER_8K[key].get("1.5", "-"), f"{PAPER_8K[key]['2']:.2f}"]
            for key, name in PAPER_NAMES.items()]
    return markdown_table(["paper model (PG-19, trained at 8K)", "8K", "12K", "16K"], rows)


def wall_table(result: dict) -> str:
    rows = [[entry["what"], entry["wall_s"]] for entry in result["wall_times"]]
    rows.append(["**total (this experiment's queue)**", sum(e["wall_s"] for e in result["wall_times"])])
    return markdown_table(["step", "wall time (s)"], rows)


def budget_table(result: dict) -> str:
    header = ["model", "attention", "options", "position", "params", "steps x batch x L = tokens",
              "final train loss", "training time (s)"]
    rows = [[name, opts["attention"], json.dumps(opts["attention_options"]), opts["position"],
             f"{result['params'][name]:,}",
             f"{result['steps']} x {result['batch_size']} x {result['train_length']} = {result['tokens_seen']:,}",
             f"{result['final_train_loss'][name]:.3f}", f"{result['train_seconds'][name]:.0f}"]
            for name, opts in result["options"].items()]
    return markdown_table(header, rows, align="llllrrrr")


def delta_table(result: dict) -> str:
    """Each variant's perplexity and its change against the first model (full LAVO), at every length."""
    names = list(result["ppl"])
    base = result["ppl"][names[0]]
    L = result["train_length"]
    header = ["variant"]
    for k in base:
        header += [f"ppl at {int(k) // L}x ({int(k):,})", f"change vs {names[0]}"]
    rows = []
    for name in names[1:]:
        cells = []
        for length, value in result["ppl"][name].items():
            cells += [fmt(value), f"{100 * (value / base[length] - 1):+.1f}%"]
        rows.append([name] + cells)
    return markdown_table(header, rows)


def filled(text: str, tables: dict[str, str]) -> tuple[str, list[str]]:
    """``text`` with each table between its ``<!-- BEGIN name -->`` and ``<!-- END name -->`` markers, and the
    names of the tables it has no markers for."""
    missing = []
    for name, table in tables.items():
        pattern = re.compile(rf"(<!-- BEGIN {re.escape(name)} -->\n).*?(<!-- END {re.escape(name)} -->)", re.S)
        text, found = pattern.subn(lambda m: m.group(1) + table + "\n" + m.group(2), text)
        if not found:
            missing.append(name)
    return text, missing


def fill(report: Path, tables: dict[str, str], shown: set[str] | None = None) -> None:
    """Fill ``report``'s tables, and say which of the tables it should show (``shown``; None: all) it shows
    none of (a renamed marker keeps an old table)."""
    if report.exists():
        text, missing = filled(report.read_text(), tables)
        write_text(report, text)
        missing = [name for name in missing if shown is None or name in shown]
        if missing:
            print(f"note: {report} has no markers for the tables {', '.join(missing)}, which it leaves out",
                  file=sys.stderr)


def make_tables(result: dict, experiment: str) -> dict[str, str]:
    """The tables of an experiment's ``results.json``, by marker name."""
    L = result["train_length"]
    multiples = [f"{int(k) / L:g}" for k in next(iter(result["ppl"].values()))][1:]
    return {"ppl": ppl_table(result), "ratio": ratio_table(result, multiples, experiment == "lm_extrapolation"),
            "paper": paper_table(), "wall": wall_table(result), "budget": budget_table(result),
            "delta": delta_table(result)}


def reported_tables(experiment: str) -> set[str]:
    """The tables of ``make_tables`` that the experiment's REPORT.md shows (tables.md holds them all): the paper's
    numbers beside experiment 1 only, the change against full LAVO in the ablation only."""
    return {"budget", "ppl", "ratio", "wall"} | {"lm_extrapolation": {"paper"}, "ablation": {"delta"}}.get(
        experiment, set())


def tables_markdown(tables: dict[str, str]) -> str:
    """``tables.md``: every table under its name."""
    return "".join(f"## {k}\n\n{v}\n\n" for k, v in tables.items())


def tables(exp: Path) -> None:
    out = make_tables(json.loads((exp / "results.json").read_text()), exp.name)
    write_text(exp / "tables.md", tables_markdown(out))
    fill(exp / "REPORT.md", out, reported_tables(exp.name))


def experiment_folder(argv: list[str], usage: str) -> Path:
    """``argv[0]``, an experiment's folder; exits with ``usage`` when it is not given or not a folder."""
    if not argv or not Path(argv[0]).is_dir():
        sys.exit(f"usage: {usage}" + (f"\n{argv[0]} is not a folder" if argv else ""))
    return Path(argv[0])


def main(argv: list[str]) -> None:
    usage = "report_tools.py {results,tables} EXPERIMENT_DIR"
    if not argv or argv[0] not in ("results", "tables"):
        sys.exit(f"usage: {usage}")
    command, exp = argv[0], experiment_folder(argv[1:], usage)
    if command == "results":
        result = collect(exp)
        write_json(exp / "results.json", result)
        plot(exp, result)
    tables(exp)
    written = [f"results.json, {exp.name}.png"] * (command == "results") + ["tables.md"]
    print(f"{exp}: {', '.join(written)}" + (", REPORT.md tables" if (exp / "REPORT.md").exists() else ""))


if __name__ == "__main__":
    main(sys.argv[1:])
