"""Evaluation by length: the same tokens at every length, chunked scoring through the cache, outputs."""
import json
import math
import signal

import numpy as np
import pytest
import torch
from stops import stop_by

from lavo.evaluate import format_table, perplexity_by_length, save_plot, segment_nll, shared_length
from lavo.model import build_model


class Bigram(torch.nn.Module):
    """Predicts from the current token only: its loss depends on which tokens are scored, not on the context."""

    supports_decoding = True

    def __init__(self, vocab):
        super().__init__()
        torch.manual_seed(0)
        self.table = torch.nn.Embedding(vocab, vocab)
        self.seen = []

    def forward(self, ids, padding_mask=None, cache=None):
        self.seen.append(ids.shape)
        return self.table(ids), (0 if cache is None else cache) + ids.shape[1]


def test_every_length_scores_the_same_tokens():
    tokens = np.random.default_rng(0).integers(0, 50, 1000).astype(np.uint16)
    model = Bigram(50)
    results = perplexity_by_length(model, tokens, [16, 32, 64, 128], batch_size=3, chunk_size=None)
    assert shared_length(1000, [16, 32, 64, 128]) == 896
    assert {r["tokens"] for r in results.values()} == {896}
    assert [results[L]["segments"] for L in (16, 32, 64, 128)] == [56, 28, 14, 7]
    losses = [results[L]["loss"] for L in (16, 32, 64, 128)]
    assert max(losses) - min(losses) < 1e-6  # float32 rounding; other tokens differ by ~1e-2
    # and those are the first 896 targets
    with torch.no_grad():
        logits = model.table(torch.from_numpy(tokens[:896].astype(np.int64)))
        expected = torch.nn.functional.cross_entropy(logits, torch.from_numpy(tokens[1:897].astype(np.int64)))
    assert abs(losses[0] - expected.item()) < 1e-5
    assert results[16]["ppl"] == pytest.approx(math.exp(expected.item()), rel=1e-5)  # the perplexity: e^loss


def test_max_tokens_and_too_short_text():
    assert shared_length(1000, [100, 300], max_tokens=700) == 600
    with pytest.raises(ValueError, match="at least 513 tokens"):
        shared_length(400, [256, 512])
    assert shared_length(2000, [48, 128]) == 1920  # a multiple of both (lcm 384), not only of 128


def test_a_loss_past_floats_range_of_perplexity_is_an_infinite_perplexity(tmp_path):
    """A diverged model, its logits in the thousands (was: OverflowError from math.exp, after all the scoring)."""
    model = Bigram(50)
    with torch.no_grad():
        model.table.weight.mul_(1e4)
    tokens = np.random.default_rng(0).integers(0, 50, 1000).astype(np.uint16)
    result = perplexity_by_length(model, tokens, [16], chunk_size=None)[16]
    assert result["loss"] > 1000 and result["ppl"] == math.inf
    assert "  inf" in format_table({"diverged": {16: result}})
    assert save_plot({"diverged": {16: result}, "fine": {16: {"ppl": 30.0}}}, tmp_path / "p.png").is_file()


def test_chunked_scoring_through_the_cache_equals_one_pass():
    torch.manual_seed(0)
    model = build_model(dict(vocab_size=70, dim=32, depth=2, heads=2, attention="lavo",
                             attention_options={"window": 8})).eval()
    segments = torch.randint(0, 70, (2, 101))
    one_pass = segment_nll(model, segments, chunk_size=None)
    chunked = segment_nll(model, segments, chunk_size=24)
    torch.testing.assert_close(chunked, one_pass, rtol=1e-5, atol=1e-4)


def test_chunks_are_fed_through_the_cache():
    model = Bigram(10)
    segment_nll(model, torch.zeros(1, 101, dtype=torch.long), chunk_size=32)
    assert [s[1] for s in model.seen] == [32, 32, 32, 4]


def test_table_and_plot(tmp_path):
    results = {"lavo": {256: {"ppl": 30.0, "tokens": 2048}, 512: {"ppl": 29.0, "tokens": 2048}},
               "softmax-rope": {256: {"ppl": 28.0, "tokens": 2048}, 512: {"ppl": 80.5, "tokens": 2048}}}
    table = format_table(results)
    assert "L=256" in table and "80.50" in table and "same 2048 held-out tokens" in table
    path = save_plot(results, tmp_path / "p.png", train_length=256)
    assert path.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_any_text_is_scored_with_the_runs_tokenizer(tmp_path, capsys):
    from lavo.cli import main
    from lavo.config import RunConfig
    from lavo.data import DataError, tokenize
    from lavo.evaluate import text_documents
    from lavo.run import load_run
    from lavo.train import train
    from lm_corpus import tiny_run, write_corpus
    corpus = write_corpus(tmp_path / "corpus", documents=4, words=1500)
    train(RunConfig.from_dict(tiny_run(corpus, tmp_path / "data", tmp_path / "run", steps=2)), log=lambda *_: None)
    model, _, tokenizer = load_run(tmp_path / "run")
    texts = write_corpus(tmp_path / "texts", documents=2, words=400, seed=5)

    folder = tokenize(text_documents(texts), tokenizer)
    one = tokenize(text_documents(texts / "doc1.txt"), tokenizer)
    first = tokenizer.encode((texts / "doc0.txt").read_text()) + [tokenizer.eot_id]
    assert folder.tolist() == first + one.tolist()
    assert one[-1] == tokenizer.eot_id
    for blank in ("", " \n\t\n"):  # were scored as an end-of-text token or a few blanks
        (texts / "blank.txt").write_text(blank)
        with pytest.raises(DataError, match=r"--text .*blank.txt is empty or holds only whitespace: nothing to score"):
            text_documents(texts / "blank.txt")
    assert len(text_documents(texts)) == 2  # a folder leaves such a file out
    (tmp_path / "no-texts").mkdir()  # was: advice to use --source austen, a flag of lavo data
    with pytest.raises(DataError, match=r"^no .txt files in .*no-texts: give --text a .txt file, or a folder of them$"):
        text_documents(tmp_path / "no-texts")
    (texts / "more").mkdir()
    (texts / "more" / "inner.txt").write_text("a text in a subfolder\n")
    told = []  # was: left out without a word, unlike a folder source's
    assert len(text_documents(texts, told.append)) == 2
    assert told == [f"note: the documents are the .txt files directly in {texts}; not read: more/inner.txt"]

    capsys.readouterr()
    assert main(["eval", str(tmp_path / "run"), "--text", str(texts), "--lengths", "16,32", "--chunk-size", "12",
                 "--quiet", "--out", str(tmp_path / "eval")]) == 0
    assert f"tokens of {texts} at every length" in capsys.readouterr().out
    saved = json.loads((tmp_path / "eval" / "results.json").read_text())
    expected = perplexity_by_length(model, folder, [16, 32], chunk_size=12)
    assert saved["text"] == str(texts) and saved["split"] is None
    assert saved["steps"] == {"run": 2}  # was: not recorded, so a run evaluated mid-training could not be told
    assert saved["results"]["run"] == {str(length): result for length, result in expected.items()}
    assert main(["eval", str(tmp_path / "run"), "--text", str(tmp_path / "nothing.txt"), "--lengths", "16"]) == 2
    assert "no such file or folder" in capsys.readouterr().err
    for flags in (["--split", "train"], ["--parts", "python"]):  # were ignored: the text was scored all the same
        assert main(["eval", str(tmp_path / "run"), "--text", str(texts), "--lengths", "16", *flags]) == 2
        assert capsys.readouterr().err == (f"lavo eval: error: --text {texts} scores that text in place of a run's "
                                           f"documents, so {' '.join(flags)} would be ignored: leave out one or the "
                                           "other\n")


def test_a_run_scores_the_documents_it_held_out_after_files_are_added_to_its_folder(tmp_path, capsys):
    """A folder's default held-out documents are its last ~10% by name: the run records which they were, so a
    file added later (sorting after them) does not move a training document into the evaluation."""
    from lavo.config import RunConfig
    from lavo.evaluate import evaluate_runs
    from lavo.train import train
    from lm_corpus import tiny_run, write_corpus
    corpus = write_corpus(tmp_path / "corpus", documents=4, words=1500)
    config = tiny_run(corpus, tmp_path / "data", tmp_path / "run", steps=2)
    config["data"]["holdout"] = None
    train(RunConfig.from_dict(config), log=lambda *_: None)
    assert json.loads((tmp_path / "run" / "config.json").read_text())["data"]["holdout"] == ["doc3"]
    before = evaluate_runs([str(tmp_path / "run")], lengths=[32], device="cpu", progress=False, log=lambda *_: None)
    for name in ("zz0", "zz1", "zz2", "zz3", "zz4", "zz5"):  # 10 documents: the default would hold out two
        (corpus / f"{name}.txt").write_text((corpus / "doc0.txt").read_text())
    after = evaluate_runs([str(tmp_path / "run")], lengths=[32], device="cpu", progress=False, log=lambda *_: None)
    assert after == before


@pytest.mark.parametrize("spread", [False, True])
def test_every_length_scores_the_same_targets_first_or_spread_over_the_text(spread):
    from lavo.evaluate import segment_starts
    lengths, num_tokens, n = [4, 6, 12], 1000, 48  # windows of lcm = 12 targets, four of them
    targets = {}
    for length in lengths:
        starts = segment_starts(num_tokens, n, lengths, length, spread)
        assert len(starts) == n // length and all(start + length + 1 <= num_tokens for start in starts)
        targets[length] = sorted(t for start in starts for t in range(start + 1, start + length + 1))
    assert targets[4] == targets[6] == targets[12] and len(set(targets[4])) == n  # the same N, none twice
    if spread:  # from the text's start to its end
        assert targets[12][0] == 1 and targets[12][-1] == num_tokens - 1
    else:
        assert targets[12] == list(range(1, n + 1))


def test_a_runs_documents_are_checked_and_runs_that_score_different_texts_are_told_apart(tmp_path):
    """A folder source may change after training: evaluation refuses documents that are no longer those the run
    recorded, and a table of runs that held out different documents says so instead of 'the same N tokens'."""
    from lavo.config import RunConfig
    from lavo.data import DataError
    from lavo.evaluate import evaluate_runs
    from lavo.hf import export_run
    from lavo.train import train
    from lm_corpus import tiny_run, write_corpus
    corpus = write_corpus(tmp_path / "corpus", documents=4, words=1500)
    for name, holdout in (("a", ["doc3"]), ("b", ["doc2"])):
        values = tiny_run(corpus, tmp_path / "data", tmp_path / name, steps=2)
        values["data"]["holdout"] = holdout
        train(RunConfig.from_dict(values), log=lambda *_: None)
    lines = []
    evaluate_runs([str(tmp_path / "a"), str(tmp_path / "b")], lengths=[16, 32], progress=False, log=lines.append)
    assert lines[0].startswith("warning: the runs score different texts")
    assert "held-out tokens, not the same ones for every run (other documents or tokenizers)" in lines[1]
    export_run(tmp_path / "a", tmp_path / "a-exported")
    lines.clear()
    same = evaluate_runs([str(tmp_path / "a"), str(tmp_path / "a-exported")], lengths=[16], progress=False,
                         log=lines.append)
    assert "the same 3712 held-out tokens" in lines[0] and same["a"] == same["a-exported"]

    with open(corpus / "doc3.txt", "a") as file:
        file.write("one more line\n")
    (corpus / "doc9.txt").write_text("a new document\n")
    for run in ("a", "a-exported"):
        with pytest.raises(DataError, match="the valid documents of .* are not those the run recorded: edited doc3"):
            evaluate_runs([str(tmp_path / run)], lengths=[16], progress=False, log=lines.append)
    with pytest.raises(DataError, match="the train documents of .* are not those the run recorded: added doc9"):
        evaluate_runs([str(tmp_path / "b")], lengths=[16], split="train", progress=False, log=lines.append)
    evaluate_runs([str(tmp_path / "b")], lengths=[16], progress=False, log=lines.append)  # doc2 is as it was
    with pytest.raises(DataError, match=r"^python is not a part of the source '.*corpus' \(it is not a mix\)$"):
        evaluate_runs([str(tmp_path / "b")], lengths=[16], parts=["python"], progress=False, log=lines.append)


def test_what_keeps_lengths_from_being_scored_is_named():
    with pytest.raises(ValueError, match=r"least common multiple 128000, .* the evaluation text has 9,885 tokens: use "
                                         "lengths that divide one another"):
        shared_length(9885, [32, 1000, 1024])
    with pytest.raises(ValueError, match="so at least 33 tokens; the evaluation text has 1 token: use shorter lengths"):
        shared_length(1, [32])  # was: "has 1 tokens"
    with pytest.raises(ValueError, match="--max-tokens 200 allows fewer: use shorter lengths or a larger --max-tokens"):
        shared_length(9885, [32, 256], max_tokens=200)
    with pytest.raises(ValueError, match="33 tokens; the evaluation text has 29 tokens: use shorter lengths$"):
        shared_length(29, [32], max_tokens=5)  # was: advice to raise --max-tokens, which could not help
    tokens = np.random.default_rng(0).integers(0, 50, 1000).astype(np.uint16)
    with pytest.warns(UserWarning, match="spread: only one window of 64 targets .*: use a larger --max-tokens or "
                                         "shorter lengths to spread them$"):
        perplexity_by_length(Bigram(50), tokens, [32, 64], spread=True, max_tokens=100)
    with pytest.warns(UserWarning, match=r"is scored, so it is the text's first: use shorter lengths to spread them$"):
        perplexity_by_length(Bigram(50), tokens[:100], [32, 64], spread=True)  # was: advice to raise --max-tokens


def test_a_length_past_a_layers_position_bound_is_refused_before_scoring():
    from lavo.evaluate import LoadedModel, check_position_bounds
    torch.manual_seed(0)
    model = build_model(dict(vocab_size=70, dim=32, depth=2, heads=2, attention="cosformer",
                             attention_options={"max_length": 256}))
    check_position_bounds([LoadedModel("cos", "runs/cos", model, None, None, None)], 256)
    with pytest.raises(ValueError, match=r"cos reads at most 256 positions \(its CosformerAttention with "
                                         r"max_positions=256\), fewer than the length 512: evaluate it at lengths "
                                         "up to 256"):
        check_position_bounds([LoadedModel("cos", "runs/cos", model, None, None, None)], 512)


@pytest.mark.parametrize("number", [signal.SIGINT, signal.SIGTERM], ids=["ctrl-c", "sigterm"])
def test_a_stop_during_an_evaluation_prints_the_lengths_scored_and_writes_no_results(number, tmp_path, capsys,
                                                                                     monkeypatch):
    """Was: exit 130 and nothing printed, every length scored before it lost; SIGTERM (`timeout`, a job
    scheduler) ended the process at once."""
    import lavo.evaluate
    from lavo.cli import main
    from lavo.config import RunConfig
    from lavo.train import train
    from lm_corpus import tiny_run, write_corpus
    corpus = write_corpus(tmp_path / "corpus", documents=4, words=1500)
    train(RunConfig.from_dict(tiny_run(corpus, tmp_path / "data", tmp_path / "run", steps=2)), log=lambda *_: None)
    whole = lavo.evaluate.evaluate_runs([str(tmp_path / "run")], lengths=[16, 32, 64], device="cpu",
                                        progress=False, log=lambda *_: None)["run"]
    scoring = lavo.evaluate.segment_nll

    def stopped_at_64(model, segments, chunk_size=None):
        if segments.shape[1] == 65:
            stop_by(number)
        return scoring(model, segments, chunk_size)

    monkeypatch.setattr(lavo.evaluate, "segment_nll", stopped_at_64)
    flags = ["--lengths", "16,32,64", "--device", "cpu", "--quiet"]
    handler = signal.getsignal(signal.SIGTERM)
    assert main(["eval", str(tmp_path / "run"), *flags, "--out", str(tmp_path / "eval")]) == 128 + number
    assert signal.getsignal(signal.SIGTERM) is handler  # restored
    out, err = capsys.readouterr()
    assert out == format_table({"run": {length: whole[length] for length in (16, 32)}}) + "\n"
    assert err == (f"interrupted: the table holds the 2 of 3 lengths scored before it; {tmp_path / 'eval'} is left "
                   "as it was\n")
    assert not (tmp_path / "eval").exists()


def test_eval_names_the_checkpoint_step_and_refuses_one_replaced_while_it_loads(tmp_path, monkeypatch):
    """The step scored is the step of the weights loaded: a checkpoint a training run writes during the load
    is refused by name rather than recorded under the earlier step."""
    from pathlib import Path

    from safetensors.torch import load_file, save_file

    import lavo.evaluate
    from lavo.config import RunConfig
    from lavo.evaluate import evaluate_runs
    from lavo.run import RunError
    from lavo.train import train
    from lm_corpus import tiny_run, write_corpus
    corpus = write_corpus(tmp_path / "corpus", documents=4, words=1500)
    train(RunConfig.from_dict(tiny_run(corpus, tmp_path / "data", tmp_path / "run", steps=3)), log=lambda *_: None)
    told = []
    evaluate_runs([str(tmp_path / "run")], lengths=[16], max_tokens=64, log=told.append)
    assert told[0] == "scoring run (checkpoint of step 3) at lengths 16"

    loading = lavo.evaluate.load_model_dir

    def load_then_checkpoint(directory, device):
        loaded = loading(directory, device)
        weights = Path(directory) / "model.safetensors"
        save_file(load_file(weights), weights, metadata={"step": "4", "checkpoint": "next"})
        return loaded

    monkeypatch.setattr(lavo.evaluate, "load_model_dir", load_then_checkpoint)
    with pytest.raises(RunError, match=r"^.*run saved a new checkpoint while it was being loaded: evaluate it again$"):
        evaluate_runs([str(tmp_path / "run")], lengths=[16], max_tokens=64, log=told.append)
