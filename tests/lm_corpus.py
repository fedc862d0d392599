"""Small generated corpora and settings for the language-modelling tests (never the real books)."""
from __future__ import annotations

import random
from pathlib import Path

WORDS = ("the a of and to in was she he it her his that had with for not be as but you at by on said "
         "miss mr mrs elinor marianne emma anne house letter morning walk garden sister mother father "
         "could would should very much little great good quite felt thought saw knew").split()


def write_corpus(directory: Path, documents: int = 4, words: int = 1500, seed: int = 0) -> Path:
    """``documents`` text files ``doc0.txt`` ... of pseudo-English, one paragraph every ~60 words."""
    rng = random.Random(seed)
    directory.mkdir(parents=True, exist_ok=True)
    for d in range(documents):
        out = []
        for i in range(words):
            out.append(rng.choice(WORDS))
            if i % 12 == 11:
                out.append(".\n" if i % 60 == 59 else ",")
        (directory / f"doc{d}.txt").write_text(" ".join(out) + "\n", encoding="utf-8")
    return directory


def tiny_run(corpus: Path, data_dir: Path, out_dir: Path, **train) -> dict:
    """A run config dict for a tiny model on ``corpus`` (override any train setting)."""
    return {
        "data": {"source": str(corpus), "tokenizer": "bpe320", "data_dir": str(data_dir), "holdout": ["doc3"]},
        "model": {"dim": 32, "depth": 2, "heads": 2, "attention": "lavo", "attention_options": {"window": 8}},
        "train": {"out_dir": str(out_dir), "train_length": 32, "batch_size": 4, "steps": 6, "warmup": 2,
                  "lr": 3e-3, "min_lr": 3e-4, "log_interval": 1, "checkpoint_interval": 2, "device": "cpu",
                  "progress": False, **train},
    }


CODE = "def add(a, b):\n\tif a:\n        return a + b  # tabs, spaces and\n\n\n    return b\n"
NOVELS = ("emma", "mansfieldpark", "northangerabbey", "persuasion", "prideprejudice", "sensesensibility")


def write_mix_sources(root: Path, repeat: int = 40) -> Path:
    """A data folder where austen, shakespeare and python are already fetched, with small made-up texts of
    ``repeat`` lines or functions each (every default held-out document included)."""
    for i, name in enumerate(NOVELS):
        path = root / "austen" / "texts" / f"{name}.txt"
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(f"Chapter {i}. It is a truth universally acknowledged.\n" * repeat)
    for name in ("hamlet", "lear", "tempest"):
        path = root / "shakespeare" / "texts" / f"{name}.txt"
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(f"{name.upper()}. To be, or not to be.\n" * repeat)
    for name in ("_pydecimal", "argparse", "difflib", "tarfile", "turtle", "email.message"):
        path = root / "python" / "texts" / f"{name}.txt"
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(f"# {name}\n" + CODE * (repeat // 2))
    (root / "python" / "source.json").write_text('{"python": "3.X.Y", "modules": 6}')
    return root
