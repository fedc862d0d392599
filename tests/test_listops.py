"""ListOps: the generator's answers against an independent evaluator, its determinism and bounds; the encoder
classifier's padding invariance and equal sizes across mechanisms."""
import statistics

import pytest
import torch

from lavo.classify import ListOpsRun, SequenceClassifier, accuracy
from lavo.listops import (CLASSES, CLOSE, OPERATORS, PAD, TOKEN_ID, VOCAB, ListOpsSpec, apply_operator, generate,
                          make_splits, to_split)

SPEC = ListOpsSpec(min_length=20, max_length=120, max_depth=6, max_args=5)


def evaluate_tokens(tokens: list[str]) -> int:
    """An evaluator that shares nothing with the generator: a stack of open lists, each reduced with the
    statistics module and plain arithmetic when its bracket closes."""
    reduce = {"[MAX": max, "[MIN": min, "[MED": lambda xs: int(statistics.median(xs)),
              "[SM": lambda xs: sum(xs) % 10}
    stack: list[tuple[str, list[int]]] = []
    result = None
    for token in tokens:
        if token.startswith("["):
            stack.append((token, []))
        elif token == "]":
            operator, arguments = stack.pop()
            value = reduce[operator](arguments)
            if stack:
                stack[-1][1].append(value)
            else:
                result = value
        else:
            stack[-1][1].append(int(token))
    assert not stack and result is not None, "unbalanced expression"
    return result


def test_the_independent_evaluator_on_hand_written_expressions():
    expression = "[MAX 4 3 [MIN 2 3 ] 1 0 [MED 1 5 8 9 2 ] ]".split()
    assert evaluate_tokens(expression) == 5
    assert evaluate_tokens("[SM 9 8 [MED 1 4 ] ]".split()) == (9 + 8 + 2) % 10  # median of 1, 4 rounds down


@pytest.mark.parametrize("operator, values, expected", [
    ("[MAX", [3, 9, 1], 9), ("[MIN", [3, 9, 1], 1), ("[SM", [7, 8, 9], 4),
    ("[MED", [5, 1, 3], 3), ("[MED", [1, 4], 2), ("[MED", [9, 2, 7, 8], 7)])
def test_operators(operator, values, expected):
    assert apply_operator(operator, values) == expected


def test_unknown_operator_is_named():
    with pytest.raises(ValueError, match=r"unknown operator '\[AVG'; operators: \[MAX, \[MIN, \[MED, \[SM"):
        apply_operator("[AVG", [1, 2])


def test_generated_answers_agree_with_the_independent_evaluator():
    examples = generate(400, 3, SPEC)
    for tokens, value in examples:
        assert evaluate_tokens(tokens) == value


def test_lra_sized_expressions_agree_too():
    spec = ListOpsSpec()  # LRA's: 500..2000 tokens, depth 10, 10 arguments
    for tokens, value in generate(20, 0, spec):
        assert spec.min_length <= len(tokens) <= spec.max_length
        assert evaluate_tokens(tokens) == value


def test_lengths_depth_and_arguments_stay_within_the_spec():
    for tokens, _ in generate(300, 4, SPEC):
        assert SPEC.min_length <= len(tokens) <= SPEC.max_length
        assert tokens[0] in OPERATORS and tokens[-1] == CLOSE
        depth, deepest, counts = 0, 0, []
        for token in tokens:
            if token in OPERATORS:
                if counts:
                    counts[-1] += 1
                counts.append(0)
                depth += 1
                deepest = max(deepest, depth)
            elif token == CLOSE:
                assert 2 <= counts.pop() <= SPEC.max_args
                depth -= 1
            else:
                counts[-1] += 1
        assert deepest <= SPEC.max_depth


def test_a_split_is_a_function_of_its_seed():
    assert generate(50, 7, SPEC) == generate(50, 7, SPEC)
    assert generate(50, 7, SPEC) != generate(50, 8, SPEC)
    small = make_splits({"train": 30, "test": 20}, 0, SPEC)
    large = make_splits({"train": 60, "test": 20}, 0, SPEC)
    assert torch.equal(small["test"].ids, large["test"].ids)  # one split's size leaves the others alone
    assert torch.equal(small["train"].ids, large["train"].ids[:30, :small["train"].ids.shape[1]])
    assert not torch.equal(small["train"].ids[:20], small["test"].ids[:20])


def test_every_class_occurs():
    labels = make_splits({"train": 1000}, 0, SPEC)["train"].labels
    assert set(labels.tolist()) == set(range(CLASSES))


def test_split_tensors_decode_to_the_examples():
    examples = generate(20, 1, SPEC)
    split = to_split(examples)
    ids, mask, labels = split.batch(torch.arange(20))
    for row, (tokens, value) in enumerate(examples):
        assert [VOCAB[i] for i in ids[row][mask[row]]] == tokens
        assert not (ids[row][~mask[row]] != TOKEN_ID[PAD]).any()
        assert labels[row] == value
    assert split.majority_accuracy() == max(labels.tolist().count(c) for c in range(CLASSES)) / 20


def test_spec_is_checked():
    with pytest.raises(ValueError, match=r"^listops.spec.min_length must be at most listops.spec.max_length \(10\); "
                       r"got 50$"):
        ListOpsSpec(min_length=50, max_length=10)
    with pytest.raises(ValueError, match=r"^listops.spec.max_args must be an integer >= 2; got 1$"):
        ListOpsSpec(max_args=1)
    # depth 2 with 3 arguments: at most [MAX d d d ], 5 tokens; asking for 6 would make generate() draw forever
    with pytest.raises(ValueError, match=r"^listops.spec.min_length \(6\) is longer than any expression of depth "
                       r"2 with 3 arguments per operator can be \(5 tokens\)"):
        ListOpsSpec(min_length=6, max_length=10, max_depth=2, max_args=3)
    longest = ListOpsSpec(min_length=5, max_length=5, max_depth=2, max_args=3)
    assert [len(tokens) for tokens, _ in generate(4, 0, longest)] == [5] * 4


def test_a_spec_whose_window_no_expression_fits_is_refused_and_depth_one_is_an_operator_over_digits():
    """Was: max_length 3 (below the 4 tokens of the shortest expression, `[MAX d d ]`) made generate() draw forever;
    max_depth 1 (the root is always an operator) was said to allow 1 token at most, refusing its lengths 4..5."""
    with pytest.raises(ValueError, match=r"^listops.spec.max_length \(3\) is shorter than any expression can be "
                       r"\(4 tokens: an operator over two digits\): raise max_length$"):
        ListOpsSpec(min_length=1, max_length=3, max_depth=3, max_args=3)
    flat = ListOpsSpec(min_length=5, max_length=5, max_depth=1, max_args=3)
    assert flat.longest() == 5 and [len(tokens) for tokens, _ in generate(3, 0, flat)] == [5] * 3


MECHANISMS = ["lavo", "softmax", "local", "performer", "cosformer", "abc", "s4d", "longshort"]


@pytest.mark.parametrize("attention", MECHANISMS)
def test_padding_does_not_change_a_sequences_logits(attention):
    torch.manual_seed(0)
    model = ListOpsRun(attention=attention, dim=32, depth=2, heads=2,
                       attention_options={"window": 8} if attention in ("lavo", "local", "longshort") else {}
                       ).build_model().eval()
    examples = generate(2, 5, SPEC)
    split = to_split(examples)
    ids, mask, _ = split.batch(torch.arange(2))
    short = int(split.lengths.argmin())
    alone = model(split.ids[short:short + 1, :int(split.lengths[short])])
    together = model(ids, mask)[short:short + 1]
    torch.testing.assert_close(together, alone, atol=1e-5, rtol=1e-4)


def test_the_classifier_is_non_causal():
    torch.manual_seed(0)
    model = ListOpsRun(attention="lavo", dim=32, depth=1, heads=2, attention_options={"window": 4}).build_model()
    assert all(not block.attention.causal for block in model.blocks)
    ids = torch.randint(1, len(VOCAB), (1, 40))
    x = model.embed(ids)
    y, _ = model.blocks[0](x)
    changed = ids.clone()
    changed[0, -1] = (ids[0, -1] % (len(VOCAB) - 1)) + 1
    y_changed, _ = model.blocks[0](model.embed(changed))
    assert (y_changed[0, 0] - y[0, 0]).abs().max() > 0  # the first position sees the last


def test_accuracy_counts_right_answers():
    """An oracle wrong on the expressions whose value is below 5: the accuracy is the share of the others, over
    batches of 3 that leave a partial last one."""
    examples = generate(10, 2, SPEC)
    split = to_split(examples)

    class Oracle(SequenceClassifier):
        def forward(self, ids, padding_mask=None):
            values = torch.tensor([evaluate_tokens([VOCAB[i] for i in row[mask]])
                                   for row, mask in zip(ids, padding_mask)])
            answers = torch.where(values < 5, (values + 1) % CLASSES, values)
            return torch.nn.functional.one_hot(answers, CLASSES).float()

    model = Oracle(ListOpsRun(attention="softmax", dim=8, depth=1, heads=1).model_config(), CLASSES)
    right = sum(value >= 5 for _, value in examples)
    assert 0 < right < 10  # some right, some wrong: this seed's values fall on both sides
    assert accuracy(model, split, batch_size=3) == right / 10


def planned_listops_runs() -> dict[str, ListOpsRun]:
    """The runs experiments/listops/run.sh trains, ``{run directory under runs/ (MODEL/seedS): its settings}``: its
    ``listops_run`` calls, read by running the script with that function replaced by printing its arguments."""
    import json
    import subprocess
    from dataclasses import asdict
    from pathlib import Path

    from lavo.config import apply_overrides, deep_merge
    root = Path(__file__).resolve().parents[1]
    experiment = root / "experiments" / "listops"
    listing = subprocess.run(
        ["bash", "--norc", "-c", 'source() { :; }; PYTHONPATH=; python() { :; }; '
         'listops_run() { printf "%s\\t" "$@"; printf "\\n"; }; . "$0"', str(experiment / "run.sh")],
        cwd=root, capture_output=True, text=True, check=True).stdout
    base = deep_merge(asdict(ListOpsRun()), json.loads((experiment / "base.json").read_text()))
    runs = {}
    for line in listing.splitlines():
        if "\t" not in line:
            continue
        name, *options = line.rstrip("\t").split("\t")
        pairs = dict(zip(options[::2], options[1::2]))
        overrides = [value for flag, value in zip(options[::2], options[1::2]) if flag == "--set"]
        values = apply_overrides(base, [f"attention={pairs['--attention']}", f"seed={pairs['--seed']}", *overrides],
                                 allow_top_level=True)
        runs[name] = ListOpsRun.from_dict(values)
    return runs


def test_every_listops_model_has_the_same_parameters_within_two_percent():
    from lavo.model import count_parameters
    runs = {name.removesuffix("/seed0"): run for name, run in planned_listops_runs().items() if run.seed == 0}
    assert {"lavo", "lavo-no-dissection", "softmax", "local", "performer", "cosformer", "abc", "s4d"} <= set(runs)
    assert not runs["lavo-no-dissection"].attention_options["dissection"]
    counts = {name: count_parameters(run.build_model()) for name, run in runs.items()}
    assert max(counts.values()) <= 1.02 * min(counts.values()), counts


def test_every_listops_model_trains_on_seeds_0_1_and_2_with_settings_that_differ_only_in_the_seed():
    from dataclasses import replace
    runs = planned_listops_runs()
    models = {name.split("/")[0] for name in runs}
    assert set(runs) == {f"{model}/seed{seed}" for model in models for seed in (0, 1, 2)}
    for name, run in runs.items():
        model, seed = name.split("/seed")
        assert run.seed == int(seed)
        assert replace(run, seed=0) == runs[f"{model}/seed0"], name


def test_listops_command_trains_tests_and_skips_a_finished_run(tmp_path, capsys):
    import json

    from lavo.cli import main
    config = tmp_path / "small.json"
    config.write_text(json.dumps({"spec": {"min_length": 10, "max_length": 40, "max_depth": 4},
                                  "dim": 16, "depth": 1, "heads": 2, "train_size": 40, "valid_size": 10,
                                  "test_size": 10, "steps": 4, "batch_size": 4, "warmup": 1, "eval_interval": 2}))
    out = tmp_path / "run"
    arguments = ["listops", "--config", str(config), "--attention", "softmax", "--seed", "1", "--out", str(out),
                 "--quiet", "--set", "attention_options.rotary=false"]
    assert main(arguments) == 0
    printed = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    results = json.loads((out / "results.json").read_text())
    assert [point["step"] for point in results["curve"]] == [2, 4]
    assert results["run"]["attention"] == "softmax" and results["run"]["seed"] == 1
    assert results["run"]["spec"] == {"min_length": 10, "max_length": 40, "max_depth": 4, "max_args": 10}
    assert printed["test_accuracy"] == results["test_accuracy"]
    assert main(arguments) == 0  # finished with the same settings: skipped, the same results printed
    assert "[skip]" in capsys.readouterr().out


def test_listops_command_names_an_unknown_setting(tmp_path, capsys):
    from lavo.cli import main
    assert main(["listops", "--out", str(tmp_path), "--set", "stpes=3"]) == 2
    assert "unknown listops settings ['stpes']; known: attention, attention_options," in capsys.readouterr().err


def test_a_finished_run_is_reused_only_for_the_settings_it_was_made_with(tmp_path, capsys):
    import json
    from dataclasses import asdict

    from lavo.classify import train_listops
    from lavo.cli import main
    (tmp_path / "results.json").write_text(json.dumps({"run": asdict(ListOpsRun()), "test_accuracy": 0.5}))
    assert train_listops(ListOpsRun(), tmp_path, log=lambda line: None)["test_accuracy"] == 0.5
    assert main(["listops", "--attention", "softmax", "--seed", "5", "--out", str(tmp_path), "--quiet"]) == 2
    assert capsys.readouterr().err == (
        f"lavo listops: error: {tmp_path}/results.json was written with other settings (attention 'lavo', asked for "
        f"'softmax'; seed 0, asked for 5); train into another --out folder, or delete {tmp_path} to train this "
        "run there\n")
    assert main(["listops", "--attention", "flash", "--out", str(tmp_path), "--quiet"]) == 2  # a typo, not a rerun
    assert "unknown attention 'flash'" in capsys.readouterr().err


@pytest.mark.parametrize("setting, message", [
    ("steps=0", "listops.steps must be an integer >= 1; got 0"),
    ("steps=abc", "listops.steps must be an integer >= 1; got 'abc' (a string)"),
    ("steps=2.5", "listops.steps must be an integer >= 1; got 2.5"),
    ("batch_size=0", "listops.batch_size must be an integer >= 1; got 0"),
    ("test_size=0", "listops.test_size must be an integer >= 1; got 0"),
    ("eval_interval=0", "listops.eval_interval must be an integer >= 1; got 0"),
    ("lr=-1", "listops.lr must be a number > 0; got -1"),
    ("min_lr=0.1", "listops.min_lr must be at most listops.lr (0.001); got 0.1"),
    ("spec.foo=1", "unknown listops.spec settings ['foo']; known: max_args, max_depth, max_length, min_length"),
    ("spec=5", "listops.spec must be a table; got 5"),
    ("spec.max_depth=0", "listops.spec.max_depth must be an integer >= 1; got 0"),
    ("dim=15", "listops.dim (15) must be divisible by listops.heads (4)"),
])
def test_listops_settings_are_checked_before_any_work(setting, message, tmp_path, monkeypatch, capsys):
    import lavo.classify
    from lavo.cli import main
    monkeypatch.setattr(lavo.classify, "make_splits", None)  # not called: calling it would raise TypeError
    assert main(["listops", "--out", str(tmp_path), "--quiet", "--set", setting]) == 2
    assert capsys.readouterr().err == f"lavo listops: error: {message}\n"


def test_a_missing_config_file_is_named_as_listops_settings(tmp_path, capsys):
    from lavo.cli import main
    assert main(["listops", "--out", str(tmp_path), "--config", str(tmp_path / "missing.json")]) == 2
    assert capsys.readouterr().err == (f"lavo listops: error: --config {tmp_path / 'missing.json'}: no such file (a "
                                       "JSON file of ListOpsRun settings)\n")


def test_a_bad_mechanism_setting_fails_before_the_data_is_drawn(tmp_path, monkeypatch):
    import lavo.classify

    def no_data(*args, **kwargs):
        raise AssertionError("the splits were drawn")

    monkeypatch.setattr(lavo.classify, "make_splits", no_data)
    with pytest.raises(ValueError, match="attention 'lavo' has no option 'windw'"):
        lavo.classify.train_listops(ListOpsRun(attention_options={"windw": 8}), tmp_path, progress=False)


def test_an_out_folder_that_cannot_take_the_results_is_named_before_the_data_is_drawn(tmp_path, monkeypatch):
    import lavo.classify

    def no_data(*args, **kwargs):
        raise AssertionError("the splits were drawn")

    monkeypatch.setattr(lavo.classify, "make_splits", no_data)
    (tmp_path / "a file").write_text("")
    with pytest.raises(ValueError, match=f"^--out {tmp_path / 'a file'} cannot be a directory: "
                                         f"{tmp_path / 'a file'} is a file$"):
        lavo.classify.train_listops(ListOpsRun(), tmp_path / "a file", progress=False)
    for text in ('{"test_accuracy": 0.5}', "not json"):  # another command's results, or no JSON at all
        (tmp_path / "results.json").write_text(text)
        with pytest.raises(ValueError, match=f"^{tmp_path / 'results.json'} is not a results file of `lavo listops` "
                                             r"\(a JSON object of run\); train into another --out folder"):
            lavo.classify.train_listops(ListOpsRun(), tmp_path, progress=False)


def listops_report():
    """experiments/listops/report.py as a module (experiments/ is not a package)."""
    import importlib.util
    from pathlib import Path
    path = Path(__file__).resolve().parents[1] / "experiments" / "listops" / "report.py"
    spec = importlib.util.spec_from_file_location("listops_report", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def write_listops_run(exp, model: str, seed: int, test: float, valid_curve: list[float], floor: float = 0.16):
    import json
    directory = exp / "runs" / model / f"seed{seed}"
    directory.mkdir(parents=True)
    curve = [{"step": 100 * (i + 1), "train_loss": 2.0, "valid_accuracy": v} for i, v in enumerate(valid_curve)]
    (directory / "results.json").write_text(json.dumps({"run": {"seed": seed}, "test_accuracy": test,
                                                        "test_majority_accuracy": floor, "curve": curve}))


def test_listops_report_averages_each_model_over_its_seeds(tmp_path):
    report = listops_report()
    (tmp_path / "run.sh").write_text('MODELS=(\n  "slow   --attention lavo"\n  "quick  --attention softmax"\n)\n')
    (tmp_path / "wall_times.jsonl").write_text('{"what": "listops slow/seed1", "wall_s": 7}\n')
    write_listops_run(tmp_path, "slow", 0, 0.2, [0.15, 0.16])   # never past the plateau
    write_listops_run(tmp_path, "slow", 1, 0.3, [0.15, 0.25])   # at 25% exactly: past it at step 200
    write_listops_run(tmp_path, "slow", 2, 0.4, [0.30, 0.31])
    write_listops_run(tmp_path, "quick", 2, 0.35, [0.3, 0.35])  # seeds 0 and 1 not run yet
    runs = report.collect(tmp_path)
    assert list(runs) == ["slow", "quick"] and list(runs["slow"]) == [0, 1, 2]
    assert [runs["slow"][seed]["wall_seconds"] for seed in (0, 1)] == [None, 7]
    summary = report.summarize(runs["slow"])
    assert summary["test_accuracy_mean"] == pytest.approx(0.3)
    assert summary["test_accuracy_std"] == pytest.approx(0.1)  # sample std: sqrt((0.01 + 0 + 0.01) / 2)
    assert summary["first_step_past_plateau"] == {0: None, 1: 200, 2: 100}
    assert summary["seeds_past_plateau"] == 2
    assert report.summarize(runs["quick"])["test_accuracy_std"] is None
    rows = report.accuracy_table(runs).splitlines()
    assert rows[2] == "| majority class (the floor) | 16.0 ± 0.0 | 16.0 / 16.0 / 16.0 | — | — | — |"
    assert rows[3] == "| slow | 30.0 ± 10.0 | 20.0 / 30.0 / 40.0 | 2 of 3 | never / 200 / 100 | — |"
    assert rows[4] == "| quick | 35.0 ± — | — / — / 35.0 | 1 of 1 | — / — / 100 | — |"


def test_listops_report_refuses_runs_of_one_seed_with_different_floors(tmp_path):
    report = listops_report()
    (tmp_path / "run.sh").write_text('MODELS=(\n  "a --attention lavo"\n  "b --attention softmax"\n)\n')
    write_listops_run(tmp_path, "a", 0, 0.2, [0.2], floor=0.16)
    write_listops_run(tmp_path, "b", 0, 0.2, [0.2], floor=0.17)
    with pytest.raises(ValueError, match="seed 0: runs disagree on the test split's majority class"):
        report.floors(report.collect(tmp_path))


def small_listops_config(folder) -> str:
    """A config of a few seconds: 7 steps, a curve point every 3 (and at the last step)."""
    import json
    config = folder / "small.json"
    config.write_text(json.dumps({"spec": {"min_length": 10, "max_length": 40, "max_depth": 4}, "dim": 16,
                                  "depth": 1, "heads": 2, "train_size": 40, "valid_size": 10, "test_size": 10,
                                  "steps": 7, "batch_size": 4, "warmup": 1, "eval_interval": 3}))
    return str(config)


def interrupt_listops(arguments, stop_during_step: int, monkeypatch) -> int:
    """``lavo listops ARGUMENTS`` with a Ctrl-C (SIGINT) arriving during step ``stop_during_step`` (0-based)."""
    import os
    import signal

    import lavo.classify
    from lavo.cli import main

    def learning_rate(step, run):
        if step == stop_during_step:
            os.kill(os.getpid(), signal.SIGINT)
        return lavo.train.learning_rate(step, run)

    monkeypatch.setattr(lavo.classify, "learning_rate", learning_rate)
    status = main(arguments)
    monkeypatch.undo()
    return status


def test_an_interrupted_listops_run_resumes_to_the_numbers_of_an_uninterrupted_one(tmp_path, capsys, monkeypatch):
    """Ctrl-C lost the whole run: a rerun trained it again from step 0."""
    import json

    from lavo.cli import main
    arguments = ["listops", "--config", small_listops_config(tmp_path), "--attention", "lavo", "--quiet", "--out"]
    assert main(arguments + [str(tmp_path / "whole")]) == 0
    stopped = tmp_path / "stopped"
    # during the 5th step: the checkpoint holds step 5, between the curve points at 3 and 6, whose average reaches
    # back before it, as the last point's (7) does
    assert interrupt_listops(arguments + [str(stopped)], 4, monkeypatch) == 130
    assert (f"interrupted after step 5; saved {stopped / 'checkpoint.pt'}: run the same command again to resume"
            in capsys.readouterr().out)
    assert not (stopped / "results.json").exists()
    assert main(arguments + [str(stopped)]) == 0
    assert f"resuming from {stopped / 'checkpoint.pt'} after step 5" in capsys.readouterr().out
    whole, resumed = (json.loads((tmp_path / name / "results.json").read_text()) for name in ("whole", "stopped"))
    assert [point["step"] for point in resumed["curve"]] == [3, 6, 7]
    assert {**resumed, "train_seconds": None} == {**whole, "train_seconds": None}
    assert not (stopped / "checkpoint.pt").exists()  # the finished run keeps its results only


def test_a_checkpoint_is_resumed_only_with_the_settings_it_was_made_with(tmp_path, capsys, monkeypatch):
    from lavo.cli import main
    stopped = tmp_path / "stopped"
    arguments = ["listops", "--config", small_listops_config(tmp_path), "--attention", "lavo", "--quiet", "--out",
                 str(stopped)]
    assert interrupt_listops(arguments, 1, monkeypatch) == 130
    capsys.readouterr()
    assert main(arguments + ["--seed", "2"]) == 2
    advice = f"train into another --out folder, or delete {stopped} to train this run there"
    assert capsys.readouterr().err == (f"lavo listops: error: {stopped / 'checkpoint.pt'} was written with other "
                                       f"settings (seed 0, asked for 2); {advice}\n")
    (stopped / "checkpoint.pt").write_bytes(b"not a checkpoint")
    assert main(arguments) == 2
    error = capsys.readouterr().err
    assert error.startswith(f"lavo listops: error: {stopped / 'checkpoint.pt'} is not a checkpoint of `lavo listops` (")
    assert error.endswith(f"); {advice}\n")


def test_a_diverged_listops_run_stops_and_keeps_the_last_finite_checkpoint(tmp_path, capsys, monkeypatch):
    """A nan loss at step 5 stops the run with advice (was: `the training loss is nan at step 5`, no way out
    named); the checkpoint of step 3, its weights finite, stays as it was."""
    import torch

    import lavo.classify
    from lavo.cli import main
    losses = lavo.classify.F.cross_entropy
    calls = []

    def nan_at_step_5(*args, **kwargs):
        calls.append(None)
        loss = losses(*args, **kwargs)
        return loss * float("nan") if len(calls) == 5 else loss

    monkeypatch.setattr(lavo.classify.F, "cross_entropy", nan_at_step_5)
    out = tmp_path / "diverged"
    assert main(["listops", "--config", small_listops_config(tmp_path), "--quiet", "--out", str(out)]) == 2
    assert capsys.readouterr().err == ("lavo listops: error: lavo: training diverged at step 5, its loss nan; weights "
                                       "after it are not saved: train with a lower lr (now 0.001) in another --out "
                                       "folder\n")
    saved = torch.load(out / "checkpoint.pt", weights_only=True)
    assert saved["step"] == 3 and all(weight.isfinite().all() for weight in saved["model"].values())
