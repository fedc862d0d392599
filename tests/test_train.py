"""Training: exact resume, checkpoint files, schedule, data-parallel processes agree."""
import json
import math
import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

import lavo.train

from lavo.config import RunConfig, TrainConfig, bundled_configs, bundled_run_configs, deep_merge, load_config
from lavo.data import DataError
from lavo.run import RunError, load_run
from lavo.train import WindowSampler, autocast_for, learning_rate, train, weights_digest
from lm_corpus import tiny_run, write_corpus
from reference_checks import count_checkpoints

ROOT = Path(__file__).resolve().parents[1]


def quiet(*args, **kwargs):
    pass


@pytest.fixture(scope="module")
def corpus(tmp_path_factory):
    return write_corpus(tmp_path_factory.mktemp("corpus"), documents=4, words=1500)


def run(corpus, tmp, name, **train_settings):
    return RunConfig.from_dict(tiny_run(corpus, tmp / "data", tmp / name, **train_settings))


def test_the_first_step_logs_the_next_token_loss_and_gradient_norm_of_its_windows(corpus, tmp_path):
    """Recomputed here from the model's initialisation and the sampler's windows: targets are the next tokens,
    and two micro-batches of 2 windows give the gradient of the mean loss over all 4."""
    from lavo.data import prepare
    from lavo.model import LanguageModel
    config = run(corpus, tmp_path, "run", steps=1, batch_size=2, grad_accum=2, lr=1e-3)
    train(config, log=quiet)
    logged = json.loads((tmp_path / "run" / "metrics.jsonl").read_text().splitlines()[0])
    data = prepare(config.data.source, config.data.tokenizer, config.data.data_dir, config.data.holdout, log=quiet)
    torch.manual_seed(config.train.seed)
    model = LanguageModel(config.model_config(vocab_size=data.tokenizer.vocab_size))
    sampler = WindowSampler(len(data.train), 32, config.train.seed)
    offsets = sampler.next_offsets(2 * 2)  # one draw a step, both micro-batches' windows
    tokens = torch.as_tensor(data.train.tokens.astype("int64"))
    inputs = torch.stack([tokens[o:o + 32] for o in offsets])
    targets = torch.stack([tokens[o + 1:o + 33] for o in offsets])
    loss = torch.nn.functional.cross_entropy(model(inputs)[0].flatten(0, 1), targets.flatten())
    loss.backward()
    norm = torch.cat([p.grad.flatten() for p in model.parameters() if p.grad is not None]).norm()
    assert logged["step"] == 1 and logged["loss"] == pytest.approx(loss.item(), rel=1e-5)
    assert logged["grad_norm"] == pytest.approx(norm.item(), abs=1e-4)


def test_a_batch_split_into_micro_batches_trains_on_the_same_windows(corpus, tmp_path):
    """What the out-of-memory advice promises: each micro-batch once drew windows of its own."""
    whole = train(run(corpus, tmp_path, "whole", steps=3, batch_size=4, grad_accum=1), log=quiet)
    split = train(run(corpus, tmp_path, "split", steps=3, batch_size=2, grad_accum=2), log=quiet)
    assert split["loss"] == pytest.approx(whole["loss"], rel=1e-5)
    first, second = (load_run(tmp_path / name)[0].state_dict() for name in ("whole", "split"))
    for name, weights in first.items():
        torch.testing.assert_close(second[name], weights, rtol=1e-5, atol=1e-6, msg=name)


def test_training_tells_the_mechanisms_of_each_optimizer_step(corpus, tmp_path):
    """Performer redraws its features after every redraw_interval-th step: lavo train counts each step once."""
    config = run(corpus, tmp_path, "run", steps=3, grad_accum=2)
    config.model.update(attention="performer", attention_options={"features": 8, "redraw_interval": 2})
    train(config, log=quiet)
    model = load_run(tmp_path / "run")[0]
    assert [int(block.attention.optimizer_steps) for block in model.blocks] == [3, 3]


def test_interrupted_and_resumed_run_ends_exactly_like_an_uninterrupted_one(corpus, tmp_path):
    settings = dict(steps=6, grad_accum=2, checkpoint_interval=100)
    whole = run(corpus, tmp_path, "whole", **settings)
    whole.model["dropout"] = 0.1  # the RNG state must be restored too
    straight = train(whole, log=quiet)

    parted = run(corpus, tmp_path, "parted", **settings)
    parted.model["dropout"] = 0.1
    first = train(parted, stop_after=4, log=quiet)
    assert first["step"] == 4
    state = torch.load(tmp_path / "parted" / "state.pt", weights_only=True)
    assert state["step"] == 4 and state["sampler"]["draws"] == 4  # one draw a step
    resumed = train(parted, resume=True, log=quiet)

    assert resumed["step"] == straight["step"] == 6
    assert resumed["tokens"] == straight["tokens"] == 6 * 2 * 4 * 32
    assert resumed["loss"] == straight["loss"]
    a, _, _ = load_run(tmp_path / "whole")
    b, _, _ = load_run(tmp_path / "parted")
    assert weights_digest(a) == weights_digest(b)
    steps = [json.loads(line)["step"] for line in (tmp_path / "parted" / "metrics.jsonl").read_text().splitlines()]
    assert steps == [1, 2, 3, 4, 4, 5, 6, 6]  # per-step records plus a final record per call


def test_a_damaged_training_state_is_named_and_resuming_is_refused(corpus, tmp_path):
    parted = run(corpus, tmp_path, "damaged", steps=4, checkpoint_interval=100)
    train(parted, stop_after=2, log=quiet)
    state = tmp_path / "damaged" / "state.pt"
    state.write_bytes(state.read_bytes()[:100])  # cut short, as by a full disk
    with pytest.raises(RunError, match=re.escape(f"{state} is not a readable training state (") + r".+\); "
                       + re.escape("the run cannot be resumed exactly: start it again with --overwrite")):
        train(parted, resume=True, log=quiet)


def test_a_run_resumed_with_activation_checkpointing_ends_exactly_like_one_without(corpus, tmp_path, monkeypatch):
    checkpointed_calls = count_checkpoints(monkeypatch)
    settings = dict(steps=4, grad_accum=2)
    whole = run(corpus, tmp_path, "whole", **settings)
    whole.model["dropout"] = 0.1  # the recomputation must draw the same dropout masks
    train(whole, log=quiet)
    assert checkpointed_calls == []
    parted = run(corpus, tmp_path, "parted", **settings)
    parted.model["dropout"] = 0.1
    train(parted, stop_after=2, log=quiet)
    parted.train.activation_checkpointing = True  # may change on resuming: it computes the same
    train(parted, resume=True, log=quiet)
    depth = len(load_run(tmp_path / "parted")[0].blocks)
    assert len(checkpointed_calls) == 2 * 2 * depth  # two steps of two micro-batches, every block
    assert weights_digest(load_run(tmp_path / "whole")[0]) == weights_digest(load_run(tmp_path / "parted")[0])


def test_checkpoint_files(corpus, tmp_path):
    summary = train(run(corpus, tmp_path, "r", steps=3), log=quiet)
    out = tmp_path / "r"
    assert sorted(p.name for p in out.iterdir()) == ["config.json", "documents.json", "metrics.jsonl",
                                                     "model.safetensors", "state.pt", "tokenizer.json"]
    weights = load_file(str(out / "model.safetensors"))
    assert "embed.weight" in weights and not any(k.startswith("head") for k in weights)
    # every file as open() makes it (safetensors alone makes its files 0600: unreadable to a group sharing runs)
    (tmp_path / "probe").write_text("")
    assert {(out / name).stat().st_mode for name in os.listdir(out)} == {(tmp_path / "probe").stat().st_mode}
    state = torch.load(out / "state.pt", weights_only=True)
    assert set(state) == {"step", "tokens", "elapsed", "loss", "optimizer", "scaler", "sampler", "rng", "checkpoint",
                          "tokenizer_sha256", "data_fingerprint", "world_size"}
    assert load_file(str(out / "model.safetensors")) is not None
    from safetensors import safe_open
    with safe_open(str(out / "model.safetensors"), "pt") as f:
        assert f.metadata() == {"step": "3", "checkpoint": state["checkpoint"]}
    config = json.loads((out / "config.json").read_text())
    assert config["model"]["vocab_size"] == 320 and config["model"]["dim"] == 32 and config["train"]["steps"] == 3
    assert "out_dir" not in config["train"] and Path(config["data"]["data_dir"]).is_absolute()
    model, loaded, tokenizer = load_run(out)
    assert loaded.train.out_dir == str(out) and loaded.model_config() == model.config
    assert tokenizer.vocab_size == 320 and tokenizer.encode("the sister") != []
    records = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    assert records[-1]["final"] and records[0]["tokens_per_s"] > 0 and summary["loss"] == records[-1]["loss"]
    with pytest.raises(FileExistsError, match=r"already holds a run \(model.safetensors, state.pt, metrics.jsonl\)"
                       ".*--resume"):
        train(run(corpus, tmp_path, "r", steps=3), log=quiet)
    misspelt = run(corpus, tmp_path, "r", steps=3)
    misspelt.data.source = "austin"  # named as such, not as a run already there
    with pytest.raises(DataError, match="^data source 'austin' is neither a built-in corpus"):
        train(misspelt, log=quiet)
    for name in ("r/model.safetensors", "r/model.safetensors/deeper"):
        with pytest.raises(ValueError, match=f"^train.out_dir {tmp_path / name} cannot be a directory: "
                                             f"{out / 'model.safetensors'} is a file$"):
            train(run(corpus, tmp_path, name, steps=3), log=quiet)
    (tmp_path / "dangling").symlink_to(tmp_path / "gone")
    with pytest.raises(ValueError, match=f"^train.out_dir {tmp_path / 'dangling'} cannot be a directory: "
                                         f"{tmp_path / 'dangling'} is a broken link$"):
        train(run(corpus, tmp_path, "dangling", steps=3), log=quiet)


def test_learning_rate_schedule():
    config = TrainConfig(lr=1.0, min_lr=0.1, warmup=10, steps=110)
    assert learning_rate(0, config) == pytest.approx(0.1)
    assert learning_rate(4, config) == pytest.approx(0.5)  # linear warmup: step s at (s + 1) / 10 of the rate
    assert learning_rate(9, config) == pytest.approx(1.0)
    # cosine, not linear, decay: a quarter of the way 0.1 + 0.45 (1 + cos(pi / 4)), where a line is at 0.775
    assert learning_rate(35, config) == pytest.approx(0.1 + 0.45 * (1 + 2 ** -0.5))
    assert learning_rate(60, config) == pytest.approx(0.55)
    assert learning_rate(110, config) == pytest.approx(0.1)
    values = [learning_rate(s, config) for s in range(10, 111)]
    assert all(a >= b for a, b in zip(values, values[1:]))


def test_sampler_is_seeded_and_resumable():
    a, b = WindowSampler(1000, 32, seed=1), WindowSampler(1000, 32, seed=1)
    first = [a.next_offsets(4) for _ in range(3)]
    b.load_state_dict({"seed": 1, "draws": 2, "length": 32})
    assert (b.next_offsets(4) == first[2]).all()
    assert all(((o >= 0) & (o <= 1000 - 33)).all() for o in first)
    with pytest.raises(ValueError, match="fewer than train_length"):
        WindowSampler(20, 32, seed=0)


def test_a_validation_split_shorter_than_a_window_is_refused_before_training(tmp_path):
    corpus = write_corpus(tmp_path / "corpus", documents=4, words=400)
    (corpus / "doc3.txt").write_text("the end.\n", encoding="utf-8")  # the held-out document
    # it once scored a few tokens per window and divided by the full length: a valid loss of 0.09 at step 2
    with pytest.raises(ValueError, match=r"the validation split has \d+ tokens, fewer than train_length \+ 1 = 33: "
                                         r"lower train.train_length or hold out more text \(data.holdout\)"):
        train(run(corpus, tmp_path, "short"), log=quiet)
    assert not (tmp_path / "short" / "state.pt").exists()


def test_config_overrides(tmp_path):
    path = tmp_path / "c.json"
    path.write_text(json.dumps({"model": {"preset": "tiny", "attention": "lavo"}, "train": {"steps": 5}}))
    config = load_config(path, ["train.steps=7", "model.attention_options.window=16", "data.source=shakespeare"])
    assert config.train.steps == 7 and config.data.source == "shakespeare"
    assert config.model_config().attention_options == {"window": 16}
    with pytest.raises(ValueError, match="unknown train settings"):
        load_config(path, ["train.stepz=1"])
    with pytest.raises(ValueError, match="model.attention is a setting"):
        load_config(path, ["model.attention.window=16"])


def test_an_override_replaces_a_whole_table_and_a_file_must_hold_sections(tmp_path):
    """The bundled config's window would not build a softmax layer: --set model.attention_options={} drops it."""
    config = load_config("lavo-tiny-austen", ["model.attention=softmax", "model.position=rope",
                                              "model.attention_options={}"])
    assert config.model["attention_options"] == {} and config.model["attention"] == "softmax"
    replaced = load_config("lavo-tiny-austen", ['model.attention_options={"rank": 8}'])
    assert replaced.model["attention_options"] == {"rank": 8}  # the file's window is gone, not merged
    # without it, the refusal says where the window came from and how to drop it
    with pytest.raises(ValueError, match=re.escape("model.attention_options {'window': 32} come from the config "
                                                   "file, for its attention 'lavo': attention 'softmax' has no "
                                                   "option 'window'; its options: rotary. --set "
                                                   "model.attention_options={} drops them")):
        load_config("lavo-tiny-austen", ["model.attention=softmax"])
    assert load_config("lavo-tiny-austen", ["model.attention=local"]).model["attention_options"] == {"window": 32}
    bad = {"broken.toml": ("[train\nsteps = 1", "broken.toml is not valid TOML: "),
           "list.json": ("[1, 2]", "list.json must hold a table of sections (data, model, train), not a list"),
           "section.json": ('{"data": 3}', "config sections ['data'] must be tables of settings")}
    for name, (text, message) in bad.items():
        (tmp_path / name).write_text(text)
        with pytest.raises(ValueError, match=re.escape(message)):
            load_config(tmp_path / name)


def test_deep_merge_merges_sections_and_leaves_its_inputs_alone():
    base = {"model": {"attention": "lavo", "attention_options": {"window": 32, "rank": 8}}, "train": {"steps": 1}}
    update = {"model": {"attention_options": {"window": 64}}, "data": {"source": "x"}}
    merged = deep_merge(base, update)
    assert merged == {"model": {"attention": "lavo", "attention_options": {"window": 64, "rank": 8}},
                      "train": {"steps": 1}, "data": {"source": "x"}}
    assert base["model"]["attention_options"]["window"] == 32 and "data" not in base
    merged["data"]["source"] = "y"
    assert update["data"]["source"] == "x"


def test_bundled_configs_load_by_name():
    assert {"demo", "lavo-tiny-austen", "softmax-rope-tiny-austen"} <= set(bundled_configs())
    by_name = load_config("lavo-tiny-austen")
    assert by_name == load_config("lavo-tiny-austen.json")
    assert by_name.model_config().attention == "lavo" and by_name.train.out_dir == "runs/lavo-tiny-austen"
    assert load_config("softmax-rope-small-shakespeare").data.tokenizer == "gpt2"
    with pytest.raises(FileNotFoundError, match="neither a file nor a bundled config"):
        load_config("configs/lavo-tiny-austen.json")
    # the demo's file is bundled too, but it is not a run config: `lavo train --help` leaves it out
    assert "demo" not in bundled_run_configs() and set(bundled_run_configs()) == set(bundled_configs()) - {"demo"}
    with pytest.raises(ValueError, match=re.escape("demo is a demo config (one model per entry of its runs "
                                                   "section): give it to `lavo demo --config demo`")):
        load_config("demo")


@pytest.mark.parametrize("compiled", [False, pytest.param(True, marks=pytest.mark.slow)])
def test_data_parallel_processes_end_with_identical_weights(corpus, tmp_path, compiled):
    # compiled: torch.compile over the DDP wrapper, with micro-steps that skip the gradient sync (no_sync)
    settings = dict(compile=True, grad_accum=2) if compiled else {}
    config = tiny_run(corpus, tmp_path / "data", tmp_path / "ddp", steps=3, checkpoint_interval=0, **settings)
    path = tmp_path / "ddp.json"
    path.write_text(json.dumps(config))
    begin = time.time()
    returncode, output = torchrun_train(path, tmp_path)
    assert returncode == 0, output[-3000:]
    final = json.loads((tmp_path / "ddp" / "metrics.jsonl").read_text().splitlines()[-1])
    assert final["world_size"] == 2 and final["step"] == 3
    assert final["tokens"] == 3 * 2 * 4 * 32 * config["train"].get("grad_accum", 1)
    digests = final["rank_digests"]
    assert len(digests) == 2 and digests[0] == digests[1]
    model, _, _ = load_run(tmp_path / "ddp")
    assert weights_digest(model) == digests[0]
    print(f"torchrun with 2 processes took {time.time() - begin:.1f}s")
    if not compiled:  # a refused run directory stops every process with its reason, not process 1 in a barrier
        returncode, output = torchrun_train(path, tmp_path)
        assert returncode != 0 and "already holds a run" in output and "process 0 refused" in output
        # (torchrun then reports the exit codes itself; no frame of the package shows)
        assert "Connection closed by peer" not in output and str(ROOT / "lavo") not in output, output[-3000:]


def torchrun_train(config: Path, cwd: Path) -> tuple[int, str]:
    """``lavo train --config CONFIG`` in two processes under torchrun: the return code and the output."""
    env = {k: v for k, v in os.environ.items() if k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK")}
    env.update(OMP_NUM_THREADS="1", HF_HUB_OFFLINE="1", PYTHONPATH=str(ROOT))
    command = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "2",
               "-m", "lavo.cli", "train", "--config", str(config)]
    # own process group, so a hang cannot leave worker processes behind
    process = subprocess.Popen(command, env=env, cwd=cwd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                               text=True, start_new_session=True)
    try:
        output, _ = process.communicate(timeout=240)
    except subprocess.TimeoutExpired:
        os.killpg(process.pid, signal.SIGKILL)
        output, _ = process.communicate()
        pytest.fail(f"torchrun did not finish in 240s:\n{output[-3000:]}")
    return process.returncode, output


def test_bfloat16_autocast_and_time_limit(corpus, tmp_path, monkeypatch):
    from lavo.model import LanguageModel
    forward, logits_dtypes = LanguageModel.forward, set()

    def recorded(self, *args, **kwargs):
        logits, cache = forward(self, *args, **kwargs)
        logits_dtypes.add(logits.dtype)
        return logits, cache

    monkeypatch.setattr(LanguageModel, "forward", recorded)
    summary = train(run(corpus, tmp_path, "bf16", steps=2, dtype="bfloat16"), log=quiet)
    assert summary["step"] == 2 and math.isfinite(summary["loss"])
    assert torch.bfloat16 in logits_dtypes  # the training steps ran under bfloat16 autocast
    logits_dtypes.clear()
    full = train(run(corpus, tmp_path, "fp32", steps=2), log=quiet)
    assert logits_dtypes == {torch.float32} and abs(full["loss"] - summary["loss"]) < 0.05
    stopped = train(run(corpus, tmp_path, "limited", steps=50, time_limit=0.0), log=quiet)
    assert stopped["step"] == 1
    state = torch.load(tmp_path / "limited" / "state.pt", weights_only=True)
    assert state["step"] == 1


def scaled_from(monkeypatch, first: float) -> list:
    """The loss scalers the trainer makes from now on, starting at ``first`` and doubling after every step that
    does not overflow (halving after one that does)."""
    scalers, grad_scaler = [], torch.amp.GradScaler

    def doubling(device, enabled):
        scalers.append(grad_scaler(device, init_scale=first, growth_interval=1, enabled=enabled))
        return scalers[-1]
    monkeypatch.setattr(lavo.train.torch.amp, "GradScaler", doubling)
    return scalers


def step_records(run_dir: Path) -> list[dict]:
    return [r for r in map(json.loads, (run_dir / "metrics.jsonl").read_text().splitlines())
            if "loss" in r and not r.get("final")]


def test_float16_scales_the_loss_and_a_resumed_run_keeps_the_scale(corpus, tmp_path, monkeypatch):
    # The scale moves at every step, so a resumed run that started again from the first scale would round
    # differently and skip other steps.
    scalers = scaled_from(monkeypatch, 2.0 ** 16)
    settings = dict(steps=8, dtype="float16")
    whole = train(run(corpus, tmp_path, "whole", **settings), log=quiet)
    assert math.isfinite(whole["loss"]) and scalers[0].is_enabled()
    scales = [r["loss_scale"] for r in step_records(tmp_path / "whole")]
    assert len(scales) == 8 and scales[-1] == scalers[0].get_scale()
    assert any(b < a for a, b in zip(scales, scales[1:]))  # a step overflowed and was skipped
    parted = run(corpus, tmp_path, "parted", **settings)
    train(parted, stop_after=4, log=quiet)
    train(parted, resume=True, log=quiet)
    assert weights_digest(load_run(tmp_path / "whole")[0]) == weights_digest(load_run(tmp_path / "parted")[0])
    train(run(corpus, tmp_path, "fp32", steps=1), log=quiet)
    assert not scalers[-1].is_enabled() and "loss_scale" not in step_records(tmp_path / "fp32")[0]


def test_float16_clips_and_records_the_unscaled_gradients(corpus, tmp_path, monkeypatch):
    scaled_from(monkeypatch, 2.0 ** 12)
    norms = {}
    for dtype in ("float16", "float32"):
        train(run(corpus, tmp_path, dtype, steps=1, dtype=dtype), log=quiet)
        norms[dtype] = step_records(tmp_path / dtype)[0]["grad_norm"]
    assert norms["float16"] == pytest.approx(norms["float32"], rel=0.05)  # not 2^12 times it


def test_bfloat16_on_a_gpu_without_it_is_refused(monkeypatch):
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device: (7, 5))
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda device: "Tesla T4")
    with pytest.raises(RunError, match=r"^train\.dtype=bfloat16 needs a GPU with bfloat16 arithmetic \(NVIDIA "
                                       r"Ampere or later\); Tesla T4 has none: use train\.dtype=float16 or "
                                       r"float32$"):
        autocast_for("bfloat16", torch.device("cuda"))
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device: (8, 0))
    autocast_for("bfloat16", torch.device("cuda"))
    with pytest.warns(UserWarning, match=r"^train.dtype=float16 on the CPU is slow: most CPUs have no fast float16 "
                                         r"arithmetic; use float32 there \(or bfloat16, on a CPU with bfloat16 "
                                         r"instructions\)$"):
        assert autocast_for("float16", torch.device("cpu"))().fast_dtype == torch.float16


def test_running_out_of_gpu_memory_says_how_to_fit(corpus, tmp_path, monkeypatch):
    from lavo.train import Trainer
    train_step = Trainer.train_step

    def failing_third(self, lr):
        if self.progress.step == 2:
            raise torch.cuda.OutOfMemoryError("CUDA out of memory. Tried to allocate 2.00 GiB")
        return train_step(self, lr)
    monkeypatch.setattr(Trainer, "train_step", failing_third)
    with pytest.raises(RunError) as raised:
        train(run(corpus, tmp_path, "oom", steps=4, checkpoint_interval=1), log=quiet)
    assert str(raised.value) == (
        "training step 3 ran out of GPU memory with 4 windows of 32 tokens per micro-batch. To fit: set "
        "train.activation_checkpointing=true (a resumed run may turn it on: --resume goes on from the last "
        "checkpoint); or train under autocast, train.dtype=bfloat16 (float16 on GPUs before Ampere); or start "
        "again with a smaller train.batch_size (4) and a train.grad_accum (1) as much larger, the same windows in "
        "smaller pieces")
    assert torch.load(tmp_path / "oom" / "state.pt", weights_only=True)["step"] == 2  # the last whole step's
    with pytest.raises(RunError) as raised:  # what is already done is not advised
        train(run(corpus, tmp_path, "oom-again", steps=4, batch_size=1, dtype="bfloat16",
                  activation_checkpointing=True), log=quiet)
    assert str(raised.value) == ("training step 3 ran out of GPU memory with 1 window of 32 tokens per micro-batch. "
                                 "To fit: start again with a shorter train.train_length (32)")


def test_a_single_process_makes_its_gpu_current(monkeypatch):
    from lavo.train import setup_distributed
    made_current = []
    monkeypatch.delenv("WORLD_SIZE", raising=False)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "set_device", made_current.append)
    env, device = setup_distributed("cuda:1")
    assert not env.enabled and device == torch.device("cuda", 1) and made_current == [device]
    assert setup_distributed("cpu")[1] == torch.device("cpu") and made_current == [device]


class StepClock:
    """A stand-in for ``lavo.train``'s clock that moves only when the test says: the time limit and the throughput
    are then exact, however loaded the machine is."""

    def __init__(self):
        self.now = 1000.0

    def perf_counter(self) -> float:
        return self.now

    def advancing(self, function, seconds: float):
        """``function`` with ``seconds`` added to the clock each call."""
        def timed(*args, **kwargs):
            self.now += seconds
            return function(*args, **kwargs)
        return timed


def test_a_time_limit_is_per_call_and_validation_is_not_counted_as_training_speed(corpus, tmp_path, monkeypatch):
    from lavo.train import Trainer
    clock = StepClock()
    monkeypatch.setattr("lavo.train.time", clock)
    monkeypatch.setattr(Trainer, "train_step", clock.advancing(Trainer.train_step, 1.0))
    lines = []
    first = train(run(corpus, tmp_path, "limited", steps=10_000, time_limit=2.5, log_interval=1000), log=quiet)
    assert first["step"] == 3  # over 2.5 s after the third 1-s step
    second = train(run(corpus, tmp_path, "limited", steps=10_000, time_limit=2.5, log_interval=1000), resume=True,
                   log=lines.append)
    assert second["step"] == 6  # three new steps: the limit counts this call's seconds, not the run's
    assert "time limit of 2.5 s for this call reached at step 6" in lines

    monkeypatch.setattr(Trainer, "validate", clock.advancing(Trainer.validate, 5.0))
    monkeypatch.setattr(Trainer, "checkpoint", clock.advancing(Trainer.checkpoint, 5.0))
    train(run(corpus, tmp_path, "validated", steps=4, eval_interval=1, checkpoint_interval=1), log=quiet)
    records = [json.loads(line) for line in (tmp_path / "validated" / "metrics.jsonl").read_text().splitlines()]
    speeds = [r["tokens_per_s"] for r in records if "tokens_per_s" in r]
    tokens_per_step = records[0]["tokens"]
    assert speeds == [tokens_per_step] * 4  # a step's tokens per its 1 s: the 10 s of validation and saving not counted


def test_resuming_with_more_steps_says_how_the_schedule_changes(corpus, tmp_path):
    train(run(corpus, tmp_path, "r", steps=4), log=quiet)
    lines = []
    train(run(corpus, tmp_path, "r", steps=8), resume=True, log=lines.append)
    config = run(corpus, tmp_path, "r", steps=8).train
    before = TrainConfig(**{**vars(config), "steps": 4})
    assert (f"train.steps is 8, the run's was 4: the learning-rate schedule now decays to step 8, so the rate at "
            f"step 4 is {learning_rate(4, config):.3g} instead of {learning_rate(4, before):.3g}") in lines
    # in the warmup the rate at the resumed step is the same under both schedules: only the new end is said
    train(run(corpus, tmp_path, "warming", steps=4, warmup=10), log=quiet)
    lines.clear()
    train(run(corpus, tmp_path, "warming", steps=8, warmup=10), resume=True, log=lines.append)
    assert "train.steps is 8, the run's was 4: the learning-rate schedule now decays to step 8" in lines


def test_each_parameter_group_follows_the_schedule_at_its_own_scale(corpus, tmp_path):
    config = run(corpus, tmp_path, "s4d", steps=2, lr=4e-3)
    config.model.update(attention="s4d", attention_options={})
    train(config, log=quiet)
    groups = torch.load(tmp_path / "s4d" / "state.pt", weights_only=True)["optimizer"]["param_groups"]
    last = learning_rate(1, config.train)
    assert sorted(round(g["lr"] / last, 6) for g in groups) == sorted(round(g["lr_scale"], 6) for g in groups)
    assert {g["lr_scale"] for g in groups} == {1.0, 0.25}


# without checkpointing is -m slow: the compiled step is the same but for the recomputation (a minute's Inductor
# code generation on two cores)
@pytest.mark.parametrize("checkpointing", [pytest.param(False, marks=pytest.mark.slow), True])
def test_compiled_training_follows_the_eager_run(corpus, tmp_path, checkpointing, monkeypatch):
    torch._dynamo.reset()
    eager = train(run(corpus, tmp_path, "eager", steps=3), log=quiet)
    checkpoints = count_checkpoints(monkeypatch)
    messages = []
    compiled = train(run(corpus, tmp_path, "compiled", steps=3, compile=True,
                         activation_checkpointing=checkpointing), log=messages.append)
    # the first step's wait is explained before it starts
    assert "train.compile: the first step compiles the model (torch.compile), so it takes longer than the others" \
        in messages
    assert bool(checkpoints) == checkpointing  # counted as Dynamo traces the blocks
    assert compiled["step"] == eager["step"] == 3

    def losses(name):
        return [r["loss"] for r in step_records(tmp_path / name)]
    # Inductor may sum in another order: the same path, to float32 rounding. (Weights are compared as a whole:
    # AdamW's first steps move a weight by about lr whatever the size of its gradient, so one whose gradient is
    # rounding noise may move either way.)
    assert losses("compiled") == pytest.approx(losses("eager"), rel=1e-5)
    a, _, _ = load_run(tmp_path / "eager")
    b, _, _ = load_run(tmp_path / "compiled")
    for (name, x), y in zip(a.state_dict().items(), b.state_dict().values()):
        assert (y - x).norm() <= 1e-4 * x.norm(), name
    assert json.loads((tmp_path / "compiled" / "config.json").read_text())["train"]["compile"] is True


def test_a_diverged_validation_loss_logs_an_infinite_perplexity(corpus, tmp_path, monkeypatch):
    """A loss past 709.78 (e ** loss beyond the floats; was: OverflowError from math.exp, ending the training)."""
    from lavo.curves import curves_table, read_curves
    monkeypatch.setattr("lavo.train.valid_loss", lambda *args: 1000.0)
    lines = []
    train(run(corpus, tmp_path, "diverged", steps=2, eval_interval=1), log=lines.append)
    records = [json.loads(line) for line in (tmp_path / "diverged" / "metrics.jsonl").read_text().splitlines()]
    assert [r["valid_ppl"] for r in records if "valid_ppl" in r] == [math.inf] * 2
    assert "step 2: valid loss 1000.0000 (ppl inf)" in lines
    assert curves_table([read_curves(tmp_path / "diverged")], smoothing=0.9)[1][0][6] == "inf"  # lavo curves' table


def test_a_step_that_leaves_the_weights_not_finite_stops_before_they_are_saved(corpus, tmp_path, monkeypatch):
    """Was: training went on and saved nan weights, every later step and checkpoint too. A non-finite loss over
    finite weights (a float16 step the loss scaler skipped) goes on."""
    from lavo.train import Trainer
    train_step = Trainer.train_step

    def poisoned(self, lr, at: int, weights: bool):
        loss, norm = train_step(self, lr)
        if self.progress.step + 1 == at:
            if weights:
                with torch.no_grad():
                    next(self.model.parameters())[0] = math.nan
            loss = torch.full_like(loss, math.nan)
        return loss, norm
    monkeypatch.setattr(Trainer, "train_step", lambda self, lr: poisoned(self, lr, at=3, weights=False))
    assert train(run(corpus, tmp_path, "skipped", steps=4), log=quiet)["step"] == 4
    monkeypatch.setattr(Trainer, "train_step", lambda self, lr: poisoned(self, lr, at=3, weights=True))
    with pytest.raises(RunError, match=re.escape(
            f"training diverged at step 3: the loss is nan and the weights are no longer finite. They are not "
            f"saved: {tmp_path / 'diverged'}'s last checkpoint, if any, is from before. Train again (--overwrite) "
            "with a lower train.lr (now 0.003) or a longer train.warmup (now 2)")):
        train(run(corpus, tmp_path, "diverged", steps=4, checkpoint_interval=2), log=quiet)
    assert torch.load(tmp_path / "diverged" / "state.pt", weights_only=True)["step"] == 2
    model = load_run(tmp_path / "diverged")[0]
    assert all(torch.isfinite(p).all() for p in model.parameters())
    assert not (tmp_path / "diverged" / ".lock").exists()
