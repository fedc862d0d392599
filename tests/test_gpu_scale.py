"""experiments/gpu_scale: the plan holds the whole protocol with like-for-like models, and its driver's dry run
trains, scores and resumes end to end (a finished run is never redone, an interrupted one continues)."""
import json
import os
import re
import signal
import tarfile
import tempfile
import time
from pathlib import Path

import pytest

from lavo.model import build_model, count_parameters
from lm_corpus import write_mix_sources
from script_loader import load_script

driver = load_script("gpu_scale_run", "experiments/gpu_scale/run.py")

PLAN = driver.load_plan()
MODELS = ["lavo", "local", "softmax-rope", "softmax-sin", "abc", "longshort", "s4d", "performer", "cosformer"]
ABLATION = ["lavo-no-posbias", "lavo-no-dissection", "lavo-learned-basis", "lavo-decay", "lavo-gated", "lavo-vector"]


def test_the_plan_holds_every_run_of_the_protocol_with_equal_budgets():
    runs = driver.planned_runs(PLAN)
    assert [run.name for run in runs] == (
        [f"{model}-s{seed}" for seed in (0, 1, 2) for model in MODELS]
        + [f"{model}-s{seed}" for seed in (0, 1, 2) for model in ABLATION])
    configs = {run.name: driver.run_config(run, Path("runs")) for run in runs}
    attention = {name: (c.model["attention"], c.model.get("position")) for name, c in configs.items()}
    assert attention["softmax-rope-s0"] == ("softmax", "rope")
    assert attention["softmax-sin-s2"] == ("softmax", "sinusoidal")
    assert {a for a, _ in attention.values()} == {
        "lavo", "local", "softmax", "abc", "longshort", "s4d", "performer", "cosformer"}
    budgets = {(c.train.steps * c.train.batch_size * c.train.grad_accum * c.train.train_length, c.train.train_length,
                c.model["preset"], c.data.source, c.data.tokenizer) for c in configs.values()}
    assert budgets == {(10_240_000, 512, "small", "austen+shakespeare+python", "bpe4096")}
    assert [c.train.seed for name, c in configs.items() if name.startswith("abc-")] == [0, 1, 2]
    options = {name: c.model.get("attention_options", {}) for name, c in configs.items()}
    assert options["lavo-decay-s1"] == {"window": 64, "write": "decay"}
    assert options["lavo-vector-s0"] == {"window": 64, "memory": "vector"}
    # every model scored at 1x..16x on both held-out sets; LAVO out to 128K
    assert PLAN["eval"]["multiples"] == [1, 2, 4, 8, 16]
    assert PLAN["eval"]["sets"] == {"books": ["austen", "shakespeare"], "code": ["python"]}
    assert PLAN["long_eval"]["models"] == ["lavo"] and max(PLAN["long_eval"]["lengths"]) == 131072
    assert options["cosformer-s0"]["max_length"] >= 16 * 512  # its causal form covers the longest evaluation


def test_every_planned_model_has_the_same_parameters_within_two_percent():
    counts = {}
    for run in driver.planned_runs(PLAN):
        if run.model not in counts:
            config = driver.run_config(run, Path("runs")).model_config(vocab_size=4096)
            counts[run.model] = count_parameters(build_model(config))
    assert set(counts) == set(MODELS + ABLATION)
    assert max(counts.values()) <= 1.02 * min(counts.values()), counts
    assert 26e6 < min(counts.values())  # the small preset


@pytest.fixture
def dry(tmp_path):
    data = write_mix_sources(tmp_path / "data", repeat=60)
    out = tmp_path / "out"

    def run(*args):
        return driver.main(["--dry-run", "--data-dir", str(data), "--runs-dir", str(out / "runs"),
                            "--results-dir", str(out / "results"), *args])
    return run, out


def test_dry_run_trains_scores_and_resumes_without_redoing_anything(dry, capsys):
    run, out = dry
    archive = out / "results.tar"
    assert run("--only", "lavo-s0,local-s0", "--max-runs", "1", "--pack", str(archive)) == 0  # stops after one run
    results = out / "results"
    assert sorted(p.name for p in results.glob("*.json")) == ["lavo-s0.json"]
    with tarfile.open(archive) as tar:
        assert sorted(tar.getnames()) == ["results", "results/calls.jsonl", "results/lavo-s0.json"]
        assert tar.extractfile("results/lavo-s0.json").read() == (results / "lavo-s0.json").read_bytes()
    lavo_result = json.loads((results / "lavo-s0.json").read_text())
    assert (lavo_result["steps"], lavo_result["tokens"], lavo_result["device"]) == (4, 4 * 2 * 128, "cpu")
    assert set(lavo_result["eval"]) == set(lavo_result["long_eval"]) == {"books", "code"}
    assert list(lavo_result["eval"]["books"]) == ["128", "256"]  # 1x and 2x, as every run
    assert list(lavo_result["long_eval"]["books"]) == ["128", "256", "1024"]  # LAVO's long evaluation, apart
    assert lavo_result["long_eval"]["code"]["1024"]["tokens"] == 1024
    first = (results / "lavo-s0.json").read_bytes()
    metrics = (out / "runs" / "lavo-s0" / "metrics.jsonl").read_text()

    # a call interrupted after 3 of local's 4 steps leaves a checkpoint and no result
    assert run("--only", "lavo-s0,local-s0", "--step-limit", "3") == 0
    assert not (results / "local-s0.json").exists()
    assert (out / "runs" / "local-s0" / "state.pt").exists()
    capsys.readouterr()

    assert run("--only", "lavo-s0,local-s0") == 0
    log = capsys.readouterr().out
    assert "[train] lavo-s0" not in log and "[train] local-s0 (resuming)" in log
    assert "resumed" in log and "at step 3" in log
    assert (results / "lavo-s0.json").read_bytes() == first  # nothing of the finished run redone
    assert (out / "runs" / "lavo-s0" / "metrics.jsonl").read_text() == metrics
    local = json.loads((results / "local-s0.json").read_text())
    assert (local["steps"], local["tokens"]) == (4, lavo_result["tokens"])
    assert list(local["eval"]["code"]) == ["128", "256"] and "long_eval" not in local
    assert local["eval"]["code"]["128"]["tokens"] == lavo_result["eval"]["code"]["128"]["tokens"] == 512
    # `lavo eval --parts python` scores the same held-out code as the driver's long evaluation (one window from
    # the start)
    from lavo.cli import main as lavo
    assert lavo(["eval", str(out / "runs" / "lavo-s0"), "--parts", "python", "--lengths", "128", "--max-tokens", "1024",
                 "--device", "cpu", "--quiet", "--out", str(out / "eval")]) == 0
    scored = json.loads((out / "eval" / "results.json").read_text())
    assert scored["parts"] == ["python"]
    assert scored["results"]["lavo-s0"]["128"]["ppl"] == pytest.approx(
        lavo_result["long_eval"]["code"]["128"]["ppl"], rel=1e-5)  # other batching
    # and with --spread, the same held-out code as its main evaluation
    assert lavo(["eval", str(out / "runs" / "lavo-s0"), "--parts", "python", "--lengths", "128,256", "--max-tokens",
                 "512", "--spread", "--device", "cpu", "--quiet", "--out", str(out / "eval-spread")]) == 0
    spread = json.loads((out / "eval-spread" / "results.json").read_text())
    assert spread["spread"] and spread["results"]["lavo-s0"]["256"]["ppl"] == pytest.approx(
        lavo_result["eval"]["code"]["256"]["ppl"], rel=1e-5)
    calls = [json.loads(line) for line in (results / "calls.jsonl").read_text().splitlines()]
    assert [(c["finished"], c["stopped"]) for c in calls] == [(["lavo-s0"], None), ([], "local-s0"),
                                                              (["local-s0"], None)]
    assert calls[-1]["remaining"] == []

    assert calls[1]["step_seconds"]["local"] > 0 and calls[0]["step_seconds"] == calls[2]["step_seconds"] == {}


def test_a_run_that_cannot_finish_within_one_call_is_not_started(dry, capsys):
    """A stopped run leaves its model's seconds per step in calls.jsonl; a run whose whole training would not fit
    in a call's budget is passed over, since on a fresh machine every call would start it from step 0 again."""
    run, out = dry
    results = out / "results"
    results.mkdir(parents=True)
    calls = [{"finished": [], "stopped": "local-s1", "step_seconds": {"local": 50.0, "abc": 1.0}},
             {"finished": [], "stopped": "local-s2", "step_seconds": {"local": 90.0}}]
    (results / "calls.jsonl").write_text("".join(json.dumps(call) + "\n" for call in calls))
    assert driver.measured_step_seconds(results) == {"local": 50.0, "abc": 1.0}  # the fastest measured
    assert run("--only", "local-s0,lavo-s0", "--budget", "150") == 0
    log = capsys.readouterr().out
    # 4 steps at 50 s, plus the time kept for scoring (1.5 times lavo-s0's, which depends on the machine's load)
    too_long = re.search(r"\[too long\] local-s0: about (\d+) s, more than a call's budget of 150 s", log)
    assert too_long and int(too_long[1]) >= 200
    assert "[train] local-s0" not in log and "[train] lavo-s0" in log
    assert not (out / "runs" / "local-s0").exists() and (results / "lavo-s0.json").exists()
    lavo = json.loads((results / "lavo-s0.json").read_text())
    planned = {r.name: r for r in driver.planned_runs(PLAN, dry_run=True)}
    # a finished run of the model is a better guide than a measured rate
    assert driver.estimate_seconds(planned["lavo-s1"], [lavo], {"lavo": 1e6}) == pytest.approx(
        lavo["train_seconds_this_machine"] + lavo["eval_seconds"])
    # and a scoring of the model cut off by a call's time limit says how long scoring takes at least
    cut_off = {"lavo": 10 * lavo["eval_seconds"] + 100}
    assert driver.estimate_seconds(planned["lavo-s1"], [lavo], {}, cut_off) == pytest.approx(
        lavo["train_seconds_this_machine"] + 1.5 * cut_off["lavo"])
    assert driver.estimate_seconds(planned["abc-s0"], [lavo], {"abc": 1.0}) == pytest.approx(
        4 * 1.0 + 1.5 * lavo["eval_seconds"])

def time_limit_during(monkeypatch, name: str, calls: int = 1):
    """Make the ``calls``-th call of the driver's function ``name`` receive SIGTERM, as ``timeout`` sends it
    when a GPU call's time is up."""
    original, count = getattr(driver, name), [0]

    def ended_during(*args, **kwargs):
        count[0] += 1
        if count[0] == calls:
            os.kill(os.getpid(), signal.SIGTERM)
            time.sleep(60)  # the handler raises first
        return original(*args, **kwargs)
    monkeypatch.setattr(driver, name, ended_during)


def last_call(results: Path) -> dict:
    return json.loads((results / "calls.jsonl").read_text().splitlines()[-1])


def test_a_call_ended_by_its_time_limit_while_scoring_says_so_and_what_scoring_takes(dry, monkeypatch):
    """Killed at its limit, a call used to bring back nothing and the next one did the same again."""
    run, out = dry
    results, archive = out / "results", out / "results.tar"
    handler = signal.getsignal(signal.SIGTERM)
    time_limit_during(monkeypatch, "evaluate")
    assert run("--only", "local-s0", "--pack", str(archive)) == 130
    assert signal.getsignal(signal.SIGTERM) == handler  # restored
    call = last_call(results)
    assert call["ended"]["run"] == "local-s0" and call["ended"]["phase"] == "scoring"
    assert call["step_seconds"]["local"] > 0 and call["scoring_cut_off"] == {"local": call["ended"]["seconds"]}
    with tarfile.open(archive) as tar:
        assert json.loads(tar.extractfile("results/calls.jsonl").read().splitlines()[-1]) == call
    # a later call keeps one and a half times that for scoring, at least
    planned = {r.name: r for r in driver.planned_runs(PLAN, dry_run=True)}
    (results / "calls.jsonl").write_text(json.dumps({"scoring_cut_off": {"local": 100.0}}) + "\n")
    assert driver.estimate_eval_seconds(planned["local-s1"], [], driver.scoring_cut_off(results)) == 150.0


def test_a_call_ended_by_its_time_limit_while_training_leaves_its_pace(dry, monkeypatch):
    import torch
    from lavo.train import Trainer
    run, out = dry
    train_step, count = Trainer.train_step, [0]

    def ended_during_step_2(self, lr):
        count[0] += 1
        if count[0] == 2:
            os.kill(os.getpid(), signal.SIGTERM)  # training's own handler: this step ends, then a checkpoint
        return train_step(self, lr)
    monkeypatch.setattr(Trainer, "train_step", ended_during_step_2)
    assert run("--only", "local-s0") == 130
    call = last_call(out / "results")
    assert call["ended"]["run"] == "local-s0" and call["ended"]["phase"] == "training"
    assert call["step_seconds"]["local"] > 0 and "scoring_cut_off" not in call
    assert torch.load(out / "runs" / "local-s0" / "state.pt", weights_only=True)["step"] == 2


def test_a_long_evaluation_cut_off_by_the_time_limit_keeps_the_runs_scores(dry, monkeypatch, capsys):
    run, out = dry
    results = out / "results"
    time_limit_during(monkeypatch, "evaluate", calls=2)  # lavo's long evaluation, after its main one
    assert run("--only", "lavo-s0") == 130
    record = json.loads((results / "lavo-s0.json").read_text())
    assert set(record["eval"]) == {"books", "code"}
    assert record["long_eval"] == {"failed": "not finished: the call's time limit ended it"}
    call = last_call(results)
    assert call["ended"]["phase"] == "long evaluation" and "scoring_cut_off" not in call  # its scores are saved
    assert call["long_eval_cut_off"] == {"lavo": call["ended"]["seconds"]}
    monkeypatch.undo()
    capsys.readouterr()
    # the next call on this machine, where the weights still are, finishes it without training again
    assert run("--only", "lavo-s0") == 0
    log = capsys.readouterr().out
    assert "[train]" not in log and "[long eval] lavo-s0: finishing the long evaluation" in log
    finished = json.loads((results / "lavo-s0.json").read_text())
    assert {k: v for k, v in finished.items() if k not in ("long_eval", "eval_seconds")} == {
        k: v for k, v in record.items() if k not in ("long_eval", "eval_seconds")}
    assert list(finished["long_eval"]["books"]) == ["128", "256", "1024"]
    assert finished["eval_seconds"] > record["eval_seconds"]
    capsys.readouterr()
    assert run("--only", "lavo-s0") == 0 and "[long eval]" not in capsys.readouterr().out  # done: left alone


def test_a_cut_off_long_evaluation_is_retried_only_where_it_fits_and_its_weights_are(dry, capsys):
    run, out = dry
    results = out / "results"
    assert run("--only", "lavo-s0") == 0
    path = results / "lavo-s0.json"
    path.write_text(json.dumps({**json.loads(path.read_text()), "long_eval": driver.LONG_EVAL_CUT_OFF}))
    with open(results / "calls.jsonl", "a") as calls:
        calls.write(json.dumps({"long_eval_cut_off": {"lavo": 300.0}}) + "\n")
    capsys.readouterr()
    assert run("--only", "lavo-s0", "--budget", "420") == 0
    assert "[too long] lavo-s0's long evaluation: about 450 s, more than a call's budget of 420 s" in (
        capsys.readouterr().out)
    assert run("--only", "lavo-s0", "--budget", "440", "--call-budget", "900") == 0
    assert "[wait] lavo-s0's long evaluation: about 450 s" in capsys.readouterr().out
    (out / "runs" / "lavo-s0" / "model.safetensors").unlink()  # another machine: the weights stayed behind
    assert run("--only", "lavo-s0", "--budget", "900") == 0
    assert "long evaluation" not in capsys.readouterr().out
    assert json.loads(path.read_text())["long_eval"] == driver.LONG_EVAL_CUT_OFF


def test_a_run_whose_scoring_cannot_fit_in_a_call_is_passed_over_not_waited_for(dry, capsys):
    run, out = dry
    results = out / "results"
    results.mkdir(parents=True)
    (results / "calls.jsonl").write_text(json.dumps({"scoring_cut_off": {"lavo": 1000.0}}) + "\n")
    assert run("--only", "lavo-s0,local-s0", "--budget", "420") == 0
    log = capsys.readouterr().out
    assert ("[too long] lavo-s0: its scoring needs about 1500 s (it was cut off before), more than a call's budget "
            "of 420 s") in log
    assert "[train] local-s0" in log and (results / "local-s0.json").exists()  # the runs after it still run


def test_a_trained_run_without_its_summary_is_scored_with_the_right_one(dry, monkeypatch):
    """A call killed between a run's last checkpoint and its summary record: the next one writes the summary,
    then scores, instead of taking an earlier chunk's summary (or none)."""
    run, out = dry
    original = driver.evaluate

    def fails(*args, **kwargs):
        raise RuntimeError("CUDA out of memory")
    monkeypatch.setattr(driver, "evaluate", fails)
    assert run("--only", "local-s0") == 0  # trained, then failed while scoring
    metrics = out / "runs" / "local-s0" / "metrics.jsonl"
    lines = metrics.read_text().splitlines()
    metrics.write_text("".join(line + "\n" for line in lines if '"final": true' not in line or '"step": 4' not in line))
    monkeypatch.setattr(driver, "evaluate", original)
    assert run("--only", "local-s0") == 0
    record = json.loads((out / "results" / "local-s0.json").read_text())
    assert (record["steps"], record["tokens"]) == (4, 4 * 2 * 128)


def test_a_run_that_fails_is_recorded_and_cannot_hold_up_the_others(dry, capsys, monkeypatch):
    run, out = dry
    train_and_score = driver.train_and_score

    def out_of_memory(planned, *args):
        if planned.name == "lavo-s0":
            raise RuntimeError("CUDA out of memory")
        return train_and_score(planned, *args)

    monkeypatch.setattr(driver, "train_and_score", out_of_memory)
    assert run("--only", "lavo-s0,local-s0") == 0
    log = capsys.readouterr().out
    assert "[failed] lavo-s0:" in log and "RuntimeError: CUDA out of memory" in log
    results = out / "results"
    assert sorted(p.name for p in results.glob("*.json")) == ["local-s0.json"]
    call = json.loads((results / "calls.jsonl").read_text().splitlines()[-1])
    assert call["failed"] == {"lavo-s0": "RuntimeError: CUDA out of memory"} and call["finished"] == ["local-s0"]
    # the next call takes the run that failed last: another run goes first
    assert run("--only", "lavo-s0,local-s1", "--max-runs", "1") == 0
    log = capsys.readouterr().out
    assert "[train] local-s1" in log and "[train] lavo-s0" not in log


def test_dry_run_of_an_unknown_run_is_refused(dry):
    run, _ = dry
    with pytest.raises(SystemExit):
        run("--only", "lavo-s9")


def test_report_tables_give_mean_and_spread_over_seeds():
    report = load_script("gpu_scale_report", "experiments/gpu_scale/report.py")

    def result(model, seed, short, long):
        return {"model": model, "seed": seed, "eval": {"books": {"512": {"ppl": short}, "8192": {"ppl": long}}}}
    results = {"lavo-s0": result("lavo", 0, 10.0, 10.0), "lavo-s1": result("lavo", 1, 12.0, 13.2),
               "local-s0": result("local", 0, 9.0, 9.9)}
    table = report.ppl_table(PLAN, results, ["lavo", "local", "abc"], "books", [512, 8192]).splitlines()
    assert table[0] == "| model | 512 (1x) | 8,192 (16x) | 16x / 1x |"
    assert table[2] == "| lavo | 11.00 ± 1.41 (2) | 11.60 ± 2.26 (2) | 1.05 ± 0.07 (2) |"  # the ratio's spread too
    assert table[3] == "| local | 9.00 (1) | 9.90 (1) | 1.10 (1) |"
    assert table[4] == "| abc | not run | not run | not run |"
    scale = {line.split("|")[1].strip(): line.split("|")[2].strip()
             for line in report.scale_table(PLAN, results).splitlines()[2:] if line.startswith("| ")}
    assert scale["lavo"] == "1.05 ± 0.07 (2)" and scale["abc"] == "not run"
    # the ablation beside its CPU-scale point: every variant was trained at CPU scale (ablation, memory_lm)
    ablation = [line.split("|") for line in report.ablation_table(PLAN, results).splitlines()[2:]
                if line.startswith("| ")]
    assert [row[1].strip() for row in ablation] == ["lavo", *ABLATION, "local"]
    assert all(row[-3].strip() != "—" and row[-2].strip() != "—" for row in ablation), ablation
    assert [row[-3].strip() for row in ablation if row[1].strip() == "lavo"] == ["232.01"]


def test_dry_run_trains_and_scores_every_planned_model(dry):
    run, out = dry
    first_seed = [r.name for r in driver.planned_runs(PLAN) if r.seed == 0]
    assert run("--only", ",".join(first_seed)) == 0
    results = driver.finished_results(out / "results")
    assert sorted(results) == sorted(first_seed)
    for name, result in results.items():
        for part, scores in result["eval"].items():
            # finite, and near the 300 of a uniform guess over bpe300 after a few steps
            assert all(0 < score["ppl"] < 2 * 300 for score in scores.values()), (name, part)


@pytest.mark.slow
def test_the_real_corpus_holds_enough_held_out_books_and_code_for_128k(tmp_path):
    """The plan's corpus, prepared for real (downloads Austen and Shakespeare): each held-out set has the tokens
    the longest evaluation scores."""
    from lavo.data import prepare, split_tokens
    data = PLAN["base"]["data"]
    prepared = prepare(data["source"], data["tokenizer"], tmp_path, log=lambda *a: None)
    for parts in PLAN["eval"]["sets"].values():
        tokens = split_tokens(data["source"], tmp_path, None, "valid", prepared.tokenizer, parts)
        assert len(tokens) > PLAN["long_eval"]["max_tokens"] >= max(PLAN["long_eval"]["lengths"])


def test_workers_share_the_plan_and_train_each_run_once(dry, capfd):
    """--workers 2: two processes of the driver take runs in turn (each run's lock is the claim), each run is
    trained and scored once, every result comes back in the pack, and both workers log the same call."""
    run, out = dry
    names = ["lavo-s0", "local-s0", "softmax-rope-s0"]
    archive = out / "results.tar"
    assert run("--only", ",".join(names), "--workers", "2", "--pack", str(archive)) == 0
    log = capfd.readouterr().out
    assert sorted(re.findall(r"\[worker [12]/2\] \[train\] (\S+)", log)) == sorted(names)  # once each
    results = out / "results"
    assert sorted(driver.finished_results(results)) == sorted(names)
    with tarfile.open(archive) as tar:
        packed = sorted(tar.getnames())
    assert packed == ["results", "results/calls.jsonl", *(f"results/{name}.json" for name in sorted(names))]
    calls = [json.loads(line) for line in (results / "calls.jsonl").read_text().splitlines()]
    parent, workers = calls[-1], calls[:-1]  # the call's own line comes last, with its whole wall time
    assert sorted(c["worker"] for c in workers) == ["1/2", "2/2"] and {c["call"] for c in calls} == {parent["call"]}
    assert parent["workers"] == 2 and "probe" not in parent and parent["wall_s"] >= max(c["wall_s"] for c in workers)
    assert sorted(n for c in workers for n in c["finished"]) == sorted(names)
    assert not list((out / "runs").glob("*/.lock"))  # every claim released
    capfd.readouterr()
    assert run("--only", ",".join(names), "--workers", "2") == 0  # nothing left to do
    assert "[train]" not in capfd.readouterr().out


def test_workers_auto_probes_once_and_keeps_its_choice(dry, capfd, monkeypatch):
    run, out = dry
    monkeypatch.setattr(driver, "MAX_PROBED_WORKERS", 2)
    assert run("--only", "lavo-s0,local-s0", "--max-runs", "1", "--workers", "auto", "--probe-seconds", "2") == 0
    log = capfd.readouterr().out
    calls = [json.loads(line) for line in (out / "results" / "calls.jsonl").read_text().splitlines()]
    probe = calls[-1]["probe"]
    assert probe["run"] == "lavo-s0" and set(probe["tokens_per_s"]) == {"1", "2"}
    assert all(value > 0 for value in probe["tokens_per_s"].values())
    throughput = {int(n): value for n, value in probe["tokens_per_s"].items()}
    assert calls[-1]["workers"] == driver.choose_workers(throughput, 4 * 2 * 128, 60.0, driver.DEFAULT_BUDGET)
    assert "[probe] 1 at once:" in log and "[probe] 2 at once:" in log
    assert not list(Path(tempfile.gettempdir()).glob("lavo-probe-*"))  # the probe's scratch runs are gone
    assert run("--only", "lavo-s0,local-s0", "--workers", "auto") == 0
    assert "[probe]" not in capfd.readouterr().out  # the choice is kept in calls.jsonl
    assert sorted(driver.finished_results(out / "results")) == ["lavo-s0", "local-s0"]


def test_the_number_of_workers_is_what_raises_throughput_and_still_fits_a_call():
    choose = driver.choose_workers
    assert choose({1: 100.0, 2: 180.0, 3: 190.0}, 10_000, 20.0, 420.0) == 2  # 3: less than 10% more than 2
    assert choose({1: 100.0, 2: 105.0, 3: 300.0}, 10_000, 20.0, 420.0) == 3
    # alone a run takes 10,000 / 100 + 20 = 120 s; two at once slow each by 2 * 100 / 180
    assert choose({1: 100.0, 2: 180.0}, 10_000, 20.0, 134.0) == 2
    assert choose({1: 100.0, 2: 180.0}, 10_000, 20.0, 133.0) == 1
    assert choose({}, 10_000, 20.0, 420.0) == 1  # a failed probe


def test_a_failed_probe_ends_its_other_workers_at_once():
    """A probe worker that fails ends the probe, and the others, which would only wait for phases that never
    come, are ended then and there (they were waited for 30 s each: a minute of a call's budget)."""
    import sys
    worker = ("import sys, time\n"
              "if sys.argv[sys.argv.index('--probe-worker') + 1].startswith('1/'):\n"
              "    sys.exit(3)\n"
              "time.sleep(120)\n")
    lines = []
    started = time.monotonic()
    assert driver.probe_throughput([sys.executable, "-c", worker], 3, 1.0, 100, lines.append, timeout=60) == {}
    assert time.monotonic() - started < 20
    assert lines == ["[probe] a probe worker exited with status 3 while building and warming up"]


def test_the_probe_leaves_the_call_most_of_its_budget_and_the_dry_run_its_data_made(dry, monkeypatch):
    """The probe's warm-up may take a quarter of the call's budget (it took 300 s whatever the budget: all of
    a short call, with nothing trained); and a dry run makes its tokenizer and caches before it starts the
    probe's workers, which would otherwise all make them at once."""
    run, out = dry
    asked = []

    def probe(command, count, seconds, tokens, log, timeout):
        data = Path(command[command.index("--data-dir") + 1])
        asked.append((timeout, sorted(path.name for path in data.glob("austen+shakespeare+python/*/train.bin"))))
        return {}
    monkeypatch.setattr(driver, "probe_throughput", probe)
    assert run("--only", "lavo-s0", "--max-runs", "1", "--workers", "auto", "--budget", "200") == 0
    assert asked == [(50.0, ["train.bin"])]
    assert sorted(driver.finished_results(out / "results")) == ["lavo-s0"]


def test_a_run_another_process_trains_is_passed_over(dry, capsys):
    from lavo.run import RunLock
    run, out = dry
    held = out / "runs" / "lavo-s0"
    held.mkdir(parents=True)
    with RunLock(held):  # as another process would: a second open of the lock file cannot take it
        assert run("--only", "lavo-s0,local-s0") == 0
    log = capsys.readouterr().out
    assert "[busy] lavo-s0: another worker is training it" in log and "[train] lavo-s0" not in log
    assert sorted(driver.finished_results(out / "results")) == ["local-s0"]


def test_gpu_utilization_is_the_mean_of_its_samples():
    import sys
    import time
    with driver.GpuUtilization(interval=0.05, command=[sys.executable, "-c", "print(' 40')"]) as sampled:
        time.sleep(1.0)
    assert sampled.samples and set(sampled.samples) == {40.0} and sampled.mean() == 40.0
    with driver.GpuUtilization(command=["no-such-nvidia-smi"]) as absent:
        pass
    assert absent.mean() is None


def test_spend_counts_the_workers_of_one_call_once(tmp_path):
    report = load_script("gpu_scale_report", "experiments/gpu_scale/report.py")
    calls = [{"call": "c1", "started": "a", "wall_s": 300.0, "gpu_utilization": 80.0, "ended": {"phase": "x"}},
             {"call": "c1", "started": "b", "wall_s": 360.0, "gpu_utilization": 90.0, "ended": {"phase": "y"}},
             {"started": "d", "wall_s": 60.0}]
    (tmp_path / "calls.jsonl").write_text("".join(json.dumps(call) + "\n" for call in calls))
    rows = dict(line.strip("|").split("|")[:2] for line in report.spend_table(tmp_path, {}).splitlines()[2:])
    rows = {key.strip(): value.strip() for key, value in rows.items()}
    assert rows["GPU calls"] == "2" and rows["GPU minutes (the calls' wall time)"] == "7.0"  # (360 + 60) / 60
    assert rows["calls ended by their time limit"] == "1"
    assert rows["GPU utilisation, mean over the calls (nvidia-smi)"] == "85%"


def test_results_made_with_other_settings_are_not_reused(dry, capsys):
    """A results file records the digest of its run's settings, corpus and scoring: one from another plan (here:
    its digest changed, as a changed plan would) is trained and scored again, and listed as stale meanwhile."""
    run, out = dry
    assert run("--only", "local-s0") == 0
    path = out / "results" / "local-s0.json"
    record = json.loads(path.read_text())
    planned = {r.name: r for r in driver.planned_runs(PLAN, dry_run=True)}
    assert record["digest"] == planned["local-s0"].digest
    path.write_text(json.dumps(dict(record, digest="another plan")))
    capsys.readouterr()
    assert run("--only", "local-s0", "--list") == 0
    assert "stale: made with other settings" in capsys.readouterr().out
    assert run("--only", "local-s0") == 0
    assert "[stale] local-s0: its results were made with other settings; training it again" in capsys.readouterr().out
    assert json.loads(path.read_text())["digest"] == planned["local-s0"].digest
    other = driver.planned_runs({**PLAN, "eval": {**PLAN["eval"], "sets": {"books": ["austen"]}}}, dry_run=True)
    assert {r.name: r.digest for r in other}["local-s0"] != planned["local-s0"].digest  # scoring is in it


def test_the_report_says_what_became_of_every_planned_run(tmp_path):
    report = load_script("gpu_scale_report", "experiments/gpu_scale/report.py")
    planned = {r.name: r for r in driver.planned_runs(PLAN)}
    (tmp_path / "lavo-s0.json").write_text(json.dumps({"digest": planned["lavo-s0"].digest}))
    (tmp_path / "local-s0.json").write_text(json.dumps({"digest": "another plan"}))
    (tmp_path / "lavo-s1.json").write_text(json.dumps({"digest": planned["lavo-s1"].digest,
                                                       "long_eval": driver.LONG_EVAL_CUT_OFF}))
    (tmp_path / "local-s1.json").write_text(json.dumps({"digest": planned["local-s1"].digest}))  # failed, then done
    failed = {"abc-s0": "OutOfMemoryError: CUDA", "local-s1": "OutOfMemoryError: CUDA"}
    (tmp_path / "calls.jsonl").write_text(json.dumps({"started": "a", "wall_s": 1.0, "failed": failed}) + "\n")
    results = driver.current_results(tmp_path, list(planned.values()))
    assert sorted(results) == ["lavo-s0", "lavo-s1", "local-s1"]
    rows = {line.split("|")[1].strip(): line.split("|")[2:4]
            for line in report.status_table(PLAN, tmp_path, results).splitlines()[2:]}
    assert [cell.strip() for cell in rows["scored"]] == ["2", "lavo-s0, local-s1"]
    assert [cell.strip() for cell in rows["scored, but not its long evaluation"]] == [
        "1", "lavo-s1 (not finished: the call's time limit ended it)"]
    assert [cell.strip() for cell in rows["failed"]] == ["1", "abc-s0 (OutOfMemoryError: CUDA)"]
    assert [cell.strip() for cell in rows["recorded with other settings (to redo)"]] == ["1", "local-s0"]
    assert rows["not run yet"][0].strip() == str(len(planned) - 5)


def test_a_call_with_run_device_shs_defaults_ends_within_eight_minutes():
    """BUDGET_S 420 with LIMIT_S = BUDGET_S + 120 and SIGKILL 30 s later needed a device limit of 580 s: a call that
    overran was killed by the 8-minute device limit first, before run.py could record what it was doing."""
    script = (Path(__file__).parents[1] / "experiments/gpu_scale/run_device.sh").read_text()
    budget = int(re.search(r"budget=\$\{BUDGET_S:-(\d+)\}", script)[1])
    slack = int(re.search(r"\$\{LIMIT_S:-\$\(\(budget \+ (\d+)\)\)\}", script)[1])
    kill_after = int(re.search(r"timeout -s TERM -k (\d+)", script)[1])
    assert budget == driver.DEFAULT_BUDGET
    assert slack >= 30  # run.py's start-up and some overrun of a scoring's estimate before SIGTERM
    assert budget + slack + kill_after + 10 <= 8 * 60  # 10 s: nvidia-smi and torch's import before the timeout


def test_one_gpu_session_gives_the_scale_experiment_what_the_check_leaves(tmp_path):
    """scripts/gpu_session.sh: the check, then run_device.sh with the seconds left of CALL_S, in one device call
    (a machine idle between two calls may be handed back). python3 and nvidia-smi are stand-ins here that log
    their arguments; the check takes 3 s and fails, which must not keep the scale experiment from its turn."""
    import subprocess
    root = Path(__file__).parents[1]
    bin_dir, log = tmp_path / "bin", tmp_path / "calls.log"
    bin_dir.mkdir()
    (bin_dir / "python3").write_text('#!/bin/sh\necho "$*" >> "$CALLS"\n'
                                     'case "$*" in *gpu_check.py*) sleep 3; exit 1;; esac\n')
    (bin_dir / "nvidia-smi").write_text("#!/bin/sh\necho 'a GPU'\n")
    for path in bin_dir.iterdir():
        path.chmod(0o755)
    env = {k: v for k, v in os.environ.items() if k != "PYTHON"} | {
        "PATH": f"{bin_dir}:{os.environ['PATH']}", "CALLS": str(log)}

    def session(call_s: int) -> str:
        log.unlink(missing_ok=True)
        done = subprocess.run(["bash", str(root / "scripts/gpu_session.sh"), str(tmp_path / "out"), "--only", "x"],
                              env=env | {"CALL_S": str(call_s)}, capture_output=True, text=True, check=True)
        return done.stdout
    out = session(200)
    check, version, scale = log.read_text().splitlines()
    assert check.startswith(f"benchmarks/gpu_check.py {tmp_path / 'out' / 'check'}")  # --wheels .whl where it is
    budget = int(re.search(r"--budget (\d+) ", scale)[1])
    assert 200 - 90 - 5 <= budget <= 200 - 90 - 3  # the check's 3 s, and run_device.sh's 90 s of limits and margin
    assert scale.endswith(f"--pack {tmp_path / 'out' / 'scale' / 'results.tar'} --only x")
    assert "gpu_check.sh exited with status 1" in out and f"the scale experiment gets {budget} s" in out
    out = session(140)
    assert len(log.read_text().splitlines()) == 1 and "would be left for the scale experiment: not started" in out
