"""Without a GPU, Triton kernels run in Triton's CPU interpreter. The choice is made when a kernel is defined, so
it is set here, before any test imports one; the other tests never reach a kernel on CPU tensors."""
import os

import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

if os.environ.get("PYTEST_XDIST_WORKER"):  # `-n 2`: one core a worker, not two threads each on two cores
    torch.set_num_threads(1)
