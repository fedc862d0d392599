# Sourced by demo.sh and test.sh: `install_lavo EXTRAS` makes .venv if needed and installs torch==2.13.0 (the
# version the README's numbers and the tests are checked with; the package itself asks only torch>=2.4) and lavo
# in editable mode with EXTRAS (e.g. "test"; empty for none). A finished install is recorded in .venv; a rerun
# with pyproject.toml unchanged skips pip, so it needs no network.
say() { echo "[$(date +%H:%M:%S)] $*"; }

install_lavo() {
    local extras=$1 torch_version=2.13.0
    [ -x .venv/bin/python ] || { say "creating .venv"; python3 -m venv .venv; }
    local stamp=".venv/lavo-installed${extras:+-$extras}" want
    want="torch==$torch_version $(sha256sum pyproject.toml | cut -d' ' -f1) $PWD"
    # the import checks a venv whose packages were changed, or a clone moved, since the recorded install
    if [ "$(cat "$stamp" 2>/dev/null)" = "$want" ] && .venv/bin/python -c "import torch, lavo
assert torch.__version__.split('+')[0] == '$torch_version'" 2>/dev/null; then
        return
    fi
    say "installing torch==$torch_version into .venv (the first time, this downloads it: minutes)"
    .venv/bin/pip install --quiet --disable-pip-version-check "torch==$torch_version"
    say "installing lavo${extras:+ with its $extras extras} and its dependencies"
    .venv/bin/pip install --quiet --disable-pip-version-check -e ".${extras:+[$extras]}"
    echo "$want" > "$stamp"
}
