"""Faults during training: Ctrl-C, kill -9 (mid-training and mid-checkpoint), a second trainer, a full disk,
damaged or mismatched run files. After each, ``--resume`` must end exactly like an uninterrupted run: the same
weights bit for bit and the same per-step losses.

The interrupted trainings are real processes (``python -m lavo.cli train`` or a wrapper that kills itself at
a chosen point of a checkpoint write); the resumptions run in this process.
"""
import json
import os
import re
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

from lavo import run as R
from lavo.config import RunConfig
from lavo.data import prepare
from lavo.run import RunError, RunLock, load_run
from lavo.train import train, weights_digest
from file_limits import file_size_limit
from lm_corpus import tiny_run, write_corpus
from paused_trainer import waiting_file

ROOT = Path(__file__).resolve().parents[1]
STEPS, INTERVAL = 60, 10


def quiet(*args, **kwargs):
    pass


@pytest.fixture(scope="module", autouse=True)
def one_thread():
    """Every training here, in this process and in the others, on one thread: the same float reductions (so
    the same bits), and far faster for a tiny model on a busy machine."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


@pytest.fixture(scope="module")
def setup(tmp_path_factory):
    """The corpus, its prepared data, and the uninterrupted run every test compares with."""
    root = tmp_path_factory.mktemp("faults")
    corpus = write_corpus(root / "corpus", documents=4, words=1500)
    config = tiny_run(corpus, root / "data", root / "straight", steps=STEPS, checkpoint_interval=INTERVAL)
    prepare(str(corpus), "bpe320", root / "data", ["doc3"], log=quiet)
    summary = train(RunConfig.from_dict(config), log=quiet)
    return {"root": root, "corpus": corpus, "summary": summary, "digest": run_digest(root / "straight"),
            "losses": step_losses(root / "straight")}


def config_for(setup, tmp_path, name="run", **train_settings) -> dict:
    settings = {"steps": STEPS, "checkpoint_interval": INTERVAL, **train_settings}
    return tiny_run(setup["corpus"], setup["root"] / "data", tmp_path / name, **settings)


def run_digest(run_dir: Path) -> str:
    return weights_digest(load_run(run_dir)[0])


def step_losses(run_dir: Path) -> list[tuple]:
    """The per-step records that do not depend on timing: (step, loss, lr, grad_norm)."""
    records = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    return [(r["step"], r["loss"], r["lr"], r["grad_norm"]) for r in records if "lr" in r]


def resume_and_compare(setup, config: dict) -> list[str]:
    """Resume the run of ``config``; check it ends like the uninterrupted run; return the log lines."""
    lines = []
    summary = train(RunConfig.from_dict(config), resume=True, log=lambda *a, **k: lines.append(" ".join(map(str, a))))
    run_dir = Path(config["train"]["out_dir"])
    assert summary["step"] == STEPS and summary["loss"] == setup["summary"]["loss"]
    assert run_digest(run_dir) == setup["digest"]
    assert step_losses(run_dir) == setup["losses"]
    assert not [p.name for p in run_dir.iterdir() if p.name.startswith(".")]  # no lock, pending or temporary file
    return lines


def start(config: dict, tmp_path: Path, kill_at: str | None = None, pause_after: int | None = None
          ) -> subprocess.Popen:
    """``lavo train`` in a process of its own; ``kill_at`` makes it SIGKILL itself inside a checkpoint write,
    ``pause_after`` makes it wait after that step until :func:`resume_paused` (tests/paused_trainer.py)."""
    path = tmp_path / "config.json"
    path.write_text(json.dumps(config))
    env = {**os.environ, "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1", "HF_HUB_OFFLINE": "1"}
    code = ["-m", "lavo.cli"]
    if kill_at is not None:
        code = [str(Path(__file__).parent / "kill_during_checkpoint.py"), kill_at]
    if pause_after is not None:
        code = [str(Path(__file__).parent / "paused_trainer.py"), str(pause_after), str(tmp_path / GATE)]
    return subprocess.Popen([sys.executable, *code, "train", "--config", str(path)], env=env, cwd=tmp_path,
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)


GATE = "go"  # the file a paused trainer waits for


def resume_paused(tmp_path: Path) -> None:
    (tmp_path / GATE).touch()


def wait_until_paused(tmp_path: Path, process: subprocess.Popen, timeout: float = 120) -> None:
    """Wait until the paused trainer of :func:`start` waits at its gate (tests/paused_trainer.py). Not until its
    step is logged: between that record and its stop check, a signal would stop it a step early."""
    deadline = time.time() + timeout
    waiting = waiting_file(tmp_path / GATE)
    while time.time() < deadline:
        if waiting.exists():
            return
        if process.poll() is not None:
            pytest.fail(f"training ended before its pause:\n{process.stdout.read()[-3000:]}")
        time.sleep(0.02)
    process.kill()
    pytest.fail(f"no pause in {timeout}s")


def finish(process: subprocess.Popen) -> tuple[int, str]:
    output, _ = process.communicate(timeout=120)
    return process.returncode, output


@pytest.mark.parametrize("number,status", [(signal.SIGINT, 130), (signal.SIGTERM, 143)], ids=["ctrl-c", "sigterm"])
def test_ctrl_c_saves_the_exact_position_and_resume_continues_exactly(setup, tmp_path, number, status):
    config = config_for(setup, tmp_path)
    process = start(config, tmp_path, pause_after=15)
    wait_until_paused(tmp_path, process)
    process.send_signal(number)  # while it waits before step 16: that step still runs, then it stops
    resume_paused(tmp_path)
    code, output = finish(process)
    assert code == status, output
    state = torch.load(tmp_path / "run" / "state.pt", weights_only=True)
    assert f"interrupted after step {state['step']}; saving a checkpoint" in output
    assert state["step"] == 16 and state["sampler"]["draws"] == 16  # one draw per step
    lines = resume_and_compare(setup, config)
    assert f"resumed {tmp_path / 'run'} at step 16" in lines


def test_ctrl_c_after_the_output_pipe_closed_still_saves_the_checkpoint(setup, tmp_path):
    """Ctrl-C on `lavo train ... | tee log` ends tee at once (was: the next write into its pipe raised
    BrokenPipeError, and the steps since the last checkpoint were lost)."""
    config = config_for(setup, tmp_path)
    process = start(config, tmp_path, pause_after=15)
    wait_until_paused(tmp_path, process)
    process.stdout.close()  # the reader is gone: every later write of the trainer meets a broken pipe
    process.send_signal(signal.SIGINT)
    resume_paused(tmp_path)
    assert process.wait(timeout=120) == 130
    assert torch.load(tmp_path / "run" / "state.pt", weights_only=True)["step"] == 16
    resume_and_compare(setup, config)


def final_steps(run_dir: Path) -> list[int]:
    records = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    return [r["step"] for r in records if r.get("final")]


def test_ctrl_c_during_the_last_step_leaves_a_finished_run(setup, tmp_path):
    """The run's checkpoint and summary are written, as for any Ctrl-C (before, an interrupted call wrote no
    summary, and --resume found nothing to do and wrote none either, so reports failed on the run)."""
    config = config_for(setup, tmp_path)
    process = start(config, tmp_path, pause_after=STEPS - 1)
    wait_until_paused(tmp_path, process)
    process.send_signal(signal.SIGINT)  # while it waits before the last step
    resume_paused(tmp_path)
    code, output = finish(process)
    assert code == 130 and f"interrupted after step {STEPS}; saving a checkpoint" in output, output
    assert final_steps(tmp_path / "run") == [STEPS]
    assert run_digest(tmp_path / "run") == setup["digest"] and step_losses(tmp_path / "run") == setup["losses"]


def test_a_stop_asked_for_during_the_final_checkpoint_waits_for_it_then_stops(setup, tmp_path, monkeypatch):
    """The request is neither lost (a driver calling train again would go on) nor allowed to cut the write."""
    import lavo.train
    save_checkpoint, lines = lavo.train.save_checkpoint, []

    def signalled_during(run_dir, model, state):
        os.kill(os.getpid(), signal.SIGTERM)  # the handler only takes note; the write goes on
        save_checkpoint(run_dir, model, state)
    monkeypatch.setattr(lavo.train, "save_checkpoint", signalled_during)
    config = RunConfig.from_dict(config_for(setup, tmp_path, steps=3, checkpoint_interval=0))
    with pytest.raises(lavo.train.Stopped) as stopped:
        train(config, log=lambda *a, **k: lines.append(" ".join(map(str, a))))
    assert stopped.value.signal == signal.SIGTERM
    assert "interrupted during the checkpoint of step 3, which is saved (resume with --resume)" in lines
    assert torch.load(tmp_path / "run" / "state.pt", weights_only=True)["step"] == 3
    assert final_steps(tmp_path / "run") == [3]


def test_resuming_a_trained_run_without_its_summary_writes_it_once(setup, tmp_path):
    """A process killed between its final checkpoint and its summary record: --resume has no step to train, but
    the run's summary (what reports read) is written then, and only then."""
    run_dir = tmp_path / "run"
    config = RunConfig.from_dict(config_for(setup, tmp_path, steps=3))
    summary = train(config, log=quiet)
    lines = (run_dir / "metrics.jsonl").read_text().splitlines()
    (run_dir / "metrics.jsonl").write_text("".join(line + "\n" for line in lines[:-1]))  # the summary dropped
    assert final_steps(run_dir) == []
    for _ in range(2):
        assert train(config, resume=True, log=quiet) == summary
        assert (run_dir / "metrics.jsonl").read_text().splitlines() == lines


def test_resume_refuses_another_number_of_processes(setup, tmp_path):
    config = RunConfig.from_dict(config_for(setup, tmp_path, steps=4))
    train(config, stop_after=2, log=quiet)
    state_path = tmp_path / "run" / "state.pt"
    state = torch.load(state_path, weights_only=True)
    assert state["world_size"] == 1
    torch.save({**state, "world_size": 2}, state_path)  # as if trained by torchrun --nproc_per_node 2
    with pytest.raises(RunError, match=re.escape(
            f"{tmp_path / 'run'} was trained by 2 processes, and is resumed by 1: each takes train.batch_size "
            "windows a step, so its batches and data order would change. Resume it with torchrun "
            "--nproc_per_node 2 -m lavo.cli train")):
        train(config, resume=True, log=quiet)


def test_kill_9_mid_training_and_a_second_trainer_meanwhile(setup, tmp_path):
    config = config_for(setup, tmp_path)
    process = start(config, tmp_path, pause_after=15)
    wait_until_paused(tmp_path, process)
    with pytest.raises(RunError, match=rf"{tmp_path / 'run'} is being trained by another process \(pid "
                                       rf"{process.pid}, which holds .*\.lock\)"):
        train(RunConfig.from_dict(config), resume=True, log=quiet)
    process.kill()  # SIGKILL: no handler runs, the lock goes with the process
    finish(process)
    lines = resume_and_compare(setup, config)
    assert f"resumed {tmp_path / 'run'} at step 10" in lines  # the last checkpoint before step 15


def test_kill_9_before_the_first_checkpoint_then_resume_starts_it_again(setup, tmp_path):
    """Nothing but metrics was written: --resume starts the run again, as an uninterrupted run would have been."""
    config = config_for(setup, tmp_path, checkpoint_interval=STEPS)
    process = start(config, tmp_path, pause_after=5)
    wait_until_paused(tmp_path, process)
    process.kill()
    finish(process)
    assert not (tmp_path / "run" / "state.pt").exists() and (tmp_path / "run" / "metrics.jsonl").exists()
    lines = resume_and_compare(setup, config)
    assert f"no checkpoint in {tmp_path / 'run'}; starting a new run" in lines


@pytest.mark.parametrize("point,resumed_at", [
    ("weights", 10),  # killed half way through writing the new weights: the step-10 checkpoint stands
    ("state", 10),  # the new weights written, killed half way through the state: still step 10
    ("commit", 20),  # killed after state.pt committed step 20, before its weights moved into place
])
def test_kill_9_during_a_checkpoint_write(setup, tmp_path, point, resumed_at):
    config = config_for(setup, tmp_path)
    code, output = finish(start(config, tmp_path, kill_at=point))
    assert code == -signal.SIGKILL, output
    left = [p.name for p in (tmp_path / "run").iterdir() if p.name.startswith(".")]
    # what a killed writer leaves: its lock file, uncommitted or unmoved weights, a temporary file
    assert left and all(re.fullmatch(rf"\.lock|{re.escape(R.PENDING)}|\.({re.escape(R.PENDING)}|state\.pt)\.tmp\d+",
                                     name) for name in left), left
    lines = resume_and_compare(setup, config)
    assert f"resumed {tmp_path / 'run'} at step {resumed_at}" in lines


@pytest.mark.parametrize("failing", [R.PENDING, R.STATE])
def test_a_failed_write_leaves_the_previous_checkpoint(setup, tmp_path, monkeypatch, failing):
    """A real write failure, not a stand-in writer: files may not grow past 100 bytes while step 20's weights
    (or its state) are written, as on a full disk (the writers of safetensors and torch.save raised errors of
    their own there, which got past the handler as tracebacks)."""
    config = config_for(setup, tmp_path)
    real = R.atomic_write

    def write_fails_at_step_20(path, write):
        metrics = (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()
        if Path(path).name != failing or json.loads(metrics[-1]).get("step") != 20:
            return real(path, write)
        with file_size_limit(100):
            return real(path, write)

    monkeypatch.setattr(R, "atomic_write", write_fails_at_step_20)
    with pytest.raises(RunError, match=r"could not write the checkpoint of step 20 to .* File too large"
                                       r".*previous checkpoint there is intact"):
        train(RunConfig.from_dict(config), log=quiet)
    monkeypatch.setattr(R, "atomic_write", real)
    assert torch.load(tmp_path / "run" / "state.pt", weights_only=True)["step"] == 10
    assert not [p.name for p in (tmp_path / "run").iterdir() if p.name.startswith(".") and p.name != ".lock"]
    lines = resume_and_compare(setup, config)
    assert f"resumed {tmp_path / 'run'} at step 10" in lines


def test_mismatched_weights_and_state_are_refused(setup, tmp_path):
    config = RunConfig.from_dict(config_for(setup, tmp_path, steps=4, checkpoint_interval=2))
    train(config, stop_after=2, log=quiet)
    older = (tmp_path / "run" / "model.safetensors").read_bytes()
    train(config, resume=True, stop_after=2, log=quiet)
    (tmp_path / "run" / "model.safetensors").write_bytes(older)  # step 2's weights beside step 4's state
    with pytest.raises(RunError, match=r"model.safetensors \(step 2\) and .*state.pt \(step 4\) are not from the "
                                       "same checkpoint"):
        train(config, resume=True, log=quiet)


def test_a_run_without_its_state_is_neither_overwritten_nor_resumed(setup, tmp_path):
    config = RunConfig.from_dict(config_for(setup, tmp_path, steps=2))
    train(config, log=quiet)
    (tmp_path / "run" / "state.pt").unlink()
    weights = (tmp_path / "run" / "model.safetensors").read_bytes()
    with pytest.raises(FileExistsError, match=r"already holds a run \(model.safetensors, metrics.jsonl\)"):
        train(config, log=quiet)
    with pytest.raises(RunError, match=r"no training state \(state.pt\), so it cannot be resumed exactly"):
        train(config, resume=True, log=quiet)
    assert (tmp_path / "run" / "model.safetensors").read_bytes() == weights


def test_overwrite_starts_the_metrics_again_and_a_finished_run_has_nothing_to_do(setup, tmp_path):
    config = RunConfig.from_dict(config_for(setup, tmp_path, steps=3, checkpoint_interval=0))
    train(config, log=quiet)
    train(config, overwrite=True, log=quiet)
    records = [json.loads(line) for line in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in records] == [1, 2, 3, 3]
    lines = []
    summary = train(config, resume=True, log=lines.append)
    assert summary["step"] == 3 and summary["loss"] == records[-1]["loss"]
    assert any("already trained to step 3" in line for line in lines)
    assert (tmp_path / "run" / "metrics.jsonl").read_text().splitlines() == [json.dumps(r) for r in records]


def test_resume_refuses_another_tokenizer_and_says_what_changed(setup, tmp_path):
    values = config_for(setup, tmp_path, steps=4)
    values["data"]["source"] = str(shutil.copytree(setup["corpus"], tmp_path / "corpus"))  # edited below
    train(RunConfig.from_dict(values), stop_after=2, log=quiet)
    values["data"]["holdout"] = ["doc2"]  # another training split: another BPE
    with pytest.raises(RunError, match=r"was trained with another tokenizer \(tokenizer_sha256 [0-9a-f]{12}\) "
                                       r"than the one prepared now in .*: the same documents, other ones held out "
                                       r"\(doc2; the run's: doc3\). Resume with the data settings of its config.json"):
        train(RunConfig.from_dict(values), resume=True, log=quiet)
    values["data"]["holdout"] = ["doc3"]
    with open(tmp_path / "corpus" / "doc0.txt", "a") as file:
        file.write("one more line\n")
    with pytest.raises(RunError, match=r"its documents are not those it recorded \(train: edited doc0\). Put them "
                                       r"back as they were, or start again with --overwrite"):
        train(RunConfig.from_dict(values), resume=True, log=quiet)


def test_resume_refuses_another_tokenizer_name_before_preparing_data(setup, tmp_path):
    values = config_for(setup, tmp_path, steps=4)
    values["data"]["data_dir"] = str(tmp_path / "data")
    train(RunConfig.from_dict(values), stop_after=2, log=quiet)
    prepared = sorted(p.name for p in (tmp_path / "data").iterdir())
    values["data"]["tokenizer"] = "bpe300"
    with pytest.raises(RunError, match=re.escape(
            f"{tmp_path / 'run'} was trained with data.tokenizer='bpe320', not 'bpe300'. A resumed run continues "
            "with its own settings")):
        train(RunConfig.from_dict(values), resume=True, log=quiet)
    assert sorted(p.name for p in (tmp_path / "data").iterdir()) == prepared  # nothing tokenised for bpe300


def test_resume_refuses_other_settings_and_takes_more_steps(setup, tmp_path):
    values = config_for(setup, tmp_path, steps=4)
    train(RunConfig.from_dict(values), stop_after=2, log=quiet)
    config_before = (tmp_path / "run" / "config.json").read_text()
    changed = {**values, "train": {**values["train"], "lr": 0.5, "seed": 7},
               "model": {**values["model"], "dim": 64}}
    with pytest.raises(RunError, match=re.escape(
            "was trained with other settings than asked now: model.dim=64 (the run's: 32); train.lr=0.5 (the "
            "run's: 0.003); train.seed=7 (the run's: 0). A resumed run continues with its own settings: give the "
            f"config and --set it was started with, or take its own (--resume {tmp_path / 'run'}, with no "
            "--config)")):
        train(RunConfig.from_dict(changed), resume=True, log=quiet)
    assert (tmp_path / "run" / "config.json").read_text() == config_before  # left as the run made it
    longer = {**values, "train": {**values["train"], "steps": 5, "log_interval": 2}}
    assert train(RunConfig.from_dict(longer), resume=True, log=quiet)["step"] == 5


def test_a_vocabulary_size_other_than_the_tokenizers_is_refused(setup, tmp_path):
    values = config_for(setup, tmp_path)
    values["model"]["vocab_size"] = 10
    with pytest.raises(ValueError, match=re.escape("model.vocab_size is 10, but the tokenizer (bpe320) has 320 "
                                                   "tokens: the tokenizer sets it, so leave model.vocab_size out")):
        train(RunConfig.from_dict(values), log=quiet)


def test_damaged_run_files_are_named(setup, tmp_path):
    train(RunConfig.from_dict(config_for(setup, tmp_path, steps=1)), log=quiet)
    run_dir = tmp_path / "run"
    weights = run_dir / "model.safetensors"
    original = weights.read_bytes()
    for damage in (original[:len(original) // 2], os.urandom(2000)):
        weights.write_bytes(damage)
        with pytest.raises(RunError, match=rf"{weights} is not a readable safetensors file"):
            load_run(run_dir)
    other = config_for(setup, tmp_path, "softmax", steps=1)
    other["model"] = {**other["model"], "attention": "softmax", "position": "rope", "attention_options": {}}
    train(RunConfig.from_dict(other), log=quiet)
    weights.write_bytes((tmp_path / "softmax" / "model.safetensors").read_bytes())
    with pytest.raises(RunError, match=rf"{weights} does not hold the weights of the model {run_dir / 'config.json'}"
                                       r" describes \(lavo, dim 32, depth 2\): missing .*pos_bias"):
        load_run(run_dir)
    weights.write_bytes(original)
    (run_dir / "config.json").write_text('{"model": {"dim": 32,')
    with pytest.raises(RunError, match=rf"{run_dir / 'config.json'} is not a valid run config"):
        load_run(run_dir)
    (run_dir / "config.json").write_text(json.dumps({"model": {"dim": -1}}))
    with pytest.raises(RunError, match=r"config.json is not a valid run config \(model.dim must be an integer >= 1"):
        load_run(run_dir)
    (run_dir / "config.json").unlink()
    with pytest.raises(RunError, match=re.escape(f"{run_dir / 'config.json'} is missing: restore it, or train the "
                                                 "run again with --overwrite")):
        train(RunConfig.from_dict(config_for(setup, tmp_path, steps=1)), resume=True, log=quiet)


def test_a_lock_is_exclusive_until_released(tmp_path):
    with RunLock(tmp_path):
        assert (tmp_path / ".lock").read_text() == f"{os.getpid()}\n"
        with pytest.raises(RunError, match=f"pid {os.getpid()}"):
            RunLock(tmp_path).acquire()
    assert not (tmp_path / ".lock").exists()
    with RunLock(tmp_path):
        pass
