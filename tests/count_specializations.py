"""A pytest plugin that counts the kernel specializations a test run would compile on a GPU, from the launches it
makes in Triton's interpreter:

    TRITON_INTERPRET=1 PYTHONPATH=.:tests python -m pytest -q -p count_specializations -m "slow or not slow" \
        tests/test_triton_ops.py tests/test_decode_step.py

A compiled kernel is specialized on its constexprs, its arguments' dtypes, integers equal to 1 or divisible by 16
and pointers aligned to 16 bytes; a launch's key here is those, so the count approximates how many kernels Triton
compiles (one at a time in a process) before the tests run on CUDA. Prints the count per kernel at the end.
"""
from __future__ import annotations

from collections import Counter

import torch
from triton.runtime.interpreter import InterpretedFunction

_keys: set[tuple] = set()
_run = InterpretedFunction.run


def _argument_key(x):
    if isinstance(x, torch.Tensor):
        return str(x.dtype), x.data_ptr() % 16 == 0
    if isinstance(x, bool) or x is None:
        return x
    if isinstance(x, int):
        return "int", x == 1, x % 16 == 0
    return type(x).__name__


def _recording_run(self, *args, grid, warmup, **kwargs):
    constexprs = {name for name, kind in self.fn.__annotations__.items() if "constexpr" in str(kind)}
    arguments = dict(zip(self.arg_names, args)) | kwargs
    _keys.add((self.fn.__name__, tuple(sorted(
        (name, value if name in constexprs else _argument_key(value)) for name, value in arguments.items()))))
    return _run(self, *args, grid=grid, warmup=warmup, **kwargs)


InterpretedFunction.run = _recording_run


def pytest_terminal_summary(terminalreporter):
    per_kernel = Counter(key[0] for key in _keys)
    terminalreporter.write_line(f"kernel specializations launched: {len(_keys)} "
                                f"({', '.join(f'{name} {count}' for name, count in per_kernel.most_common())})")
