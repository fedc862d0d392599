"""The demo: tiny LAVO vs tiny softmax+RoPE on Jane Austen, same token budget, perplexity at 1x..8x the
training length on the held-out novel (Persuasion). Sized for a few minutes per model on two CPU cores."""
from __future__ import annotations

import copy
import json
import time
from pathlib import Path

from .config import RunConfig, apply_overrides, read_config_file

DEMO = {
    "out_dir": "runs/demo",
    "data": {"source": "austen", "tokenizer": "bpe4096", "data_dir": "data"},
    # train.steps: at most this many; fewer when the slowest model would not fit in seconds_per_model (measured
    # before training; every model gets the same number of steps, i.e. the same token budget). Set
    # seconds_per_model to 0 (or null) to train exactly train.steps. The slowest model trains first; if it is
    # still running at 1.25 x the budget (a much busier machine than measured) it stops there, and the other
    # models stop at the same step, on the same learning-rate schedule.
    "seconds_per_model": 240,
    "train": {"train_length": 256, "batch_size": 8, "grad_accum": 1, "steps": 2000, "lr": 2e-3, "min_lr": 2e-4,
              "warmup": 30, "log_interval": 10, "checkpoint_interval": 100, "seed": 0, "device": "auto"},
    "models": {
        "lavo": {"preset": "tiny", "attention": "lavo", "attention_options": {"window": 32}, "position": "none"},
        "softmax-rope": {"preset": "tiny", "attention": "softmax", "position": "rope"},
    },
    "eval": {"multiples": [1, 2, 4, 8], "max_tokens": 16384, "batch_size": 4, "chunk_size": 512},
}


def demo_settings(path: str | None = None, overrides: list[str] = ()) -> dict:
    settings = copy.deepcopy(DEMO)
    if path is not None:
        for key, value in read_config_file(path).items():
            if isinstance(value, dict) and isinstance(settings.get(key), dict) and key != "models":
                settings[key].update(value)
            else:
                settings[key] = value
    return apply_overrides(settings, list(overrides), allow_top_level=True)


def seconds_per_step(config: RunConfig, vocab_size: int, steps: int = 4, warmup: int = 2) -> float:
    """Time of one optimiser step of ``config``'s model on random tokens: the fastest of ``steps`` timed steps
    after ``warmup`` steps (the minimum is what the machine can do; other load on it only adds)."""
    import torch
    import torch.nn.functional as F

    from .model import LanguageModel
    from .train import resolve_device

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


def run_demo(path: str | None = None, overrides: list[str] = (), log=print) -> dict:
    from .data import describe, prepare
    from .evaluate import evaluate_runs
    from .registry import available_attentions
    from .train import train

    settings = demo_settings(path, overrides)
    out = Path(settings["out_dir"])
    out.mkdir(parents=True, exist_ok=True)
    (out / "demo.json").write_text(json.dumps(settings, indent=1) + "\n")
    begin = time.perf_counter()
    data = settings["data"]
    prepared = prepare(data["source"], data["tokenizer"], data["data_dir"], data.get("holdout"), log=log)
    log(describe(prepared))
    configs = {}
    for name, model in settings["models"].items():
        if model.get("attention", "lavo") not in available_attentions():
            log(f"skipping {name}: attention {model.get('attention')!r} is not registered "
                f"(available: {', '.join(available_attentions())})")
            continue
        configs[name] = RunConfig.from_dict({"data": data, "model": model,
                                             "train": {**settings["train"], "out_dir": str(out / name)}})
    if not configs:
        raise ValueError("no demo model could be built")

    budget = settings.get("seconds_per_model")
    steps = settings["train"]["steps"]
    if budget:
        timing = {name: seconds_per_step(c, prepared.tokenizer.vocab_size) for name, c in configs.items()}
        log("measured seconds per step: " + ", ".join(f"{n} {t:.2f}" for n, t in timing.items()))
        steps = max(10, min(steps, int(budget / max(timing.values()))))
        configs = dict(sorted(configs.items(), key=lambda item: -timing[item[0]]))  # slowest first
    tc = settings["train"]
    log(f"training every model for {steps} steps of {tc['batch_size'] * tc.get('grad_accum', 1)} x "
        f"{tc['train_length']} tokens ({steps * tc['batch_size'] * tc.get('grad_accum', 1) * tc['train_length']:,} "
        "tokens each)")
    runs, summaries, cap = [], {}, None
    for name, config in configs.items():
        config.train.steps = steps  # the same schedule for every model, even if one is cut short
        if budget and config.train.time_limit is None and cap is None:
            config.train.time_limit = 1.25 * budget  # a guard against a machine much busier than measured
        log(f"\n== training {name} ==")
        summary = train(config, overwrite=True, stop_after=cap, log=log)
        log(f"{name}: {summary['step']} steps, {summary['tokens']:,} tokens, final training loss "
            f"{summary['loss']:.3f}, {summary['elapsed']:.0f}s")
        if cap is None and summary["step"] < steps:
            cap = summary["step"]
            log(f"{name} reached the time limit after {cap} of {steps} steps (the machine is busier than when "
                f"measured): the other models stop at step {cap} too, on the same learning-rate schedule")
        elif cap is not None and summary["step"] < cap:
            log(f"warning: {name} stopped after {summary['step']} steps, before the others: token budgets differ")
        runs.append(str(out / name))
        summaries[name] = summary
    log("\n== held-out perplexity by evaluation length ==")
    ev = settings["eval"]
    results = evaluate_runs(runs, multiples=ev.get("multiples"), lengths=ev.get("lengths"),
                            batch_size=ev["batch_size"], chunk_size=ev["chunk_size"], max_tokens=ev["max_tokens"],
                            device=settings["train"].get("device", "auto"), out_dir=str(out), log=log)
    for name, summary in summaries.items():
        log(f"{name}: {summary['parameters'] / 1e6:.2f}M parameters, {summary['tokens']:,} training tokens, "
            f"{summary['elapsed']:.0f}s")
    log(f"demo finished in {time.perf_counter() - begin:.0f}s; results in {out}")
    return results
