"""Training curves read from metrics.jsonl: smoothing, where validation points fall, damaged records."""
import json
import math

import pytest

from lavo.cli import main
from lavo.curves import plot_curves, read_curves, show_curves
from lavo.run import RunError


def write_metrics(run_dir, records, tail=""):
    run_dir.mkdir(parents=True, exist_ok=True)
    (run_dir / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in records) + tail)
    return run_dir


def step(n, loss, tokens_per_step=10, seconds_per_step=0.5):
    return {"step": n, "loss": loss, "lr": 1e-3, "tokens": n * tokens_per_step, "elapsed": n * seconds_per_step}


def test_the_training_loss_is_a_start_corrected_exponential_average(tmp_path):
    losses = [4.0, 2.0, 3.0, float("nan"), 1.0]
    curves = read_curves(write_metrics(tmp_path / "r", [step(i + 1, x) for i, x in enumerate(losses)]))
    points = curves.train_points("step", smoothing=0.5)
    finite = [(i + 1, x) for i, x in enumerate(losses) if math.isfinite(x)]
    # each point: the mean of the finite losses so far, the k-th last weighted 0.5^k
    expected = []
    for n in range(1, len(finite) + 1):
        weights = [0.5 ** (n - 1 - i) for i in range(n)]
        expected.append((finite[n - 1][0], sum(w * x for w, (_, x) in zip(weights, finite)) / sum(weights)))
    assert [x for x, _ in points] == [x for x, _ in expected]
    assert [y for _, y in points] == pytest.approx([y for _, y in expected])
    assert curves.train_points("tokens", smoothing=0) == [(10 * s, x) for s, x in finite]


def test_validation_points_take_the_tokens_and_time_of_their_step(tmp_path):
    # logged every 10 steps, validated every 15: step 15 falls between logged steps 10 and 20
    records = [step(10, 5.0), {"step": 10, "valid_loss": 4.9, "valid_ppl": math.exp(4.9)},
               {"step": 15, "valid_loss": 4.5}, {**step(20, 4.0), "elapsed": 30.0}, {"step": 30, "valid_loss": 4.4}]
    curves = read_curves(write_metrics(tmp_path / "r", records))
    assert curves.valid_points("tokens") == [(100.0, 4.9), (150.0, 4.5)]  # step 30 is past the last logged step
    assert curves.valid_points("time") == [(5.0, 4.9), (17.5, 4.5)]
    records.insert(0, {"step": 5, "valid_loss": 5.5})  # before the first logged step: from 0 tokens at step 0
    assert read_curves(write_metrics(tmp_path / "r", records)).valid_points("step") == [(5.0, 5.5), (10.0, 4.9),
                                                                                         (15.0, 4.5)]


def test_summary_records_are_left_out_and_the_table_names_each_runs_last_and_best(tmp_path, capsys):
    first = write_metrics(tmp_path / "a" / "run", [
        {"step": 1, "valid_loss": float("nan")}, step(1, 4.0), {"step": 1, "valid_loss": 3.0}, step(2, 2.0),
        {"step": 2, "valid_loss": 3.5},
        {"final": True, "step": 2, "loss": 2.0, "tokens": 20, "elapsed": 1.0}])
    second = write_metrics(tmp_path / "b" / "run", [step(1, 6.0)])
    curves = show_curves([first, second], smoothing=0)
    assert [c.name for c in curves] == [str(first), str(second)]  # one folder name: the paths tell them apart
    assert [r["step"] for r in curves[0].steps] == [1, 2]
    rows = capsys.readouterr().out.splitlines()[2:]
    assert rows[0].split() == [str(first), "2", "20", "1", "2.000", "3.500", f"{math.exp(3.5):.2f}", "3.000", "(1)"]
    assert rows[1].split() == [str(second), "1", "10", "0", "6.000", "—", "—", "—"]


def test_a_call_stopped_between_logged_steps_ends_at_its_last_step(tmp_path):
    """A time limit or an interruption stops a call between logged steps: its summary carries the last one."""
    final = {"final": True, "step": 23, "loss": 2.5, "tokens": 230, "elapsed": 11.5}
    records = [step(10, 4.0), step(20, 3.0), final, {"step": 23, "valid_loss": float("nan")},
               {"step": 10, "valid_loss": 3.9}]
    curves = read_curves(write_metrics(tmp_path / "r", records))
    assert [r["step"] for r in curves.steps] == [10, 20, 23]
    assert curves.valid_points("tokens")[-1] == (100.0, 3.9)
    only_final = read_curves(write_metrics(tmp_path / "s", [final]))
    assert only_final.train_points("time", smoothing=0) == [(11.5, 2.5)]


def test_runs_are_named_by_folder_and_told_apart(tmp_path, monkeypatch):
    from lavo.curves import run_names
    monkeypatch.chdir(tmp_path)
    assert run_names([".", "a/run", "b/run", "c/x", "c/x"]) == [tmp_path.name, "a/run", "b/run", "c/x #1", "c/x #2"]


def test_damaged_and_missing_records_are_named(tmp_path):
    with pytest.raises(RunError, match=r"has no metrics.jsonl: give the train.out_dir of a run `lavo train` made"):
        read_curves(tmp_path)
    half_written = write_metrics(tmp_path / "r", [step(1, 4.0)], tail='{"step": 2, "lo')
    assert [r["step"] for r in read_curves(half_written).steps] == [1]
    write_metrics(tmp_path / "r", [step(1, 4.0)], tail='{"step": 2, "lo\n' + json.dumps(step(3, 3.0)) + "\n")
    with pytest.raises(RunError, match=r"metrics.jsonl, line 2, is not a JSON record: the file is damaged"):
        read_curves(tmp_path / "r")
    write_metrics(tmp_path / "r", [{"step": 0, "valid_loss": 5.0}])
    with pytest.raises(RunError, match=r"metrics.jsonl holds no training step yet"):
        read_curves(tmp_path / "r")
    with pytest.raises(ValueError, match=r"curves.smoothing must be a number in \[0, 1\); got 1.0"):
        show_curves([half_written], smoothing=1.0)


def test_the_plot_is_written_and_the_command_reports_bad_input(tmp_path, capsys):
    run = write_metrics(tmp_path / "run", [step(n, 5.0 - n / 10) for n in range(1, 30)]
                        + [{"step": 29, "valid_loss": 2.5}])
    assert plot_curves([read_curves(run)], tmp_path / "plot" / "curves.png", axis="time").stat().st_size > 0
    assert main(["curves", str(run), "--out", str(tmp_path / "out"), "--x", "step"]) == 0
    assert (tmp_path / "out" / "curves.png").is_file()
    assert "wrote" in capsys.readouterr().out
    assert main(["curves", str(tmp_path / "nothing")]) == 2
    assert capsys.readouterr().err.startswith(f"lavo curves: error: {tmp_path / 'nothing'} has no metrics.jsonl")
