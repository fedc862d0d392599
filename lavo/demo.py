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
    "train": {"train_length": 256, "batch_size": 8, "grad_accum": 1, "steps": 600, "lr": 2e-3, "min_lr": 2e-4,
              "warmup": 30, "log_interval": 10, "checkpoint_interval": 200, "seed": 0, "device": "auto",
              "time_limit": 330},
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
    log(describe(prepare(data["source"], data["tokenizer"], data["data_dir"], data.get("holdout"), log=log)))
    runs = []
    for name, model in settings["models"].items():
        if model.get("attention", "lavo") not in available_attentions():
            log(f"skipping {name}: attention {model.get('attention')!r} is not registered "
                f"(available: {', '.join(available_attentions())})")
            continue
        config = RunConfig.from_dict({"data": data, "model": model,
                                      "train": {**settings["train"], "out_dir": str(out / name)}})
        log(f"\n== training {name} ==")
        summary = train(config, overwrite=True, log=log)
        log(f"{name}: {summary['step']} steps, {summary['tokens']:,} tokens, final training loss "
            f"{summary['loss']:.3f}, {summary['elapsed']:.0f}s")
        runs.append(str(out / name))
    if not runs:
        raise ValueError("no demo model could be built")
    log("\n== held-out perplexity by evaluation length ==")
    ev = settings["eval"]
    results = evaluate_runs(runs, multiples=ev.get("multiples"), lengths=ev.get("lengths"),
                            batch_size=ev["batch_size"], chunk_size=ev["chunk_size"], max_tokens=ev["max_tokens"],
                            device=settings["train"].get("device", "auto"), out_dir=str(out), log=log)
    log(f"demo finished in {time.perf_counter() - begin:.0f}s; results in {out}")
    return results
