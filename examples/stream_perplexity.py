"""Running perplexity of a LAVO model over a text of any length, read in pieces with constant memory.

The model is used as a stateful reader: each chunk of tokens goes through ``model(ids, cache=state)`` and the
returned state (a :class:`lavo.hf.LavoState` around LAVO's fixed-size memory) carries the whole past into the
next chunk, so every token is predicted from everything before it while neither the state nor the text held in
memory grows. The text is read a block of characters at a time, each block cut where a word starts, so the
tokens are those of the whole text.

    lavo export runs/lavo-tiny-austen exported/
    python examples/stream_perplexity.py exported/ book.txt --report-every 100000

Each report prints the tokens scored so far, the running perplexity, the state's size in bytes and the reading
speed. (A model with a growing cache, softmax, works too, but its state grows with the text.)
"""
from __future__ import annotations

import argparse
import os
import time
from collections.abc import Iterator

os.environ.setdefault("HF_HUB_OFFLINE", "1")

import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402
from transformers import AutoModelForCausalLM, AutoTokenizer  # noqa: E402
from transformers.utils import logging  # noqa: E402

import lavo.hf  # noqa: E402,F401  (registers the lavo_lm model type)
from lavo.devices import resolve_device  # noqa: E402
from lavo.report import perplexity  # noqa: E402
from lavo.run import is_exported, is_run  # noqa: E402


def last_word_start(text: str) -> int:
    """The index of the last space followed by a non-space (0 if none): byte-level BPE starts a pre-token
    there, so text cut at that index tokenises as the whole text does."""
    cut = text.rfind(" ")
    while cut > 0 and (cut + 1 == len(text) or text[cut + 1].isspace()):
        cut = text.rfind(" ", 0, cut)
    return max(cut, 0)


def text_pieces(path: str, block_chars: int) -> Iterator[str]:
    """The file's text in consecutive pieces of about ``block_chars`` characters, each (but the last) ending
    where a word starts."""
    carry = ""
    with open(path, encoding="utf-8-sig") as file:  # without a byte-order mark, as lavo eval --text reads it
        while block := file.read(block_chars):
            text = carry + block
            cut = last_word_start(text)
            if cut > 0:
                yield text[:cut]
            carry = text[cut:]
    if carry:
        yield carry


def token_chunks(path: str, tokenizer, chunk_tokens: int, block_chars: int) -> Iterator[list[int]]:
    """The text's tokens in chunks of ``chunk_tokens + 1``, each overlapping the next by one token: the last token
    of a chunk is only a target there and the first input of the next chunk."""
    buffer: list[int] = []
    for piece in text_pieces(path, block_chars):
        buffer += tokenizer(piece)["input_ids"]
        while len(buffer) > chunk_tokens:
            yield buffer[:chunk_tokens + 1]
            buffer = buffer[chunk_tokens:]
    if len(buffer) > 1:
        yield buffer


@torch.no_grad()
def running_perplexity(model, tokenizer, path: str, chunk_tokens: int = 2048,
                       block_chars: int = 1 << 16) -> Iterator[dict]:
    """After each chunk: ``{"tokens", "ppl", "state_bytes"}``, every token of the file at ``path`` scored given
    all the text before it."""
    state, nll, scored = None, 0.0, 0
    device = next(model.parameters()).device
    for chunk in token_chunks(path, tokenizer, chunk_tokens, block_chars):
        ids = torch.tensor([chunk], device=device)
        out = model(ids[:, :-1], cache=state, use_cache=True)
        state = out.cache
        nll += F.cross_entropy(out.logits[0].float(), ids[0, 1:], reduction="sum").item()
        scored += ids.shape[1] - 1
        yield {"tokens": scored, "ppl": perplexity(nll / scored), "state_bytes": state.nbytes()}


def check_paths(parser: argparse.ArgumentParser, model: str, text: str) -> None:
    """Refuse, by name, a model directory that ``lavo export`` did not write, and a text that is not a file."""
    if not is_exported(model):
        found = (f"a training run: export it first (`lavo export {model} OUT_DIR`)"
                 if is_run(model) else "not a directory written by `lavo export`")
        parser.error(f"{model} is {found}")
    if not os.path.isfile(text):
        parser.error(f"{text} is not a file")


def positive(value: str) -> int:
    if not value.isdigit() or int(value) < 1:
        raise argparse.ArgumentTypeError(f"must be an integer >= 1; got {value!r}")
    return int(value)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("model", help="a directory written by `lavo export`")
    parser.add_argument("text", help="a UTF-8 text file of any length")
    parser.add_argument("--chunk-tokens", type=positive, default=2048, help="tokens per forward pass (default: 2048)")
    parser.add_argument("--report-every", type=positive, default=100_000,
                        help="tokens between reports (default: 100000)")
    parser.add_argument("--device", default="auto", help="auto, cpu, cuda or cuda:N (default: auto)")
    args = parser.parse_args(argv)
    check_paths(parser, args.model, args.text)
    try:
        device = resolve_device(args.device)
    except (RuntimeError, ValueError) as error:  # torch's for a name it does not know, lavo's for a missing GPU
        parser.error(str(error))
    logging.disable_progress_bar()
    model = AutoModelForCausalLM.from_pretrained(args.model).to(device).eval()
    if not model.lavo.supports_decoding:  # every chunk would start from an empty context
        parser.error(f"{args.model} is a {model.config.attention} model, which has no decoding form, so no state "
                     "carries the text before a chunk: score it with `lavo eval` at a fixed length instead")
    tokenizer = AutoTokenizer.from_pretrained(args.model)
    start, next_report, report = time.perf_counter(), args.report_every, None
    try:
        for report in running_perplexity(model, tokenizer, args.text, args.chunk_tokens):
            if report["tokens"] >= next_report:
                speed = report["tokens"] / (time.perf_counter() - start)
                print(f"{report['tokens']:>10,d} tokens  perplexity {report['ppl']:8.2f}  "
                      f"state {report['state_bytes']:,d} bytes  {speed:,.0f} tokens/s", flush=True)
                next_report += args.report_every
    except UnicodeDecodeError as error:
        parser.error(f"{args.text} is not UTF-8 text ({error.reason}): convert it, e.g. "
                     f"`iconv -f latin1 -t utf-8 {args.text} -o {args.text}.new` (-f utf-16 for UTF-16 text)")
    if report is None:
        parser.error(f"{args.text} holds fewer than two tokens: nothing to score")
    print(f"{report['tokens']:>10,d} tokens  perplexity {report['ppl']:8.2f}  (whole text, "
          f"{time.perf_counter() - start:.0f} s)")


if __name__ == "__main__":
    main()
