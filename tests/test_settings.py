"""Bad values: every setting and flag is checked against its declared type and range before any work, and the
error names the setting, the value and what is allowed."""
import argparse
import re
from dataclasses import dataclass

import pytest

from lavo.cli import build_parser, main
from lavo.config import load_config
from lavo.evaluate import perplexity_by_length
from lavo.generate import generate
from lavo.settings import SettingsError, at_least, check_settings, comma_list, flag_type, one_of, setting


@pytest.mark.parametrize("override,message", [
    ("train.lr=abc", "train.lr must be a number > 0; got 'abc' (a string)"),
    ("train.steps=ten", "train.steps must be an integer >= 1; got 'ten' (a string)"),
    ("train.steps=0", "train.steps must be an integer >= 1; got 0"),
    ("train.steps=-5", "train.steps must be an integer >= 1; got -5"),
    ("train.steps=2.5", "train.steps must be an integer >= 1; got 2.5"),
    ("train.log_interval=0", "train.log_interval must be an integer >= 1; got 0"),
    ("train.grad_accum=0", "train.grad_accum must be an integer >= 1; got 0"),
    ("train.batch_size=0", "train.batch_size must be an integer >= 1; got 0"),
    ("train.device=gpu", "train.device must be auto, cpu, cuda or cuda:N; got 'gpu' (a string)"),
    ("train.dtype=float64", "train.dtype must be one of float32, bfloat16, float16; got 'float64' (a string)"),
    ("train.beta2=1", "train.beta2 must be a number in [0, 1); got 1"),
    ("train.progress=1", "train.progress must be true or false; got 1"),
    ("train.time_limit=-1", "train.time_limit must be a number >= 0, or null; got -1"),
    ("train.min_lr=0.5", "train.min_lr must be at most train.lr (0.002); got 0.5"),
    ("data.tokenizer=bpe100", "data.tokenizer must be gpt2 or bpe<vocab size> with vocab size > 257"),
    ("data.tokenizer=bpe99999999999", "data.tokenizer must be gpt2 or bpe<vocab size> with vocab size > 257 and "
                                      "at most 1048576, e.g. bpe4096; got 'bpe99999999999'"),
    ("train.out_dir=", "train.out_dir must be a folder path; got ''"),
    ("data.holdout=\"persuasion\"", "data.holdout must be a non-empty list of strings, or null; got 'persuasion'"),
    # text that is not JSON stays a string: the message shows the JSON it was likely meant as
    ("data.holdout=[emma, persuasion]", "data.holdout must be a non-empty list of strings, or null; got "
                                        "'[emma, persuasion]' (a string; write a list as JSON, [\"emma\", "
                                        "\"persuasion\"], in --set too)"),
    ("model.attention_options={window: 32}", "model.attention_options must be a table; got '{window: 32}' (a "
                                             "string; write a table as JSON, {\"window\": 32}, in --set too)"),
    ("model.depth=0", "model.depth must be an integer >= 1; got 0"),
    ("model.dropout=1.5", "model.dropout must be a number in [0, 1); got 1.5"),
    ("model.attention_options.window=0", "model.attention_options {'window': 0} do not build a 'lavo' layer"),
])
def test_bad_settings_are_refused_when_the_config_loads(override, message, capsys):
    with pytest.raises(ValueError, match="^" + re.escape(message)):
        load_config("lavo-tiny-austen", [override])
    assert main(["train", "--config", "lavo-tiny-austen", "--set", override]) == 2
    err = capsys.readouterr().err
    assert err.startswith(f"lavo train: error: {message}") and "Traceback" not in err


def test_a_toml_config_loads_as_its_json_twin(tmp_path):
    (tmp_path / "run.toml").write_text(
        '[data]\nsource = "austen"\ntokenizer = "bpe4096"\ndata_dir = "data"\n\n'
        '[model]\npreset = "tiny"\nattention = "lavo"\nposition = "none"\n\n'
        '[model.attention_options]\nwindow = 32\n\n'
        '[train]\nout_dir = "runs/lavo-tiny-austen"\ntrain_length = 256\nbatch_size = 8\nsteps = 2000\n'
        'lr = 2e-3\nmin_lr = 2e-4\nwarmup = 50\neval_interval = 250\ncheckpoint_interval = 250\n')
    assert load_config(tmp_path / "run.toml", ["train.steps=7"]) == load_config("lavo-tiny-austen", ["train.steps=7"])
    assert load_config(tmp_path / "run.toml").model["attention_options"] == {"window": 32}


def test_every_bad_setting_is_listed_at_once():
    with pytest.raises(SettingsError, match=r"train.steps must be .*; got 0; train.lr must be .*; got 'x'"):
        load_config(None, ["train.steps=0", "train.lr=x"])


def test_numbers_are_converted_to_their_type():
    config = load_config(None, ["train.lr=1", "train.time_limit=5"])
    assert config.train.lr == 1.0 and isinstance(config.train.lr, float) and config.train.time_limit == 5.0


@pytest.mark.parametrize("argv,message", [
    (["eval", "r", "--lengths", "-256"], "argument --lengths: must be a non-empty list of integers, each >= 1; "
                                         "got '-256'"),
    (["eval", "r", "--lengths", "0"], "argument --lengths: must be a non-empty list of integers, each >= 1"),
    (["eval", "r", "--chunk-size", "-5"], "argument --chunk-size: must be an integer >= 0; got '-5'"),
    (["eval", "r", "--batch-size", "0"], "argument --batch-size: must be an integer >= 1; got '0'"),
    (["eval", "r", "--multiples", "1,x"], "argument --multiples: must be a non-empty list of numbers, each > 0"),
    (["eval", "r", "--split", "test"], "argument --split: invalid choice: 'test'"),
    (["generate", "r", "--num-samples", "0"], "argument --num-samples: must be an integer >= 1; got '0'"),
    (["generate", "r", "--top-p", "0"], "argument --top-p: must be a number in (0, 1]; got '0'"),
    (["generate", "r", "--top-p", "2"], "argument --top-p: must be a number in (0, 1]; got '2'"),
    (["generate", "r", "--top-k", "-5"], "argument --top-k: must be an integer >= 0; got '-5'"),
    (["generate", "r", "--temperature", "-1"], "argument --temperature: must be a number >= 0; got '-1'"),
    (["generate", "r", "--device", "gpu"], "argument --device: must be auto, cpu, cuda or cuda:N; got 'gpu'"),
    (["generate", "r", "--seed", str(2**63)], f"argument --seed: must be an integer in [0, 2^63); got '{2**63}'"),
    (["listops", "--out", "o", "--seed", "-1"], "argument --seed: must be an integer in [0, 2^63); got '-1'"),
    (["data", "--tokenizer", "wordpiece"], "argument --tokenizer: must be gpt2 or bpe<vocab size>"),
    (["train", "--resume", "--overwrite"], "argument --overwrite: not allowed with argument --resume"),
    (["curves", "r", "--smooth", "1"], "argument --smooth: must be a number in [0, 1); got '1'"),
    (["curves", "r", "--smooth", "-0.5"], "argument --smooth: must be a number in [0, 1); got '-0.5'"),
    (["curves", "r", "--smooth", "nan"], "argument --smooth: must be a number in [0, 1); got 'nan'"),
    (["eval", "r", "--parts", " , "], "argument --parts: must be a non-empty comma-separated list; got ' , '"),
    (["forecast", "--cross", "lavo, nope"], "argument --cross: unknown nope; choose from "),
])
def test_bad_flags_are_refused_by_the_parser(argv, message, capsys):
    with pytest.raises(SystemExit) as exit_info:
        main(argv)
    assert exit_info.value.code == 2
    assert f"lavo {argv[0]}: error: {message}" in capsys.readouterr().err


def test_list_flags_drop_the_spaces_around_their_items():
    from lavo.config import DataConfig
    from lavo.evaluate import EvalSettings
    assert flag_type(DataConfig, "holdout")("doc0, doc1") == ["doc0", "doc1"]
    assert flag_type(EvalSettings, "lengths")(" 256 , 512") == [256, 512]
    assert build_parser().parse_args(["eval", "r", "--parts", "austen, shakespeare"]).parts == ["austen", "shakespeare"]
    assert comma_list(int)("0, 256,") == [0, 256]


def test_a_list_item_of_the_wrong_type_is_named_by_argparse(capsys):
    parser = argparse.ArgumentParser(prog="probe")
    parser.add_argument("--contexts", type=comma_list(int))
    with pytest.raises(SystemExit):
        parser.parse_args(["--contexts", "0,a"])
    assert "probe: error: argument --contexts: invalid comma-separated int value: '0,a'" in capsys.readouterr().err


def test_the_library_checks_the_same_ranges():
    with pytest.raises(SettingsError, match=r"eval.lengths must be a non-empty list of integers, each >= 1, or null; "
                                            r"got \[-256\]"):
        perplexity_by_length(None, [1, 2, 3], [-256])
    with pytest.raises(SettingsError, match=r"eval.chunk_size must be an integer >= 0, or null; got -5"):
        perplexity_by_length(None, [1, 2, 3], [2], chunk_size=-5)
    with pytest.raises(SettingsError, match="sampling.num_samples must be an integer >= 1; got 0"):
        generate(None, [1], 5, num_samples=0)
    with pytest.raises(SettingsError, match=r"sampling.top_p must be a number in \(0, 1\], or null; got 2"):
        generate(None, [1], 5, top_p=2)


@dataclass
class Example:
    count: int = setting(1, at_least(1))
    mode: str = setting("a", one_of("a", "b"))
    sizes: list[int] | None = setting(None, at_least(2))

    def __post_init__(self):
        check_settings(self, "example")


def test_one_declaration_checks_the_dataclass_and_the_flag():
    assert Example(3, "b", [2, 5]).sizes == [2, 5]
    with pytest.raises(SettingsError, match=r"example.count must be an integer >= 1; got True; "
                                            r"example.mode must be one of a, b; got 'c' \(a string\); "
                                            r"example.sizes must be a non-empty list of integers, each >= 2, or "
                                            r"null; got \[2, 1\]"):
        Example(True, "c", [2, 1])
    parse = flag_type(Example, "sizes")
    assert parse("2,3") == [2, 3]
    # argparse reports an ArgumentTypeError's own words; any other error as "invalid parse_flag value"
    with pytest.raises(argparse.ArgumentTypeError,
                       match=r"^must be a non-empty list of integers, each >= 2; got '2,1'$"):
        parse("2,1")
