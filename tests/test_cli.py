"""The `lavo` command line, end to end on a small generated corpus."""
import json
import os
import re
import shutil
import signal
from pathlib import Path

import pytest
import torch

from lavo.cli import main
from lavo.run import RunLock
from lm_corpus import tiny_run, write_corpus


@pytest.mark.parametrize("command", [[], ["data"], ["train"], ["curves"], ["eval"], ["generate"], ["export"],
                                     ["demo"], ["bench"], ["forecast"], ["listops"]])
def test_help(command, capsys, monkeypatch):
    """Wrapped to the terminal's width (`lavo bench --help` printed its description as one line of 270 columns)."""
    monkeypatch.setenv("COLUMNS", "80")
    with pytest.raises(SystemExit) as exit_info:
        main(command + ["--help"])
    assert exit_info.value.code == 0
    text = capsys.readouterr().out
    assert "usage: lavo" in text and max(len(line) for line in text.splitlines()) <= 80


@pytest.mark.parametrize("argv, unknown", [(["generate", "--run", "runs/x"], "--run"),
                                           (["eval", "runs/x", "--lenghts", "512"], "--lenghts 512")])
def test_an_unknown_flag_is_named_by_its_command_with_the_commands_usage(argv, unknown, capsys):
    """`lavo generate --run runs/x` answered `lavo: error: unrecognized arguments: --run` under the top-level
    usage, which lists the commands but none of generate's flags."""
    with pytest.raises(SystemExit) as exit_info:
        main(argv)
    assert exit_info.value.code == 2
    err = capsys.readouterr().err
    assert err.startswith(f"usage: lavo {argv[0]} ")
    assert err.splitlines()[-1] == f"lavo {argv[0]}: error: unrecognized arguments: {unknown}"


def test_every_flag_with_a_default_says_it_in_help():
    """`lavo generate --help` gave no default for --max-new-tokens (200), --seed or --num-samples."""
    import argparse
    from lavo.cli import build_parser
    commands = next(a for a in build_parser()._actions if isinstance(a, argparse._SubParsersAction)).choices
    silent = [f"{name} {action.option_strings[-1]}" for name, parser in commands.items()
              for action in parser._actions
              if action.option_strings and action.default not in (None, False, "", [], argparse.SUPPRESS)
              and not re.search(r"default|\[.+\]", action.help or "")]  # lavo bench: "[default]"
    assert not silent


def test_data_train_eval_generate(tmp_path, capsys):
    corpus = write_corpus(tmp_path / "corpus", documents=4, words=1500)
    config = tiny_run(corpus, tmp_path / "data", tmp_path / "run", steps=4)
    (tmp_path / "run.json").write_text(json.dumps(config))
    data = ["--source", str(corpus), "--tokenizer", "bpe320", "--data-dir", str(tmp_path / "data"),
            "--holdout", "doc3"]
    assert main(["data", *data]) == 0
    assert "valid" in capsys.readouterr().out
    assert main(["train", "--config", str(tmp_path / "run.json"), "--set", "train.steps=3"]) == 0
    assert json.loads(capsys.readouterr().out.strip().splitlines()[-1])["step"] == 3
    assert main(["train", "--config", str(tmp_path / "run.json"), "--resume"]) == 0
    assert json.loads(capsys.readouterr().out.strip().splitlines()[-1])["step"] == 4
    assert main(["curves", str(tmp_path / "run"), "--out", str(tmp_path / "curves")]) == 0
    assert capsys.readouterr().out.splitlines()[2].split()[:3] == ["run", "4", f"{4 * 4 * 32}"]  # steps x batch x L
    assert (tmp_path / "curves" / "curves.png").is_file()

    assert main(["eval", str(tmp_path / "run"), "--multiples", "1,2,4", "--out", str(tmp_path / "eval"),
                 "--chunk-size", "40", "--quiet"]) == 0
    out = capsys.readouterr().out
    assert "L=32" in out and "L=128" in out
    results = json.loads((tmp_path / "eval" / "results.json").read_text())["results"]["run"]
    assert sorted(results, key=int) == ["32", "64", "128"]
    assert (tmp_path / "eval" / "perplexity.png").is_file()
    # scored under bfloat16 autocast: the same tokens, the loss within bfloat16's rounding of float32's
    assert main(["eval", str(tmp_path / "run"), "--multiples", "1,2,4", "--out", str(tmp_path / "eval-bf16"),
                 "--chunk-size", "40", "--dtype", "bfloat16", "--quiet"]) == 0
    capsys.readouterr()
    bf16 = json.loads((tmp_path / "eval-bf16" / "results.json").read_text())
    assert bf16["dtype"] == "bfloat16"
    for length, result in bf16["results"]["run"].items():
        assert result["tokens"] == results[length]["tokens"]
        assert result["loss"] != results[length]["loss"] and abs(result["loss"] - results[length]["loss"]) < 0.02

    args = ["generate", str(tmp_path / "run"), "--prompt", "the sister", "--max-new-tokens", "12", "--seed", "3"]
    assert main(args) == 0
    first = capsys.readouterr().out
    assert main(args) == 0
    assert capsys.readouterr().out == first and first.startswith("the sister")

    moved = tmp_path / "moved"  # resumed by its directory alone, with its own settings
    shutil.move(tmp_path / "run", moved)
    assert main(["train", "--resume", str(moved), "--set", "train.steps=5"]) == 0
    assert json.loads(capsys.readouterr().out.strip().splitlines()[-1])["step"] == 5
    for flags, error in (
            (["--config", str(tmp_path / "run.json")],
             f"--resume {moved} continues with the run's own config.json: leave out --config"),
            (["--set", "train.out_dir=elsewhere"],
             f"the run resumed is the one in {moved}: leave out --set train.out_dir"),
            (["--set", "train.lr=0.5"], f"{moved} was trained with other settings than asked now: train.lr=0.5")):
        assert main(["train", "--resume", str(moved), *flags]) == 2
        assert f"lavo train: error: {error}" in capsys.readouterr().err
    assert main(["train", "--resume", str(tmp_path / "run")]) == 2
    assert (f"error: {tmp_path / 'run'} is not a directory: give the train.out_dir of the run to resume"
            in capsys.readouterr().err)


def test_a_run_directory_is_self_contained(tmp_path, monkeypatch, capsys):
    """Trained with relative paths, then moved (data too) and used from another working directory."""
    from lavo import data as D
    corpus = write_corpus(tmp_path / "corpus", documents=4, words=1500)

    def fetch_toy(root, log):  # a built-in source, so that its texts live in the data directory
        texts = Path(root) / "toy" / "texts"
        if not texts.is_dir():
            shutil.copytree(corpus, texts)
        return texts

    monkeypatch.setitem(D.BUILTIN_SOURCES, "toy", (fetch_toy, ["doc3"]))
    (tmp_path / "work").mkdir()
    monkeypatch.chdir(tmp_path / "work")
    config = tiny_run(Path("toy"), Path("data"), Path("runs/r"), steps=3)
    Path("run.json").write_text(json.dumps(config))
    assert main(["train", "--config", "run.json"]) == 0
    generate = ["--prompt", "the sister", "--max-new-tokens", "12", "--seed", "3"]
    evaluate = ["--lengths", "32,64", "--chunk-size", "40", "--quiet"]
    capsys.readouterr()
    assert main(["generate", "runs/r", *generate]) == 0
    text = capsys.readouterr().out
    assert main(["eval", "runs/r", *evaluate, "--out", "before"]) == 0
    before = json.loads(Path("before/results.json").read_text())["results"]

    moved = tmp_path / "elsewhere" / "r"
    shutil.move("runs/r", moved)
    shutil.move("data", tmp_path / "data-moved")  # the prepared cache and its tokenizer go too
    (tmp_path / "other").mkdir()
    monkeypatch.chdir(tmp_path / "other")
    assert sorted(p.name for p in moved.iterdir()) == ["config.json", "documents.json", "metrics.jsonl",
                                                       "model.safetensors", "state.pt", "tokenizer.json"]
    capsys.readouterr()
    assert main(["generate", str(moved), *generate]) == 0
    assert capsys.readouterr().out == text and text.startswith("the sister")

    assert main(["eval", str(moved), *evaluate]) == 2  # its data is no longer where it trained
    assert "toy is not downloaded in" in (err := capsys.readouterr().err) and "lavo eval --data-dir" in err
    assert main(["eval", str(moved), *evaluate, "--data-dir", str(tmp_path / "data-moved"), "--out", "after"]) == 0
    assert json.loads(Path("after/results.json").read_text())["results"] == {"r": before["r"]}


def test_errors_are_one_clear_line(tmp_path, capsys):
    (tmp_path / "empty").mkdir()
    assert main(["data", "--source", str(tmp_path / "empty"), "--data-dir", str(tmp_path / "d")]) == 2
    err = capsys.readouterr().err
    assert "lavo data: error: no .txt files in" in err and "Traceback" not in err
    assert main(["eval", str(tmp_path / "missing")]) == 2  # a mistyped path
    assert (f"{tmp_path / 'missing'} is not a directory: give one that `lavo train` (its train.out_dir) or `lavo "
            "export` wrote") in capsys.readouterr().err
    (tmp_path / "starting").mkdir()
    with RunLock(tmp_path / "starting"):  # a trainer before its first checkpoint
        assert main(["generate", str(tmp_path / "starting")]) == 2
    assert (f"error: {tmp_path / 'starting'} is being trained (pid {os.getpid()}) and has no checkpoint yet: wait for "
            "its first one (train.checkpoint_interval steps)") in capsys.readouterr().err
    assert main(["generate", str(tmp_path / "starting")]) == 2  # the lock released: no trainer
    assert "is not a trained run" in capsys.readouterr().err
    (tmp_path / "starting" / ".lock").write_text(f"{os.getpid()}\n")  # left by a killed trainer; the pid lives on
    assert main(["generate", str(tmp_path / "starting")]) == 2
    assert "is not a trained run" in capsys.readouterr().err
    assert main(["train", "--set", "train.nonsense=1"]) == 2
    assert "unknown train settings ['nonsense']" in capsys.readouterr().err


def test_misused_run_folders_and_outputs_are_refused_with_what_to_do(tmp_path, capsys):
    corpus = write_corpus(tmp_path / "corpus", documents=4, words=1500)
    (tmp_path / "run.json").write_text(json.dumps(tiny_run(corpus, tmp_path / "data", tmp_path / "run", steps=2)))
    assert main(["train", "--config", str(tmp_path / "run.json")]) == 0
    run = str(tmp_path / "run")
    evaluate = ["eval", run, "--lengths", "32", "--quiet"]
    (tmp_path / "taken.txt").write_text("")
    capsys.readouterr()
    assert main([*evaluate, "--out", str(tmp_path / "taken.txt")]) == 2  # refused before scoring
    assert capsys.readouterr().err.endswith("taken.txt is a file: give a folder for results.json and "
                                            "perplexity.png\n")
    assert main([*evaluate, "--out", str(tmp_path / "taken.txt" / "eval")]) == 2  # was: refused after scoring
    assert capsys.readouterr() == ("", f"lavo eval: error: --out {tmp_path / 'taken.txt' / 'eval'}: "
                                       f"{tmp_path / 'taken.txt'} is a file, so the folder cannot be made there: "
                                       "give a folder for results.json and perplexity.png\n")
    assert main(["eval", run, run, "--lengths", "32", "--quiet"]) == 2  # was: one row, as if given once
    assert capsys.readouterr().err == f"lavo eval: error: {run} is given twice: give each run once\n"
    assert main([*evaluate, "--split", "train"]) == 0
    assert "training tokens at every length" in capsys.readouterr().out
    if not torch.cuda.is_available():
        assert main(["generate", run, "--device", "cuda", "--prompt", "the"]) == 2
        assert "no CUDA device is available: choose the CPU (--device cpu" in capsys.readouterr().err
    for samples in ("2", "1"):  # printed when done, or token by token
        read, write = os.pipe()  # `lavo generate ... | head -1`: the reader goes away after its first line
        os.close(read)
        with open(write, "w") as pipe, pytest.MonkeyPatch.context() as patch:
            patch.setattr("sys.stdout", pipe)
            status = main(["generate", run, "--prompt", "the", "--max-new-tokens", "3", "--num-samples", samples])
        assert (status, capsys.readouterr().err) == (128 + signal.SIGPIPE, "")  # was: exit 2, "[Errno 32] ..."
    # b"caf\xe9" from a Latin-1 terminal, as Python decodes the command line (was: a TypeError traceback)
    assert main(["generate", run, "--prompt", "caf\udce9"]) == 2
    assert capsys.readouterr().err == ("lavo generate: error: --prompt holds bytes that are not UTF-8 text (byte 0xe9 "
                                       "at position 3): give it in UTF-8\n")

    shutil.move(corpus, tmp_path / "moved")  # the folder the run read its texts from
    assert main(evaluate) == 2
    assert "the run read its texts from that folder: put them back as they were" in capsys.readouterr().err
    config = tmp_path / "run" / "config.json"
    config.write_text("{not json")
    assert main(["generate", run, "--prompt", "the"]) == 2
    err = capsys.readouterr().err
    assert f"{config} is not a valid run config" in err and "Traceback" not in err


def test_a_prompt_file_is_continued_as_the_same_prompt_given_inline_and_only_the_continuation_printed(tmp_path,
                                                                                                          capsys):
    """A long document as the prompt (a long-context model's use) had to pass through the shell as one argument,
    and came back printed in full before its continuation."""
    import threading
    corpus = write_corpus(tmp_path / "corpus", documents=4, words=1500)
    (tmp_path / "run.json").write_text(json.dumps(tiny_run(corpus, tmp_path / "data", tmp_path / "run", steps=2)))
    assert main(["train", "--config", str(tmp_path / "run.json")]) == 0
    generate = ["generate", str(tmp_path / "run"), "--max-new-tokens", "8", "--seed", "3"]
    capsys.readouterr()
    assert main([*generate, "--prompt", "the sister"]) == 0
    inline = capsys.readouterr().out
    assert inline.startswith("the sister")
    (tmp_path / "prompt.txt").write_text("the sister")
    assert main([*generate, "--prompt-file", str(tmp_path / "prompt.txt")]) == 0
    assert capsys.readouterr().out == inline.removeprefix("the sister")

    fifo = tmp_path / "pipe"  # as /dev/stdin is when a pipe feeds it: not a regular file
    os.mkfifo(fifo)
    writer = threading.Thread(target=lambda: fifo.write_text("the sister"))
    writer.start()
    assert main([*generate, "--prompt-file", str(fifo)]) == 0
    writer.join()
    assert capsys.readouterr().out == inline.removeprefix("the sister")

    from lavo.cli import prompt_text
    (tmp_path / "line.txt").write_text("the sister\n")
    assert prompt_text("", str(tmp_path / "line.txt")) == "the sister\n"  # as it is: the newline is text

    (tmp_path / "latin1.txt").write_bytes("caf\xe9".encode("latin-1"))
    for prompt_file, error in ((tmp_path / "missing.txt", f"--prompt-file {tmp_path / 'missing.txt'}: no such file"),
                               (tmp_path, f"--prompt-file {tmp_path}: a folder"),
                               (tmp_path / "latin1.txt", f"{tmp_path / 'latin1.txt'} is not UTF-8 text")):
        assert main([*generate, "--prompt-file", str(prompt_file)]) == 2
        assert capsys.readouterr().err.startswith(f"lavo generate: error: {error}")
    with pytest.raises(SystemExit) as exit_info:
        main([*generate, "--prompt", "the", "--prompt-file", str(tmp_path / "prompt.txt")])
    assert exit_info.value.code == 2
    assert capsys.readouterr().err.splitlines()[-1] == ("lavo generate: error: argument --prompt-file: not allowed "
                                                        "with argument --prompt")


def test_one_sample_is_printed_as_it_is_sampled_so_ctrl_c_keeps_what_came(tmp_path, monkeypatch, capsys):
    """The whole sample was printed once sampling ended: a long one showed nothing for minutes, and Ctrl-C lost it."""
    from lavo import generate
    from lavo.cli import sample_text
    from lavo.run import load_model_dir
    corpus = write_corpus(tmp_path / "corpus", documents=4, words=1500)
    (tmp_path / "run.json").write_text(json.dumps(tiny_run(corpus, tmp_path / "data", tmp_path / "run", steps=1)))
    assert main(["train", "--config", str(tmp_path / "run.json")]) == 0
    model, _, tokenizer = load_model_dir(tmp_path / "run", "cpu")
    sample = generate.generate(model, tokenizer.encode("the sister"), 12, temperature=0.8, top_k=50, top_p=0.95,
                               seed=3, stop_id=tokenizer.eot_id)[0]
    command = ["generate", str(tmp_path / "run"), "--prompt", "the sister", "--max-new-tokens", "12", "--seed", "3"]
    capsys.readouterr()
    assert main(command) == 0
    assert capsys.readouterr().out == sample_text(tokenizer, "the sister", sample) + "\n"

    sample_next, draws = generate.sample_next, []

    def interrupted(*args, **kwargs):  # Ctrl-C as the sixth token is drawn
        if len(draws) == 5:
            raise KeyboardInterrupt
        draws.append(None)
        return sample_next(*args, **kwargs)
    monkeypatch.setattr(generate, "sample_next", interrupted)
    assert main(command) == 128 + signal.SIGINT
    assert capsys.readouterr().out == sample_text(tokenizer, "the sister", sample[:5]) + "\n"


def test_the_demo_does_not_train_over_runs_it_did_not_make(tmp_path):
    from lavo.demo import check_only_demo_runs, demo_config
    demo = demo_config(None, [f"out_dir={tmp_path}"])
    check_only_demo_runs(tmp_path, demo.runs)  # nothing there yet
    (tmp_path / "lavo").mkdir()
    (tmp_path / "lavo" / "metrics.jsonl").write_text("")
    with pytest.raises(FileExistsError, match="lavo already hold runs that the demo did not make"):
        check_only_demo_runs(tmp_path, demo.runs)
    (tmp_path / "demo.json").write_text("{}")  # an earlier demo's folder: rerunning it trains again
    check_only_demo_runs(tmp_path, demo.runs)


def test_demo_config_is_one_run_config_per_model_with_overrides():
    from lavo.config import read_config_file
    from lavo.demo import demo_config
    demo = demo_config(None, ["train.steps=5", "runs.lavo.model.attention_options.window=64", "out_dir=x"])
    assert demo.settings == demo_config("demo", ["train.steps=5", "runs.lavo.model.attention_options.window=64",
                                                 "out_dir=x"]).settings
    assert list(demo.runs) == list(read_config_file("demo")["runs"]) == ["lavo", "softmax-rope"]
    lavo, softmax = demo.runs["lavo"], demo.runs["softmax-rope"]
    assert lavo.train.steps == softmax.train.steps == 5 and lavo.train.lr == softmax.train.lr == 0.002
    assert Path(lavo.train.out_dir) == Path("x/lavo") and Path(softmax.train.out_dir) == Path("x/softmax-rope")
    assert lavo.model_config().attention_options == {"window": 64} and lavo.model_config().dim == 192
    assert softmax.model_config().position == "rope" and softmax.model_config().attention == "softmax"
    assert demo.eval.multiples == [1, 2, 4, 8] and demo.seconds_per_model == 240


def test_demo_config_errors():
    from lavo.demo import demo_config
    with pytest.raises(ValueError, match="same data and token budget"):
        demo_config(None, ["runs.lavo.train.batch_size=4"])
    with pytest.raises(ValueError, match="unknown eval settings"):
        demo_config(None, ["eval.lenghts=[1]"])
    with pytest.raises(ValueError, match="not a section"):
        demo_config(None, ["runs.lavo.model.attention.window=3"])


def stub_demo_work(monkeypatch, calls: list, scored: list, time_limit_steps: dict | None = None):
    """The demo's training, scoring and step timing replaced by stand-ins: ``calls`` records each training
    (attention, steps, stop_after, time_limit), ``scored`` each scoring's settings; ``time_limit_steps``: the
    step at which each attention reaches its time limit (default: LAVO, trained first, at step 7)."""
    time_limit_steps = {"lavo": 7} if time_limit_steps is None else time_limit_steps
    import lavo.demo
    import lavo.evaluate
    import lavo.train

    def fake_train(config, overwrite=False, stop_after=None, log=print):
        calls.append((config.model["attention"], config.train.steps, stop_after, config.train.time_limit))
        step = min(config.train.steps if stop_after is None else stop_after,
                   time_limit_steps.get(config.model["attention"], config.train.steps))
        run_dir = Path(config.train.out_dir)
        run_dir.mkdir(parents=True, exist_ok=True)
        (run_dir / "metrics.jsonl").write_text(json.dumps({"step": step, "loss": 1.0, "lr": 1e-3, "tokens": step * 100,
                                                           "elapsed": 1.0}) + "\n")
        return {"step": step, "tokens": step * 100, "loss": 1.0, "elapsed": 1.0, "parameters": 10}

    monkeypatch.setattr(lavo.train, "train", fake_train)
    monkeypatch.setattr(lavo.evaluate, "evaluate_runs", lambda runs, **kwargs: scored.append(kwargs) or {})
    monkeypatch.setattr(lavo.demo, "seconds_per_step",
                        lambda config, vocab: {"lavo": 2.0, "softmax": 1.0}[config.model["attention"]])


def test_demo_gives_every_model_the_same_steps_even_when_cut_short(tmp_path, monkeypatch):
    import lavo.demo
    corpus = write_corpus(tmp_path / "corpus", documents=3, words=400)
    calls, scored = [], []
    stub_demo_work(monkeypatch, calls, scored)
    lines = []
    lavo.demo.run_demo(None, [f"out_dir={tmp_path / 'demo'}", f"data.source={corpus}", "data.tokenizer=bpe300",
                              f"data.data_dir={tmp_path / 'data'}", "seconds_per_model=100", "train.steps=1000"],
                       log=lambda *a, **k: lines.append(" ".join(map(str, a))))
    assert calls == [("lavo", 45, None, 100.0), ("softmax", 45, 7, 100.0)]  # 90% of 100s planned; both capped
    assert any("stop at step 7 too" in line for line in lines)
    assert (tmp_path / "demo" / "curves.png").is_file()
    calls.clear()  # train.steps is the most steps, below the 10 a slow machine still gets too
    lavo.demo.run_demo(None, [f"out_dir={tmp_path / 'demo'}", f"data.source={corpus}", "data.tokenizer=bpe300",
                              f"data.data_dir={tmp_path / 'data'}", "seconds_per_model=100", "train.steps=3"],
                       log=lambda *a, **k: None)
    assert [steps for _, steps, _, _ in calls] == [3, 3]
    calls.clear()  # the second model reaches the time limit before the first: said, and the first is not cut
    stub_demo_work(monkeypatch, calls, scored, {"softmax": 5})
    lines.clear()
    lavo.demo.run_demo(None, [f"out_dir={tmp_path / 'demo'}", f"data.source={corpus}", "data.tokenizer=bpe300",
                              f"data.data_dir={tmp_path / 'data'}", "seconds_per_model=100", "train.steps=1000"],
                       log=lambda *a, **k: lines.append(" ".join(map(str, a))))
    assert [stop_after for _, _, stop_after, _ in calls] == [None, None]
    assert ("warning: softmax-rope reached the time limit after 5 steps, before the others: token budgets differ"
            in lines)
    assert not any("stop at step" in line for line in lines)  # was: "the other models stop at step 5 too"
    calls.clear()  # the eval section reaches the scoring whole (eval.dtype was dropped)
    lavo.demo.run_demo(None, [f"out_dir={tmp_path / 'demo'}", f"data.source={corpus}", "data.tokenizer=bpe300",
                              f"data.data_dir={tmp_path / 'data'}", "seconds_per_model=100", "train.steps=3",
                              "eval.dtype=bfloat16", "eval.chunk_size=5", "eval.lengths=[8, 16]"],
                       log=lambda *a, **k: None)
    assert {key: scored[-1][key] for key in ("dtype", "chunk_size", "lengths")} == {
        "dtype": "bfloat16", "chunk_size": 5, "lengths": [8, 16]}


def test_a_demo_run_again_or_stopped_says_it_trains_afresh_and_how_to_score_trained_models(tmp_path, monkeypatch):
    """Was: a second run silently deleted and retrained the first's models, and Ctrl-C left only the trainer's
    `(resume with --resume)`, a flag `lavo demo` does not have, even when both models had finished training."""
    import shlex
    import lavo.demo
    import lavo.evaluate
    from lavo.cli import build_parser
    corpus = write_corpus(tmp_path / "corpus", documents=3, words=400)
    stub_demo_work(monkeypatch, [], [])
    demo = tmp_path / "my demo"  # the printed command quotes it
    settings = [f"out_dir={demo}", f"data.source={corpus}", "data.tokenizer=bpe300",
                f"data.data_dir={tmp_path / 'data'}", "seconds_per_model=100", "train.steps=3", "eval.max_tokens=64"]
    lines = []
    lavo.demo.run_demo(None, settings, log=lambda *a, **k: lines.append(" ".join(map(str, a))))
    assert not any("earlier demo" in line for line in lines)
    lavo.demo.run_demo(None, settings, log=lambda *a, **k: lines.append(" ".join(map(str, a))))
    assert (f"{demo} holds an earlier demo's lavo, softmax-rope: the demo trains every model again from the start"
            in lines)

    def stop(*args, **kwargs):
        raise KeyboardInterrupt
    monkeypatch.setattr(lavo.evaluate, "evaluate_runs", stop)  # Ctrl-C while scoring: both models are trained
    lines.clear()
    with pytest.raises(KeyboardInterrupt):
        lavo.demo.run_demo(None, settings, log=lambda *a, **k: lines.append(" ".join(map(str, a))))
    advice = "the demo stopped: `lavo demo` run again trains every model from the start (it does not resume)"
    command = re.fullmatch(re.escape(advice) + "; its models are trained: `(.*)` scores them", lines[-1]).group(1)
    args = build_parser().parse_args(shlex.split(command)[1:])
    assert args.runs == [str(demo / "lavo"), str(demo / "softmax-rope")] and args.out == str(demo)
    assert (args.multiples, args.max_tokens, args.batch_size, args.chunk_size) == ([1, 2, 4, 8], 64, 4, 512)
    monkeypatch.setattr(lavo.train, "train", stop)  # Ctrl-C while training
    with pytest.raises(KeyboardInterrupt):
        lavo.demo.run_demo(None, settings, log=lambda *a, **k: lines.append(" ".join(map(str, a))))
    assert lines[-1] == advice


def test_the_training_output_that_may_close_is_otherwise_the_stream_it_wraps(tmp_path):
    """What a progress bar asks of it (its encoding, whether it is a terminal, its file descriptor) is the
    stream's: an AttributeError there would make tqdm take it for an ASCII stream of unknown width."""
    from lavo.cli import OutputThatMayClose
    with open(tmp_path / "log", "w", encoding="utf-8") as stream:
        wrapped = OutputThatMayClose(stream)
        assert wrapped.write("step 1\n") == 7
        assert (wrapped.encoding, wrapped.isatty(), wrapped.fileno()) == ("utf-8", False, stream.fileno())
    assert (tmp_path / "log").read_text() == "step 1\n"
