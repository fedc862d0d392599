"""Probe 3, context use: perplexity of a trained LM on the last ``target`` tokens of a segment given 0, 256, 1K,
4K, ... tokens of preceding context. The targets are the same for every context length (the context grows to the
left of them), so a model whose memory carries the context improves as it grows; one that ignores what lies
beyond its window stays flat.

    python experiments/context_use/context_use.py RUN_DIR... --contexts 0,256,1024,4096 --out experiments/context_use
"""
from __future__ import annotations

import sys
from pathlib import Path

import numpy as np
import torch
import torch.nn.functional as F

from lavo.files import write_json
from lavo.report import line_plot, perplexity
from lavo.settings import comma_list

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from probe_runs import load_runs, run_parser  # noqa: E402  (experiments/ is not a package)


@torch.no_grad()
def target_loss(model, tokens: np.ndarray, contexts: list[int], target: int, segments: int,
                chunk_size: int = 1024) -> dict[int, float]:
    """Mean loss on the last ``target`` tokens of ``segments`` spans, each given every context length in turn.

    Span ``s`` ends at ``(s + 1) * stride`` with ``stride = max(contexts) + target + 1``, so the targets never
    overlap and the longest context fits. Long inputs go through the model's cache in chunks.
    """
    stride = max(contexts) + target + 1
    if segments * stride > len(tokens):
        raise ValueError(f"{segments} segments of {stride} tokens need {segments * stride} tokens; the text has "
                         f"{len(tokens)}: use fewer segments or shorter contexts")
    model.eval()
    ends = [(s + 1) * stride for s in range(segments)]
    losses = {}
    for context in contexts:
        spans = torch.from_numpy(np.stack([np.asarray(tokens[end - context - target - 1:end], dtype=np.int64)
                                           for end in ends]))
        inputs, targets = spans[:, :-1], spans[:, 1:]
        cache, pieces = None, []
        for start in range(0, inputs.shape[1], chunk_size):
            logits, cache = model(inputs[:, start:start + chunk_size], cache=cache)
            if cache is None and start + chunk_size < inputs.shape[1]:  # no decoding form: one call
                logits, _ = model(inputs)
                pieces = [logits]
                break
            pieces.append(logits)
        logits = torch.cat(pieces, 1)[:, -target:]
        losses[context] = F.cross_entropy(logits.float().flatten(0, 1), targets[:, -target:].flatten()).item()
    return losses


def main(argv: list[str] | None = None) -> None:
    parser = run_parser(__doc__.splitlines()[0])
    parser.add_argument("--contexts", type=comma_list(int), default=[0, 256, 1024, 4096])
    parser.add_argument("--target", type=int, default=256)
    parser.add_argument("--segments", type=int, default=8)
    args = parser.parse_args(argv)
    contexts = args.contexts
    results = {}
    for name, model, _, _, tokens in load_runs(args.runs, args.data_dir, ("valid",)):
        losses = target_loss(model, tokens["valid"], contexts, args.target, args.segments)
        results[name] = {str(c): {"loss": loss, "ppl": perplexity(loss)} for c, loss in losses.items()}
        print(name, {c: round(perplexity(loss), 2) for c, loss in losses.items()}, flush=True)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    write_json(out / "results.json", {"target": args.target, "segments": args.segments, "contexts": contexts,
                                      "runs": {Path(r).name: str(r) for r in args.runs}, "results": results})
    series = {name: [(max(int(c), 1), v["ppl"]) for c, v in per.items()] for name, per in results.items()}
    line_plot(series, out / "context_use.png", xlabel="preceding context (tokens; 0 drawn at 1)",
              ylabel=f"perplexity of the last {args.target} tokens", title="context use")


if __name__ == "__main__":
    main()
