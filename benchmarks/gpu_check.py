"""The GPU check of LAVO's Triton path, one command on a machine with an NVIDIA GPU and no network: the kernel tests on
CUDA, then the op benchmark against SDPA (and fla's ops when importable), decoding, whole-model training, and a
profile by kernel of LAVO's op, SDPA and the training step (what the targets missed are looked at with), all bf16,
each step under a time limit of its own and all of them within ``--budget`` seconds (330: the whole check stays
under six minutes on an H200); the steps come in order of what the targets need most, so a step the budget leaves
no time for is the least needed one, recorded as not run.
Decoding is measured per token at 1K..128K of context, against softmax's key/value cache through SDPA, in each form
LAVO decodes: through its cache (torch), the fixed-layout step with the fused kernel (``decode``) and with torch ops
(``decode_torch``), each also replayed from a CUDA graph; with each form's cache bytes. Writes ``<gpu>_bf16.json``
and ``<gpu>_bf16.md`` into the output directory, again after every step (so a check cut off keeps what it
measured), and every step's tables, JSON and log in one archive there, ``steps.tar.gz``: three files, since a
machine lent for the check may give back only a few.

Run through ``scripts/gpu_check.sh OUT_DIR``. ``--dry-run`` takes the same steps on the CPU at tiny sizes, with
the kernels in Triton's interpreter: a check of this script, not a measurement.
"""
from __future__ import annotations

import argparse
import importlib.metadata
import importlib.util
import json
import os
import re
import subprocess
import sys
import tarfile
import tempfile
import time
import zipfile
from pathlib import Path

import torch

from lavo.bench.measure import source_commit
from lavo.bench.output import markdown
from lavo.bench.settings import Settings
from lavo.files import atomic_write, write_json, write_text
from lavo.report import length_label, markdown_table, number

LENGTHS = "1K,2K,4K,8K,16K,32K,64K,128K"
# (step, mechanism, what it is) of each form of LAVO's decoding step the check measures.
DECODING_FORMS = [("decode", "lavo", "through LavoCache (torch)"),
                  ("decode_torch", "lavo (step)", "fixed layout, torch ops"),
                  ("decode_torch", "lavo (graph)", "fixed layout, torch ops, CUDA graph"),
                  ("decode", "lavo (step)", "fused kernel"),
                  ("decode", "lavo (graph)", "fused kernel, CUDA graph")]


KERNEL_TESTS = ["-m", "slow or not slow", "tests/test_triton_ops.py", "tests/test_decode_step.py"]
COLLECT_SECONDS = 60  # listing the kernel tests to split them; past it they run as one command
BUDGET_SECONDS = 330  # all steps together: with start-up and the summary, the check ends within six minutes
MIN_STEP_SECONDS = 10  # a step given less is recorded as not run: it could not start its bench in that time


def pytest(*args: str) -> list[str]:
    return [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", *args]


def steps(dry_run: bool, fla: bool) -> list[tuple[str, float, list[str]]]:
    """(name, seconds allowed, command) of each step; a bench step's JSON goes to ``{out}/<name>.json``."""
    bench = [sys.executable, "-m", "lavo.bench", "--no-progress", "--dtype", "bf16"]
    if dry_run:
        quick = bench + ["--device", "cpu", "--quick", "--backend", "triton", "--time-limit", "60"]
        return [("tests", 120, pytest("-k", "backend_choice or cross_attention_layer or graphed_decoder",
                                      *KERNEL_TESTS)),
                ("ops", 120, quick + ["--sections", "attention", "--attentions", "", "--ops", "lavo_attention,sdpa"]),
                ("decode", 60, quick + ["--sections", "decode", "--decode-attentions", "lavo,local,softmax"]),
                ("decode_torch", 60, quick + ["--sections", "decode", "--decode-attentions", "lavo", "--backend",
                                              "torch"]),
                ("model", 120, quick + ["--sections", "model", "--model-attentions", "lavo,local,softmax"]),
                ("profile", 120, quick + ["--sections", "profile", "--attentions", "", "--ops", "lavo_attention",
                                          "--passes", "fwd+bwd", "--model-attentions", "lavo"])]
    # the Triton path by name: were it unavailable, LAVO's rows fail instead of silently timing the torch path
    gpu = bench + ["--device", "cuda", "--backend", "triton", "--time-limit", "20", "--repeats", "10", "--warmup", "3"]
    attention = gpu + ["--sections", "attention", "--attentions", ""]
    # fla's ops as anchors, each in a step of its own (SDPA beside them for the ratios): the sliding window right
    # after the targets' rows; the chunked linear attention, which autotunes some 100 configurations at each new
    # shape, last, with what is left
    anchor = attention + ["--lengths", "1K,16K,64K", "--ops"]
    fla_window = [("fla_window", 30, anchor + ["sdpa,fla_window"])] if fla else []
    fla_linear = [("fla_linear", 90, anchor + ["sdpa,fla_linear"])] if fla else []
    # where the time goes, for the targets above that are missed: LAVO's op and SDPA at 16K and 64K, and the
    # training step at 4K and 16K
    profile = gpu + ["--sections", "profile", "--attentions", "", "--ops", "lavo_attention,sdpa", "--passes", "fwd+bwd",
                     "--lengths", "16K,64K", "--max-quadratic-length", "64K", "--model-preset", "small",
                     "--model-attentions", "lavo,softmax", "--model-lengths", "4K,16K", "--warmup", "2",
                     "--repeats", "3"]
    # the targets' rows first (kernel tests, op, decoding, training), then the torch path's and the profile
    return [("tests", 110, pytest(*KERNEL_TESTS)),
            ("ops", 70, attention + ["--ops", "lavo_attention,sdpa", "--lengths", LENGTHS,
                                     "--max-quadratic-length", "128K"]),
            ("decode", 70, gpu + ["--sections", "decode", "--decode-attentions", "lavo,local,softmax",
                                  "--decode-lengths", LENGTHS, "--max-quadratic-length", "16K"]),
            ("model", 65, gpu + ["--sections", "model", "--model-preset", "small", "--model-attentions",
                                 "lavo,local,softmax", "--model-lengths", "1K,4K,16K", "--model-repeats", "3",
                                 "--max-quadratic-length", "16K"]),
            *fla_window,
            ("decode_torch", 40, gpu + ["--sections", "decode", "--decode-attentions", "lavo", "--backend", "torch",
                                        "--decode-lengths", LENGTHS]),
            ("ops_torch", 30, attention + ["--ops", "lavo_attention", "--backend", "torch", "--lengths", "1K,4K,16K"]),
            ("profile", 35, profile),
            *fla_linear]


def unpack_wheels(folder: Path, site: Path) -> Path | None:
    """Every ``*.whl`` in ``folder`` unpacked into ``site``: a folder to put on the path. A pure-Python wheel is a
    zip of the importable files, so this is what installing it would do, less its scripts and records. None,
    with a warning, when there are none: the check runs without them (the anchor rows are optional)."""
    wheels = sorted(folder.glob("*.whl"))
    if not wheels:
        print(f"[gpu_check] warning: --wheels: no .whl files in {folder}; running without them", file=sys.stderr)
        return None
    for wheel in wheels:
        with zipfile.ZipFile(wheel) as archive:
            archive.extractall(site)
    return site


def split_tests(command: list[str], shards: int, env: dict) -> list[list[str]]:
    """A pytest ``command`` as up to ``shards`` commands, to run at once, dealing its test ids round-robin (the
    heavy tests stand together in the files: dealt, no command gets them all).

    Triton compiles each kernel specialization on the CPU, one at a time in a process; the kernel tests launch
    229 of them (``tests/count_specializations.py``), most of the step's time in one process."""
    try:
        listed = subprocess.run(command + ["--collect-only"], capture_output=True, text=True, env=env,
                                timeout=COLLECT_SECONDS).stdout
    except subprocess.TimeoutExpired:  # the one command, under its step's limit, says what hangs
        return [command]
    ids = [line for line in listed.splitlines() if "::" in line]
    if not ids:  # nothing to split (or collection failed: the one command says why)
        return [command]
    options = [arg for arg in command[len(pytest()):] if not arg.startswith("tests/")]
    return [pytest(*options, *ids[first::shards]) for first in range(min(shards, len(ids)))]


def pytest_summary(stdouts: list[str]) -> str:
    """The counts of pytest's last summary line in each output, added up: ``"150 passed, 2 failed"``."""
    counts: dict[str, int] = {}
    for stdout in stdouts:
        lines = re.findall(r"^=*\s*(\d+ (?:passed|failed|error|skipped|deselected).*?)\s*=*$", stdout, re.M)
        for count, word in re.findall(r"(\d+) (passed|failed|errors?|skipped|deselected|xfailed|xpassed)",
                                      lines[-1] if lines else ""):
            counts[word] = counts.get(word, 0) + int(count)
    return ", ".join(f"{count} {word}" for word, count in counts.items()) or "no pytest summary"


def _read_back(file) -> str:
    """What was written to a temporary file; closes it."""
    with file:
        file.seek(0)
        return file.read()


def run_step(name: str, seconds: float, commands: list[list[str]], out: Path, env: dict) -> dict:
    """Run one step's commands at once, all within its time limit: their stdout, one after another, to
    ``{out}/{name}.md`` (a bench step's tables), with their stderr to ``{out}/{name}.log``."""
    if name != "tests":
        commands = [command + ["--json", str(out / f"{name}.json")] for command in commands]
    start = time.monotonic()
    # files, not pipes: a process blocked on a full pipe would wait for the one read before it
    files = [(tempfile.TemporaryFile("w+"), tempfile.TemporaryFile("w+")) for _ in commands]
    running = [subprocess.Popen(command, stdout=stdout, stderr=stderr, text=True, env=env)
               for command, (stdout, stderr) in zip(commands, files)]
    failed, late = [], False
    for process in running:
        try:
            process.wait(timeout=max(0.0, seconds - (time.monotonic() - start)))
        except subprocess.TimeoutExpired:
            process.kill()
            process.wait()
            late = True
        failed += [process.returncode] * (process.returncode != 0)
    outputs = [(_read_back(stdout), _read_back(stderr)) for stdout, stderr in files]
    status = f"timed out after {seconds:g} s" if late else f"exit {failed[0]}" if failed else "ok"
    write_text(out / f"{name}.md", "".join(stdout for stdout, _ in outputs))
    write_text(out / f"{name}.log", "".join(stdout + stderr for stdout, stderr in outputs))
    step = dict(name=name, command=" ".join(commands[0]) + (f" (and {len(commands) - 1} more at once)"
                                                               if len(commands) > 1 else ""),
                seconds=round(time.monotonic() - start, 1), status=status)
    if name == "tests":
        step["summary"] = pytest_summary([stdout for stdout, _ in outputs])
    return step


def step_tables(path: Path) -> str:
    """The markdown tables of a bench step, from its JSON: written after every record, so a step stopped at its
    time limit still shows what it measured."""
    if not path.exists():
        return ""
    saved = json.loads(path.read_text())
    return markdown(saved["records"], saved["machine"], Settings(**saved["settings"]))


def records(out: Path, step_names: list[str]) -> list[dict]:
    """Every record of the bench steps' JSON files, each tagged with its step."""
    found = []
    for name in step_names:
        path = out / f"{name}.json"
        if path.exists():
            found += [dict(r, step=name) for r in json.loads(path.read_text())["records"]]
    return found


def _find(rows: list[dict], **match) -> dict | None:
    return next((r for r in rows if all(r.get(k) == v for k, v in match.items()) and r["status"] == "ok"), None)


def targets(rows: list[dict], contexts: int = len(LENGTHS.split(","))) -> list[list[str]]:
    """The issue's targets against this run: (target, measured, met); ``contexts``: the decoding lengths."""
    table = []

    def ratio(length: int) -> float | None:
        lavo = _find(rows, step="ops", mechanism="lavo_attention (op)", op="fwd+bwd", length=length)
        sdpa = _find(rows, step="ops", mechanism="sdpa (op)", op="fwd+bwd", length=length)
        return lavo["ms"] / sdpa["ms"] if lavo and sdpa else None

    def add(target: str, value: float | None, text: str, met) -> None:
        verdict = None if value is None else met(value)
        table.append([target, text if value is not None else "not measured",
                      "—" if value is None else verdict if isinstance(verdict, str) else "yes" if verdict else "no"])

    for length, bound, words in ((1024, 2.0, "within 2x of SDPA"), (16384, 1.0, "no slower than SDPA"),
                                 (65536, 0.2, "at least 5x faster than SDPA")):
        value = ratio(length)
        add(f"fwd+bwd {length_label(length)}: {words}", value, f"{number(value, 3)} x SDPA's time",
            lambda v, bound=bound: v <= bound)
    lavo64 = _find(rows, step="ops", mechanism="lavo_attention (op)", op="fwd+bwd", length=65536)
    add("fwd+bwd 64K <= 7 ms", lavo64 and lavo64["ms"], f"{number(lavo64 and lavo64['ms'])} ms", lambda v: v <= 7)
    for length in (16384, 65536, 131072):
        lavo = _find(rows, step="ops", mechanism="lavo_attention (op)", op="fwd+bwd", length=length)
        sdpa = _find(rows, step="ops", mechanism="sdpa (op)", op="fwd+bwd", length=length)
        value = lavo["peak_mib"] / sdpa["peak_mib"] if lavo and sdpa and sdpa["peak_mib"] else None
        add(f"peak memory {length_label(length)} <= SDPA's", value,
            f"{number(lavo and lavo['peak_mib'])} vs {number(sdpa and sdpa['peak_mib'])} MiB", lambda v: v <= 1)
    for step, mechanism, form in DECODING_FORMS:
        steps_ms = [r["ms"] for r in rows if r["step"] == step and r["mechanism"] == mechanism and r["status"] == "ok"]
        worst = max(steps_ms) if steps_ms else None
        complete = len(steps_ms) == contexts  # "every context" is judged on all of them, not on those measured
        add(f"decoding step <= 0.3 ms at every context: {form}", worst,
            f"at most {number(worst)} ms over {len(steps_ms)} of {contexts} contexts",
            lambda v: v <= 0.3 if complete else f"partial ({len(steps_ms)}/{contexts})")
    for length, bound in ((4096, 1.0), (16384, 2.0)):
        lavo = _find(rows, step="model", mechanism="lavo", length=length)
        softmax = _find(rows, step="model", mechanism="softmax+rope", length=length)
        value = lavo["tokens_per_s"] / softmax["tokens_per_s"] if lavo and softmax else None
        add(f"`small` training {length_label(length)}: LAVO tokens/s >= {bound:g}x softmax+RoPE", value,
            f"{number(value, 3)}x", lambda v, bound=bound: v >= bound)
    return table


def write_summary(out: Path, work: Path, machine: dict, plan: list, done: list[dict]) -> Path:
    """The steps' files in ``work`` as ``steps.tar.gz`` in ``out`` (first: they land even if a summary cannot be
    made of them), then ``<gpu>_bf16.{json,md}`` from the steps ``done`` so far; returns the markdown's path."""

    def archive(tmp: Path) -> None:
        with tarfile.open(tmp, "w:gz") as tar:
            for path in sorted(work.iterdir()):
                tar.add(path, arcname=f"steps/{path.name}")
    atomic_write(out / "steps.tar.gz", archive)
    rows = records(work, [name for name, _, _ in plan])
    stem = re.sub(r"[^a-z0-9]+", "_", machine["gpu"].lower()).strip("_") + "_bf16"
    met = targets(rows)
    write_json(out / f"{stem}.json", dict(machine=machine, steps=done, targets=met, records=rows))
    text = [f"# GPU check: {machine['gpu']}, bf16", "",
            f"torch {machine['torch']}, CUDA {machine['cuda']}, triton {machine['triton']}, fla "
            f"{machine['fla'] or 'absent'}; {machine['date']}. Made by `scripts/gpu_check.sh`.", "",
            "## Steps", "",
            markdown_table(["step", "status", "seconds", "note"],
                           [[s["name"], s["status"], s["seconds"], s.get("summary", "")] for s in done]), "",
            "## Targets", "", markdown_table(["target", "measured", "met"], met), ""]
    for name, _, _ in plan:
        tables = step_tables(work / f"{name}.json")
        if "## " in tables:
            text += [f"## Step `{name}`", "", tables[tables.find("## "):].replace("\n## ", "\n### ").strip()
                     .replace("## ", "### ", 1), ""]
    write_text(out / f"{stem}.md", "\n".join(text))
    return out / f"{stem}.md"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("out", type=Path, help="output directory")
    parser.add_argument("--dry-run", action="store_true", help="CPU, tiny sizes, kernels in Triton's interpreter")
    parser.add_argument("--budget", type=float, default=BUDGET_SECONDS,
                        help=f"seconds for all steps together (default {BUDGET_SECONDS}); each step also has its own "
                        "limit, and a step started with less time left gets what is left")
    parser.add_argument("--wheels", type=Path, help="a folder of pure-Python wheels to use without installing them "
                        "(e.g. fla-core, for the anchor rows, where nothing can be installed)")
    args = parser.parse_args(argv)
    if not args.dry_run and not torch.cuda.is_available():
        raise SystemExit("no CUDA device: run with --dry-run to check this script on the CPU")
    if args.out.exists() and any(args.out.iterdir()):
        raise SystemExit(f"{args.out} is not empty: give the check a new folder (an earlier run's files there would "
                         "be read as this run's)")
    args.out.mkdir(parents=True, exist_ok=True)
    work = Path(tempfile.mkdtemp(prefix="gpu_check_steps_"))  # each step's files; archived into the output
    env = dict(os.environ, HF_HUB_OFFLINE="1", TOKENIZERS_PARALLELISM="false")
    site = unpack_wheels(args.wheels, Path(tempfile.mkdtemp(prefix="gpu_check_site_"))) if args.wheels else None
    if site is not None:
        sys.path.insert(0, str(site))
        env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(site), env.get("PYTHONPATH")]))
    if args.dry_run:
        env["TRITON_INTERPRET"] = "1"
    fla = importlib.util.find_spec("fla") is not None
    fla_version = next((importlib.metadata.version(name) for name in
                        importlib.metadata.packages_distributions().get("fla", [])), "present") if fla else None
    triton_version = None
    if importlib.util.find_spec("triton") is not None:
        import triton
        triton_version = triton.__version__
    machine = dict(gpu="cpu-dry-run" if args.dry_run else torch.cuda.get_device_name(0), torch=torch.__version__,
                   cuda=torch.version.cuda, triton=triton_version, fla=fla_version,
                   date=time.strftime("%Y-%m-%d %H:%M:%S"), **source_commit())
    plan = steps(args.dry_run, fla)
    shards = 2 if args.dry_run else min(8, os.cpu_count() or 1)
    done, deadline = [], time.monotonic() + args.budget
    for name, seconds, command in plan:
        seconds = min(seconds, deadline - time.monotonic())
        if seconds < MIN_STEP_SECONDS:
            done.append(dict(name=name, command=" ".join(command), seconds=0,
                             status=f"not run: the check's budget of {args.budget:g} s was spent"))
        else:
            print(f"[gpu_check] {name} (at most {seconds:.0f} s)", file=sys.stderr, flush=True)
            began = time.monotonic()  # listing the tests to split them counts against the step's time
            commands = split_tests(command, shards, env) if name == "tests" else [command]
            done.append(run_step(name, seconds - (time.monotonic() - began), commands, work, env))
            done[-1]["seconds"] = round(time.monotonic() - began, 1)
            collected = sum("::" in arg for command in commands for arg in command)
            if collected:  # a command killed at the limit prints no summary: its tests would go uncounted
                done[-1]["summary"] += f" of {collected} collected"
        print(f"[gpu_check] {name}: {done[-1]['status']} in {done[-1]['seconds']} s", file=sys.stderr, flush=True)
        try:
            summary = write_summary(args.out, work, machine, plan, done)
        except Exception as error:  # the check runs once: a step's files it cannot summarise must not stop the rest
            summary = f"no summary after {name}: {error!r} (the steps' files are in steps.tar.gz)"
            print(f"[gpu_check] {summary}", file=sys.stderr, flush=True)
    print(summary)
    return 0


if __name__ == "__main__":
    sys.exit(main())
