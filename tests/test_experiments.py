"""The committed experiments compare like with like: every model an experiment's run.sh trains has, within 2%,
the parameters of the others."""
import json
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
from script_loader import load_script

from lavo.config import load_config
from lavo.model import build_model, count_parameters

ROOT = Path(__file__).resolve().parents[1]
# The experiments whose run.sh trains language models through common.sh's train_run (the probes have their own
# scripts and test their models' sizes themselves).
EXPERIMENTS = sorted(p.parent.name for p in (ROOT / "experiments").glob("*/run.sh") if "train_run " in p.read_text())
# Runs the script with its training and evaluation replaced by printing what would be trained.
LIST_RUNS = ('source() { :; }; python() { :; }; eval_runs() { :; }; '
             'train_run() { printf "%s\\t" "$@"; printf "\\n"; }; . "$0"')


def planned_runs(experiment: str) -> dict[str, list[str]]:
    """``{run name: [--set overrides]}`` of the ``train_run`` calls in ``experiments/NAME/run.sh``, each with its
    experiment's base config first."""
    script = ROOT / "experiments" / experiment / "run.sh"
    listing = subprocess.run(["bash", "--norc", "-c", LIST_RUNS, str(script)], cwd=ROOT, capture_output=True,
                             text=True, check=True).stdout
    runs = {}
    for line in listing.splitlines():
        if "\t" not in line:  # the script's own messages
            continue
        directory, name, *options = line.rstrip("\t").split("\t")
        overrides = [value for flag, value in zip(options[::2], options[1::2]) if flag == "--set"]
        runs[name] = [str(ROOT / directory / "base.json"), *overrides]
    return runs


@pytest.mark.parametrize("experiment", EXPERIMENTS)
def test_every_model_of_an_experiment_has_the_same_parameters_within_two_percent(experiment):
    counts = {}
    for name, (base, *overrides) in planned_runs(experiment).items():
        config = load_config(base, overrides)
        counts[name] = count_parameters(build_model(config.model_config(vocab_size=4096)))
    assert len(counts) >= 3
    assert max(counts.values()) <= 1.02 * min(counts.values()), counts


# The experiments whose tables experiments/report_tools.py makes from their evaluation and metrics.
REPORTED = sorted(p.parent.name for p in (ROOT / "experiments").glob("*/run.sh")
                  if "report_tools.py results" in p.read_text())


def test_a_step_run_again_counts_once_in_the_wall_times(tmp_path):
    """A rerun from scratch appends to wall_times.jsonl: each step's latest time counts, not both."""
    report_tools = load_script("report_tools", "experiments/report_tools.py")
    lines = [{"what": "train a", "wall_s": 10}, {"what": "train b", "wall_s": 20}, {"what": "train a", "wall_s": 12}]
    (tmp_path / "wall_times.jsonl").write_text("".join(json.dumps(line) + "\n" for line in lines))
    assert report_tools.wall_times(tmp_path) == [{"what": "train a", "wall_s": 12}, {"what": "train b", "wall_s": 20}]


def test_a_stopped_and_resumed_step_counts_both_attempts_in_the_wall_times(tmp_path):
    report_tools = load_script("report_tools", "experiments/report_tools.py")
    lines = [{"what": "listops a", "wall_s": 30, "finished": False},
             {"what": "listops a", "wall_s": 5, "finished": True},
             {"what": "listops b", "wall_s": 9, "finished": False},  # stopped, not resumed yet: not a finished step
             {"what": "listops a", "wall_s": 40, "finished": False},  # run again from scratch
             {"what": "listops a", "wall_s": 2, "finished": True}]
    (tmp_path / "wall_times.jsonl").write_text("".join(json.dumps(line) + "\n" for line in lines))
    assert report_tools.wall_times(tmp_path) == [{"what": "listops a", "wall_s": 42}]  # the latest run, both parts


def test_the_queue_records_a_stopped_attempt_as_unfinished_and_stops(tmp_path):
    root = tmp_path / "repo"  # common.sh with an empty virtual environment
    (root / "experiments").mkdir(parents=True)
    (root / ".venv" / "bin").mkdir(parents=True)
    (root / ".venv" / "bin" / "activate").write_text("")
    shutil.copy(ROOT / "experiments" / "common.sh", root / "experiments")
    queue = f"source {root}/experiments/common.sh; timed {tmp_path} 'listops a' {tmp_path}/a.log "
    stopped = subprocess.run(["bash", "-c", queue + "bash -c 'exit 130'; echo next"], capture_output=True, text=True)
    assert stopped.returncode == 130 and "next" not in stopped.stdout  # lavo's exit after Ctrl-C ends the queue
    assert re.fullmatch(r"\[stopped\] listops a after \d+ s \(exit 130\)\n", stopped.stdout)
    resumed = subprocess.run(["bash", "-c", queue + "true"], capture_output=True, text=True, check=True)
    assert re.fullmatch(r"\[done\] listops a in \d+ s\n", resumed.stdout)
    entries = [json.loads(line) for line in (tmp_path / "wall_times.jsonl").read_text().splitlines()]
    assert [entry["finished"] for entry in entries] == [False, True]


@pytest.mark.parametrize("experiment", REPORTED)
def test_the_committed_tables_are_what_the_report_tool_makes_of_the_committed_results(experiment, monkeypatch):
    """No committed number drifts from its source: results.json is what the evaluation and the runs' metrics
    give, and tables.md and REPORT.md's tables are what results.json gives."""
    report_tools = load_script("report_tools", "experiments/report_tools.py")
    monkeypatch.chdir(ROOT)  # the evaluation names its runs relative to the repository
    exp = ROOT / "experiments" / experiment
    result = report_tools.collect(exp)
    assert result == json.loads((exp / "results.json").read_text())
    tables = report_tools.make_tables(result, experiment)
    assert report_tools.tables_markdown(tables) == (exp / "tables.md").read_text()
    report = (exp / "REPORT.md").read_text()
    assert report_tools.filled(report, tables)[0] == report


def test_a_report_without_a_tables_markers_is_told_so(tmp_path, capsys):
    report_tools = load_script("report_tools", "experiments/report_tools.py")
    report = tmp_path / "REPORT.md"
    report.write_text("<!-- BEGIN main -->\nold\n<!-- END main -->\n"
                      "<!-- BEGIN renamed -->\nold\n<!-- END renamed -->\n")
    report_tools.fill(report, {"main": "new", "delta": "a table"})
    assert report.read_text().startswith("<!-- BEGIN main -->\nnew\n<!-- END main -->")
    assert capsys.readouterr().err == f"note: {report} has no markers for the tables delta, which it leaves out\n"
    report_tools.fill(report, {"main": "new", "delta": "a table"}, shown={"main"})  # delta is not its to show
    assert capsys.readouterr().err == ""


@pytest.mark.parametrize("experiment", REPORTED)
def test_rewriting_a_clones_tables_says_nothing_is_missing(experiment, tmp_path, capsys):
    """run.sh in a clone only rewrites the tables, and said of every report that it had no markers for the tables
    it does not mean to show (paper, delta): a note that should only come when a marker is lost."""
    report_tools = load_script("report_tools", "experiments/report_tools.py")
    exp = tmp_path / experiment
    exp.mkdir()
    for name in ("results.json", "REPORT.md"):
        shutil.copy(ROOT / "experiments" / experiment / name, exp / name)
    report_tools.tables(exp)
    assert capsys.readouterr().err == ""
    assert (exp / "REPORT.md").read_text() == (ROOT / "experiments" / experiment / "REPORT.md").read_text()


@pytest.mark.parametrize("script", ["listops/report.py", "forecasting/report.py", "memory_lm/report.py",
                                    "recall/report.py", "report_tools.py tables"])
def test_a_report_without_its_experiment_folder_prints_its_usage(script, tmp_path):
    """Was: IndexError: list index out of range (none given), or a FileNotFoundError traceback."""
    path, *command = script.split()
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    for folder, says in (([], ""), ([str(tmp_path / "nowhere")], f"\n{tmp_path / 'nowhere'} is not a folder")):
        done = subprocess.run([sys.executable, str(ROOT / "experiments" / path), *command, *folder], env=env,
                              capture_output=True, text=True)
        assert done.returncode == 1 and done.stdout == "", done.stderr
        assert re.fullmatch(rf"usage: {re.escape(Path(path).name)} .*EXPERIMENT_DIR.*{re.escape(says)}\n", done.stderr,
                            re.S), done.stderr
