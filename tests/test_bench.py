"""The efficiency benchmark harness (``python -m lavo.bench``): output formats, helpers, FLOP formula. No timing
is asserted."""
import dataclasses
import json

import pytest
import torch
from torch.utils.flop_counter import FlopCounterMode

from lavo import bench
from lavo.cache import LavoCache
from lavo.ops import lavo_attention, orthogonal_basis
from lavo.registry import available_attentions, build_attention

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
    assert bench.main(["--quick", "--no-progress", "--threads", "1", "--json", str(out),
                       "--plots", str(tmp_path / "plots")]) == 0
    text = capsys.readouterr().out
    for heading in ("## Attention, fwd:", "## Attention, fwd+bwd:", "## Decoding", "## Model", "## LAVO op FLOP"):
        assert heading in text

    payload = json.loads(out.read_text())
    assert {"torch", "threads", "cpu"} <= set(payload["machine"])
    assert payload["machine"]["torch"] == torch.__version__
    records = payload["records"]
    assert records and all(RECORD_FIELDS <= set(r) for r in records)
    assert {r["section"] for r in records} == set(bench.SECTIONS)
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
    assert {r["mechanism"] for r in decode} == {"lavo", "softmax", "local"}
    assert all(r["cache_bytes"] > 0 and r["ms"] > 0 for r in decode)
    model = [r for r in records if r["section"] == "model"]
    assert "softmax+rope" in {r["mechanism"] for r in model}
    assert all(r["tokens_per_s"] > 0 for r in model)
    flops = [r for r in records if r["section"] == "flops" and r["mechanism"] != "matmul"]
    assert flops and all(r["gflop"] > 0 and r["gflops_per_s"] > 0 and r["ratio"] > 0 for r in flops)

    plots = {p.name for p in (tmp_path / "plots").iterdir()}
    assert {"time_fwd.png", "time_fwd_bwd.png", "memory_fwd.png", "memory_fwd_bwd.png", "decode_step.png",
            "decode_cache.png", "model_tokens_per_s.png"} <= plots
    assert all((tmp_path / "plots" / name).stat().st_size > 0 for name in plots)


def test_help_documents_every_section(capsys):
    with pytest.raises(SystemExit) as exit_info:
        bench.main(["--help"])
    assert exit_info.value.code == 0
    text = capsys.readouterr().out
    for option in ("--sections", "--quick", "--max-quadratic-length", "--dtype", "--repeats", "--time-limit",
                   "--json", "--plots", "--decode-lengths", "--model-preset", "--matmul-size"):
        assert option in text


def test_unknown_mechanism_is_an_error():
    with pytest.raises(SystemExit, match="unknown"):
        bench.main(["--quick", "--attentions", "nope"])


def test_slow_and_failing_measurements_are_skipped_with_a_note(capsys, tmp_path):
    out = tmp_path / "bench.json"
    bench.main(["--quick", "--no-progress", "--sections", "attention", "--attentions", "local", "--ops", "sdpa",
                "--passes", "fwd", "--time-limit", "0", "--json", str(out)])
    records = json.loads(out.read_text())["records"]
    assert [r["status"] for r in records] == ["skipped"] * len(records)
    assert "--time-limit" in records[0]["note"] and "skipped" in records[-1]["note"]
    bench.main(["--quick", "--no-progress", "--sections", "attention", "--attentions", "local", "--ops", "sdpa",
                "--passes", "fwd", "--attention-options", '{"local": {"window": -1}}', "--json", str(out)])
    local = [r for r in json.loads(out.read_text())["records"] if r["mechanism"] == "local"]
    assert local[0]["status"] == "failed" and "window" in local[0]["note"]
    assert local[1]["status"] == "skipped"
    assert "[1]" in capsys.readouterr().out


@dataclasses.dataclass
class _State:
    a: torch.Tensor
    parts: tuple
    extra: dict
    position: int


def test_tensor_nbytes_on_a_known_structure():
    shared = torch.zeros(3, 4)  # 48 bytes, referenced twice: stored once
    state = _State(a=torch.zeros(2, 5, dtype=torch.float64),  # 80
                   parts=(shared, [torch.zeros(7, dtype=torch.bool), shared], None),  # 48 + 7
                   extra={"h": torch.zeros(2, dtype=torch.complex64), "name": "x"},  # 16
                   position=12)
    assert bench.tensor_nbytes(state) == 80 + 48 + 7 + 16
    assert bench.tensor_nbytes([state, {"n": 3}]) == 151
    assert bench.tensor_nbytes(None) == 0


def test_tensor_nbytes_matches_lavo_cache_nbytes():
    layer = build_attention("lavo", 32, 2, window=8, rank=8)
    with torch.no_grad():
        _, cache = layer(torch.randn(2, 21, 32))
    assert isinstance(cache, LavoCache)
    assert bench.tensor_nbytes(cache) == cache.nbytes()


def test_softmax_prefill_past_the_quadratic_limit_builds_the_same_cache():
    settings = bench.settings_from_args(bench.build_parser().parse_args(["--quick", "--max-quadratic-length", "8"]))
    for rotary in (False, True):
        layer = build_attention("softmax", 32, 2, rotary=rotary)
        x = torch.randn(1, 20, 32)
        direct, ran = bench.prefill(layer, x, settings)
        assert not ran
        with torch.no_grad():
            _, full = layer(x)
        assert direct.position == full.position == 20
        for name in ("keys", "values", "key_mask"):
            torch.testing.assert_close(getattr(direct, name), getattr(full, name))


def test_lavo_flops_small_case_by_hand():
    # T=8, w=4, D=2, r=2, one head: two blocks of 4 queries against K=8 keys.
    # forward: local 2 blocks * (QK^T 4*8*2 + PV 4*8*2 multiply-adds) * 2 = 512;
    # memory: query projection and read 2 * (8*2*2) * 2 = 128, window sums 2 windows * 2*2 * 2 = 16
    forward = bench.lavo_flops(1, 8, 1, 2, 2, 4)
    assert forward == {"local": 512, "memory": 144, "total": 656}
    # backward: 4 gradient matmuls = 4 * 256 = 1024 more (weights kept); memory: 3 * 64 + 16
    both = bench.lavo_flops(1, 8, 1, 2, 2, 4, backward=True)
    assert both == {"local": 512 + 1024, "memory": 144 + 3 * 64 + 16, "total": 1888}


@pytest.mark.parametrize("recompute", [False, True])
@pytest.mark.parametrize("B,T,H,D,r,w,causal,basis_grad", [
    (1, 8, 1, 2, 2, 4, True, False),
    (2, 11, 3, 8, 4, 4, True, False),  # padded: T is not a multiple of w
    (1, 16, 2, 8, 8, 4, False, False),
    (1, 12, 2, 6, 3, 4, True, True),
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
    assert bench.lavo_flops(B, T, H, D, r, w, causal=causal)["total"] == forward
    assert bench.lavo_flops(B, T, H, D, r, w, causal=causal, backward=True,
                            basis_grad=basis_grad)["total"] == forward + backward


def test_peak_memory_reports_none_without_proc(monkeypatch):
    real_open = open

    def no_clear_refs(path, *args, **kwargs):
        if str(path) == "/proc/self/clear_refs":
            raise PermissionError(path)
        return real_open(path, *args, **kwargs)

    monkeypatch.setattr("builtins.open", no_clear_refs)
    with bench.PeakMemory(torch.device("cpu")) as peak:
        torch.zeros(1000)
    assert peak.mib is None


def test_peak_memory_sees_a_large_allocation():
    with bench.PeakMemory(torch.device("cpu")) as peak:
        x = torch.ones(64, 2 ** 20 // 4)  # 64 MiB, touched
        del x
    if peak.mib is None:
        pytest.skip("/proc/self/clear_refs is not writable here")
    assert peak.mib >= 60
