#!/usr/bin/env bash
# The test suite under other versions of Python, torch, triton or numpy than scripts/test.sh installs, with lavo
# from this source tree on PYTHONPATH, as on a GPU machine where nothing can be installed. The venv is made once
# in VENV (a CUDA build of torch from PyPI is about 5 GB).
# Usage: [EXTRAS=LIST] bash scripts/test_stack.sh VENV PYTHON "REQUIREMENT ..." [pytest arguments]
#   e.g. the GPU machine's torch and triton, with the numpy that triton 3.6's interpreter runs with:
#   bash scripts/test_stack.sh /tmp/stack python3.11 "torch==2.11.0 triton==3.6.0 numpy==2.3.5" -m "slow or not slow"
# EXTRAS (default: test) names the package's extras to install. The oldest torch the package supports pins a
# Triton older than the test extra's (and transformers 5 refuses it), so that stack leaves the extras out and
# names the test tools itself; the tests that need Triton or transformers are then skipped:
#   EXTRAS= bash scripts/test_stack.sh /tmp/floor python3.11 "torch==2.4.0 pytest setuptools>=70.1 vermin pandas"
set -euo pipefail
venv=${1:?usage: scripts/test_stack.sh VENV PYTHON "REQUIREMENT ..." [pytest arguments]}
python=${2:?usage: scripts/test_stack.sh VENV PYTHON "REQUIREMENT ..." [pytest arguments]}
read -r -a pins <<< "${3:?usage: scripts/test_stack.sh VENV PYTHON \"REQUIREMENT ...\" [pytest arguments]}"
shift 3
cd "$(dirname "$0")/.."
[ -x "$venv/bin/python" ] || "$python" -m venv "$venv"
# the package's dependencies and extras resolved together with the pins; lavo itself is not installed
extras=${EXTRAS-test}
"$venv/bin/pip" install --quiet --disable-pip-version-check "${pins[@]}" ".${extras:+[$extras]}"
"$venv/bin/pip" uninstall --quiet --yes lavo
export PYTHONPATH="$PWD" HF_HUB_OFFLINE=1 TOKENIZERS_PARALLELISM=false
"$venv/bin/python" -c "import numpy, torch
from lavo.ops.common import TRITON_VERSION
print('torch', torch.__version__, 'triton', TRITON_VERSION, 'numpy', numpy.__version__)"
exec "$venv/bin/python" -m pytest -q -p no:cacheprovider "$@"
