"""What each memory variant costs: forward + backward time of one LAVO layer over a long sequence, the time of
one decoding step, and the decoding state, against the paper's memory and local attention alone. Times are the
fastest of several repeats (the machine is shared).

    python experiments/recall/speed.py --out experiments/recall/speed.json
"""
from __future__ import annotations

import argparse
import time
from pathlib import Path

import torch

from lavo import build_attention
from lavo.files import write_json

VARIANTS = {
    "lavo": {},
    "lavo-decay": {"write": "decay"},
    "lavo-gated": {"write": "gated"},
    "lavo-vector": {"memory": "vector"},
    "lavo-gated-vector": {"write": "gated", "memory": "vector", "read_temperature": True},
}


def fastest(fn, repeats: int) -> float:
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return min(times)


def measure(name: str, options: dict, dim: int, heads: int, window: int, length: int, repeats: int) -> dict:
    torch.manual_seed(0)
    layer = build_attention(name, dim, heads, window=window, **options)
    x = torch.randn(1, length, dim, requires_grad=True)

    def train_step():
        y, _ = layer(x)
        y.sum().backward()

    with torch.no_grad():
        _, cache = layer(x[:, :-1])
        token = x[:, -1:]
        decode = fastest(lambda: layer(token, cache=cache), repeats * 10)
    return {"train_step_s": round(fastest(train_step, repeats), 4), "decode_step_ms": round(1000 * decode, 3),
            "state_bytes": layer.cache_nbytes(1, length)}


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--dim", type=int, default=256)
    parser.add_argument("--heads", type=int, default=4)
    parser.add_argument("--window", type=int, default=64)
    parser.add_argument("--length", type=int, default=4096)
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--out", required=True)
    args = parser.parse_args(argv)
    shape = dict(dim=args.dim, heads=args.heads, window=args.window, length=args.length, repeats=args.repeats)
    results = {label: measure("lavo", options, **shape) for label, options in VARIANTS.items()}
    results["local"] = measure("local", {}, **shape)
    write_json(Path(args.out), {"settings": {k: v for k, v in vars(args).items() if k != "out"},
                                "threads": torch.get_num_threads(), "layers": results})
    for label, row in results.items():
        print(label, row, flush=True)


if __name__ == "__main__":
    main()
