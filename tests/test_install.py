"""scripts/venv.sh, which the README's two commands (demo.sh, test.sh) install with: pip runs for a new venv or a
changed pyproject.toml and is skipped on a rerun, so a rerun needs no network. A stand-in .venv records each pip
call instead of installing."""
import shutil
import subprocess
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]

FAKE_PYTHON = """#!/usr/bin/env bash
# imports succeed once pip has run, with the torch version in $FAKE_TORCH
[ -f "$(dirname "$0")/../installed" ] && [ "${FAKE_TORCH:-2.13.0}" = 2.13.0 ]
"""
FAKE_PIP = """#!/usr/bin/env bash
echo "$*" >> "$(dirname "$0")/../pip_calls"
touch "$(dirname "$0")/../installed"
"""


def checkout(tmp_path: Path) -> Path:
    """A folder with the installer, pyproject.toml and a stand-in .venv."""
    (tmp_path / "scripts").mkdir()
    shutil.copy(ROOT / "scripts" / "venv.sh", tmp_path / "scripts")
    shutil.copy(ROOT / "pyproject.toml", tmp_path)
    bin_dir = tmp_path / ".venv" / "bin"
    bin_dir.mkdir(parents=True)
    for name, text in (("python", FAKE_PYTHON), ("pip", FAKE_PIP)):
        (bin_dir / name).write_text(text)
        (bin_dir / name).chmod(0o755)
    return tmp_path


def install(folder: Path, extras: str, **env: str) -> list[str]:
    """Run ``install_lavo EXTRAS`` in ``folder``; every pip call so far."""
    subprocess.run(["bash", "-c", f"set -euo pipefail; source scripts/venv.sh; install_lavo '{extras}'"], cwd=folder,
                   check=True, capture_output=True, env={"PATH": "/usr/bin:/bin", **env})
    calls = folder / ".venv" / "pip_calls"
    return calls.read_text().splitlines() if calls.exists() else []


def test_a_rerun_with_nothing_changed_skips_pip(tmp_path):
    folder = checkout(tmp_path)
    first = install(folder, "test")
    assert [call.split()[-1] for call in first] == ["torch==2.13.0", ".[test]"]
    assert install(folder, "test") == first


def test_pip_runs_again_for_a_changed_pyproject_other_extras_or_another_torch(tmp_path):
    folder = checkout(tmp_path)
    calls = len(install(folder, "test"))
    with (folder / "pyproject.toml").open("a") as pyproject:
        pyproject.write("# changed\n")
    assert len(install(folder, "test")) == calls + 2
    assert install(folder, "")[-1].endswith("-e .")  # the demo's install is recorded apart from the tests'
    calls = len(install(folder, ""))
    assert len(install(folder, "", FAKE_TORCH="2.11.0")) == calls + 2


def test_a_failed_install_is_not_recorded(tmp_path):
    folder = checkout(tmp_path)
    (folder / ".venv" / "bin" / "pip").write_text("#!/usr/bin/env bash\nexit 1\n")
    with pytest.raises(subprocess.CalledProcessError):
        install(folder, "test")
    assert not list((folder / ".venv").glob("lavo-installed*"))
