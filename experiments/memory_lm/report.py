"""The tables of experiments/memory_lm beyond experiments/report_tools.py's (which makes the perplexity tables):
perplexity against local attention's, context use and passkey (each probe's folder and the folders of its
kept earlier runs, e.g. passkey-60steps), into probes.md and REPORT.md under the folder's name.

    python experiments/memory_lm/report.py experiments/memory_lm
"""
from __future__ import annotations

import json
import sys
from pathlib import Path

from lavo.files import write_text
from lavo.report import markdown_table

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from report_tools import experiment_folder, fill  # noqa: E402  (experiments/ is not a package)


def context_table(result: dict) -> str:
    contexts = [str(c) for c in result["contexts"]]
    header = ["model"] + [f"context {c}" for c in contexts] + [f"{contexts[-1]} / 0"]
    rows = [[name] + [f"{per[c]['ppl']:.2f}" for c in contexts] + [f"{per[contexts[-1]]['ppl'] / per['0']['ppl']:.3f}"]
            for name, per in result["results"].items()]
    return markdown_table(header, rows)


def passkey_table(result: dict) -> str:
    lengths = list(next(iter(result["accuracy"].values())))
    rows = [[name] + [f"{per[k]:.3f}" for k in lengths] for name, per in result["accuracy"].items()]
    return markdown_table(["model"] + [f"{int(k):,} tokens" for k in lengths], rows)


def versus_table(result: dict, reference: str) -> str:
    """Each model's held-out perplexity relative to ``reference``'s at every length (+3.0% = 3% higher)."""
    lengths = list(result["ppl"][reference])
    rows = [[name] + [f"{100 * (per[k] / result['ppl'][reference][k] - 1):+.1f}%" for k in lengths]
            for name, per in result["ppl"].items() if name != reference]
    return markdown_table(["model"] + [f"{int(k):,}" for k in lengths], rows)


def main(argv: list[str]) -> None:
    exp = experiment_folder(argv, "report.py EXPERIMENT_DIR (experiments/memory_lm)")
    tables = {"versus_local": versus_table(json.loads((exp / "results.json").read_text()), "local")}
    for probe, table in (("context_use", context_table), ("passkey", passkey_table)):
        for path in sorted(exp.glob(f"{probe}*/results.json")):  # the probe's folder and its kept earlier runs
            tables[path.parent.name] = table(json.loads(path.read_text()))
    write_text(exp / "probes.md", "".join(f"## {k}\n\n{v}\n\n" for k, v in tables.items()))
    fill(exp / "REPORT.md", tables)


if __name__ == "__main__":
    main(sys.argv[1:])
