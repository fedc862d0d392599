"""The GPU-scale runs: train the next unfinished runs of ``plan.json`` back to back within a time budget, score
each at 1x..16x its training length on the held-out books and the held-out code, and write one results file per
run as it finishes. A later call skips finished runs and resumes a checkpointed one (on the same machine).

    python experiments/gpu_scale/run.py --prepare          # once, with network: the corpus, into data/
    python experiments/gpu_scale/run.py --list             # every run, its parameters and whether it is done
    python experiments/gpu_scale/run.py --budget 390       # one GPU call (run_device.sh wraps it)
    python experiments/gpu_scale/run.py --budget 390 --workers 2   # the same, two runs at a time
    python experiments/gpu_scale/run.py --dry-run          # tiny models, few steps, CPU: the whole path

Results go to ``results/<run>.json`` (kept in git); run directories (weights, optimiser state) to ``runs/``,
which stays on the machine that trained them. REPORT.md says how the plan was chosen.
"""
from __future__ import annotations

import argparse
import contextlib
import hashlib
import json
import shutil
import signal
import statistics
import sys
import time
import traceback
from dataclasses import dataclass, field
from datetime import datetime, timezone
from pathlib import Path
from typing import Callable

HERE = Path(__file__).resolve().parent
ROOT = HERE.parents[1]
sys.path.insert(0, str(ROOT))  # this checkout's lavo, also where it is not installed (the GPU machine)
sys.path.insert(0, str(HERE))

from concurrent_runs import GpuUtilization, choose_workers, probe_throughput, probe_worker, run_workers  # noqa: E402
from lavo.config import RunConfig, deep_merge  # noqa: E402
from lavo.files import write_json  # noqa: E402
from lavo.settings import comma_list  # noqa: E402

DEFAULT_BUDGET = 390  # seconds of work in one 8-minute GPU call (run_device.sh's BUDGET_S); the rest is start-up,
# the slack before run_device.sh's SIGTERM (LIMIT_S) and the 30 s until its SIGKILL
MAX_PROBED_WORKERS = 3  # --workers auto tries 1..3 runs at once
PROBE_SECONDS = 5.0
# the probe's workers must be built and warmed up within this share of the call's budget (and 300 s), else the probe
# fails and the call trains with one worker: a slow warm-up must not spend the call
PROBE_WARMUP_SHARE = 0.25
LONG_EVAL_CUT_OFF = {"failed": "not finished: the call's time limit ended it"}  # a results file's long_eval, until done


class CallEnded(BaseException):
    """SIGTERM: the call's time limit (run_device.sh's ``timeout``) is up. A BaseException, like Ctrl-C's, so
    that no ``except Exception`` takes it for a failed run."""


@contextlib.contextmanager
def sigterm_ends_the_call():
    """While active, SIGTERM raises :class:`CallEnded` (training turns it into a checkpoint and a
    KeyboardInterrupt itself), so that the call records what it was doing before it goes."""
    def end(number, frame):
        signal.signal(signal.SIGTERM, signal.SIG_IGN)  # once: the call's line is then written in peace
        raise CallEnded
    previous = signal.signal(signal.SIGTERM, end)
    try:
        yield
    finally:
        signal.signal(signal.SIGTERM, previous)


@dataclass
class Activity:
    """What a call is doing, for the line a call ended at its time limit leaves in ``calls.jsonl``."""

    run: PlannedRun | None = None
    phase: str = ""  # "training", "scoring" or "long evaluation"
    since: float = field(default_factory=time.monotonic)
    step_seconds: float | None = None  # the run's training pace, once measured

    def enter(self, run: PlannedRun, phase: str) -> None:
        self.run, self.phase, self.since = run, phase, time.monotonic()

    def ended(self) -> dict:
        """The call-line entries of a call ended now: what it was doing, for how long, and what that measured."""
        if self.run is None:
            return {"ended": {"phase": "between runs"}}
        seconds = round(time.monotonic() - self.since, 2)
        entries = {"ended": {"run": self.run.name, "phase": self.phase, "seconds": seconds}}
        if self.step_seconds is not None:
            entries["step_seconds"] = {self.run.model: round(self.step_seconds, 4)}
        if self.phase == "scoring":  # it takes at least this long: the next call plans for it
            entries["scoring_cut_off"] = {self.run.model: seconds}
        if self.phase == "long evaluation":  # its run's scores are saved; a later call on this machine finishes it
            entries["long_eval_cut_off"] = {self.run.model: seconds}
        return entries


@dataclass
class PlannedRun:
    name: str  # "<model>-s<seed>"
    model: str  # a key of the plan's "models" or "ablation"
    seed: int
    values: dict  # the run config, without out_dir
    long_eval: bool  # also scored at the plan's long_eval lengths
    digest: str = ""  # of what its results depend on (settings_digest): a result with another one is stale


def load_plan(path: Path = HERE / "plan.json") -> dict:
    return json.loads(path.read_text())


def planned_runs(plan: dict, dry_run: bool = False, data_dir: str | None = None) -> list[PlannedRun]:
    """Every run of the plan, in the order they are trained: each model for every seed, then each ablation."""
    base = deep_merge(plan["base"], plan["dry_run"]["run"]) if dry_run else plan["base"]
    if data_dir is not None:
        base = deep_merge(base, {"data": {"data_dir": data_dir}})
    runs = []
    for group in ("models", "ablation"):
        for seed in plan["seeds"]:
            for model, overrides in plan[group].items():
                values = deep_merge(deep_merge(base, overrides), {"train": {"seed": seed}})
                long_eval = model in plan["long_eval"]["models"]
                digest = settings_digest(plan, values, long_eval, dry_run)
                runs.append(PlannedRun(f"{model}-s{seed}", model, seed, values, long_eval, digest))
    return runs


def settings_digest(plan: dict, values: dict, long_eval: bool, dry_run: bool) -> str:
    """A digest of what a run's results depend on: its settings (where the data lies aside), the corpus and
    how it is scored. A results file recorded with another digest came from another plan, and is not reused."""
    plan_eval, plan_long_eval = eval_settings(plan, dry_run)
    settings = deep_merge(values, {"data": {"data_dir": None}})
    what = dict(run=settings, corpus=plan["corpus_fingerprint"], eval=plan_eval,
                long_eval=plan_long_eval if long_eval else None)
    return hashlib.sha256(json.dumps(what, sort_keys=True).encode()).hexdigest()[:16]


def eval_settings(plan: dict, dry_run: bool) -> tuple[dict, dict]:
    """The plan's ``eval`` and ``long_eval`` sections, with the dry run's values on top."""
    if not dry_run:
        return plan["eval"], plan["long_eval"]
    dry = plan["dry_run"]
    return deep_merge(plan["eval"], dry["eval"]), deep_merge(plan["long_eval"], dry["long_eval"])


def run_config(run: PlannedRun, runs_dir: Path) -> RunConfig:
    return RunConfig.from_dict(deep_merge(run.values, {"train": {"out_dir": str(runs_dir / run.name)}}))


# ----------------------------------------------------------------------------------------------- data

def prepare_corpus(plan: dict, data_dir: str, log=print) -> None:
    """Fetch and tokenise the corpus into ``data_dir``, drop the downloads (the texts stay), and say how large
    the folder is: it travels to the GPU machine whole."""
    from lavo.data import describe, prepare
    data = plan["base"]["data"]
    prepared = prepare(data["source"], data["tokenizer"], data_dir, log=log)
    for download in Path(data_dir).glob("*/download"):
        shutil.rmtree(download)
    log(describe(prepared))
    size = sum(path.stat().st_size for path in Path(data_dir).rglob("*") if path.is_file())
    log(f"{data_dir}: {size / 2 ** 20:.1f} MiB in all")
    if prepared.manifest["fingerprint"][:12] != plan["corpus_fingerprint"]:
        log(f"warning: this corpus ({prepared.manifest['fingerprint'][:12]}) is not the plan's "
            f"({plan['corpus_fingerprint']}): other texts, or another interpreter's standard library")


def dry_run_data(data_dir: Path, scratch: Path) -> str:
    """A data folder for the dry run: links to ``data_dir``'s source texts, so that the dry run's own tokenizer
    and token caches (some 30 MB) are written beside its runs, not into the folder carried to the GPU machine."""
    scratch.mkdir(parents=True, exist_ok=True)
    for source in data_dir.iterdir():
        link = scratch / source.name
        if source.is_dir() and "+" not in source.name and not link.exists():  # a mix's caches are the dry run's own
            link.symlink_to(source.resolve(), target_is_directory=True)
    return str(scratch)


def check_corpus(plan: dict, data_dir: str) -> None:
    """Refuse to train on anything but the plan's corpus, prepared beforehand (the GPU machine has no network,
    and its own standard library would make another code corpus)."""
    from lavo.data import DataError, prepare
    data = plan["base"]["data"]
    try:
        prepared = prepare(data["source"], data["tokenizer"], data_dir, fetch=False, log=lambda *a: None)
    except DataError as error:
        raise SystemExit(f"the corpus is not prepared in {data_dir} ({error}): run `python "
                         f"experiments/gpu_scale/run.py --prepare` where there is network, and carry {data_dir}")
    found = prepared.manifest["fingerprint"][:12]
    if found != plan["corpus_fingerprint"]:
        raise SystemExit(f"{data_dir} holds the corpus {found}, not the plan's {plan['corpus_fingerprint']}")


def prepare_dry_run(config: RunConfig) -> None:
    """The dry run's own tokenizer and token caches, made once by the call before it starts any worker, as each
    worker makes them (``prepare_run``): made by each worker, or each of the probe's, they would all train the
    same tokenizer at once."""
    from lavo.train import Distributed, prepare_run
    prepare_run(config, Distributed(), lambda *args: None)


# ----------------------------------------------------------------------------------------------- training

def train_within(config: RunConfig, deadline: float, step_limit: int | None, log,
                 activity: Activity) -> tuple[bool, float | None]:
    """Train (or resume) one run, whose directory the caller has locked, until it is finished, ``deadline``
    (``time.monotonic()``) is near or ``step_limit`` steps were done in this call; checkpoints on the way. Returns
    whether the run is finished and its seconds per step (:func:`train_within`'s pace; None if it trained none).
    Ended by the call's time limit (a checkpoint, then KeyboardInterrupt), it leaves the pace so far in
    ``activity``."""
    from lavo.train import Distributed, Trainer, check_run_directory, prepare_run, resolve_device

    env, steps, interval = Distributed(), config.train.steps, config.train.checkpoint_interval or config.train.steps
    check_run_directory(Path(config.train.out_dir), resume=True, overwrite=False)
    trainer = Trainer(config, env, resolve_device(config.train.device), prepare_run(config, env, log), log)
    trainer.restore()
    trainer.start()
    if trainer.progress.step >= steps:  # trained; its summary is written, should a killed call have left none
        trainer.run(steps)
    budget = steps if step_limit is None else step_limit
    timings = []  # seconds per step of each chunk
    call_started, call_first = time.monotonic(), trainer.progress.step
    try:
        while trainer.progress.step < steps and budget > 0:
            chunk = min(interval, steps - trainer.progress.step, budget)
            if timings:  # the next chunk must end before the deadline, at the last chunk's pace
                chunk = min(chunk, int((deadline - time.monotonic()) / timings[-1]))
                if chunk < 1:
                    break
            started, first = time.monotonic(), trainer.progress.step
            trainer.run(first + chunk)  # checkpoints at its end
            timings.append((time.monotonic() - started) / max(1, trainer.progress.step - first))
            budget -= trainer.progress.step - first
    except KeyboardInterrupt:
        if trainer.progress.step > call_first:
            activity.step_seconds = (time.monotonic() - call_started) / (trainer.progress.step - call_first)
        raise
    # the model's pace: the fastest chunk after the first, which also compiles and warms up (all there is of one)
    pace = min(timings[1:] or timings) if timings else None
    return trainer.progress.step >= steps, pace


def evaluate(run_dir: Path, plan_eval: dict, settings: dict, lengths: list[int] | None, device, log) -> dict:
    """``{set: {length: {"loss", "ppl", "tokens", "segments"}}}`` on each held-out set of the plan (the
    held-out documents of those parts of the mix) with ``settings`` (the plan's ``eval`` or ``long_eval``), at
    ``lengths`` (None: the plan's multiples of the training length). The targets, the same at every length, are
    windows spread evenly over the whole set, so that it is sampled throughout rather than by its first documents
    (one window, from the start, where the longest length takes them all)."""
    from lavo.data import split_tokens
    from lavo.evaluate import perplexity_by_length
    from lavo.run import load_run

    model, config, tokenizer = load_run(run_dir, device)
    lengths = lengths or sorted({int(m * config.train.train_length) for m in plan_eval["multiples"]})
    scores = {}
    for name, parts in plan_eval["sets"].items():
        tokens = split_tokens(config.data.source, config.data.data_dir, config.data.holdout, "valid", tokenizer, parts)
        log(f"{run_dir.name}: scoring {name} ({len(tokens):,} held-out tokens) at {', '.join(map(str, lengths))}")
        scores[name] = {str(k): v for k, v in perplexity_by_length(
            model, tokens, lengths, batch_size=settings["batch_size"], chunk_size=settings["chunk_size"],
            max_tokens=settings["max_tokens"], device=device, spread=True).items()}
    return scores


def last_summary(run_dir: Path) -> dict:
    """The summary the last training call wrote at the end of ``metrics.jsonl``."""
    lines = (run_dir / "metrics.jsonl").read_text().splitlines()
    return [json.loads(line) for line in lines if '"final": true' in line][-1]


def device_name(device) -> str:
    import torch
    return torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu"


def estimate_seconds(run: PlannedRun, done: list[dict], step_seconds: dict[str, float],
                     cut_off: dict[str, float] | None = None) -> float | None:
    """How long ``run`` should take (training and scoring), from finished runs of the same model; else from the
    seconds per step a stopped run of that model measured (``step_seconds``, by model) and its scoring
    (:func:`estimate_eval_seconds`); else from finished runs of any model; None before any run has finished or
    measured its model. Scoring counts at least one and a half times what a scoring of the model ran before a
    call's time limit cut it off (``cut_off``), in either case."""
    if run.model in step_seconds and not any(r["model"] == run.model for r in done):
        return step_seconds[run.model] * run.values["train"]["steps"] + estimate_eval_seconds(run, done, cut_off)
    same = same_model_first(run, done)
    if not same:
        return None
    floor = 1.5 * (cut_off or {}).get(run.model, 0.0)
    return statistics.median(r["train_seconds_this_machine"] + max(r["eval_seconds"], floor) for r in same)


def past_calls(results_dir: Path) -> list[dict]:
    """What each earlier call did (``results/calls.jsonl``), oldest first."""
    path = results_dir / "calls.jsonl"
    return [json.loads(line) for line in path.read_text().splitlines()] if path.exists() else []


def by_model(results_dir: Path, entry: str, pick: Callable[[float, float], float]) -> dict[str, float]:
    """The ``{model: seconds}`` entry ``entry`` of every call line, ``pick`` (min or max) of each model's values."""
    seconds: dict[str, float] = {}
    for call in past_calls(results_dir):
        for model, value in call.get(entry, {}).items():
            seconds[model] = pick(value, seconds.get(model, value))
    return seconds


def measured_step_seconds(results_dir: Path) -> dict[str, float]:
    """Seconds per training step by model: the fastest any call that stopped a run of it measured (a slower one
    shared the GPU with more workers, or timed a run's first chunk)."""
    return by_model(results_dir, "step_seconds", min)


def scoring_cut_off(results_dir: Path) -> dict[str, float]:
    """Seconds a scoring of each model ran before its call's time limit ended it: the longest on record."""
    return by_model(results_dir, "scoring_cut_off", max)


def failed_before(results_dir: Path) -> set[str]:
    """The runs an earlier call saw fail (``calls.jsonl``'s ``failed``)."""
    return {name for call in past_calls(results_dir) for name in call.get("failed", {})}


def same_model_first(run: PlannedRun, done: list[dict]) -> list[dict]:
    """The finished runs of ``run``'s model, or every finished run when none is of that model."""
    return [r for r in done if r["model"] == run.model] or done


def pack(results_dir: Path, archive: Path | None) -> None:
    """``results_dir`` as the tar file ``archive`` (replaced whole), so that a call killed at its time limit still
    brings back every run finished before."""
    if archive is None:
        return
    import tarfile

    from lavo.files import atomic_write

    def write(tmp: Path) -> None:
        # the files a run or a call writes whole, not the temporary ones of a write under way in another worker
        calls = results_dir / "calls.jsonl"
        files = sorted(results_dir.glob("*.json")) + [calls] * calls.exists()
        with tarfile.open(tmp, "w") as tar:
            tar.add(results_dir, arcname="results", recursive=False)
            for path in files:
                tar.add(path, arcname=f"results/{path.name}")
    atomic_write(archive, write)


def finished_results(results_dir: Path) -> dict[str, dict]:
    """Every results file, by run name, whatever plan made it."""
    return {path.stem: json.loads(path.read_text()) for path in sorted(results_dir.glob("*.json"))}


def current_results(results_dir: Path, runs: list[PlannedRun]) -> dict[str, dict]:
    """The results of ``runs`` made with their present settings (the same digest): the ones not to redo."""
    found = finished_results(results_dir)
    return {run.name: found[run.name] for run in runs
            if run.name in found and found[run.name].get("digest") == run.digest}


def train_and_score(run: PlannedRun, runs_dir: Path, plan_eval: dict, long_eval: dict, deadline: float,
                    step_limit: int | None, log, activity: Activity,
                    save: Callable[[dict], None]) -> tuple[dict | None, float | None]:
    """Train ``run`` (its directory locked by the caller) until done or ``deadline`` less the time its scoring
    needs, then score it. Returns its results record (None when training stopped first) and its seconds per
    step (:func:`train_within`'s pace). The record is also saved (``save``) before the long evaluation, which a
    call's time limit may then cut off without losing the run."""
    from lavo.train import resolve_device

    config = run_config(run, runs_dir)
    device = resolve_device(config.train.device)
    t0 = time.monotonic()
    activity.enter(run, "training")
    done, seconds_per_step = train_within(config, deadline, step_limit, log, activity)
    activity.step_seconds = seconds_per_step
    if not done:
        return None, seconds_per_step
    train_seconds, t0 = time.monotonic() - t0, time.monotonic()
    # every run at the plan's multiples with the same settings; the long evaluation apart, so that it can fail
    # without losing those
    activity.enter(run, "scoring")
    scores = evaluate(runs_dir / run.name, plan_eval, plan_eval, None, device, log)
    summary = last_summary(runs_dir / run.name)
    record = {"name": run.name, "model": run.model, "seed": run.seed, "config": run.values,
              "parameters": summary["parameters"], "steps": summary["step"], "tokens": summary["tokens"],
              "final_train_loss": summary["loss"], "train_seconds": summary["elapsed"],
              "train_seconds_this_machine": round(train_seconds, 2),
              "eval_seconds": round(time.monotonic() - t0, 2), "device": device_name(device),
              "finished": datetime.now(timezone.utc).isoformat(timespec="seconds"), "digest": run.digest,
              "eval": scores}
    if run.long_eval:
        record = score_long(run, {**record, "long_eval": LONG_EVAL_CUT_OFF}, runs_dir, plan_eval, long_eval, log,
                            activity, save)
    log(f"[done] {run.name}: " + ", ".join(
        f"{name} ppl {s[str(config.train.train_length)]['ppl']:.2f} at 1x" for name, s in scores.items()))
    return record, seconds_per_step


def score_long(run: PlannedRun, record: dict, runs_dir: Path, plan_eval: dict, long_eval: dict, log,
               activity: Activity, save: Callable[[dict], None]) -> dict:
    """``record`` with the long evaluation of ``run``'s trained weights in ``long_eval`` (or why it failed) and
    its seconds added to ``eval_seconds``. ``record`` is saved first as it is, its ``long_eval`` marked
    :data:`LONG_EVAL_CUT_OFF`, so that a call's time limit reached here loses none of the run's scores."""
    from lavo.train import resolve_device

    save(record)
    activity.enter(run, "long evaluation")
    try:
        scores = evaluate(runs_dir / run.name, plan_eval, long_eval, long_eval["lengths"],
                          resolve_device(run.values["train"]["device"]), log)
    except Exception as error:  # e.g. out of memory at 128K
        log(f"[failed] {run.name}'s long evaluation:\n{traceback.format_exc()}")
        scores = {"failed": f"{type(error).__name__}: {error}"[:500]}
    return {**record, "long_eval": scores,
            "eval_seconds": round(record["eval_seconds"] + time.monotonic() - activity.since, 2)}


def long_eval_to_finish(run: PlannedRun, record: dict, runs_dir: Path) -> bool:
    """Whether ``record``, ``run``'s results, lacks a long evaluation that a call's time limit cut off while the
    run's weights are still here (this is the machine that trained it): it is finished without training again."""
    return (run.long_eval and record.get("long_eval") == LONG_EVAL_CUT_OFF
            and (runs_dir / run.name / "model.safetensors").exists())


def finish_long_eval(run: PlannedRun, runs_dir: Path, results_dir: Path, archive: Path | None, plan_eval: dict,
                     long_eval: dict, left: float, call_budget: float, log, activity: Activity) -> None:
    """Run the long evaluation of a finished ``run`` that a call's time limit cut off (:func:`long_eval_to_finish`)
    and save its results, if it fits in the ``left`` seconds: it needs one and a half times the longest it ran
    before being cut off. One that needs more than a whole call is left as it is, so that it does not take the
    start of every call."""
    needs = 1.5 * by_model(results_dir, "long_eval_cut_off", max).get(run.model, 0.0)  # the longest on record
    if needs >= call_budget:
        log(f"[too long] {run.name}'s long evaluation: about {needs:.0f} s, more than a call's budget of "
            f"{call_budget:.0f} s")
        return
    if needs >= left:
        log(f"[wait] {run.name}'s long evaluation: about {needs:.0f} s, {left:.0f} s left")
        return
    with claimed(runs_dir / run.name) as mine:
        record = current_results(results_dir, [run]).get(run.name, {})
        if not mine or not long_eval_to_finish(run, record, runs_dir):  # another worker has it, or did it
            return
        log(f"[long eval] {run.name}: finishing the long evaluation a call's time limit cut off")
        save_result(results_dir, score_long(run, record, runs_dir, plan_eval, long_eval, log, activity,
                                            lambda record: None), archive)


def not_now(run: PlannedRun, done: list[dict], step_seconds: dict[str, float], cut_off: dict[str, float],
            budget: float, left: float, resuming: bool) -> str | None:
    """Why ``run`` is not started in this call, as a log line, or None to start (or resume) it."""
    estimate = estimate_seconds(run, done, step_seconds, cut_off)
    if estimate is None or resuming:
        return None
    if estimate > budget:  # it would stop unfinished in every call, and a fresh machine starts it from step 0
        return f"[too long] {run.name}: about {estimate:.0f} s, more than a call's budget of {budget:.0f} s"
    if estimate > left:
        return f"[wait] {run.name}: about {estimate:.0f} s, {left:.0f} s left"
    return None


@contextlib.contextmanager
def claimed(run_dir: Path):
    """Hold ``run_dir``'s lock during the block: yields True, or False (holding nothing) where another process
    holds it."""
    from lavo.run import RunError, RunLock
    run_dir.mkdir(parents=True, exist_ok=True)
    lock = RunLock(run_dir)
    try:
        lock.acquire()
    except RunError:
        yield False
        return
    try:
        yield True
    finally:
        lock.release()


def run_plan(runs: list[PlannedRun], plan_eval: dict, long_eval: dict, runs_dir: Path, results_dir: Path,
             budget: float, max_runs: int | None, step_limit: int | None, archive: Path | None = None,
             log=print, call: dict | None = None, call_budget: float | None = None) -> dict:
    """Train and score the unfinished ``runs`` in order until ``budget`` seconds are spent or ``max_runs`` have
    finished; returns what this call did (also appended to ``results/calls.jsonl``, with ``call``'s entries).
    ``archive``: a tar file of the results folder, written again after each finished run. Each run is trained
    under its directory's lock, so workers of one call (:func:`run_workers`) share the plan: a run another
    process holds is passed over. A run that raises is logged, recorded under ``failed`` and passed over; in
    later calls the runs that failed come last, so that one cannot stop the others. A finished run whose long
    evaluation a time limit cut off is finished where its weights still are (:func:`finish_long_eval`).
    ``call_budget``: a whole call's seconds (default ``budget``), what a run must fit in to be started at all. A
    call ended by its time limit (SIGTERM, :func:`sigterm_ends_the_call`, or Ctrl-C) writes its line too, with
    what it was doing then (``ended``) and what that measured, which later calls plan with (``step_seconds``,
    ``scoring_cut_off``, ``long_eval_cut_off``)."""
    from lavo.train import resolve_device

    started, start_time = time.monotonic(), datetime.now(timezone.utc).isoformat(timespec="seconds")
    deadline = started + budget
    results_dir.mkdir(parents=True, exist_ok=True)
    step_seconds, cut_off = measured_step_seconds(results_dir), scoring_cut_off(results_dir)
    failed_earlier = failed_before(results_dir)
    runs = sorted(runs, key=lambda run: run.name in failed_earlier)  # stable: the plan's order otherwise
    finished, stopped, failed, device, measured, ended, activity = [], None, {}, None, {}, {}, Activity()
    with GpuUtilization() as utilization:
        try:
            for run in runs:
                activity = Activity()
                results = current_results(results_dir, runs)  # other workers' too
                if run.name in results:
                    if long_eval_to_finish(run, results[run.name], runs_dir):
                        finish_long_eval(run, runs_dir, results_dir, archive, plan_eval, long_eval,
                                         deadline - time.monotonic(), call_budget or budget, log, activity)
                        activity = Activity()
                    continue
                if max_runs is not None and len(finished) >= max_runs:
                    break
                eval_reserve = estimate_eval_seconds(run, list(results.values()), cut_off)
                if eval_reserve >= (call_budget or budget):  # its scoring alone would not fit in any call
                    log(f"[too long] {run.name}: its scoring needs about {eval_reserve:.0f} s (it was cut off "
                        f"before), more than a call's budget of {call_budget or budget:.0f} s")
                    continue
                left = deadline - time.monotonic()
                if left <= eval_reserve:
                    break
                resuming = (runs_dir / run.name / "state.pt").exists()
                reason = not_now(run, list(results.values()), step_seconds, cut_off, call_budget or budget, left,
                                 resuming)
                if reason is not None:
                    log(reason)
                    continue
                device = device_name(resolve_device(run.values["train"]["device"]))
                try:
                    outcome = train_claimed(run, resuming, runs_dir, results_dir, archive, plan_eval, long_eval,
                                            deadline - eval_reserve, step_limit, log, activity)
                except Exception as error:  # e.g. out of memory: the other runs still get their turn
                    log(f"[failed] {run.name}:\n{traceback.format_exc()}")
                    failed[run.name] = f"{type(error).__name__}: {error}"[:500]
                    continue
                if outcome is None:
                    continue
                record, seconds_per_step = outcome
                if record is not None:
                    activity = Activity()  # done with it
                else:
                    stopped = run.name
                    if seconds_per_step is not None:
                        measured[run.model] = round(seconds_per_step, 4)
                    log(f"[stopped] {run.name}: checkpointed in {runs_dir / run.name}; the next call on this "
                        "machine resumes it")
                    break
                finished.append(run.name)
        except (KeyboardInterrupt, CallEnded):
            signal.signal(signal.SIGTERM, signal.SIG_IGN)  # another (the workers' parent's) would cut the line
            ended = activity.ended()
            log(f"[ended] by the call's time limit: {json.dumps(ended)}")
            raise
        finally:
            done = current_results(results_dir, runs)
            call = {**(call or {}), "started": start_time, "wall_s": round(time.monotonic() - started, 1),
                    "budget_s": budget, "device": device, "gpu_utilization": utilization.mean(),
                    "finished": finished, "stopped": stopped, "failed": failed, **ended,
                    "step_seconds": measured | ended.get("step_seconds", {}),
                    "remaining": [r.name for r in runs if r.name not in done]}
            add_call(results_dir, call, archive)
    return call


def train_claimed(run: PlannedRun, resuming: bool, runs_dir: Path, results_dir: Path, archive: Path | None,
                  plan_eval: dict, long_eval: dict, deadline: float, step_limit: int | None, log,
                  activity: Activity) -> tuple[dict | None, float | None] | None:
    """:func:`train_and_score` ``run`` under its directory's lock and save its results there, so that no other
    worker starts it again; None where another worker holds it or has finished it. Results of other settings
    (another plan's) are trained again from step 0."""
    from lavo.run import clear_run

    with claimed(runs_dir / run.name) as mine:
        if not mine:
            log(f"[busy] {run.name}: another worker is training it")
            return None
        if run.name in current_results(results_dir, [run]):  # finished by another worker meanwhile
            return None
        if (results_dir / f"{run.name}.json").exists():
            log(f"[stale] {run.name}: its results were made with other settings; training it again")
            clear_run(runs_dir / run.name)
            resuming = False
        log(f"[train] {run.name}" + (" (resuming)" if resuming else ""))
        record, seconds_per_step = train_and_score(run, runs_dir, plan_eval, long_eval, deadline, step_limit, log,
                                                   activity, lambda record: save_result(results_dir, record, archive))
        if record is not None:
            save_result(results_dir, record, archive)
        return record, seconds_per_step


def save_result(results_dir: Path, record: dict, archive: Path | None) -> None:
    """Write a run's results file, then pack the results folder."""
    write_json(results_dir / f"{record['name']}.json", record)
    pack(results_dir, archive)


def call_with_workers(workers: str, command: list[str], limits: list[str], runs: list[PlannedRun], results_dir: Path,
                      archive: Path | None, budget: float, probe_seconds: float, log=print) -> int:
    """One call whose runs train ``workers`` at a time, each worker ``command + limits`` (``auto``: as many as
    the last probe chose, else as a probe on the next run decides now). Adds the call's own line to
    ``calls.jsonl``: its whole wall time, the number of workers and the probe's result."""
    started, call_id = time.monotonic(), datetime.now(timezone.utc).isoformat(timespec="seconds")
    call: dict = {"call": call_id}
    done = current_results(results_dir, runs)
    todo = [run for run in runs if run.name not in done]
    count = int(workers) if workers != "auto" else last_probe_choice(results_dir)
    try:
        if count is None:
            count = 1
            if todo:  # a failed probe is kept too (one worker): a probe is not retried at every call's expense
                train = todo[0].values["train"]
                step_tokens = train["batch_size"] * train.get("grad_accum", 1) * train["train_length"]
                throughput = probe_throughput(command + ["--only", todo[0].name], MAX_PROBED_WORKERS, probe_seconds,
                                              step_tokens, log, timeout=min(300.0, PROBE_WARMUP_SHARE * budget))
                scoring = estimate_eval_seconds(todo[0], list(done.values()), scoring_cut_off(results_dir))
                count = choose_workers(throughput, step_tokens * train["steps"], scoring, budget)
                call["probe"] = {"run": todo[0].name,
                                 "tokens_per_s": {str(n): round(v) for n, v in throughput.items()}}
                log(f"[probe] {count} worker(s)")
        call["workers"] = count
        left = budget - (time.monotonic() - started)
        return run_workers(command + limits + ["--budget", f"{left:.0f}", "--call-budget", f"{budget:.0f}",
                                               "--call", call_id], count, results_dir,
                           lambda: pack(results_dir, archive))
    except (KeyboardInterrupt, CallEnded):
        call["ended"] = {"phase": "probing" if "workers" not in call else "waiting for the workers"}
        raise
    finally:  # the workers have written their own lines (run_workers waits for them)
        call |= {"started": call_id, "wall_s": round(time.monotonic() - started, 1), "budget_s": budget}
        add_call(results_dir, call, archive)


def add_call(results_dir: Path, call: dict, archive: Path | None) -> None:
    """Append ``call`` to ``calls.jsonl`` (one short write: the lines of workers do not mix), then pack."""
    with open(results_dir / "calls.jsonl", "a") as file:
        file.write(json.dumps(call) + "\n")
    pack(results_dir, archive)


def last_probe_choice(results_dir: Path) -> int | None:
    """The number of workers the last probe in ``calls.jsonl`` chose; None before any probe."""
    chosen = [call["workers"] for call in past_calls(results_dir) if "probe" in call]
    return chosen[-1] if chosen else None


def run_probe_worker(run: PlannedRun, spec: str, folder: Path) -> None:
    """Probe worker ``spec`` ("k/n") of :func:`concurrent_runs.probe_throughput`, on ``run``'s model, data and
    settings; its run directory is a scratch one in the probe's folder."""
    from lavo.train import Distributed, Trainer, prepare_run, resolve_device
    index, count = map(int, spec.split("/"))
    config, env = run_config(run, folder / f"worker-{index}"), Distributed()
    quiet = lambda *args: None  # noqa: E731
    trainer = Trainer(config, env, resolve_device(config.train.device), prepare_run(config, env, quiet), quiet)
    probe_worker(trainer, config.train.lr, index, count, folder)


def estimate_eval_seconds(run: PlannedRun, done: list[dict], cut_off: dict[str, float] | None = None) -> float:
    """Time to keep for scoring after training: the longest scoring of a finished run of the same model (else
    of any), plus a half; 60 s before any run has been scored; and at least one and a half times what a scoring
    of the model ran before a call's time limit cut it off (``cut_off``, by model: :func:`scoring_cut_off`)."""
    same = same_model_first(run, done)
    estimate = 1.5 * max(r["eval_seconds"] for r in same) if same else 60.0
    return max(estimate, 1.5 * (cut_off or {}).get(run.model, 0.0))


# ----------------------------------------------------------------------------------------------- listing

def list_runs(runs: list[PlannedRun], runs_dir: Path, results_dir: Path, log=print) -> None:
    """Each run with its parameter count (vocabulary 4,096) and status; the spread of the counts."""
    from lavo.model import build_model, count_parameters
    results, recorded = current_results(results_dir, runs), finished_results(results_dir)
    counts = {}
    for run in runs:
        if run.model not in counts:
            counts[run.model] = count_parameters(build_model(run_config(run, runs_dir).model_config(4096)))
        status = ("done" if run.name in results else "stale: made with other settings" if run.name in recorded
                  else "checkpointed" if (runs_dir / run.name / "state.pt").exists() else "to run")
        log(f"{run.name:24s} {counts[run.model]:>12,d}  {status}")
    low, high = min(counts.values()), max(counts.values())
    log(f"{len(runs)} runs, {len(results)} done; parameters {low:,} .. {high:,} (+{100 * (high / low - 1):.2f}%)")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    action = parser.add_mutually_exclusive_group()
    action.add_argument("--prepare", action="store_true", help="fetch and tokenise the corpus into --data-dir")
    action.add_argument("--list", action="store_true", help="list the runs, their parameters and status")
    parser.add_argument("--budget", type=float, default=DEFAULT_BUDGET, help="seconds of work in this call")
    parser.add_argument("--dry-run", action="store_true", help="tiny models, a few steps, on the CPU (the plan's "
                        "dry_run section); results and runs go to dry-run/ unless given")
    parser.add_argument("--only", type=comma_list(), default=None,
                        help="comma-separated run names: train only these")
    parser.add_argument("--max-runs", type=int, default=None,
                        help="stop after this many runs finish (in each worker with --workers)")
    parser.add_argument("--step-limit", type=int, default=None,
                        help="train at most this many steps in this call, then checkpoint and stop (as a deadline)")
    parser.add_argument("--pack", default=None, help="a tar file of the results folder, written after each run")
    parser.add_argument("--workers", default="1",
                        help="train this many runs at once, each in a process of its own, or 'auto': as many as "
                             "the last probe chose, or a probe on the next run now (calls.jsonl keeps it) [1]")
    parser.add_argument("--probe-seconds", type=float, default=PROBE_SECONDS,
                        help=f"seconds each phase of the --workers auto probe trains [{PROBE_SECONDS:g}]")
    parser.add_argument("--worker", default=None, help=argparse.SUPPRESS)  # "k/n": one of --workers' processes
    parser.add_argument("--call", default=None, help=argparse.SUPPRESS)  # the call a worker belongs to
    parser.add_argument("--call-budget", type=float, default=None, help=argparse.SUPPRESS)  # its whole budget
    parser.add_argument("--probe-worker", default=None, help=argparse.SUPPRESS)  # "k/n": one of the probe's
    parser.add_argument("--probe-dir", type=Path, default=None, help=argparse.SUPPRESS)
    parser.add_argument("--data-dir", default=None, help="the prepared corpus (default: the plan's data_dir)")
    parser.add_argument("--runs-dir", default=None, help="run directories (default: runs/, dry run: dry-run/runs/)")
    parser.add_argument("--results-dir", default=None,
                        help="results files (default: results/, dry run: dry-run/results/)")
    args = parser.parse_args(argv)
    if args.workers != "auto" and not (args.workers.isdigit() and int(args.workers) >= 1):
        parser.error(f"--workers: a number from 1, or auto; not {args.workers!r}")

    plan = load_plan()
    data_dir = args.data_dir or str(ROOT / plan["base"]["data"]["data_dir"])
    if args.prepare:
        prepare_corpus(plan, data_dir)
        return 0
    scratch = HERE / ("dry-run" if args.dry_run else "")
    if args.dry_run and args.data_dir is None:
        data_dir = dry_run_data(Path(data_dir), scratch / "data")
    runs_dir = Path(args.runs_dir or scratch / "runs")
    results_dir = Path(args.results_dir or scratch / "results")
    runs = planned_runs(plan, args.dry_run, data_dir)
    if args.only:
        wanted = args.only
        unknown = sorted(set(wanted) - {run.name for run in runs})
        if unknown:
            parser.error(f"--only: no runs named {unknown} in the plan")
        runs = [run for run in runs if run.name in wanted]
    if args.list:
        list_runs(runs, runs_dir, results_dir)
        return 0
    if not args.dry_run:
        check_corpus(plan, data_dir)
    elif runs and not (args.worker or args.probe_worker):
        prepare_dry_run(run_config(runs[0], runs_dir))
    archive = Path(args.pack) if args.pack else None
    if args.probe_worker:
        run_probe_worker(runs[0], args.probe_worker, args.probe_dir)
        return 0
    try:
        with sigterm_ends_the_call():
            if args.workers != "1":  # the workers themselves run with the default, 1
                shared = {"--data-dir": data_dir, "--runs-dir": runs_dir, "--results-dir": results_dir}
                command = [sys.executable, str(Path(__file__).resolve()), *["--dry-run"] * args.dry_run,
                           *(str(x) for option, value in shared.items() for x in (option, value))]
                limits = {"--only": args.only and ",".join(args.only), "--max-runs": args.max_runs,
                          "--step-limit": args.step_limit}
                limited = [str(x) for option, value in limits.items() if value is not None for x in (option, value)]
                return call_with_workers(args.workers, command, limited, runs, results_dir, archive, args.budget,
                                         args.probe_seconds)
            plan_eval, long_eval = eval_settings(plan, args.dry_run)
            log, call = print, None
            if args.worker:
                log = lambda message: print(f"[worker {args.worker}] {message}", flush=True)  # noqa: E731
                call = {"call": args.call, "worker": args.worker}
            call = run_plan(runs, plan_eval, long_eval, runs_dir, results_dir, args.budget, args.max_runs,
                            args.step_limit, archive, log, call, args.call_budget)
    except (KeyboardInterrupt, CallEnded):  # its line is in calls.jsonl, and the results are packed
        return 130
    print(json.dumps({key: call[key] for key in ("wall_s", "finished", "stopped")}
                     | {"remaining": len(call["remaining"])}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
