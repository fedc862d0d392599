"""The efficiency benchmark harness (``python -m lavo.bench``): output formats, helpers, FLOP formula. No timing
is asserted."""
import gc
import io
import json
import os
import re
import signal
import subprocess
import sys
import tarfile
import time
from pathlib import Path

import pytest
import torch
from stops import stop_by
from torch.utils.flop_counter import FlopCounterMode

from lavo import report
from lavo.bench import attention, cli, decode, flops, measure, model, output, profile, settings
from lavo.bench.measure import Measurement
from lavo.bench.runner import Runner, record
from lavo.layers.local import LocalAttention
from lavo.model import LanguageModel
from lavo.ops import lavo_attention, orthogonal_basis
from lavo.registry import ATTENTIONS, attention_class, available_attentions, build_attention
from reference_checks import needs_triton
from script_loader import load_script

gpu_check = load_script("gpu_check", "benchmarks/gpu_check.py")
growth = load_script("growth", "benchmarks/growth.py")

RECORD_FIELDS = {"section", "level", "mechanism", "op", "length", "dtype", "ms", "peak_mib", "ratio", "status",
                 "note"}


@pytest.fixture(autouse=True)
def one_thread():
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


def test_quick_run_writes_tables_json_and_plots(tmp_path, capsys):
    out = tmp_path / "bench.json"
    assert cli.main(["--quick", "--no-progress", "--threads", "1", "--json", str(out),
                       "--plots", str(tmp_path / "plots")]) == 0
    assert gc.get_freeze_count() == 0  # what the run froze is collectable again, at exit too
    text = capsys.readouterr().out
    for heading in ("## Attention, fwd:", "## Attention, fwd+bwd:", "## Decoding", "## Model", "## LAVO op FLOP"):
        assert heading in text

    payload = json.loads(out.read_text())
    assert {"torch", "threads", "cpu"} <= set(payload["machine"])
    assert payload["machine"]["torch"] == torch.__version__
    records = payload["records"]
    assert records and all(RECORD_FIELDS <= set(r) for r in records)
    assert {r["section"] for r in records} == set(settings.DEFAULT_SECTIONS)
    failed = [r for r in records if r["status"] != "ok"]
    assert not failed, failed

    attention = [r for r in records if r["section"] == "attention"]
    names = {r["mechanism"] for r in attention}
    assert set(available_attentions()) | {"lavo_attention (op)", "sdpa (op)"} == names
    assert {r["op"] for r in attention} == {"fwd", "fwd+bwd"}
    for r in attention:
        assert r["ms"] > 0 and len(r["times_ms"]) == payload["settings"]["repeats"]
        assert r["ratio_to"] == "sdpa (op)" and r["ratio"] > 0
        assert r["peak_mib"] is None or r["peak_mib"] >= 0
    decode = [r for r in records if r["section"] == "decode"]
    assert {r["mechanism"] for r in decode} == {"lavo", "lavo (step)", "softmax", "local"}
    through_cache = [r for r in decode if r["mechanism"] != "lavo (step)"]
    assert all(0 < r["cache_bytes"] <= r["cache_bound_bytes"] and r["ms"] > 0 for r in through_cache)
    # the fixed layout at every context (B=1, H=2, D=16, r=16, w=32): a ring of 2w keys and values in fp32, its
    # mask, the two fp32 sums of r and their counts per head, the int64 position per head
    step_layout = 2 * 2 * 64 * 16 * 4 + 64 + 2 * 2 * 16 * 4 + 2 * 2 * 4 + 2 * 8
    assert {r["cache_bytes"] for r in decode if r["mechanism"] == "lavo (step)"} == {step_layout}
    assert all(r["ratio_to"] == "softmax" for r in decode)
    assert all(len(r["times_ms"]) == payload["settings"]["decode_steps"] for r in decode)
    model = [r for r in records if r["section"] == "model"]
    assert "softmax+rope" in {r["mechanism"] for r in model}
    assert all(len(r["times_ms"]) == payload["settings"]["model_repeats"] for r in model)
    assert all(r["ratio_to"] == "softmax+rope" for r in model)
    assert all(r["tokens_per_s"] > 0 for r in model)
    flops = [r for r in records if r["section"] == "flops" and r["mechanism"] != "matmul"]
    assert flops and all(r["gflop"] > 0 and r["gflops_per_s"] > 0 and r["ratio"] > 0 for r in flops)

    plots = {p.name for p in (tmp_path / "plots").iterdir()}
    assert {"time_fwd.png", "time_fwd_bwd.png", "memory_fwd.png", "memory_fwd_bwd.png", "decode_step.png",
            "decode_cache.png", "model_tokens_per_s.png", "model_memory.png"} <= plots
    assert all((tmp_path / "plots" / name).stat().st_size > 0 for name in plots)


def test_help_documents_every_section(capsys):
    with pytest.raises(SystemExit) as exit_info:
        cli.main(["--help"])
    assert exit_info.value.code == 0
    text = capsys.readouterr().out
    for option in ("--sections", "--quick", "--max-quadratic-length", "--dtype", "--repeats", "--time-limit",
                   "--json", "--plots", "--decode-lengths", "--model-preset", "--matmul-size"):
        assert option in text


def bench_error(capsys, *args: str) -> str:
    """The error line of ``python -m lavo.bench ARGS``, which must exit with status 2 (as argparse does)."""
    with pytest.raises(SystemExit) as exit_info:
        cli.main(["--quick", "--no-progress", *args])
    assert exit_info.value.code == 2
    return capsys.readouterr().err.splitlines()[-1]


@pytest.mark.parametrize("flag, sections", [
    ("--lengths", "attention, flops and profile sections"), ("--passes", "attention, flops and profile sections"),
    ("--ops", "attention and profile sections"), ("--batch", "the attention, decode, flops and profile sections"),
    ("--decode-lengths", "decode section"), ("--decode-steps", "decode section"),
    ("--model-lengths", "model and profile sections")])
def test_help_names_the_sections_a_flag_sets_and_lengths_in_tokens(flag, sections):
    """--lengths read as every section's (was: 'sequence lengths'; the decode and model sections take their own)."""
    text = cli.build_parser()._option_string_actions[flag].help
    assert sections in text
    assert "lengths" not in flag or "lengths in tokens" in text


def test_float16_runs_every_mechanism_and_the_model(tmp_path):
    out = tmp_path / "fp16.json"
    assert cli.main(["--quick", "--no-progress", "--threads", "1", "--dtype", "fp16", "--sections", "attention,model",
                     "--passes", "fwd+bwd", "--model-attentions", "lavo,softmax", "--json", str(out)]) == 0
    records = json.loads(out.read_text())["records"]
    assert {r["status"] for r in records} == {"ok"} and {r["dtype"] for r in records} == {"fp16"}
    assert {r["mechanism"] for r in records} >= set(available_attentions()) | {"lavo_attention (op)", "sdpa (op)"}


def test_unknown_mechanism_is_an_error(capsys):
    assert bench_error(capsys, "--attentions", "nope") == (
        f"python -m lavo.bench: error: --attentions: unknown ['nope']; choose from {', '.join(available_attentions())}")
    assert re.fullmatch(r"python -m lavo.bench: error: --decode-attentions: \['longshort'\] have no decoding form; "
                        r"choose from .*", bench_error(capsys, "--decode-attentions", "longshort"))


@pytest.mark.parametrize("flag, value, allowed", [
    ("--threads", "0", "an integer >= 1"), ("--repeats", "0", "an integer >= 1"), ("--warmup", "-1", "an integer >= 0"),
    ("--time-limit", "0", "a number > 0"), ("--device", "gpu", "cpu, cuda or cuda:N")])
def test_numbers_and_the_device_are_checked_when_parsed(flag, value, allowed, capsys):
    assert bench_error(capsys, flag, value) == (
        f"python -m lavo.bench: error: argument {flag}: must be {allowed}; got '{value}'")


@pytest.mark.parametrize("flag", ["--lengths", "--passes", "--sections"])
def test_a_list_that_would_measure_nothing_is_refused_when_parsed(flag, capsys):
    assert bench_error(capsys, f"{flag}=") == (
        f"python -m lavo.bench: error: argument {flag}: must be a non-empty comma-separated list; got ''")


def test_a_rank_above_the_head_dimension_is_refused_before_any_measurement(capsys):
    assert bench_error(capsys, "--rank", "32") == (  # --quick's head dimension: 16
        "python -m lavo.bench: error: --rank 32 is more than --head-dim 16: LAVO's memory has at most one slot per "
        "dimension of a head")


@pytest.mark.parametrize("flag", ["--lengths", "--decode-lengths", "--model-lengths"])
def test_lengths_below_one_or_not_numbers_are_refused_when_parsed(flag, capsys):
    assert bench_error(capsys, flag, "1K,0") == (
        f"python -m lavo.bench: error: argument {flag}: a length must be at least 1; got '0'")
    for text in ("abc", "infk", "nank", "0.3k"):  # "0.3K" would be 307.2 tokens; "infK" crashed
        assert bench_error(capsys, flag, f"1K,{text}") == (
            f"python -m lavo.bench: error: argument {flag}: '{text}' is not a length: a whole number, or one with a "
            "K suffix (4K = 4096) that makes a whole number")
    assert cli.parse_length("1.5K") == 1536


@pytest.mark.parametrize("options, message", [
    ('{"lavo": 3}', "--attention-options must be a JSON object of {mechanism: {option: value}}"),
    ('{"nope": {}}', "--attention-options: unknown mechanisms ['nope']; choose from abc, cosformer, lavo"),
    ('{"lavo": {"bogus": 1}}', "--attention-options: attention 'lavo' has no option 'bogus'; its options: rank")])
def test_attention_options_are_checked_before_any_measurement(options, message, capsys):
    assert bench_error(capsys, "--attention-options", options).startswith(f"python -m lavo.bench: error: {message}")


def test_attention_options_that_are_not_json_quote_the_json_error(capsys):
    assert bench_error(capsys, "--attention-options", "{lavo") == (
        "python -m lavo.bench: error: argument --attention-options: '{lavo' is not JSON (Expecting property name "
        "enclosed in double quotes: line 1 column 2 (char 1))")


@pytest.mark.parametrize("flag, made, message", [("--json", "folder", "is a folder; give the path of a JSON file"),
                                                 ("--plots", "file", "is a file; give a folder for the PNG plots")])
def test_output_paths_that_cannot_be_written_are_refused_before_measuring(flag, made, message, tmp_path, capsys):
    """Was: a traceback at the first record's save (--json), or after the whole run (--plots)."""
    path = tmp_path / "out"
    path.mkdir() if made == "folder" else path.write_text("")
    tiny = ("--sections", "attention", "--attentions", "", "--ops", "sdpa", "--passes", "fwd", "--lengths", "16")
    assert bench_error(capsys, *tiny, flag, str(path)) == f"python -m lavo.bench: error: {flag} {path}: {message}"


@pytest.mark.parametrize("flag, items, repeated", [("--lengths", "128,256,128", "128"),
                                                   ("--passes", "fwd,fwd", "fwd"),
                                                   ("--attentions", "lavo,local,lavo,local", "lavo, local"),
                                                   ("--decode-lengths", "1K,1024", "1024")])
def test_a_list_flag_naming_an_item_twice_is_refused(flag, items, repeated, capsys):
    """Each would be measured twice (was: twice the time, and the table kept one of the two)."""
    assert bench_error(capsys, flag, items) == (
        f"python -m lavo.bench: error: {flag}: {repeated} given more than once; name each once")


def test_a_run_that_would_measure_nothing_is_refused(capsys):
    """--quick stops quadratic mechanisms at 256 tokens (was: an empty report, exit 0)."""
    assert bench_error(capsys, "--sections", "attention", "--attentions", "softmax", "--ops", "sdpa", "--lengths",
                       "1K") == ("python -m lavo.bench: error: --sections attention: nothing to measure with these "
                                 "flags (the mechanisms and ops they name at their lengths; quadratic ones and SDPA "
                                 "only up to --max-quadratic-length 256)")
    assert bench_error(capsys, "--sections", "decode,model", "--decode-attentions", "", "--model-attentions", "")
    # a section with nothing to measure beside one that has something still runs, as '' for none says
    assert quick_settings("--sections", "attention,model", "--model-attentions", "").model_attentions == []


def test_a_cuda_device_the_machine_lacks_is_refused(monkeypatch, capsys):
    from lavo.cli import main
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 0)
    assert bench_error(capsys, "--device", "cuda") == (
        "python -m lavo.bench: error: --device cuda: no such CUDA device on this machine (it has 0); use --device cpu")
    assert main(["bench", "--quick", "--no-progress", "--device", "cuda:1"]) == 2
    assert capsys.readouterr().err == ("lavo bench: error: --device cuda:1: no such CUDA device on this machine "
                                       "(it has 0); use --device cpu\n")


def quick_settings(*args: str) -> settings.Settings:
    return cli.settings_from_args(cli.build_parser().parse_args(["--quick", "--no-progress", *args]))


class QuadraticLocal(LocalAttention):
    """Local attention declared quadratic: generic code must treat it as it treats softmax."""
    time_complexity = "quadratic"


def test_declared_time_complexity_decides_the_lengths_run_and_the_skips_predicted(monkeypatch):
    monkeypatch.setitem(ATTENTIONS, "quadratic_local", QuadraticLocal)
    # every call "takes" 1 s: at twice the length, linear growth predicts 2 s and quadratic growth 4 s; quadratic
    # ones stop at --max-quadratic-length
    monkeypatch.setattr(Runner, "measure", lambda self, fn, repeats=None: Measurement(1000.0, [1000.0], None))
    s = quick_settings("--attentions", "local,quadratic_local", "--ops", "lavo_attention,sdpa", "--passes", "fwd",
                       "--lengths", "128,256,512", "--max-quadratic-length", "256", "--time-limit", "3")
    runner = Runner(s, None)
    attention.run(runner)
    status = {(r["mechanism"], r["length"]): r["status"] for r in runner.records}
    assert status == {("sdpa (op)", 128): "ok", ("sdpa (op)", 256): "skipped",
                      ("lavo_attention (op)", 128): "ok", ("lavo_attention (op)", 256): "ok",
                      ("lavo_attention (op)", 512): "ok",
                      ("local", 128): "ok", ("local", 256): "ok", ("local", 512): "ok",
                      ("quadratic_local", 128): "ok", ("quadratic_local", 256): "skipped"}
    notes = {(r["mechanism"], r["length"]): r["note"] for r in runner.records}
    assert "predicted 4 s" in notes["quadratic_local", 256] and "predicted 4 s" in notes["sdpa (op)", 256]
    text = output.markdown(runner.records, {"device": "cpu", "cpu": "test", "threads": 1, "torch": "test"}, s)
    assert ("Empty cells: quadratic mechanisms are not run past --max-quadratic-length 256, and where the reference "
            "of the ratios is not run, the others have no ratio.") in text  # the cells at 512 say nothing themselves



@pytest.mark.parametrize("flags, noted", [(("--attentions", "lavo,abc", "--ops", ""), False),
                                          (("--attentions", "lavo", "--ops", "sdpa"), True),
                                          (("--attentions", "softmax", "--ops", ""), True)])
def test_the_quadratic_limit_note_appears_only_where_a_quadratic_mechanism_is_run(flags, noted):
    """Was: under every table with a length past --max-quadratic-length, though only linear ones were run."""
    s = quick_settings("--sections", "attention", "--passes", "fwd", "--lengths", "128,1K", *flags)
    records = [record("attention", "layer", name, "fwd", 128, s, ms=1.0) for name in s.attentions]
    text = output.markdown(records, {"device": "cpu", "cpu": "test", "threads": 1, "torch": "test"}, s)
    assert ("Empty cells: quadratic mechanisms are not run past --max-quadratic-length 256" in text) == noted


def test_a_length_whose_predicted_peak_memory_would_not_fit_is_skipped(monkeypatch):
    peaks_mib = iter([100.0, 200.0])
    monkeypatch.setattr(Runner, "measure", lambda self, fn, repeats=None: Measurement(1.0, [1.0], next(peaks_mib)))
    monkeypatch.setattr("lavo.bench.runner.available_mib", lambda device: 400.0)
    s = quick_settings("--attentions", "local", "--ops", "", "--passes", "fwd", "--lengths", "128,256,512")
    runner = Runner(s, None)
    attention.run(runner)
    # from the last length: 100 MiB at 128 predicts 200 MiB at 256, within 80% of 400 MiB; 200 MiB there predicts
    # 400 MiB at 512, which is not
    assert [(r["length"], r["status"], r["note"]) for r in runner.records] == [
        (128, "ok", ""), (256, "ok", ""),
        (512, "skipped", "skipped: predicted peak 400 MiB > 80% of the 400 MiB available")]


@pytest.mark.parametrize("number", [signal.SIGINT, signal.SIGTERM], ids=["ctrl-c", "sigterm"])
def test_a_run_stopped_midway_has_written_and_prints_what_it_measured(number, monkeypatch, tmp_path, capsys):
    """SIGTERM (`timeout`, a job scheduler) ended the process at once, the measurements since the last JSON
    write lost and no table printed."""
    calls = []

    def measure_until_stopped(self, fn, repeats=None):
        calls.append(fn)
        if len(calls) == 3:
            stop_by(number)
        return Measurement(float(len(calls)), [float(len(calls))], None)

    monkeypatch.setattr(Runner, "measure", measure_until_stopped)
    s = quick_settings("--sections", "attention", "--attentions", "", "--ops", "sdpa", "--passes", "fwd",
                       "--lengths", "128,256,512", "--max-quadratic-length", "512")
    records, info = cli.run(s, progress=False, json_path=tmp_path / "bench.json")
    saved = json.loads((tmp_path / "bench.json").read_text())
    assert [(r["length"], r["ms"]) for r in saved["records"]] == [(128, 1.0), (256, 2.0)]
    assert saved["settings"]["lengths"] == [128, 256, 512] and "torch" in saved["machine"]
    assert info["interrupted"] == number.name and len(records) == 2
    calls.clear()  # and from the command line: the tables of what was measured, and the signal's exit code
    assert cli.main(["--quick", "--no-progress", "--sections", "attention", "--attentions", "", "--ops", "sdpa",
                     "--passes", "fwd", "--lengths", "128,256,512", "--max-quadratic-length", "512",
                     "--json", str(tmp_path / "cli.json")]) == 128 + number
    assert json.loads((tmp_path / "cli.json").read_text())["machine"]["interrupted"] == number.name
    out, err = capsys.readouterr()
    assert "| sdpa" in out and "interrupted: the tables hold the 2 measurements made before it" in err

def test_the_first_quadratic_mechanism_is_the_reference_of_decode_and_model(monkeypatch):
    monkeypatch.setitem(ATTENTIONS, "quadratic_local", QuadraticLocal)
    monkeypatch.setattr(Runner, "measure", lambda self, fn, repeats=None: Measurement(1.0, [1.0], None))
    s = quick_settings("--decode-attentions", "lavo,quadratic_local", "--model-attentions", "lavo,quadratic_local",
                       "--decode-lengths", "64", "--model-lengths", "32")
    runner = Runner(s, None)
    decode.run(runner)
    model.run(runner)
    assert [(r["mechanism"], r["ratio_to"]) for r in runner.records] == [
        ("quadratic_local", "quadratic_local"), ("lavo", "quadratic_local"), ("lavo (step)", "quadratic_local"),
        ("quadratic_local", "quadratic_local"), ("lavo", "quadratic_local")]


def test_ratios_are_each_time_over_the_reference_time_at_the_same_point(monkeypatch):
    # in run order: sdpa, LAVO's op; softmax, lavo, lavo (step) decoding; the softmax+rope and lavo models
    times_ms = iter([2.0, 6.0, 8.0, 2.0, 1.0, 4.0, 2.0])
    monkeypatch.setattr(Runner, "measure", lambda self, fn, repeats=None: Measurement(next(times_ms), [], None))
    s = quick_settings("--attentions", "", "--ops", "lavo_attention,sdpa", "--passes", "fwd", "--lengths", "128",
                       "--decode-attentions", "lavo,softmax", "--decode-lengths", "64", "--model-attentions",
                       "lavo,softmax", "--model-lengths", "32", "--model-batch", "2")
    runner = Runner(s, None)
    for section in (attention, decode, model):
        section.run(runner)
    assert [(r["mechanism"], r["ratio"]) for r in runner.records] == [
        ("sdpa (op)", 1.0), ("lavo_attention (op)", 3.0), ("softmax", 1.0), ("lavo", 0.25), ("lavo (step)", 0.125),
        ("softmax+rope", 1.0), ("lavo", 0.5)]
    assert [r["tokens_per_s"] for r in runner.records if r["section"] == "model"] == [
        pytest.approx(2 * 32 / 4e-3), pytest.approx(2 * 32 / 2e-3)]  # both sequences of the batch
    text = output.markdown(runner.records, {"device": "cpu", "cpu": "test", "threads": 1, "torch": "test"}, s)
    for row in ("| lavo_attention (op) | 6.00 (×3.0) |", "| lavo | 2.00 (×0.25) |",
                "| lavo | 32000 (×0.50) / — |"):
        assert row in text.splitlines()


def test_a_quadratic_mechanism_without_a_cache_is_not_the_reference(monkeypatch):
    monkeypatch.setattr(Runner, "measure", lambda self, fn, repeats=None: Measurement(1.0, [1.0], None))
    assert attention_class("longshort").time_complexity == "quadratic"
    s = quick_settings("--model-attentions", "longshort,softmax", "--model-lengths", "32")
    runner = Runner(s, None)
    model.run(runner)
    assert [(r["mechanism"], r["ratio_to"]) for r in runner.records] == [
        ("softmax+rope", "softmax+rope"), ("longshort", "softmax+rope")]


def test_model_compile_compiles_each_model_and_runs_it_once_before_its_measurement(monkeypatch):
    compiled_steps = []

    def compile_counting(module):
        def forward(*args, **kwargs):
            compiled_steps.append(module.config.attention)
            return module(*args, **kwargs)
        return forward
    monkeypatch.setattr(torch, "compile", compile_counting)
    seen_by_measure = []
    monkeypatch.setattr(Runner, "measure", lambda self, fn, repeats=None: (
        seen_by_measure.append(list(compiled_steps)), Measurement(1.0, [1.0], None))[1])
    s = quick_settings("--model-attentions", "local,softmax", "--model-lengths", "32", "--model-compile")
    runner = Runner(s, None)
    model.run(runner)
    assert seen_by_measure == [["softmax"], ["softmax", "local"]]  # the compiling step came before each timing
    assert [r["compiled"] for r in runner.records] == [True, True]
    info = dict(device="cpu", cpu="cpu", threads=1, torch=torch.__version__)
    assert "training step, compiled, batch 1" in output.markdown(runner.records, info, s)


def test_model_checkpointing_measures_each_model_also_checkpointed_beside_the_one_without(monkeypatch):
    checkpointed = []
    monkeypatch.setattr(Runner, "measure", lambda self, fn, repeats=None: Measurement(1.0, [1.0], None))
    monkeypatch.setattr(LanguageModel, "set_activation_checkpointing",
                        lambda self, enable=True: checkpointed.append((self.config.attention, enable)))
    s = quick_settings("--model-attentions", "lavo,softmax", "--model-lengths", "32,64", "--model-checkpointing")
    runner = Runner(s, None)
    model.run(runner)
    # a checkpointed step against the checkpointed reference, the others against the reference
    assert [(r["mechanism"], r["length"], r["ratio_to"]) for r in runner.records] == [
        (name, n, reference) for name, reference in (
            ("softmax+rope", "softmax+rope"), ("softmax+rope, checkpointed", "softmax+rope, checkpointed"),
            ("lavo", "softmax+rope"), ("lavo, checkpointed", "softmax+rope, checkpointed")) for n in (32, 64)]
    assert checkpointed == [(name, enable) for name in ("softmax", "lavo") for enable in (False, True)
                            for _ in range(2)]
    assert [r["checkpointed"] for r in runner.records] == [False, False, True, True] * 2
    assert len(runner.records) == model.planned(s)


def test_options_go_to_the_mechanisms_that_have_them():
    s = quick_settings("--window", "8", "--rank", "4", "--attention-options", '{"performer": {"features": 16}}',
                       "--backend", "torch")
    assert settings.mechanism_options("lavo", s, 100) == {"window": 8, "rank": 4, "backend": "torch"}
    assert settings.mechanism_options("local", s, 100) == {"window": 8, "backend": "torch"}
    assert settings.mechanism_options("cosformer", s, 100) == {"max_length": 100}
    assert settings.mechanism_options("performer", s, 100) == {"features": 16}
    assert settings.mechanism_options("softmax", s, 100) == {}
    for name in available_attentions():
        build_attention(name, s.dim, s.heads, **settings.mechanism_options(name, s, 100))


def test_the_attention_that_takes_rotary_positions_runs_with_rope(monkeypatch):
    assert model.label("softmax") == "softmax+rope" and model.label("lavo") == "lavo"
    s = quick_settings()
    assert model.model_for("softmax", s, 64).config.position == "rope"
    assert model.model_for("lavo", s, 64).config.position == "none"
    monkeypatch.setattr(LocalAttention, "accepts_rotary", True)
    assert model.label("local") == "local+rope"


@pytest.mark.parametrize("which", ["fwd", "fwd+bwd"])
def test_sdpa_op_row_is_causal(monkeypatch, which):
    calls = []
    real = torch.nn.functional.scaled_dot_product_attention

    def spy(q, k, v, **options):
        calls.append((q.shape, options))
        return real(q, k, v, **options)

    monkeypatch.setattr(torch.nn.functional, "scaled_dot_product_attention", spy)
    s = quick_settings()
    attention.attention_call("sdpa (op)", s, 48, which, Runner(s, None))()
    assert calls == [((s.batch, s.heads, 48, s.head_dim), {"is_causal": True})]


@pytest.mark.parametrize("which", ["fwd", "fwd+bwd"])
def test_lavo_op_row_runs_lavo_attention_with_the_run_shapes(monkeypatch, which):
    calls = []

    def spy(q, k, v, basis, **options):
        calls.append((q.shape, k.shape, v.shape, basis.shape, options))
        return lavo_attention(q, k, v, basis, **options)

    monkeypatch.setattr(attention, "lavo_attention", spy)
    s = quick_settings()
    attention.attention_call("lavo_attention (op)", s, 48, which, Runner(s, None))()
    assert len(calls) == 1
    q_shape, k_shape, v_shape, basis_shape, options = calls[0]
    assert q_shape == k_shape == v_shape == (s.batch, 48, s.heads, s.head_dim)
    assert basis_shape == (s.heads, s.rank, s.head_dim)
    assert options["window"] == s.window and options["causal"] is True
    assert options["pos_bias"].shape == (s.heads, 2 * s.window)


def test_slow_and_failing_measurements_are_skipped_with_a_note(capsys, tmp_path):
    out = tmp_path / "bench.json"
    cli.main(["--quick", "--no-progress", "--sections", "attention", "--attentions", "local", "--ops", "sdpa",
                "--passes", "fwd", "--time-limit", "1e-9", "--json", str(out)])
    records = json.loads(out.read_text())["records"]
    assert [r["status"] for r in records] == ["skipped"] * len(records)
    assert "--time-limit" in records[0]["note"] and "skipped" in records[-1]["note"]
    cli.main(["--quick", "--no-progress", "--sections", "attention", "--attentions", "local", "--ops", "sdpa",
                "--passes", "fwd", "--attention-options", '{"local": {"window": -1}}', "--json", str(out)])
    local = [r for r in json.loads(out.read_text())["records"] if r["mechanism"] == "local"]
    assert local[0]["status"] == "failed" and "window" in local[0]["note"]
    assert local[1]["status"] == "skipped"
    assert "[1]" in capsys.readouterr().out


def test_softmax_prefill_past_the_quadratic_limit_builds_the_same_cache():
    run_settings = quick_settings("--max-quadratic-length", "8")
    for rotary in (False, True):
        layer = build_attention("softmax", 32, 2, rotary=rotary)
        x = torch.randn(1, 20, 32)
        direct, ran = decode.prefill(layer, x, run_settings)
        assert not ran
        with torch.no_grad():
            _, full = layer(x)
        assert direct.position == full.position == 20
        for name in ("keys", "values", "key_mask"):
            torch.testing.assert_close(getattr(direct, name), getattr(full, name))
    # under bfloat16 autocast in the dtype the layer's own forward keeps (twice the bytes, and a cast of the whole
    # cache at every step, would slow softmax's decoding past the limit only)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        direct, _ = decode.prefill(layer, x, run_settings)
        full = layer(x)[1]
    assert direct.keys.dtype == full.keys.dtype == torch.bfloat16
    assert direct.nbytes() <= layer.cache_nbytes(1, 20, torch.bfloat16)


def test_lavo_flops_small_case_by_hand():
    # T=8, w=4, D=2, r=2, one head: two blocks of 4 queries against K=8 keys.
    # forward: local 2 blocks * (QK^T 4*8*2 + PV 4*8*2 multiply-adds) * 2 = 512;
    # memory: query projection and read 2 * (8*2*2) * 2 = 128, window sums 2 windows * 2*2 * 2 = 16
    forward = flops.lavo_flops(1, 8, 1, 2, 2, 4)
    assert forward == {"local": 512, "memory": 144, "total": 656}
    # backward: 4 gradient matmuls = 4 * 256 = 1024 more (weights kept); memory: 3 * 64 + 16
    both = flops.lavo_flops(1, 8, 1, 2, 2, 4, backward=True)
    assert both == {"local": 512 + 1024, "memory": 144 + 3 * 64 + 16, "total": 1888}


@pytest.mark.parametrize("recompute", [False, True])
@pytest.mark.parametrize("B,T,H,D,r,w,causal,basis_grad", [
    (1, 8, 1, 2, 2, 4, True, False),
    (2, 11, 3, 8, 4, 4, True, False),  # padded: T is not a multiple of w
    (1, 16, 2, 8, 8, 4, False, False),
    (1, 12, 2, 6, 3, 4, True, True),
    (1, 3, 1, 4, 2, 8, True, False),  # shorter than the window: one block of T
    (1, 5, 2, 4, 2, 8, False, False),
])
def test_lavo_flops_matches_the_matmuls_the_op_runs(monkeypatch, B, T, H, D, r, w, causal, basis_grad, recompute):
    if recompute:  # the path of long sequences: weights recomputed in backward
        monkeypatch.setattr("lavo.ops.local.blocked.SAVED_WEIGHTS_LIMIT", 0)
    q, k, v = (torch.randn(B, T, H, D, requires_grad=True) for _ in range(3))
    basis = orthogonal_basis(H, r, D).requires_grad_(basis_grad)
    pos_bias = torch.zeros(H, 2 * w if causal else 4 * w - 1, requires_grad=True)
    with FlopCounterMode(display=False) as counter:
        y = lavo_attention(q, k, v, basis, window=w, causal=causal, pos_bias=pos_bias)
    forward = counter.get_total_flops()
    with FlopCounterMode(display=False) as counter:
        y.backward(torch.randn_like(y))
    backward = counter.get_total_flops()
    assert flops.lavo_flops(B, T, H, D, r, w, causal=causal)["total"] == forward
    assert flops.lavo_flops(B, T, H, D, r, w, causal=causal, backward=True,
                            basis_grad=basis_grad)["total"] == forward + backward


@pytest.mark.parametrize("torch_path", [True, False])
def test_the_flops_section_counts_recomputed_scores_only_where_the_torch_path_recomputes(monkeypatch, torch_path):
    # was: on the Triton kernels, the torch path's recomputation was counted past its weight limit only, so the
    # rate of the same kernels jumped where that limit fell
    s = quick_settings("--sections", "flops", "--passes", "fwd+bwd", "--lengths", "64")
    assert flops.runs_torch_path(s, torch.device("cpu"))
    monkeypatch.setattr("lavo.ops.local.blocked.SAVED_WEIGHTS_LIMIT", 0)
    monkeypatch.setattr(flops, "runs_torch_path", lambda s, device: torch_path)
    runner = Runner(s, None)
    flops.run(runner)
    (entry,) = [r for r in runner.records if r["mechanism"] == "lavo_attention (op)"]
    local_products = 2 * 64 * 2 * s.window * s.head_dim * s.heads  # one [T', K, D] matmul; T' = 64, K = 2w
    assert entry["gflop_local"] * 1e9 == (7 if torch_path else 6) * local_products


def test_the_flops_rate_is_the_counted_work_over_the_attention_sections_time(monkeypatch):
    s = quick_settings("--sections", "flops", "--passes", "fwd", "--lengths", "64,128")
    monkeypatch.setattr(Runner, "measure", lambda self, fn, repeats=None: Measurement(8.388608, [8.388608], None))
    runner = Runner(s, None)
    lavo_op, sdpa_op = attention.OPS["lavo_attention"].label, attention.SDPA
    runner.records = [dict(section="attention", mechanism=lavo_op, op="fwd", length=64, ms=0.657408,
                           times_ms=[0.657408], peak_mib=None, note=""),
                      dict(section="attention", mechanism=sdpa_op, op="fwd", length=64, ms=0.1, times_ms=[0.1],
                           peak_mib=None, note=""),
                      dict(section="attention", mechanism=lavo_op, op="fwd", length=128, ms=None, times_ms=None,
                           peak_mib=None, note="skipped: too slow")]
    flops.run(runner)
    matmul, at_64, at_128 = runner.records[3:]
    # quick shapes: H=2, D=16, r=16, w=32; at T=64: local 2 * 2*64*64*16*2, memory 2 * 2*64*16*16*2 + 2*2*16*16*2
    assert at_64["gflop"] * 1e9 == 524288 + 133120 == 657408
    assert matmul["gflops_per_s"] == pytest.approx(2 * 256 ** 3 / 1e9 / 8.388608e-3) == 4.0  # --matmul-size 256
    assert at_64["gflops_per_s"] == pytest.approx(1.0) and at_64["ratio"] == pytest.approx(0.25)
    assert (at_128["status"], at_128["note"]) == (
        "skipped", "skipped: not measured in the attention section (skipped: too slow)")
    text = output.markdown([matmul, at_64, at_128], {"device": "cpu", "cpu": "test", "threads": 1, "torch": "test"}, s)
    assert "| fwd | 1.00 (25%) | — [1] |" in text.splitlines()


def test_peak_memory_reports_none_without_proc(monkeypatch):
    real_open = open

    def no_clear_refs(path, *args, **kwargs):
        if str(path) == "/proc/self/clear_refs":
            raise PermissionError(path)
        return real_open(path, *args, **kwargs)

    monkeypatch.setattr("builtins.open", no_clear_refs)
    with measure.PeakMemory(torch.device("cpu")) as peak:
        torch.zeros(1000)
    assert peak.mib is None


def test_peak_memory_sees_a_large_allocation():
    with measure.PeakMemory(torch.device("cpu")) as peak:
        x = torch.ones(64, 2 ** 20 // 4)  # 64 MiB, touched
        del x
    if peak.mib is None:
        pytest.skip("/proc/self/clear_refs is not writable here")
    assert peak.mib >= 60


@pytest.mark.parametrize("device", ["cpu", "cuda"])
def test_peak_memory_is_the_growth_above_what_was_held_before_the_call(monkeypatch, device):
    # CPU: the resident set's high-water mark after the call over the resident set before (KiB);
    # CUDA: the peak allocated after the call over the memory allocated before (bytes)
    monkeypatch.setattr(measure, "_proc_status_kib", {"VmRSS": 500_000, "VmHWM": 502_048}.get)
    real_open = open
    monkeypatch.setattr("builtins.open", lambda path, *args, **kwargs: io.StringIO() if (
        str(path) == "/proc/self/clear_refs") else real_open(path, *args, **kwargs))
    for name, value in (("synchronize", None), ("reset_peak_memory_stats", None),
                        ("memory_allocated", 10 * measure.MIB), ("max_memory_allocated", 12 * measure.MIB)):
        monkeypatch.setattr(torch.cuda, name, lambda *device, value=value: value)
    with measure.PeakMemory(torch.device(device)) as peak:
        pass
    assert peak.mib == 2.0


def test_wide_table_marks_skipped_cells_and_lists_their_reasons_once():
    def entry(mechanism, length, ms, note=""):
        return dict(mechanism=mechanism, length=length, ms=ms, status="ok" if ms else "skipped", note=note)

    records = [entry("a", 1024, 1.5), entry("a", 4096, None, "too slow"), entry("b", 1024, 2.0),
               entry("b", 4096, None, "failed before")]
    text = output.wide_table(records, lambda r: r["mechanism"], lambda r: report.number(r["ms"]), "mechanism")
    assert text.splitlines() == ["| mechanism | 1K | 4K |", "| --- | ---: | ---: |", "| a | 1.50 | — [1] |",
                                 "| b | 2.00 | — [2] |", "", "[1] a at 4K: too slow", "[2] b at 4K: failed before"]
    unnoted = output.wide_table(records, lambda r: r["mechanism"], lambda r: "x", "mechanism", notes=False)
    assert "[1]" not in unnoted and "| a | x | — |" in unnoted


def test_the_results_document_cites_only_clean_runs_of_this_history():
    root = Path(__file__).resolve().parents[1]
    if not (root / ".git").exists():
        pytest.skip("not a git checkout: the recorded commits cannot be checked")
    cited = sorted(set(re.findall(r"results/([\w.-]+\.json)", (root / "benchmarks" / "RESULTS.md").read_text())))
    assert cited
    for name in cited:
        machine = json.loads((root / "benchmarks" / "results" / name).read_text())["machine"]
        assert machine.get("commit") and machine.get("dirty") is False, f"{name} records no clean commit"
        ancestor = subprocess.run(["git", "merge-base", "--is-ancestor", machine["commit"], "HEAD"], cwd=root)
        assert ancestor.returncode == 0, f"{name} was measured at {machine['commit']}, not in this history"


def test_the_json_records_the_measured_commit():
    info = measure.machine_info("cpu")
    head = subprocess.run(["git", "rev-parse", "HEAD"], capture_output=True, text=True,
                          cwd=Path(__file__).resolve().parents[1])
    if head.returncode != 0:
        pytest.skip("not a git checkout")
    assert info["commit"] == head.stdout.strip() and isinstance(info["dirty"], bool)


@pytest.mark.slow
@needs_triton
def test_gpu_check_dry_run_writes_its_summary(tmp_path):
    """scripts/gpu_check.sh --dry-run: every step of the GPU check on the CPU, kernels in Triton's interpreter."""
    root = Path(__file__).resolve().parents[1]
    subprocess.run(["bash", str(root / "scripts/gpu_check.sh"), str(tmp_path), "--dry-run"], check=True,
                   env=dict(os.environ, PYTHON=sys.executable), capture_output=True)
    summary = json.loads((tmp_path / "cpu_dry_run_bf16.json").read_text())
    assert [s["name"] for s in summary["steps"]] == ["tests", "ops", "decode", "decode_torch", "model", "profile"]
    assert all(s["status"] == "ok" for s in summary["steps"]), summary["steps"]
    assert {r["step"] for r in summary["records"] if r["status"] == "ok"} == {"ops", "decode", "decode_torch", "model",
                                                                              "profile"}
    assert {r["mechanism"] for r in summary["records"] if r["step"] == "decode_torch"} == {"lavo", "lavo (step)"}
    assert "## Targets" in (tmp_path / "cpu_dry_run_bf16.md").read_text()
    # three files in all, the steps' own in one archive: a machine lent for the check may give back only a few
    assert sorted(p.name for p in tmp_path.iterdir()) == ["cpu_dry_run_bf16.json", "cpu_dry_run_bf16.md",
                                                          "steps.tar.gz"]
    with tarfile.open(tmp_path / "steps.tar.gz") as tar:
        names = set(tar.getnames())
        steps = ("ops", "decode", "model")
        assert {f"steps/{step}.{kind}" for step in steps for kind in ("json", "md", "log")} <= names
        assert json.loads(tar.extractfile("steps/ops.json").read())["records"] == [
            {k: v for k, v in r.items() if k != "step"} for r in summary["records"] if r["step"] == "ops"]


@needs_triton
def test_gpu_check_splits_the_kernel_tests_into_commands_run_at_once():
    selection = gpu_check.pytest("-k", "backend_choice or interpreter_that or bfloat16_kernels",
                                *gpu_check.KERNEL_TESTS)
    env = dict(os.environ, HF_HUB_OFFLINE="1")
    commands = gpu_check.split_tests(selection, 2, env)
    ids = [arg for command in commands for arg in command if "::" in arg]
    assert len(commands) == 2 and len(ids) == 4 and len(set(ids)) == 4
    listed = subprocess.run(selection + ["--collect-only"], capture_output=True, text=True, env=env).stdout
    in_order = [line for line in listed.splitlines() if "::" in line]
    assert [[arg for arg in command if "::" in arg] for command in commands] == [in_order[0::2], in_order[1::2]]
    assert all(command[:len(gpu_check.pytest())] == gpu_check.pytest() and "slow or not slow" in command
               for command in commands)
    assert {i.split("::")[1].split("[")[0] for i in ids} == {
        "test_backend_choice_and_its_errors", "test_an_interpreter_that_cannot_run_with_this_numpy_is_named",
        "test_bfloat16_kernels_are_close_to_the_float32_reference"}
    assert gpu_check.split_tests(gpu_check.pytest("tests/no_such_file.py"), 2, env) == [
        gpu_check.pytest("tests/no_such_file.py")]


def test_gpu_check_puts_unpacked_wheels_on_the_path(tmp_path, capsys):
    import zipfile
    wheels = tmp_path / "wheels"
    wheels.mkdir()
    with zipfile.ZipFile(wheels / "tiny_pkg-1.2-py3-none-any.whl", "w") as wheel:
        wheel.writestr("tiny_pkg/__init__.py", "VALUE = 7\n")
        wheel.writestr("tiny_pkg-1.2.dist-info/METADATA", "Metadata-Version: 2.1\nName: tiny-pkg\nVersion: 1.2\n")
    site = gpu_check.unpack_wheels(wheels, tmp_path / "site")
    found = subprocess.run([sys.executable, "-c", "import importlib.metadata, tiny_pkg; "
                            "print(tiny_pkg.VALUE, importlib.metadata.version('tiny-pkg'))"],
                           env=dict(os.environ, PYTHONPATH=str(site)), capture_output=True, text=True, check=True)
    assert found.stdout.split() == ["7", "1.2"]
    (tmp_path / "empty").mkdir()  # e.g. not carried to the machine: the check runs without them
    assert gpu_check.unpack_wheels(tmp_path / "empty", tmp_path / "site2") is None
    assert "warning: --wheels: no .whl files in " in capsys.readouterr().err


def test_gpu_check_steps_come_in_order_of_need_and_put_fla_last():
    without, with_fla = gpu_check.steps(False, False), gpu_check.steps(False, True)
    names = [name for name, _, _ in without]
    assert names[:4] == ["tests", "ops", "decode", "model"]  # the targets' rows
    # fla's sliding window right after them; its chunked linear attention, which autotunes at each shape, last
    assert [name for name, _, _ in with_fla] == names[:4] + ["fla_window"] + names[4:] + ["fla_linear"]
    assert not any("fla" in " ".join(command) for _, _, command in without)
    assert gpu_check.BUDGET_SECONDS <= 6 * 60 - 30  # start-up and the summary fit in the rest of six minutes


def test_gpu_check_steps_share_its_budget(tmp_path, monkeypatch):
    """Each step gets at most what the budget has left; one left under 10 s is recorded as not run."""
    clock, given = [0.0], {}

    def fake_step(name, seconds, commands, out, env):
        given[name] = seconds
        clock[0] += seconds  # every step uses all it is given
        return dict(name=name, command="", seconds=seconds, status="ok")

    monkeypatch.setattr(gpu_check, "run_step", fake_step)
    monkeypatch.setattr(gpu_check, "split_tests", lambda command, shards, env: [command])
    monkeypatch.setattr(gpu_check.time, "monotonic", lambda: clock[0])
    assert gpu_check.main([str(tmp_path), "--dry-run", "--budget", "250"]) == 0
    assert given == {"tests": 120, "ops": 120, "decode": 10}  # the dry run's limits: 120, 120, 60, ...
    summary = json.loads(next(tmp_path.glob("*_bf16.json")).read_text())
    assert [step["status"] for step in summary["steps"][3:]] == ["not run: the check's budget of 250 s was spent"] * 3

def test_gpu_check_runs_every_step_though_one_leaves_a_file_it_cannot_summarise(tmp_path, monkeypatch, capsys):
    """The check runs once on a borrowed GPU: a step's unreadable JSON stopped every step after it."""
    ran = []

    def fake_step(name, seconds, commands, out, env):
        ran.append(name)
        if name == "ops":
            (out / "ops.json").write_text('{"records": [')  # cut off mid-write
        return dict(name=name, command="", seconds=0, status="ok")

    monkeypatch.setattr(gpu_check, "run_step", fake_step)
    monkeypatch.setattr(gpu_check, "split_tests", lambda command, shards, env: [command])
    assert gpu_check.main([str(tmp_path), "--dry-run"]) == 0
    assert ran == [name for name, _, _ in gpu_check.steps(True, False)]
    assert capsys.readouterr().out.startswith(f"no summary after {ran[-1]}: JSONDecodeError(")
    with tarfile.open(tmp_path / "steps.tar.gz") as tar:
        assert tar.getnames() == ["steps/ops.json"]


def test_gpu_check_adds_up_the_pytest_summaries_of_its_commands():
    outputs = ["..F.\n=== 1 failed, 3 passed, 2 deselected in 4.10s ===\n", "....\n4 passed in 1.02s\n",
               "collected nothing\n"]
    assert gpu_check.pytest_summary(outputs) == "1 failed, 7 passed, 2 deselected"
    assert gpu_check.pytest_summary(["killed\n"]) == "no pytest summary"

def test_decode_measures_the_fixed_layout_forms_of_the_layers_that_have_one():
    cpu, cuda = torch.device("cpu"), torch.device("cuda")
    assert decode.forms("lavo", cuda) == ["cache", "step", "graph"]
    assert decode.forms("lavo", cpu) == ["cache", "step"]  # a CUDA graph needs CUDA
    assert decode.forms("softmax", cuda) == decode.forms("local", cuda) == ["cache"]
    assert [decode.label("lavo", form) for form in ("cache", "graph")] == ["lavo", "lavo (graph)"]


def test_profile_counts_each_operator_per_call():
    a = torch.randn(64, 64)

    def call():
        torch.relu(a @ a @ a)

    s = quick_settings("--repeats", "3")
    result = profile.profiled(call, Runner(s, None))
    rows = {row["name"]: row for row in result["kernels"]}
    assert rows["aten::mm"]["calls"] == 2 and rows["aten::relu"]["calls"] == 1  # per call, over the 3 profiled
    assert sum(row["ms"] for row in result["kernels"]) == pytest.approx(result["busy_ms"])
    assert sum(row["share"] for row in result["kernels"]) == pytest.approx(1)
    assert 0 < result["busy_ms"] <= result["ms"]


def test_profile_table_keeps_the_longest_rows_and_sums_the_rest():
    from types import SimpleNamespace
    from torch.autograd import DeviceType

    def event(name, us, device=DeviceType.CUDA, count=2):
        return SimpleNamespace(key=name, count=count, self_cpu_time_total=us, self_device_time_total=us,
                               device_type=device)

    events = [event(f"kernel{i}", 10 * (i + 1)) for i in range(profile.TOP + 3)]
    events += [event("aten::mm", 10_000, DeviceType.CPU), event("idle", 0)]
    table, total_ms = profile.kernel_table(events, on_device=True, repeats=2)
    names = [row["name"] for row in table]
    # on CUDA the launching operators do not count their kernels' time again; zero-time rows are left out
    assert names == [f"kernel{i}" for i in range(profile.TOP + 2, 2, -1)] + ["(3 others)"]
    assert table[-1]["calls"] == 3 and table[-1]["ms"] == pytest.approx((10 + 20 + 30) / 1e3 / 2)
    assert total_ms == pytest.approx(sum(10 * (i + 1) for i in range(profile.TOP + 3)) / 1e3 / 2)
    on_cpu, _ = profile.kernel_table(events, on_device=False, repeats=2)
    assert on_cpu[0]["name"] == "aten::mm"


def test_profile_section_runs_ops_and_training_steps_when_asked(capsys):
    s = quick_settings("--sections", "profile", "--attentions", "", "--ops", "lavo_attention", "--passes", "fwd+bwd",
                       "--lengths", "64", "--model-attentions", "lavo", "--threads", "1")
    records, info = cli.run(s, progress=False)
    assert [(r["level"], r["mechanism"], r["op"], r["length"]) for r in records] == [
        ("op", "lavo_attention (op)", "fwd+bwd", 64), ("model", "lavo", "train_step", 64)]
    assert all(r["status"] == "ok" and r["kind"] == "operator" and r["kernels"] for r in records), records
    op_names, model_names = ({row["name"] for row in r["kernels"]} for r in records)
    assert "_BlockedLocalAttention" in op_names and "_BlockedLocalAttentionBackward" in op_names  # torch path on CPU
    assert "Optimizer.step#AdamW.step" in model_names
    text = output.markdown(records, info, s)
    assert "## Profile: self time per call by operator, longest first" in text
    assert "**lavo_attention (op) fwd+bwd at 64**:" in text and "**lavo train_step at 64**:" in text
    assert cli.build_parser().parse_args([]).sections == list(settings.DEFAULT_SECTIONS)  # only when asked
    assert quick_settings("--model-attentions", "").model_attentions == []  # as --attentions '': none


def test_gpu_check_counts_listing_the_tests_in_their_step_and_refuses_a_used_folder(tmp_path, monkeypatch):
    clock, given = [0.0], {}

    def fake_step(name, seconds, commands, out, env):
        given[name] = seconds
        return dict(name=name, command="", seconds=0, status="ok")

    def slow_listing(command, shards, env):
        clock[0] += 30  # listing the tests took 30 s of the step's 120
        return [command]

    monkeypatch.setattr(gpu_check, "run_step", fake_step)
    monkeypatch.setattr(gpu_check, "split_tests", slow_listing)
    monkeypatch.setattr(gpu_check.time, "monotonic", lambda: clock[0])
    assert gpu_check.main([str(tmp_path / "check"), "--dry-run"]) == 0
    summary = json.loads(next((tmp_path / "check").glob("*_bf16.json")).read_text())
    assert given["tests"] == 90 and summary["steps"][0]["seconds"] == 30
    assert "commit" in summary["machine"] and "dirty" in summary["machine"]
    with pytest.raises(SystemExit, match="is not empty: give the check a new folder"):
        gpu_check.main([str(tmp_path / "check"), "--dry-run"])


def test_gpu_check_judges_every_context_only_on_all_of_them():
    rows = [dict(step="decode", mechanism="lavo (step)", status="ok", ms=0.1, length=1024 * 2 ** i) for i in range(8)]
    for measured, verdict in ((rows[:2], "partial (2/8)"), (rows, "yes")):  # a step cut short, a whole one
        verdicts = {target: met for target, _, met in gpu_check.targets(measured)}
        assert verdicts["decoding step <= 0.3 ms at every context: fused kernel"] == verdict


def test_gpu_check_judges_lavo_against_sdpa_and_softmax_by_their_ratio():
    def op(mechanism, length, ms, peak_mib):
        return dict(step="ops", mechanism=mechanism, op="fwd+bwd", length=length, ms=ms, peak_mib=peak_mib,
                    status="ok")
    rows = [op("lavo_attention (op)", 1024, 3.0, 10.0), op("sdpa (op)", 1024, 2.0, 10.0),
            op("lavo_attention (op)", 16384, 4.0, 50.0), op("sdpa (op)", 16384, 2.0, 100.0)]
    rows += [dict(step="model", mechanism=mechanism, length=length, tokens_per_s=tokens_per_s, status="ok")
             for length in (4096, 16384) for mechanism, tokens_per_s in (("lavo", 3000.0), ("softmax+rope", 2000.0))]
    judged = {target: (measured, met) for target, measured, met in gpu_check.targets(rows)}
    assert judged["fwd+bwd 1K: within 2x of SDPA"] == ("1.50 x SDPA's time", "yes")
    assert judged["fwd+bwd 16K: no slower than SDPA"] == ("2.00 x SDPA's time", "no")
    assert judged["peak memory 16K <= SDPA's"] == ("50.0 vs 100 MiB", "yes")
    assert judged["`small` training 4K: LAVO tokens/s >= 1x softmax+RoPE"] == ("1.50x", "yes")
    assert judged["`small` training 16K: LAVO tokens/s >= 2x softmax+RoPE"] == ("1.50x", "no")


def test_peak_memory_is_taken_after_the_timed_calls_so_never_on_the_first_call(monkeypatch):
    calls = []

    class RecordingPeak:
        mib = 1.0

        def __init__(self, device):
            pass

        def __enter__(self):
            calls.append("peak")
            return self

        def __exit__(self, *exc):
            pass
    monkeypatch.setattr(measure, "PeakMemory", RecordingPeak)
    measure.measure(lambda: calls.append("call"), torch.device("cpu"), repeats=2, warmup=0, time_limit=20)
    assert calls == ["call", "call", "peak", "call"]


def test_the_memory_tables_show_each_peak_and_cache_in_mib():
    s = quick_settings("--sections", "attention,decode", "--passes", "fwd")
    records = [record("attention", "op", "sdpa (op)", "fwd", 128, s, ms=2.0, peak_mib=5.0),
               record("decode", "layer", "lavo", "decode_step", 128, s, ms=0.5, cache_bytes=3 * 2 ** 20)]
    text = output.markdown(records, {"device": "cpu", "cpu": "test", "threads": 1, "torch": "test"}, s)
    tables = {block.splitlines()[0]: block.splitlines()[4] for block in text.split("## ")[1:]}
    assert tables == {"Attention, fwd: B=1, H=2, D=16; ms (× SDPA op at the same length)": "| sdpa (op) | 2.00 |",
                      "Attention, fwd: peak memory growth, MiB": "| sdpa (op) | 5.00 |",
                      "Decoding: ms per token step at a context length (× —)": "| lavo | 0.500 |",
                      "Decoding: cache MiB after the context": "| lavo | 3.00 |"}


def test_the_attention_table_names_sdpa_as_its_reference_only_where_sdpa_was_run():
    """Was: '(× SDPA op at the same length)' over a table of no ratios, with --ops ''."""
    s = quick_settings("--sections", "attention", "--attentions", "lavo", "--ops", "", "--passes", "fwd")
    text = output.markdown([record("attention", "layer", "lavo", "fwd", 128, s, ms=2.0, peak_mib=5.0)],
                           {"device": "cpu", "cpu": "test", "threads": 1, "torch": "test"}, s)
    assert "## Attention, fwd: B=1, H=2, D=16; ms (× —)\n" in text


def test_a_flops_cell_without_the_matmul_rate_shows_no_fraction():
    records = [dict(section="flops", mechanism="matmul", op="matmul", length=3000, dtype="fp32", status="skipped",
                    note="skipped: one call took 1 s > --time-limit 0.2 s"),
               dict(section="flops", mechanism="lavo_attention (op)", op="fwd", length=128, status="ok",
                    gflops_per_s=2.16, ratio=None)]
    s = quick_settings("--sections", "flops")
    text = output.markdown(records, {"device": "cpu", "cpu": "test", "threads": 1, "torch": "test"}, s)
    assert "| fwd | 2.16 |" in text and "%" not in text.split("## LAVO op FLOP")[1]


def test_a_series_first_call_may_compile_but_later_calls_keep_the_time_limit(monkeypatch):
    durations = iter([30.0] + [0.001] * 20)  # seconds of each call: the first compiles
    monkeypatch.setattr(measure, "_timed", lambda fn, device: next(durations))
    result = measure.measure(lambda: None, torch.device("cpu"), repeats=3, warmup=2, time_limit=20,
                             first_call_limit=120)
    assert result.times_ms == [1.0] * 3
    durations = iter([30.0] + [0.001] * 20)
    with pytest.raises(measure.Skipped, match=r"one call took 30 s > --time-limit 20 s"):
        measure.measure(lambda: None, torch.device("cpu"), repeats=3, warmup=2, time_limit=20)


def test_a_measurement_reports_the_median_of_its_timed_calls(monkeypatch):
    durations = iter([0.5, 0.001, 0.009, 0.002, 0.004])  # seconds: one warm-up call, three timed, the memory one
    monkeypatch.setattr(measure, "_timed", lambda fn, device: next(durations))
    result = measure.measure(lambda: None, torch.device("cpu"), repeats=3, warmup=1, time_limit=20)
    assert result.times_ms == pytest.approx([1.0, 9.0, 2.0]) and result.ms == pytest.approx(2.0)  # the mean: 4


def test_attention_runs_length_by_length_with_sdpa_first():
    s = quick_settings("--lengths", "128,256", "--ops", "lavo_attention,sdpa", "--attentions", "", "--passes", "fwd")
    assert [(name, length) for name, _, length in attention.plan(s)] == [
        ("sdpa (op)", 128), ("lavo_attention (op)", 128), ("sdpa (op)", 256), ("lavo_attention (op)", 256)]


def test_the_benchmark_scripts_replace_their_results_only_when_a_run_finishes(tmp_path):
    """benchmarks/run_cpu*.sh write into the committed files: a run that stops leaves them as they were."""
    out = tmp_path / "cpu"
    for name in ("cpu.json", "cpu.md"):
        (tmp_path / name).write_text("committed")
    quick = "--quick --no-progress --sections attention --attentions '' --ops sdpa --passes fwd --lengths 128"

    def bench_into(flags: str) -> int:
        script = f"source benchmarks/common.sh && bench_into {out} {flags}"
        return subprocess.run(["bash", "-c", script], env={**os.environ, "PYTHON": sys.executable},
                              capture_output=True, text=True).returncode

    assert bench_into(quick + " --repeats 0") != 0  # stopped (here by a bad flag) before it finished
    assert (tmp_path / "cpu.json").read_text() == (tmp_path / "cpu.md").read_text() == "committed"
    assert bench_into(quick) == 0
    assert json.loads((tmp_path / "cpu.json").read_text())["records"] and "| sdpa" in (tmp_path / "cpu.md").read_text()
    assert not list(tmp_path.glob("*.partial.*"))


@pytest.mark.parametrize("flag, value, message", [
    ("--repeats", "0", "argument --repeats: must be an integer >= 1; got '0'"),
    ("--short", "0", "argument --short: a length must be at least 1; got '0'"),
    ("--long", "abc", "argument --long: 'abc' is not a length")])
def test_growth_refuses_bad_flags_by_name_before_measuring(flag, value, message, capsys):
    # were: every child process failed (IndexError, an empty layer) and the script ended in a CalledProcessError
    with pytest.raises(SystemExit):
        growth.build_parser().parse_args([flag, value, "--out", "unused"])
    assert f": error: {message}" in capsys.readouterr().err.strip().splitlines()[-1]


def test_growth_reports_the_median_of_every_timed_call(monkeypatch):
    # was: the upper of the two middle calls, so "median of 2" reported the slower call
    child = subprocess.CompletedProcess([], 0, stdout='{"64": [4.0, 1.0, 2.0, 3.0], "128": [9.0, 5.0]}\n')
    monkeypatch.setattr(growth.subprocess, "run", lambda *args, **kwargs: child)
    times_ms = growth.measure("lavo", 64, 128, 4, {})
    entry = growth.growth_record("lavo", "glibc default", times_ms, 64, 128)
    assert entry["ms"] == {64: 2.5, 128: 7.0} and entry["growth"] == 7.0 / 2.5
    assert entry["times_ms"] == {64: [4.0, 1.0, 2.0, 3.0], 128: [9.0, 5.0]}


def test_growth_times_the_repeats_asked_for_and_not_the_warm_up_call():
    times_ms = growth.measure("local", 8, 16, 2, {})  # a child process at tiny lengths; no time is asserted
    assert {length: len(times) for length, times in times_ms.items()} == {8: 2, 16: 2}


def test_the_benchmark_scripts_show_their_progress_outside_the_tables(tmp_path):
    """A script's run takes up to an hour: its bar goes to stderr, and its .md holds the tables alone."""
    for script in Path("benchmarks").glob("run_*.sh"):
        assert "--no-progress" not in script.read_text(), script
    out = tmp_path / "cpu"
    script = (f"source benchmarks/common.sh && bench_into {out} --quick --sections attention --attentions '' "
              "--ops sdpa --passes fwd --lengths 128")
    done = subprocess.run(["bash", "-c", script], env={**os.environ, "PYTHON": sys.executable},
                          capture_output=True, text=True, check=True)
    assert "bench: 100%" in done.stderr and done.stdout == (tmp_path / "cpu.md").read_text()
    assert "measurement/s" not in done.stdout


def test_ctrl_c_on_a_benchmark_script_keeps_its_tables_in_the_partial_files(tmp_path):
    """Ctrl-C reaches every process of the terminal's group: tee must not stop before the bench has printed."""
    out = tmp_path / "cpu"
    script = (f"source benchmarks/common.sh && bench_into {out} --quick --no-progress --sections attention "
              "--attentions '' --ops sdpa --passes fwd --lengths 128,4K,8K,16K,32K --max-quadratic-length 32K "
              "--repeats 50")
    # a terminal's foreground job gets Ctrl-C; a suite run in the background (`&`) ignores SIGINT, and so would its
    # children unless the handler is reset
    shell = subprocess.Popen(["bash", "-c", script], env={**os.environ, "PYTHON": sys.executable},
                             start_new_session=True, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
                             preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL))
    partial = tmp_path / "cpu.partial.json"
    deadline = time.monotonic() + 120
    while not (partial.exists() and json.loads(partial.read_text() or "{}").get("records")):
        assert time.monotonic() < deadline and shell.poll() is None, "the bench measured nothing in time"
        time.sleep(0.2)
    os.killpg(shell.pid, signal.SIGINT)  # as Ctrl-C in a terminal: the whole foreground group
    assert shell.wait(timeout=60) != 0 and not (tmp_path / "cpu.json").exists()
    assert json.loads(partial.read_text())["machine"]["interrupted"]
    assert "| sdpa" in (tmp_path / "cpu.partial.md").read_text()
