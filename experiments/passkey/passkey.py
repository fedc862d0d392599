"""Probe 2, passkey retrieval in prose: a number stated once near the start of a stretch of Austen, asked for at
its end. Each trained LM is fine-tuned briefly on the task at its training length, then scored at 1x .. 64x.

    <the pass key is 417. remember it.> prose ... prose <what is the pass key? the pass key is> 417

Accuracy is the share of examples whose every answer token is the model's most likely next token (teacher
forced). Fine-tuning examples come from the training split, scored ones from the held-out split.

    python experiments/passkey/passkey.py RUN_DIR... --multiples 1,4,16,64 --out experiments/passkey
"""
from __future__ import annotations

import json
import sys
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch
import torch.nn.functional as F

from lavo.files import write_json
from lavo.report import line_plot
from lavo.settings import comma_list

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from probe_runs import load_runs, run_parser  # noqa: E402  (experiments/ is not a package)


@dataclass(frozen=True)
class Prompt:
    """The token ids of the fixed parts of an example."""

    statement: list  # before the key
    after_key: list
    question: list

    @classmethod
    def of(cls, tokenizer) -> "Prompt":
        return cls(tokenizer.encode("The pass key is"), tokenizer.encode(". Remember it. "),
                   tokenizer.encode(" What is the pass key? The pass key is"))


def passkey_example(rng: np.random.Generator, prose: np.ndarray, prompt: Prompt, tokenizer, length: int
                    ) -> tuple[np.ndarray, int]:
    """One example of exactly ``length`` tokens and the number of answer tokens at its end."""
    key = int(rng.integers(100, 1000))
    answer = tokenizer.encode(f" {key}")
    stated = prompt.statement + answer + prompt.after_key
    filler = length - len(stated) - len(prompt.question) - len(answer)
    if filler < 1:
        raise ValueError(f"a passkey example needs more than {length - filler} tokens, got length={length}")
    start = int(rng.integers(0, len(prose) - filler))
    ids = stated + [int(t) for t in prose[start:start + filler]] + prompt.question + answer
    return np.asarray(ids, dtype=np.int64), len(answer)


@torch.no_grad()
def answer_logits(model, ids: torch.Tensor, answered: int, chunk_size: int) -> torch.Tensor:
    """Logits predicting the last ``answered`` tokens of ``ids [1, L]``, the sequence fed in chunks through the
    model's cache (one call for a model without one)."""
    inputs = ids[:, :-1]
    cache, last = None, None
    for start in range(0, inputs.shape[1], chunk_size):
        last, cache = model(inputs[:, start:start + chunk_size], cache=cache)
        if cache is None:
            last, _ = model(inputs)
            break
    return last[0, -answered:]


def finetune(model, prose, prompt, tokenizer, length: int, steps: int, batch_size: int, lr: float, seed: int):
    """Train on the answer tokens of examples of ``length`` tokens."""
    rng = np.random.default_rng(seed)
    optimizer = torch.optim.AdamW(model.parameters(), lr=lr, weight_decay=0.0)
    model.train()
    for _ in range(steps):
        examples = [passkey_example(rng, prose, prompt, tokenizer, length) for _ in range(batch_size)]
        ids = torch.from_numpy(np.stack([e[0] for e in examples]))
        targets = torch.full_like(ids, -1)
        for row, (_, answered) in enumerate(examples):
            targets[row, -answered:] = ids[row, -answered:]
        logits, _ = model(ids[:, :-1])
        loss = F.cross_entropy(logits.flatten(0, 1), targets[:, 1:].flatten(), ignore_index=-1)
        optimizer.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        optimizer.step()
    model.eval()


def passkey_accuracy(model, prose, prompt, tokenizer, length: int, samples: int, seed: int,
                     chunk_size: int = 512) -> float:
    rng = np.random.default_rng(seed)
    correct = 0
    for _ in range(samples):
        ids, answered = passkey_example(rng, prose, prompt, tokenizer, length)
        predicted = answer_logits(model, torch.from_numpy(ids)[None], answered, chunk_size).argmax(-1)
        correct += bool(torch.equal(predicted, torch.from_numpy(ids[-answered:])))
    return correct / samples


def main(argv: list[str] | None = None) -> None:
    parser = run_parser(__doc__.splitlines()[0])
    parser.add_argument("--multiples", type=comma_list(int), default=[1, 2, 4, 8, 16, 32, 64])
    parser.add_argument("--steps", type=int, default=100, help="fine-tuning steps at 1x")
    parser.add_argument("--batch-size", type=int, default=8)
    parser.add_argument("--lr", type=float, default=1e-3)
    parser.add_argument("--samples", type=int, default=16, help="scored examples per length")
    args = parser.parse_args(argv)
    multiples = args.multiples
    out = Path(args.out)
    settings = {"steps": args.steps, "samples": args.samples, "multiples": multiples}
    for name, model, config, tokenizer, splits in load_runs(args.runs, args.data_dir, ("train", "valid")):
        if name in finished_runs(out / "results.json", settings):  # scored before, or by a second process
            continue
        prompt = Prompt.of(tokenizer)
        length = config.train.train_length
        finetune(model, splits["train"], prompt, tokenizer, length, args.steps, args.batch_size, args.lr, seed=0)
        accuracy = {str(m * length): passkey_accuracy(model, splits["valid"], prompt, tokenizer, m * length,
                                                      args.samples, seed=1)
                    for m in multiples}
        print(name, accuracy, flush=True)
        write_results(out, settings, args.runs, {**finished_runs(out / "results.json", settings), name: accuracy})


def finished_runs(path: Path, settings: dict) -> dict:
    """The accuracies already in ``path`` when it was written with the same settings, else none: a rerun skips
    those models, and processes sharing one ``--out`` add to each other's results."""
    if not path.exists():
        return {}
    earlier = json.loads(path.read_text())
    if any(earlier[key] != value for key, value in settings.items()):
        raise ValueError(f"{path} holds a run with other settings; choose another --out")
    return earlier["accuracy"]


def write_results(out: Path, settings: dict, runs: list[str], results: dict) -> None:
    """``results.json`` and the plot, rewritten after every model so an interrupted probe keeps what it did."""
    out.mkdir(parents=True, exist_ok=True)
    path = out / "results.json"
    earlier = json.loads(path.read_text())["runs"] if path.exists() else {}  # models another process scored
    paths = {**earlier, **{Path(r).name: str(r) for r in runs}}
    write_json(path, {**settings, "runs": {name: paths.get(name, "") for name in results},
                                      "accuracy": results})
    series = {name: [(int(k), v) for k, v in per.items()] for name, per in results.items()}
    line_plot(series, out / "passkey.png", xlabel="example length (tokens)", ylabel="passkey accuracy",
              title=f"passkey retrieval after {settings['steps']} fine-tuning steps", length_ticks=True)


if __name__ == "__main__":
    main()
