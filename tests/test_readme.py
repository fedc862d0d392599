"""The README's Python examples of the layer and the baselines run as written, and print what their comments say;
the library's public classes and functions say what they take and give; the tests, files and functions the docs
cite exist, and so do the flags and settings of the command lines they give."""
import ast
import contextlib
import importlib
import inspect
import io
import re
from pathlib import Path

from lavo import available_attentions
from lavo.registry import attention_class

README = (Path(__file__).resolve().parents[1] / "README.md").read_text()
BLOCKS = re.findall(r"```python\n(.*?)```", README, re.DOTALL)


def test_the_layer_and_baseline_examples_run_in_order_and_print_what_they_say():
    layer_example, baselines_example = BLOCKS[0], BLOCKS[1]
    assert "LavoAttention(" in layer_example and "build_attention(" in baselines_example
    namespace = {}
    printed = run(layer_example, namespace)
    assert tuple(namespace["y"].shape) == (2, 4096, 512) and printed == [str(namespace["cache"].nbytes())]
    # the baselines example continues the session: it calls its layer on the first example's `x`
    printed = run(baselines_example, namespace)
    said = re.search(r"print\(available_attentions\(\)\)\s+# (\[.*\])", baselines_example).group(1)
    assert printed == [said] and ast.literal_eval(said) == available_attentions()
    assert tuple(namespace["y"].shape) == (2, 4096, 512)


def run(source: str, namespace: dict) -> list[str]:
    """Execute ``source`` in ``namespace``; the lines it printed."""
    printed = io.StringIO()
    with contextlib.redirect_stdout(printed):
        exec(compile(source, "README.md", "exec"), namespace)
    return printed.getvalue().splitlines()


def test_the_attentions_table_lists_every_option_with_its_default():
    """docs/ATTENTIONS.md's options column: each mechanism's constructor options and defaults, no more, no less
    (``rank=D`` stands for LAVO's None: the head dimension)."""
    table = (Path(__file__).resolve().parents[1] / "docs" / "ATTENTIONS.md").read_text()
    for name in available_attentions():
        row = re.search(rf"^\| `{name}` \| (.*?) \|", table, re.MULTILINE).group(1)
        listed = dict(re.findall(r"`(\w+)=([^`]+)`", row))
        expected = attention_class(name).option_defaults()
        if name == "lavo":
            assert listed.pop("rank") == "D" and expected.pop("rank") is None
        assert {option: ast.literal_eval(value) for option, value in listed.items()} == expected, name


def test_the_demo_table_is_the_committed_demo_runs():
    """The README's demo table is docs/demo/results.json, the run whose log is beside it."""
    import json
    results = json.loads((Path(__file__).resolve().parents[1] / "docs" / "demo" / "results.json").read_text())
    table = re.search(r"\| model \| L=256 .*?\n\n", README, re.DOTALL).group(0)
    rows = {cells[0]: cells[1:] for line in table.splitlines()[2:] if line.startswith("|")
            for cells in [[cell.strip() for cell in line.strip("|").split("|")]]}
    assert rows == {name: [f"{per_length[length]['ppl']:.2f}" for length in ("256", "512", "1024", "2048")]
                    for name, per_length in results["results"].items()}


# What a model of your own is built from: a module's __all__, or what it defines itself.
LIBRARY = ["lavo", "lavo.layers", "lavo.ops", "lavo.model", "lavo.cache", "lavo.generate", "lavo.registry", "lavo.hf",
           *(f"lavo.ops.{name}" for name in ("abc", "cosformer", "feature_attention", "lavo", "local", "longshort",
                                              "performer", "s4d", "softmax"))]


def test_every_public_class_and_function_of_the_library_has_a_docstring():
    """Was: none for LanguageModel, ModelConfig (its dataclass signature only), build_model,
    available_cross_attentions, cross_attention_class and LavoLMForCausalLM."""
    missing = []
    for module_name in LIBRARY:
        module = importlib.import_module(module_name)
        names = getattr(module, "__all__", None)
        if names is None:
            names = [name for name, value in vars(module).items()
                     if not name.startswith("_") and getattr(value, "__module__", None) == module_name]
        for name in names:
            value = getattr(module, name)
            if not (inspect.isclass(value) or inspect.isfunction(value)):
                continue
            doc = value.__dict__.get("__doc__") if inspect.isclass(value) else value.__doc__
            if not doc or doc.startswith(f"{value.__name__}("):  # a dataclass's generated signature is no docstring
                missing.append(f"{module_name}.{name}")
    assert not missing


ROOT = Path(__file__).resolve().parents[1]
DOCS = sorted(path for pattern in ("*.md", "docs/*.md", "benchmarks/*.md", "experiments/*/*.md")
              for path in ROOT.glob(pattern))


def test_every_test_file_and_module_the_docs_cite_exists():
    """The docs back their claims with tests and files by name (``test_x.py::test_y``, ``lavo/...py``,
    ``lavo.ops.common.reciprocal``): a renamed test or a moved function must not leave them citing nothing."""
    tests = {path.name: {node.name for node in ast.walk(ast.parse(path.read_text()))
                         if isinstance(node, (ast.FunctionDef, ast.ClassDef))}
             for path in (ROOT / "tests").glob("*.py")}
    stale = []
    for doc in DOCS:
        text = doc.read_text()
        for file, name in re.findall(r"(test_\w+\.py)::(\w+)(?![\w*])", text):  # not a glob, test_error_*
            if name not in tests.get(file, ()):
                stale.append(f"{doc.name}: {file}::{name}")
        for path in re.findall(r"`((?:lavo|tests|scripts|benchmarks|experiments|docs|examples)/[\w./-]+\.\w+)`", text):
            if not (ROOT / path).exists():
                stale.append(f"{doc.name}: {path}")
        for dotted in re.findall(r"`(lavo(?:\.\w+)+)", text):
            if dotted != "lavo.attentions" and not resolves(dotted):  # lavo.attentions: an entry-point group
                stale.append(f"{doc.name}: {dotted}")
    assert not stale


def resolves(dotted: str) -> bool:
    """Whether ``dotted`` names a module of lavo, or an attribute reached from one."""
    parts = dotted.split(".")
    for split in range(len(parts), 0, -1):
        try:
            value = importlib.import_module(".".join(parts[:split]))
        except ImportError:
            continue
        for part in parts[split:]:
            if not hasattr(value, part):
                return False
            value = getattr(value, part)
        return True
    return False


# A command line in the docs: `lavo CMD ...` (or `-m lavo.cli CMD`, `-m lavo.bench`) in a code span or a shell block,
# up to the end of its shell command.
COMMAND = re.compile(r"(?:\blavo|-m lavo\.cli) (data|train|curves|eval|generate|export|demo|bench|forecast|listops)\b"
                     r"|-m lavo\.(bench)\b")
FLAG = re.compile(r"(?<![\w-])--[a-z][\w-]*")
SET = re.compile(r"--set\s+'?([\w.]+)=")
# a setting named in prose: data.NAME or train.NAME, not a file (train.py) nor part of a longer name
SETTING = re.compile(r"(?<![\w./-])((?:data|train)\.(?!(?:py|json|md)\b)\w+)\b(?!\.\w)")


def test_every_flag_and_setting_the_docs_give_a_command_exists():
    """Each ``--flag`` of a ``lavo`` command line in the docs is one of that command's flags, and each key it
    ``--set``s, like each ``train.*`` or ``data.*`` setting a code span names, is a setting: a renamed flag or
    setting must not leave the docs giving a command that fails."""
    flags = command_flags()
    wrong = []
    for doc in DOCS:
        text = doc.read_text()
        for command in command_lines(text):
            for name, arguments in commands_in(command):
                wrong += [f"{doc.name}: lavo {name} {flag}" for flag in FLAG.findall(arguments)
                          if flag not in flags[name]]
                wrong += [f"{doc.name}: lavo {name} --set {key}" for key in SET.findall(arguments)
                          if not is_setting(name, key)]
        for span in code_spans(text):
            wrong += [f"{doc.name}: {key}" for key in re.findall(SETTING, span) if not is_setting("train", key)]
    assert not wrong


def command_flags() -> dict[str, set[str]]:
    """Each ``lavo`` command's flags, as its parser has them."""
    import argparse

    from lavo.cli import build_parser
    commands = next(action for action in build_parser()._actions if isinstance(action, argparse._SubParsersAction))
    return {name: {flag for action in parser._actions for flag in action.option_strings}
            for name, parser in commands.choices.items()}


def code_spans(text: str) -> list[str]:
    """The inline code spans of a markdown text (outside its fenced blocks), each on one line."""
    prose = re.sub(r"```.*?```", "", text, flags=re.DOTALL)
    return [span.replace("\n", " ") for span in re.findall(r"`([^`]+)`", prose)]


def command_lines(text: str) -> list[str]:
    """The shell commands of a markdown text: its shell blocks' lines (continuations joined) and its code spans,
    split at pipes, ``;``, ``&&`` and comments."""
    blocks = re.findall(r"```(?:bash|sh)\n(.*?)```", text, re.DOTALL)
    lines = [line for block in blocks for line in block.replace("\\\n", " ").splitlines()] + code_spans(text)
    return [part for line in lines for part in re.split(r"\||;|&&|#", line)]


def commands_in(line: str) -> list[tuple[str, str]]:
    """``(command, the text of its arguments)`` for each ``lavo`` command that ``line`` gives."""
    matches = list(COMMAND.finditer(line))
    ends = [match.start() for match in matches[1:]] + [len(line)]
    return [(match.group(1) or match.group(2), line[match.end():end]) for match, end in zip(matches, ends)]


def is_setting(command: str, key: str) -> bool:
    """Whether ``key`` (``section.name``, deeper within a table setting) is a setting that ``lavo command --set``
    takes."""
    import dataclasses

    from lavo.classify import ListOpsRun
    from lavo.config import DataConfig, TrainConfig
    from lavo.evaluate import EvalSettings
    from lavo.model import ModelConfig

    def fields(kind) -> set[str]:
        return {field.name for field in dataclasses.fields(kind)}

    parts = key.split(".")
    if command == "listops":
        return parts[0] in fields(ListOpsRun)
    sections = {"data": fields(DataConfig), "train": fields(TrainConfig), "model": fields(ModelConfig) | {"preset"}}
    if command == "demo":
        if parts[0] == "runs":  # runs.NAME.section.name: one model's run settings
            parts = parts[2:]
        elif len(parts) == 1:
            return key in {"seconds_per_model", "out_dir"}
        sections["eval"] = fields(EvalSettings)
    return len(parts) >= 2 and parts[1] in sections.get(parts[0], ())


def test_a_script_run_without_arguments_prints_the_usage_its_header_gives():
    """A script's usage message is its header's ``# Usage:`` line (was: scripts/gpu_check.sh's left out
    ``--budget SECONDS``)."""
    import subprocess
    checked = 0
    for script in sorted((ROOT / "scripts").glob("*.sh")):
        header = re.search(r"^# Usage: (?:\[?\w+=\w+\]? )?bash (.*)$", script.read_text(), re.MULTILINE)
        if header is None:
            continue
        run = subprocess.run(["bash", str(script)], capture_output=True, text=True, cwd=ROOT, timeout=60)
        usage = run.stderr.partition("usage: ")[2].strip()
        assert run.returncode != 0 and usage == header.group(1).replace('"', ""), script.name
        checked += 1
    assert checked == 3  # gpu_check.sh, gpu_session.sh, test_stack.sh


# A check the docs give as a one-line command: `python -c "..."`, its code spanning lines at most.
PYTHON_CHECK = re.compile(r'`python -c "([^"]+)"`')


def test_each_python_check_the_docs_give_prints_the_number_they_state_before_it():
    """DESIGN.md states cache sizes and gives the ``python -c`` line that prints each: the number printed is
    one the sentence before the command states (with thousands separators)."""
    checked = 0
    for doc in DOCS:
        text = doc.read_text()
        for match in PYTHON_CHECK.finditer(text):
            printed = run(match.group(1).replace("\n", " ").replace("  ", " "), {})
            assert len(printed) == 1 and printed[0].isdigit(), (doc.name, match.group(1))
            stated = text[max(match.start() - 400, 0):match.start()]
            assert f"{int(printed[0]):,d}" in stated, (doc.name, printed[0])
            checked += 1
    assert checked == 2  # LavoCache.max_nbytes and LavoStepCache.nbytes in docs/DESIGN.md


def test_the_stated_bfloat16_cache_size_is_what_max_nbytes_gives():
    import torch

    from lavo import LavoCache
    design = " ".join((ROOT / "docs" / "DESIGN.md").read_text().split())
    assert "**1,048,839 bytes (1.0 MiB) in float32 and 526,599 bytes in bfloat16**" in design
    assert LavoCache.max_nbytes(1, 8, 64, 64, 128, torch.bfloat16) == 526_599


def test_the_streaming_state_of_the_tiny_preset_has_the_size_the_readme_states():
    """examples/stream_perplexity.py on ``lavo-tiny-austen``: the state holds 202,912 bytes after every chunk of
    2,048 tokens, in each layer 32 cached keys and values (a chunk ends at a window boundary) and the sums."""
    import torch

    from lavo.config import load_config
    from lavo.model import build_model, model_config
    stated = re.search(r"the state holds ([\d,]+) bytes after every chunk of ([\d,]+) tokens", README)
    state_bytes, chunk = (int(number.replace(",", "")) for number in stated.groups())
    model = build_model(model_config(**load_config("lavo-tiny-austen").model, vocab_size=64)).eval()
    cache, sizes = None, []
    with torch.no_grad():
        for _ in range(2):
            _, cache = model(torch.randint(64, (1, chunk)), cache=cache)
            sizes.append(cache.nbytes())
    assert sizes == [state_bytes] * 2
    window, layers = model.config.attention_options["window"], model.config.depth
    assert {tuple(layer.keys.shape) for layer in cache.layers} == {(1, window, model.config.heads,
                                                                    model.config.dim // model.config.heads)}
    assert f"in each of the {layers} layers, {window} of the at most {2 * window - 1} cached keys" in " ".join(
        README.split())


def test_the_preset_sizes_the_readme_states_are_those_of_the_models_built():
    """The demo's two tiny models have 2.56M parameters, the gpu_scale experiment's small ones 27M."""
    from lavo.model import build_model, model_config

    def millions(preset: str, **settings) -> float:
        return sum(p.numel() for p in build_model(model_config(preset, **settings)).parameters()) / 1e6
    tiny = {f"{millions('tiny', **settings):.2f}M" for settings in (
        {"attention": "lavo", "attention_options": {"window": 32}, "position": "none"},
        {"attention": "softmax", "position": "rope"})}
    assert tiny == {re.search(r"both models ([\d.]+M) parameters", README).group(1)}
    small = re.search(r"at the `small` preset \((\d+)M parameters\)", README).group(1)
    assert f"{millions('small', attention='lavo', attention_options={'window': 64}):.0f}" == small
