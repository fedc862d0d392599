"""The command line: ``python -m lavo.bench`` (:func:`main`), or mounted on another parser with
:func:`add_arguments` and :func:`run_from_args`."""
from __future__ import annotations

import argparse
import contextlib
import gc
import importlib
import json
import signal
import sys
from pathlib import Path

import torch

from ..model import PRESETS
from ..ops.common import BACKENDS, make_current
from ..registry import attention_class, available_attentions, check_options
from ..report import length_label
from ..settings import SettingsError, comma_list, flag_type
from ..train import sigterm_as_interrupt
from . import attention, decode, flops, model, profile
from .measure import machine_info, ramp_up
from .output import markdown, plots, write_records
from .runner import Runner
from .settings import DEFAULT_SECTIONS, DTYPES, FULL, PASSES, QUICK, SECTIONS, Settings, having_option, quadratic

RUN = {"attention": attention, "decode": decode, "model": model, "flops": flops, "profile": profile}  # SECTIONS order

DESCRIPTION = ("Efficiency benchmark of LAVO and the other attention mechanisms: time and peak memory of the layers "
               "and raw ops, decoding step time and cache size, whole-model training throughput and LAVO's FLOP "
               "efficiency; on request, a profile of where the time goes. Prints markdown tables; see "
               "benchmarks/README.md.")
EPILOG = ("Lengths accept a K suffix (1K = 1024). Defaults in brackets are the full run's; --quick uses tiny sizes "
          "for any setting not given.")


def _flag(name: str):
    """The ``type=`` of the flag that sets ``Settings.name``: the type and range declared on that field."""
    return flag_type(Settings, name)


def parse_length(text: str) -> int:
    """``"4K"`` -> 4096, ``"1.5K"`` -> 1536, ``"300"`` -> 300; a length is a whole number of tokens, at least 1."""
    text = text.strip().lower()
    try:
        tokens = float(text[:-1]) * 1024 if text.endswith("k") else int(text)
    except ValueError:
        tokens = None
    if tokens is None or not float(tokens).is_integer():  # "0.3K" is 307.2 tokens; "infK" none at all
        raise argparse.ArgumentTypeError(f"{text!r} is not a length: a whole number, or one with a K suffix "
                                         "(4K = 4096) that makes a whole number")
    length = int(tokens)
    if length < 1:
        raise argparse.ArgumentTypeError(f"a length must be at least 1; got {text!r}")
    return length


def parse_json(text: str) -> object:
    """The value of a JSON flag, or an error that quotes JSON's complaint (argparse's own says "invalid loads
    value")."""
    try:
        return json.loads(text)
    except json.JSONDecodeError as error:
        raise argparse.ArgumentTypeError(f"{text!r} is not JSON ({error})") from None


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """The benchmark's options, on ``parser``."""
    a = parser.add_argument
    registered = available_attentions()
    quadratic_ones = [name for name in registered if quadratic(name)]
    rotary = [name for name in registered if attention_class(name).accepts_rotary]
    a("--sections", type=comma_list(str), default=list(DEFAULT_SECTIONS),
      help=f"comma-separated sections to run, of {','.join(SECTIONS)} [{','.join(DEFAULT_SECTIONS)}]")
    a("--quick", action="store_true", help="tiny sizes and few repeats: a smoke run of every section in seconds")
    a("--attentions", type=comma_list(str, may_be_empty=True), default=None,
      help="attention section: registered mechanisms to measure as layers ('' for none) [all registered]")
    a("--ops", type=comma_list(str, may_be_empty=True), default=list(attention.DEFAULT_OPS),
      help=f"attention and profile sections: raw ops to measure, of {','.join(attention.OPS)} (the fla ones need "
           f"its package and a GPU) "
           f"[{','.join(attention.DEFAULT_OPS)}]")
    a("--passes", type=comma_list(str), default=list(PASSES),
      help="attention, flops and profile sections: fwd, fwd+bwd or both [both]")
    a("--lengths", type=comma_list(parse_length), default=None,
      help="attention, flops and profile sections: sequence lengths in tokens [1K,2K,...,64K]")
    a("--max-quadratic-length", type=parse_length, default=None,
      help=f"longest sequence for the quadratic mechanisms ({','.join(quadratic_ones)}) and SDPA (attention, "
           f"model sections; decode fills their longer caches without running the attention) [16K]")
    a("--batch", type=_flag("batch"), default=1,
      help="batch size of the attention, decode, flops and profile sections [1]")
    a("--heads", type=_flag("heads"), default=None, help="heads H [8]")
    a("--head-dim", type=_flag("head_dim"), default=None, help="head dim D; the layers' dim is H*D [64]")
    a("--rank", type=_flag("rank"), default=None,
      help=f"memory rank r of LAVO's op and of the mechanisms with a rank option "
           f"({','.join(having_option('rank', registered))}) [64]")
    a("--window", type=_flag("window"), default=None,
      help=f"window w of LAVO's op and of the mechanisms with a window option "
           f"({','.join(having_option('window', registered))}) [128]")
    a("--dtype", choices=sorted(DTYPES), default="fp32",
      help="fp32, or bf16 or fp16 (for GPUs without bf16): ops take 16-bit inputs, layers and models run under "
           "autocast to it [fp32]")
    a("--repeats", type=_flag("repeats"), default=None,
      help="timed calls per measurement; the median is reported [5]")
    a("--warmup", type=_flag("warmup"), default=None, help="untimed calls before each measurement [1]")
    a("--time-limit", type=_flag("time_limit"), default=None,
      help="seconds one call may take; slower measurements and the longer lengths after them are skipped [60]")
    a("--decode-attentions", type=comma_list(str, may_be_empty=True), default=["lavo", "softmax", "local"],
      help="decode section: mechanisms (need a decoding form) [lavo,softmax,local]")
    a("--decode-lengths", type=comma_list(parse_length), default=None,
      help="decode section: context lengths in tokens [1K,...,64K]")
    a("--decode-steps", type=_flag("decode_steps"), default=None,
      help="decode section: timed single-token steps per context length [32]")
    a("--model-preset", default=None, help="model section: preset of lavo.model.PRESETS [small]")
    a("--model-attentions", type=comma_list(str, may_be_empty=True), default=None,
      help=f"model section: attentions (those taking rotary positions, {','.join(rotary)}, run with rope; '' for "
           f"none) [all registered]")
    a("--model-lengths", type=comma_list(parse_length), default=None,
      help="model and profile sections: training sequence lengths in tokens [1K,4K]")
    a("--model-batch", type=_flag("model_batch"), default=1, help="model section batch size [1]")
    a("--model-repeats", type=_flag("model_repeats"), default=None, help="timed training steps per measurement [3]")
    a("--model-compile", action="store_true",
      help="model section: torch.compile every model (the compiling call is not timed) [off]")
    a("--model-checkpointing", action="store_true",
      help="model section: measure every model also with activation checkpointing, as rows '<attention>, "
           "checkpointed' beside those without: the memory it saves, the time it costs [off]")
    a("--matmul-size", type=_flag("matmul_size"), default=None,
      help="flops section: square matmul size for the peak rate [2048]")
    a("--attention-options", type=parse_json, default={},
      help='JSON options per mechanism on top of the defaults, e.g. \'{"performer": {"features": 128}}\'')
    a("--device", default="cpu", type=_flag("device"), help="cpu or cuda[:N] [cpu]")
    a("--backend", choices=BACKENDS, default="auto",
      help=f"LAVO's op and the mechanisms with a backend option ({','.join(having_option('backend', registered))}): "
           f"triton kernels, the torch path, or auto (triton on CUDA when importable) [auto]")
    a("--threads", type=_flag("threads"), default=None, help="torch intra-op threads [torch's default]")
    a("--seed", type=_flag("seed"), default=0, help="random seed [0]")
    a("--json", type=Path, default=None, help="write the records and machine info to this JSON file")
    a("--plots", type=Path, default=None, help="write PNG plots into this directory")
    a("--no-progress", action="store_true", help="no progress bar")


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="python -m lavo.bench", description=DESCRIPTION, epilog=EPILOG)
    add_arguments(parser)
    return parser


def check_attention_options(options: object, registered: list[str]) -> None:
    """``--attention-options`` before any measurement: a JSON object of registered mechanisms, each with an
    object of the options it has."""
    shape = "--attention-options must be a JSON object of {mechanism: {option: value}}"
    if not isinstance(options, dict) or not all(isinstance(value, dict) for value in options.values()):
        raise SettingsError(shape)
    unknown = [name for name in options if name not in registered]
    if unknown:
        raise SettingsError(f"--attention-options: unknown mechanisms {unknown}; choose from {', '.join(registered)}")
    for name, values in options.items():
        try:
            check_options(name, values)
        except ValueError as error:
            raise SettingsError(f"--attention-options: {error}") from None


def check_output_paths(json_path: Path | None, plots: Path | None) -> None:
    """Refuse, before measuring, a ``--json`` file that cannot be written (its folder cannot be made, or it is a
    folder) and a ``--plots`` folder that is a file: found after the first measurement or the last, they lost
    the run."""
    if json_path is not None:
        if json_path.is_dir():
            raise SettingsError(f"--json {json_path}: is a folder; give the path of a JSON file")
        try:
            json_path.parent.mkdir(parents=True, exist_ok=True)
        except OSError as error:
            raise SettingsError(f"--json {json_path}: cannot make its folder ({error})") from error
    if plots is not None and plots.exists() and not plots.is_dir():
        raise SettingsError(f"--plots {plots}: is a file; give a folder for the PNG plots")


def check_no_repeats(args: argparse.Namespace, values: dict) -> None:
    """Refuse a list flag that names an item twice: it would be measured twice, and its table keep one of them."""
    lists = {"--sections": args.sections, "--ops": args.ops, "--passes": args.passes, "--attentions": args.attentions,
             "--decode-attentions": args.decode_attentions, "--model-attentions": args.model_attentions,
             "--lengths": values["lengths"], "--decode-lengths": values["decode_lengths"],
             "--model-lengths": values["model_lengths"]}
    for option, items in lists.items():
        repeated = list(dict.fromkeys(item for item in items or [] if items.count(item) > 1))
        if repeated:
            raise SettingsError(f"{option}: {', '.join(map(str, repeated))} given more than once; name each once")


def check_something_is_measured(settings: Settings) -> None:
    """Refuse a run whose sections plan no measurement, which would print an empty report and exit 0: e.g.
    ``--quick --attentions softmax --lengths 1K``, past ``--quick``'s limit for quadratic mechanisms."""
    if not any(RUN[name].planned(settings) for name in settings.sections):
        raise SettingsError(f"--sections {','.join(settings.sections)}: nothing to measure with these flags (the "
                            "mechanisms and ops they name at their lengths; quadratic ones and SDPA only up to "
                            f"--max-quadratic-length {length_label(settings.max_quadratic_length)})")


def settings_from_args(args: argparse.Namespace) -> Settings:
    defaults = QUICK if args.quick else FULL
    given = {key: getattr(args, key, None) for key in FULL}  # model_overrides has no option: --quick only
    values = {key: defaults[key] if value is None else value for key, value in given.items()}
    registered = available_attentions()
    for option, names, allowed in (("--sections", args.sections, SECTIONS), ("--ops", args.ops, list(attention.OPS)),
                                   ("--passes", args.passes, PASSES),
                                   ("--attentions", args.attentions or [], registered),
                                   ("--decode-attentions", args.decode_attentions, registered),
                                   ("--model-attentions", args.model_attentions or [], registered)):
        unknown = [n for n in names if n not in allowed]
        if unknown:
            raise SettingsError(f"{option}: unknown {unknown}; choose from {', '.join(allowed)}")
    check_no_repeats(args, values)
    cannot = [name for name in args.decode_attentions if not attention_class(name).supports_decoding]
    if cannot:
        raise SettingsError(f"--decode-attentions: {cannot} have no decoding form; choose from "
                            f"{', '.join(name for name in registered if attention_class(name).supports_decoding)}")
    if values["model_preset"] not in PRESETS:
        raise SettingsError(f"--model-preset: unknown {values['model_preset']!r}; choose from {', '.join(PRESETS)}")
    check_attention_options(args.attention_options, registered)
    if values["rank"] > values["head_dim"]:  # LAVO's basis has at most head-dim orthonormal rows
        raise SettingsError(f"--rank {values['rank']} is more than --head-dim {values['head_dim']}: LAVO's memory "
                            "has at most one slot per dimension of a head")
    check_output_paths(args.json, args.plots)
    if args.device != "cpu" and (torch.device(args.device).index or 0) >= torch.cuda.device_count():
        raise SettingsError(f"--device {args.device}: no such CUDA device on this machine (it has "
                            f"{torch.cuda.device_count()}); use --device cpu")
    settings = Settings(sections=args.sections,
                        attentions=registered if args.attentions is None else args.attentions, ops=args.ops,
                        passes=args.passes, batch=args.batch, dtype=args.dtype,
                        decode_attentions=args.decode_attentions,
                        model_attentions=registered if args.model_attentions is None else args.model_attentions,
                        model_batch=args.model_batch, model_compile=args.model_compile,
                        model_checkpointing=args.model_checkpointing, attention_options=args.attention_options,
                        device=args.device, backend=args.backend, threads=args.threads, seed=args.seed,
                        quick=args.quick, **values)
    check_something_is_measured(settings)
    return settings


def run(settings: Settings, *, progress: bool = True, json_path: Path | None = None) -> tuple[list[dict], dict]:
    """Run the selected sections; returns (records, machine info). With ``json_path``, the records so far are
    written there after each one, so a run stopped midway (a time limit, Ctrl-C) keeps what it measured."""
    if settings.threads is not None:
        torch.set_num_threads(settings.threads)
    make_current(settings.device)
    ramp_up(torch.device(settings.device))
    torch.manual_seed(settings.seed)
    with contextlib.suppress(Exception):
        # torch imports its compiler stack on the first use of some ops; imported now, its objects are frozen
        # out of the garbage collections made before each measurement
        importlib.import_module("torch._dynamo")
    gc.collect()
    gc.freeze()  # later collections (one per memory measurement) skip the objects of the imported modules
    info = machine_info(settings.device)
    sections = [RUN[name] for name in SECTIONS if name in settings.sections]
    bar = None
    if progress:
        from tqdm import tqdm
        bar = tqdm(total=sum(section.planned(settings) for section in sections), desc="bench",
                   unit="measurement", dynamic_ncols=True, file=sys.stderr)
    save = None if json_path is None else (lambda records: write_records(json_path, records, info, settings))
    runner = Runner(settings, bar, save)
    try:
        with sigterm_as_interrupt():  # `timeout` or a job scheduler stops it as Ctrl-C does
            for section in sections:
                section.run(runner)
    except KeyboardInterrupt as stop:  # what was measured is kept: its tables are printed and its JSON written
        info["interrupted"] = signal.Signals(getattr(stop, "signal", signal.SIGINT)).name
    finally:
        if bar is not None:
            bar.close()
        # frozen objects are never collected, not even at exit, where Triton's bindings then report them leaked
        gc.unfreeze()
    return runner.records, info


def run_from_args(args: argparse.Namespace) -> int:
    """Run with the options :func:`add_arguments` parsed: tables on stdout, then the JSON and plots asked for."""
    settings = settings_from_args(args)
    records, info = run(settings, progress=not args.no_progress, json_path=args.json)
    print(markdown(records, info, settings))
    if args.json is not None:  # also when nothing was measured
        write_records(args.json, records, info, settings)
    if args.plots is not None:
        for path in plots(records, args.plots, settings):
            print(f"plot: {path}", file=sys.stderr)
    if info.get("interrupted"):
        print(f"interrupted: the tables hold the {len(records)} measurements made before it", file=sys.stderr)
        return 128 + signal.Signals[info["interrupted"]]  # 130 after Ctrl-C, 143 after SIGTERM
    return 0


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    try:
        return run_from_args(args)
    except SettingsError as error:
        parser.error(str(error))
