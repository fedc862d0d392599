"""How each linear mechanism's forward + backward time grows from one length to four times it, with glibc's
default allocator settings and with freed memory kept in the process, in one run.

glibc serves every allocation above its mmap threshold (at most 32 MiB) with a fresh mapping and hands it back
to the kernel when freed, so each large temporary of the next call page-faults again. The tensors of a layer
grow with T, so that cost adds a super-linear term that is the allocator's, not the mechanism's. The second
setting (``MALLOC_MMAP_MAX_=0``, a trim threshold above any heap) keeps freed memory for reuse; both settings run
in fresh processes, one thread each, on the same inputs.

    python benchmarks/growth.py --out benchmarks/results/cpu_growth      # writes .json and .md
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

ALLOCATORS = {
    "glibc default": {},
    "freed memory kept": {"MALLOC_MMAP_MAX_": "0", "MALLOC_TRIM_THRESHOLD_": str(2 ** 40)},
}
CHILD = r"""
import json, sys, time, torch
from lavo import build_attention
from lavo.registry import attention_class
torch.set_num_threads(1)
name, short, long, repeats = sys.argv[1], int(sys.argv[2]), int(sys.argv[3]), int(sys.argv[4])
options = {"max_length": long} if "max_length" in attention_class(name).option_names() else {}
times = {}
for length in (short, long):
    torch.manual_seed(0)
    layer = build_attention(name, 512, 8, causal=True, **options)
    x = torch.randn(1, length, 512, requires_grad=True)
    runs = []
    for _ in range(repeats + 1):  # the first call warms up
        start = time.perf_counter()
        y, _ = layer(x)
        y.sum().backward()
        runs.append((time.perf_counter() - start) * 1e3)
    times[length] = runs[1:]
print(json.dumps(times))
"""


def measure(name: str, short: int, long: int, repeats: int, extra_env: dict) -> dict[int, list[float]]:
    """Every timed call's ms at each length, in a fresh process with ``extra_env``."""
    env = {**os.environ, "OMP_NUM_THREADS": "1", **extra_env}
    result = subprocess.run([sys.executable, "-c", CHILD, name, str(short), str(long), str(repeats)], env=env,
                            capture_output=True, text=True, check=True)
    return {int(k): v for k, v in json.loads(result.stdout.strip().splitlines()[-1]).items()}


def growth_record(name: str, allocator: str, times_ms: dict[int, list[float]], short: int, long: int) -> dict:
    """The median ms at each length (of an even count of calls, the mean of the middle two), every call's ms
    (their spread is the noise) and the growth from ``short`` to ``long``."""
    ms = {length: statistics.median(times) for length, times in times_ms.items()}
    return {"mechanism": name, "allocator": allocator, "ms": ms, "times_ms": times_ms, "growth": ms[long] / ms[short]}


def build_parser() -> argparse.ArgumentParser:
    """The flags, each checked as ``lavo bench`` checks its own: a bad value is refused by name here, not met as a
    traceback of the first child process."""
    from lavo.bench.cli import parse_length
    from lavo.bench.settings import Settings
    from lavo.settings import flag_type

    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--short", type=parse_length, default=4096, help="the shorter length [4096]")
    parser.add_argument("--long", type=parse_length, default=16384, help="the longer length [16384]")
    parser.add_argument("--repeats", type=flag_type(Settings, "repeats"), default=3, help="timed calls per length [3]")
    parser.add_argument("--out", type=Path, required=True, help="path prefix of the .json and .md files")
    return parser


def main() -> None:
    from lavo.bench.measure import machine_info
    from lavo.files import write_json, write_text
    from lavo.registry import attention_class, available_attentions
    from lavo.report import markdown_table

    args = build_parser().parse_args()
    names = [n for n in available_attentions() if attention_class(n).time_complexity == "linear"]
    records = []
    for name in names:
        for allocator, extra_env in ALLOCATORS.items():
            times_ms = measure(name, args.short, args.long, args.repeats, extra_env)
            records.append(growth_record(name, allocator, times_ms, args.short, args.long))
            print(f"{name:10s} {allocator:18s} x{records[-1]['growth']:.2f}", flush=True)
    ideal = args.long / args.short
    info = {**machine_info("cpu"), "threads": 1}
    write_json(args.out.with_suffix(".json"), {"machine": info, "short": args.short, "long": args.long,
                                               "records": records, "date": time.strftime("%Y-%m-%d %H:%M:%S")})
    rows = []
    for name in names:
        cells = [r for r in records if r["mechanism"] == name]
        rows.append([name] + [f"{r['ms'][args.short]:.0f} / {r['ms'][args.long]:.0f} ms, x{r['growth']:.2f}"
                              for r in cells])
    table = markdown_table(["mechanism"] + [f"{a}: {args.short} / {args.long}" for a in ALLOCATORS], rows)
    write_text(args.out.with_suffix(".md"),
               f"# Forward + backward growth from T={args.short} to T={args.long} (x{ideal:g} is linear)\n\n"
               f"One layer (dim 512, 8 heads), one thread, median of {args.repeats}; commit {info['commit']}.\n\n"
               f"{table}\n")


if __name__ == "__main__":
    main()
