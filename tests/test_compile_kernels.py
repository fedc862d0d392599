"""Every Triton kernel of the package compiled for real GPUs (sm_90, sm_80, sm_100, and sm_86 and sm_120 with their
99 KB of shared memory) without one, as its launchers call it there, and its shared memory and registers within the
hardware's limits (tests/compile_kernels.py). The interpreter the other kernel tests run accepts code compiled
Triton refuses."""
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

from reference_checks import needs_triton

pytest.importorskip("triton.backends.nvidia")
pytestmark = needs_triton

from compile_kernels import all_kernels  # noqa: E402 (needs the nvidia backend checked for above)


def compile_kernels(tmp_path: Path, *options: str) -> str:
    """Run the check with the interpreter off and a fresh Triton cache; its stdout, once it passed."""
    env = {name: value for name, value in os.environ.items() if name != "TRITON_INTERPRET"}
    env["TRITON_CACHE_DIR"] = str(tmp_path)
    done = subprocess.run([sys.executable, str(Path(__file__).parent / "compile_kernels.py"), *options], env=env,
                          capture_output=True, text=True, timeout=1800)
    assert done.returncode == 0, done.stderr[-5000:]
    return done.stdout


@pytest.mark.parametrize("targets, kernels", [
    # the default suite: an H100/H200 and a GPU of 99 KB per block, whose launchers take other configurations
    ("sm_90,sm_86", 26),
    pytest.param("sm_90,sm_80,sm_86,sm_100,sm_120", 65, marks=pytest.mark.slow)])
def test_every_kernel_compiles_for_every_target(tmp_path, targets, kernels):
    """One case per launcher (bfloat16, D = 128, every switch on): the seven launches of the six kernels once per
    target, and the six window and memory-read launches once more in their form for offsets past 2^31 elements."""
    out = compile_kernels(tmp_path, "--fast", "--targets", targets).splitlines()
    assert out[-1] == f"compiled {kernels} kernels, 0 failed"
    assert {re.search(r"(sm_\d+) \S+ torch\.", line).group(1) for line in out[:-1]} == set(targets.split(","))
    assert sum("WIDE=True" in line for line in out) == 6 * len(targets.split(","))


@pytest.mark.slow
def test_every_kernel_compiles_in_every_configuration(tmp_path):
    """fp32 and bf16, D in 32, 64, 128 and 60, each switch on and off: each kernel for each target and dtype."""
    out = compile_kernels(tmp_path).splitlines()
    assert re.fullmatch(r"compiled \d+ kernels, 0 failed", out[-1])
    compiled = {re.search(r"(sm_\d+) (\S+) torch\.(\w+)", line).groups() for line in out[:-1]}
    kernels = {kernel for _, kernel, _ in compiled}
    assert kernels == {name.removeprefix("lavo.ops.") for name in all_kernels()}  # was a count, 7, left stale
    assert compiled == {(arch, kernel, dtype) for arch in ("sm_90", "sm_80", "sm_86", "sm_100", "sm_120")
                        for kernel in kernels for dtype in ("float32", "bfloat16")}
