# Sourced by the benchmark scripts. bench_into OUT ARGS...: `python -m lavo.bench ARGS` into OUT.json and OUT.md,
# which only a finished run replaces: a run stopped midway leaves what it measured in OUT.partial.{json,md} (its
# tables too) and the committed results as they were.
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."
python="${PYTHON:-.venv/bin/python}"

bench_into() {
    local out=$1
    shift
    # tee -i: Ctrl-C stops the bench, which prints what it measured, not tee
    "$python" -m lavo.bench "$@" --json "$out.partial.json" | tee -i "$out.partial.md"
    mv "$out.partial.json" "$out.json"
    mv "$out.partial.md" "$out.md"
}
