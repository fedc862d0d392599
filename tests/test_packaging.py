"""What `pip install lavo` (not editable) gets: a wheel built from this tree holds every module and the bundled
configs, nothing else, and works from where it is installed; the version stands the same everywhere."""
from __future__ import annotations

import os
import re
import shutil
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest

import lavo
from lavo.config import tomllib  # the standard library's, or tomli on Python 3.10

ROOT = Path(__file__).resolve().parents[1]


def project_table() -> dict:
    return tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]


def test_the_version_is_the_same_in_the_package_its_metadata_and_its_citation():
    citation = re.search(r'^version: "([^"]+)"$', (ROOT / "CITATION.cff").read_text(), re.MULTILINE)
    assert citation is not None, "CITATION.cff has no version line"
    assert project_table()["version"] == lavo.__version__ == citation.group(1)


def test_the_code_needs_no_python_newer_than_the_oldest_it_declares():
    pytest.importorskip("vermin")  # the test extra's
    oldest = re.fullmatch(r">=(3\.\d+)", project_table()["requires-python"]).group(1)
    # vermin reads the source and names the first Python each construct and standard module needs.
    vermin = [sys.executable, "-c", "import sys, vermin; sys.exit(vermin.main())"]
    found = subprocess.run([*vermin, "--no-tips", "--violations", f"-t={oldest}-",
                            *(str(ROOT / part) for part in ("lavo", "tests", "examples"))],
                           capture_output=True, text=True)
    assert found.returncode == 0, found.stdout


def test_the_declared_license_is_the_license_file():
    assert project_table()["license"] == {"text": "MIT"}
    assert (ROOT / "LICENSE").read_text().startswith("MIT License\n")


@pytest.fixture(scope="module")
def wheel(tmp_path_factory) -> Path:
    pytest.importorskip("setuptools", minversion="70.1")  # the test extra's: it builds wheels without `wheel`
    source, out = tmp_path_factory.mktemp("source"), tmp_path_factory.mktemp("wheel")
    # A copy of what the build reads, so that setuptools' build folders stay out of the work tree.
    for name in ("pyproject.toml", "README.md", "LICENSE"):
        shutil.copy(ROOT / name, source)
    shutil.copytree(ROOT / "lavo", source / "lavo", ignore=shutil.ignore_patterns("__pycache__"))
    # No build isolation: the test extra brings the setuptools pyproject.toml asks for, so no download is needed.
    subprocess.run([sys.executable, "-m", "pip", "wheel", "--quiet", "--no-deps", "--no-build-isolation",
                    "--disable-pip-version-check", "--wheel-dir", str(out), str(source)], check=True)
    (built,) = out.glob("lavo-*.whl")
    return built


def test_the_wheel_holds_every_module_and_bundled_config_and_nothing_else(wheel):
    names = set(zipfile.ZipFile(wheel).namelist())
    package_files = {name for name in names if ".dist-info/" not in name}
    in_tree = {path.relative_to(ROOT).as_posix() for path in (ROOT / "lavo").rglob("*")
               if path.suffix in (".py", ".json") and "__pycache__" not in path.parts}
    assert package_files == in_tree
    assert any(name.startswith("lavo/configs/") for name in package_files)
    (entry_points,) = [name for name in names if name.endswith(".dist-info/entry_points.txt")]
    assert "lavo = lavo.cli:main" in zipfile.ZipFile(wheel).read(entry_points).decode()


def test_the_installed_wheel_runs_and_finds_its_bundled_configs(wheel, tmp_path):
    target = tmp_path / "site"
    subprocess.run([sys.executable, "-m", "pip", "install", "--quiet", "--no-deps", "--disable-pip-version-check",
                    "--target", str(target), str(wheel)], check=True)
    # From outside the source tree, with the installed copy first on the path (the editable one is behind it).
    script = ("import lavo, lavo.config as c; print(lavo.__file__); "
              "print(c.load_config('lavo-tiny-austen').model['attention'])")
    env = dict(os.environ, PYTHONPATH=str(target))
    out = subprocess.run([sys.executable, "-c", script], cwd=tmp_path, env=env, check=True,
                         capture_output=True, text=True).stdout.split()
    assert Path(out[0]).is_relative_to(target)
    assert out[1] == "lavo"
    cli = subprocess.run([sys.executable, "-m", "lavo.cli", "--help"], cwd=tmp_path, env=env, check=True,
                         capture_output=True, text=True).stdout
    assert "train" in cli and "generate" in cli
