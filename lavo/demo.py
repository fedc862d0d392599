"""The demo: tiny LAVO vs tiny softmax+RoPE on Jane Austen, same token budget, perplexity at 1x..8x the
training length on the held-out novel (Persuasion). Sized for a few minutes per model on two CPU cores.

Its settings are one file, the bundled ``lavo/configs/demo.json`` unless ``--config`` names another:

* ``data``, ``model``, ``train``: the run config every model shares;
* ``runs``: one entry per model, merged over the shared run config (``runs.lavo.model.attention_options...``);
  each run trains in ``out_dir/<name>``;
* ``seconds_per_model``: the most seconds any model trains, so the demo's training takes at most
  ``len(runs) x seconds_per_model``. ``train.steps`` is the most steps; fewer when the slowest model would not
  fit in 90% of the budget (its step time is measured before training; every model gets the same number of
  steps, i.e. the same token budget). Every model stops at the budget, whatever happens: if the slowest (which
  trains first) stops early (a busier machine than measured), the others stop at the same step, on the same
  learning-rate schedule. 0 or null trains exactly ``train.steps`` with no time limit;
* ``eval``: the lengths (``multiples`` of the training length, or ``lengths``) and batching of the evaluation.

The demo does not resume: run again, it trains every model from the start, and says so. Stopped with Ctrl-C
after its models are trained, it prints the ``lavo eval`` command that scores them with its settings.
"""
from __future__ import annotations

import json
import shlex
import time
from dataclasses import asdict, dataclass
from pathlib import Path

from .config import RunConfig, apply_overrides, deep_merge, read_config_file
from .evaluate import EvalSettings
from .files import write_json
from .settings import at_least, check_known, check_settings, setting

RUN_SECTIONS = ("data", "model", "train")
PLANNED_SHARE = 0.9  # of seconds_per_model planned for training steps; the rest absorbs logging and checkpoints
# every model trains on the same data and number of tokens, so these train settings may not differ between runs
BUDGET = ("train_length", "batch_size", "grad_accum", "steps")


@dataclass
class DemoConfig:
    runs: dict[str, RunConfig]
    eval: EvalSettings
    seconds_per_model: float | None = setting(None, at_least(0))
    out_dir: str = "runs/demo"
    settings: dict = setting(factory=dict)  # the merged file and overrides, as written to out_dir/demo.json

    def __post_init__(self):
        check_settings(self, "demo")


def demo_config(name: str | None = None, overrides: list[str] = ()) -> DemoConfig:
    """The demo file (a path or a bundled name; default ``demo``) with ``--set`` overrides applied."""
    settings = apply_overrides(read_config_file(name or "demo"), list(overrides), allow_top_level=True)
    known = {*RUN_SECTIONS, "runs", "eval", "seconds_per_model", "out_dir"}
    unknown = sorted(set(settings) - known)
    if unknown:
        raise ValueError(f"unknown demo settings {unknown}; known: {', '.join(sorted(known))}")
    if not settings.get("runs"):
        raise ValueError("the demo settings name no runs: add a `runs` section, e.g. {\"lavo\": {\"model\": ...}}")
    check_known(EvalSettings, settings.get("eval", {}), "eval")
    out_dir = settings.get("out_dir", "runs/demo")
    shared = {section: settings[section] for section in RUN_SECTIONS if section in settings}
    runs = {}
    for name, overlay in settings["runs"].items():
        values = deep_merge(deep_merge(shared, overlay, f"runs.{name}."),
                            {"train": {"out_dir": str(Path(out_dir) / name)}})
        runs[name] = RunConfig.from_dict(values)
    compared = {json.dumps([asdict(run.data), [getattr(run.train, key) for key in BUDGET]]) for run in runs.values()}
    if len(compared) > 1:
        raise ValueError("the demo compares models on the same data and token budget: set data.* and "
                         f"train.{', train.'.join(BUDGET)} in the shared sections, not per run")
    return DemoConfig(runs, EvalSettings(**settings.get("eval", {})), settings.get("seconds_per_model"), out_dir,
                      settings)


def seconds_per_step(config: RunConfig, vocab_size: int, steps: int = 4, warmup: int = 2) -> float:
    """Time of one optimiser step of ``config``'s model on random tokens: the fastest of ``steps`` timed steps
    after ``warmup`` steps (the minimum is what the machine can do; other load on it only adds)."""
    import torch
    import torch.nn.functional as F

    from .model import LanguageModel
    from .devices import resolve_device

    device = resolve_device(config.train.device)
    torch.manual_seed(0)
    model = LanguageModel(config.model_config(vocab_size)).to(device).train()
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4)
    ids = torch.randint(0, vocab_size, (config.train.batch_size, config.train.train_length + 1), device=device)
    times = []
    for i in range(warmup + steps):
        begin = time.perf_counter()
        for _ in range(config.train.grad_accum):
            logits, _ = model(ids[:, :-1])
            F.cross_entropy(logits.flatten(0, 1), ids[:, 1:].flatten()).backward()
        optimizer.step()
        optimizer.zero_grad()
        if device.type == "cuda":
            torch.cuda.synchronize()
        if i >= warmup:
            times.append(time.perf_counter() - begin)
    return min(times)


def check_only_demo_runs(out: Path, runs: dict) -> None:
    """The demo trains its models afresh, replacing what their folders hold: refuse when ``out`` has no
    ``demo.json`` (an earlier demo's) but holds a run where a demo model would go, e.g. ``out_dir=runs``."""
    from .run import trained_files

    if (out / "demo.json").exists():
        return
    taken = [str(Path(config.train.out_dir)) for config in runs.values() if trained_files(config.train.out_dir)]
    if taken:
        raise FileExistsError(f"{', '.join(taken)} already hold runs that the demo did not make, and the demo would "
                              "train over them: choose another out_dir (--set out_dir=FOLDER)")


def train_models(configs: dict[str, RunConfig], steps: int, budget: float | None, log) -> tuple[list, dict]:
    """Train every model afresh for ``steps`` steps (at most ``budget`` seconds each; the first to stop early
    stops the others at its step); returns their run directories and training summaries."""
    from .train import train

    runs, summaries, cap = [], {}, None
    for run_name, config in configs.items():
        config.train.steps = steps  # the same schedule for every model, even if one is cut short
        if budget and config.train.time_limit is None:
            config.train.time_limit = float(budget)
        log(f"\n== training {run_name} ==")
        summary = train(config, overwrite=True, stop_after=cap, log=log)
        log(f"{run_name}: {summary['step']} steps, {summary['tokens']:,} tokens, final training loss "
            f"{summary['loss']:.3f}, {summary['elapsed']:.0f}s")
        if summary["step"] < (steps if cap is None else cap):
            if not runs:  # the first model: the others can still stop where it did
                cap = summary["step"]
                log(f"{run_name} reached the time limit after {cap} of {steps} steps (the machine is busier than "
                    f"when measured): the other models stop at step {cap} too, on the same learning-rate schedule")
            else:  # a model trained before it took more steps
                log(f"warning: {run_name} reached the time limit after {summary['step']} steps, before the others: "
                    "token budgets differ")
        runs.append(config.train.out_dir)
        summaries[run_name] = summary
    return runs, summaries


def stopped_advice(runs: list[str] | None, settings: EvalSettings, out: Path) -> str:
    """What to do after Ctrl-C: the demo does not resume, but models it has finished training (``runs``, None
    while training) can be scored as they are, with the demo's evaluation settings."""
    advice = "the demo stopped: `lavo demo` run again trains every model from the start (it does not resume)"
    if runs is None:
        return advice
    values = {key: value for key, value in asdict(settings).items() if value is not None}
    if settings.lengths is not None:  # lavo eval takes one of the two
        del values["multiples"]
    flags = [item for key, value in values.items() for item in (f"--{key.replace('_', '-')}", flag_text(value))]
    command = shlex.join(["lavo", "eval", *runs, *flags, "--out", str(out)])
    return f"{advice}; its models are trained: `{command}` scores them"


def flag_text(value) -> str:
    """A setting as a command-line flag's value: a list comma-separated, as the flags read it."""
    return ",".join(map(str, value)) if isinstance(value, list) else str(value)


def run_demo(name: str | None = None, overrides: list[str] = (), log=print) -> dict:
    from .curves import show_curves
    from .data import describe, prepare
    from .evaluate import evaluate_runs
    from .registry import available_attentions
    from .run import trained_files

    demo = demo_config(name, overrides)
    out = Path(demo.out_dir)
    check_only_demo_runs(out, demo.runs)
    out.mkdir(parents=True, exist_ok=True)
    write_json(out / "demo.json", demo.settings)
    begin = time.perf_counter()
    first = next(iter(demo.runs.values()))
    data = first.data
    prepared = prepare(data.source, data.tokenizer, data.data_dir, data.holdout, log=log)
    log(describe(prepared))
    configs = {}
    for run_name, config in demo.runs.items():
        attention = config.model_config().attention
        if attention not in available_attentions():
            log(f"skipping {run_name}: attention {attention!r} is not registered "
                f"(available: {', '.join(available_attentions())})")
            continue
        configs[run_name] = config
    if not configs:
        raise ValueError("no demo model could be built")

    budget = demo.seconds_per_model
    tc = first.train
    steps = tc.steps
    if budget:
        log(f"measuring the step time of {', '.join(configs)} (a few seconds each)")
        timing = {n: seconds_per_step(c, prepared.tokenizer.vocab_size) for n, c in configs.items()}
        log("measured seconds per step: " + ", ".join(f"{n} {t:.2f}" for n, t in timing.items()))
        # at least 10 steps however slow the machine, but never more than train.steps
        steps = min(steps, max(10, int(PLANNED_SHARE * budget / max(timing.values()))))
        configs = dict(sorted(configs.items(), key=lambda item: -timing[item[0]]))  # slowest first
    window_tokens = tc.batch_size * tc.grad_accum * tc.train_length
    log(f"training every model for {steps} steps of {tc.batch_size * tc.grad_accum} x {tc.train_length} tokens "
        f"({steps * window_tokens:,} tokens each)" + (f", at most {budget:g}s each" if budget else ""))
    earlier = [name for name, config in configs.items() if trained_files(config.train.out_dir)]
    if earlier:
        log(f"{out} holds an earlier demo's {', '.join(earlier)}: the demo trains every model again from the start")
    runs = None
    try:
        runs, summaries = train_models(configs, steps, budget, log)
        log("\n== training curves ==")
        show_curves(runs, out_dir=out, log=log)
        log("\n== held-out perplexity by evaluation length ==")
        # every eval setting, so that none is accepted and then dropped
        results = evaluate_runs(runs, **asdict(demo.eval), device=tc.device, out_dir=str(out), log=log)
    except KeyboardInterrupt:
        log(stopped_advice(runs, demo.eval, out))
        raise
    for run_name, summary in summaries.items():
        log(f"{run_name}: {summary['parameters'] / 1e6:.2f}M parameters, {summary['tokens']:,} training tokens, "
            f"{summary['elapsed']:.0f}s")
    log(f"demo finished in {time.perf_counter() - begin:.0f}s; results in {out}")
    return results
