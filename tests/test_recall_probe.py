"""Probe 1 (experiments/recall): the generator's answers against an independent loop, and a tiny dry run."""
import json

import numpy as np
import pytest
from script_loader import ROOT, load_script

recall = load_script("recall_probe", "experiments/recall/recall.py")


@pytest.mark.parametrize("pairs,gap", [(1, 0), (4, 7), (16, 3)])
def test_every_target_is_the_value_stored_with_the_queried_key(pairs, gap):
    vocab = recall.Vocabulary(keys=20, values=10, fillers=5)
    ids, targets = recall.recall_batch(np.random.default_rng(0), vocab, 8, pairs, gap)
    assert ids.shape == targets.shape == (8, 4 * pairs + gap)
    for row, target in zip(ids.tolist(), targets.tolist()):
        stored = {}
        for position in range(0, 2 * pairs, 2):
            assert row[position] not in stored and row[position] < vocab.keys
            stored[row[position]] = row[position + 1]
        assert all(vocab.keys + vocab.values <= token < vocab.size for token in row[2 * pairs:2 * pairs + gap])
        answered = []
        for position, token in enumerate(row):
            if target[position] >= 0:
                assert position >= 2 * pairs + gap and token in stored
                assert target[position] == stored[token] == row[position + 1]
                answered.append(token)
        assert sorted(answered) == sorted(stored)  # each key is queried once


def test_more_pairs_than_keys_is_refused():
    with pytest.raises(ValueError, match="5 pairs need as many distinct keys; the vocabulary has 4"):
        recall.recall_batch(np.random.default_rng(0), recall.Vocabulary(4, 4, 2), 1, 5, 0)


def test_tiny_sweep_writes_a_score_per_model_and_cell(tmp_path):
    config = json.loads((ROOT / "experiments/recall/config.json").read_text())
    config.update(pairs=[1, 2], gaps=[0, 5], test_sequences=4,
                  vocabulary={"keys": 8, "values": 8, "fillers": 4},
                  model={"dim": 16, "depth": 1, "heads": 2, "mlp_ratio": 2, "position": "none"})
    config["train"].update(steps=3, batch_size=2, warmup=1)
    config["models"] = {name: config["models"][name] for name in ("lavo-gated-vector", "local")}
    (tmp_path / "config.json").write_text(json.dumps(config))
    recall.main(["--config", str(tmp_path / "config.json"), "--out", str(tmp_path), "--log", "quiet"])
    results = json.loads((tmp_path / "results.json").read_text())
    assert results["chance"] == 0.125
    assert sorted(results["models"]) == ["lavo-gated-vector", "local"]
    for record in results["models"].values():
        assert sorted(record["accuracy"]) == ["1,0", "1,5", "2,0", "2,5"]
        assert all(0 <= a <= 1 for a in record["accuracy"].values())
        assert record["parameters"] > 0
    report = load_script("recall_report", "experiments/recall/report.py")
    report.main([str(tmp_path)])
    assert (tmp_path / "recall_pairs1.png").exists() and "| local |" in (tmp_path / "tables.md").read_text()


context_use = load_script("context_use_probe", "experiments/context_use/context_use.py")


def test_context_use_scores_the_same_targets_at_every_context_length():
    import torch

    from lavo.model import build_model

    torch.manual_seed(0)
    tokens = np.random.default_rng(0).integers(0, 40, 2000)
    model = build_model(dict(vocab_size=40, dim=16, depth=1, heads=2, attention="lavo",
                             attention_options={"window": 8, "write": "gated"}))
    losses = context_use.target_loss(model, tokens, [0, 16, 100], target=24, segments=3, chunk_size=32)
    # An independent computation: one call on each span, loss on its last 24 targets.
    stride = 100 + 24 + 1
    for context, loss in losses.items():
        ends = [(s + 1) * stride for s in range(3)]
        spans = torch.stack([torch.from_numpy(tokens[end - context - 25:end]) for end in ends])
        with torch.no_grad():
            logits, _ = model(spans[:, :-1])
        expected = torch.nn.functional.cross_entropy(logits[:, -24:].flatten(0, 1), spans[:, -24:].flatten())
        assert abs(loss - expected.item()) < 1e-4, context
    with pytest.raises(ValueError, match="3 segments of 1125 tokens need 3375 tokens; the text has 2000"):
        context_use.target_loss(model, tokens, [1100], target=24, segments=3)


passkey = load_script("passkey_probe", "experiments/passkey/passkey.py")


class _Characters:
    """A tokenizer of single characters, enough for the passkey examples."""

    def encode(self, text):
        return [ord(c) % 128 for c in text]


def test_passkey_example_states_the_key_and_ends_with_it():
    tokenizer = _Characters()
    prompt = passkey.Prompt.of(tokenizer)
    prose = np.full(500, ord("x"))
    ids, answered = passkey.passkey_example(np.random.default_rng(0), prose, prompt, tokenizer, 120)
    text = "".join(chr(i) for i in ids)
    assert len(ids) == 120 and answered == 4
    key = text[-3:]
    assert text.startswith(f"The pass key is {key}. Remember it. x") and text.endswith(f"pass key is {key}")
    assert text.count(key) == 2
    with pytest.raises(ValueError, match="a passkey example needs more than"):
        passkey.passkey_example(np.random.default_rng(0), prose, prompt, tokenizer, 60)


def test_passkey_finetune_and_score_run_through_the_cache():
    import torch

    from lavo.model import build_model

    torch.manual_seed(0)
    tokenizer = _Characters()
    prompt = passkey.Prompt.of(tokenizer)
    prose = np.random.default_rng(1).integers(97, 123, 3000)
    model = build_model(dict(vocab_size=128, dim=16, depth=1, heads=2, attention="lavo",
                             attention_options={"window": 8, "memory": "vector"}))
    passkey.finetune(model, prose, prompt, tokenizer, 80, steps=2, batch_size=2, lr=1e-3, seed=0)
    ids, answered = passkey.passkey_example(np.random.default_rng(2), prose, prompt, tokenizer, 200)
    ids = torch.from_numpy(ids)[None]
    chunked = passkey.answer_logits(model, ids, answered, chunk_size=48)
    with torch.no_grad():
        whole = model(ids[:, :-1])[0][0, -answered:]
    torch.testing.assert_close(chunked, whole, atol=1e-4, rtol=1e-4)
    assert 0 <= passkey.passkey_accuracy(model, prose, prompt, tokenizer, 200, samples=2, seed=3) <= 1


def test_passkey_results_are_kept_per_model_and_a_rerun_with_other_settings_is_refused(tmp_path):
    settings = {"steps": 5, "samples": 2, "multiples": [1, 4]}
    passkey.write_results(tmp_path, settings, ["runs/a", "runs/b"], {"a": {"8": 0.5, "32": 0.0}})
    written = json.loads((tmp_path / "results.json").read_text())
    assert written["runs"] == {"a": "runs/a"} and written["steps"] == 5
    assert passkey.finished_runs(tmp_path / "results.json", settings) == {"a": {"8": 0.5, "32": 0.0}}
    assert passkey.finished_runs(tmp_path / "missing.json", settings) == {}
    with pytest.raises(ValueError, match="holds a run with other settings; choose another --out"):
        passkey.finished_runs(tmp_path / "results.json", {**settings, "steps": 6})


@pytest.mark.parametrize("sweep", ["", "single"])
def test_the_probe_models_are_within_4_percent_and_the_sizes_recorded(sweep):
    """The report compares models of 108,800 to 112,964 parameters; built again, each has its recorded count."""
    from lavo.model import count_parameters
    folder = ROOT / "experiments" / "recall" / sweep
    config = json.loads((folder / "config.json").read_text())
    vocab = recall.Vocabulary(**config["vocabulary"])
    counts = {name: count_parameters(recall.probe_model(settings, config, vocab)[0])
              for name, settings in config["models"].items()}
    assert max(counts.values()) <= 1.04 * min(counts.values())
    recorded = json.loads((folder / "results.json").read_text())["models"]
    assert counts == {name: record["parameters"] for name, record in recorded.items()}


def test_the_probes_read_a_runs_documents_only_as_it_recorded_them(tmp_path):
    """experiments/probe_runs.py, which the context-use and passkey probes load runs with, scored a held-out
    document edited after training without a word; it now checks them as `lavo eval` does."""
    from lavo.config import RunConfig
    from lavo.data import DataError, split_tokens
    from lavo.train import train
    from lm_corpus import tiny_run, write_corpus

    corpus = write_corpus(tmp_path / "corpus", documents=4, words=400)
    config = RunConfig.from_dict(tiny_run(corpus, tmp_path / "data", tmp_path / "run", steps=1))
    train(config, log=lambda *args: None)
    probe_runs = load_script("probe_runs", "experiments/probe_runs.py")
    (name, _, _, tokenizer, tokens), = probe_runs.load_runs([str(tmp_path / "run")], None, ("train", "valid"))
    assert name == "run"
    for split in ("train", "valid"):
        np.testing.assert_array_equal(tokens[split], split_tokens(str(corpus), tmp_path / "data", ["doc3"], split,
                                                                  tokenizer))
    with open(corpus / "doc3.txt", "a") as file:
        file.write("one more line\n")
    with pytest.raises(DataError, match=r"edited doc3"):
        list(probe_runs.load_runs([str(tmp_path / "run")], None, ("valid",)))
