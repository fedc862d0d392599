"""A learned orthonormal basis that stays orthonormal in every dtype: torch's orthogonal parametrization, with
its map computed in float32 at least."""
from __future__ import annotations

import torch
from torch import nn
from torch.nn.utils import parametrize
from torch.nn.utils.parametrizations import _Orthogonal, _OrthMaps

from ..ops.common import accumulation_dtype


class Float32Orthogonal(_Orthogonal):
    r"""``torch.nn.utils.parametrizations.orthogonal`` (the matrix exponential for a square matrix, Householder
    reflections otherwise, trivialised at the ``base`` that registration and assignment set), with the map run in
    float32 (float64 for float64 tensors) and its result cast back to the parameter's dtype.

    In bfloat16 or float16 torch's map gives no orthogonal matrix: ``matrix_exp`` returns 1e30 for a near-zero
    input on the CPU, and Householder products are not implemented there. In float32 and float64 this is torch's
    map, operation for operation (tests/test_layers.py compares the two), and it keeps torch's state-dict keys and
    initialisation, so checkpoints load either way."""

    def __init__(self, weight: torch.Tensor, orthogonal_map: _OrthMaps):
        super().__init__(weight, orthogonal_map)
        # torch registers the base as None and sets it in right_inverse, which cannot run on the meta device where
        # transformers builds a model before loading it: the base then had no state-dict key and stayed None.
        size = max(weight.shape[-2:])
        self.base = weight.new_empty(*weight.shape[:-2], size, size)

    def right_inverse(self, Q: torch.Tensor) -> torch.Tensor:
        if Q.is_meta:  # shapes only: loading fills the original and the base (torch's checks fail on meta)
            return torch.empty_like(Q)
        # in float32 too (a layer built under a 16-bit default dtype): torch's QR there gave a NaN base
        dtype = Q.dtype
        original = super().right_inverse(Q.to(accumulation_dtype(dtype)))
        self.base = self.base.to(dtype)
        return original.to(dtype)

    def forward(self, X: torch.Tensor) -> torch.Tensor:
        dtype = X.dtype
        X = X.to(accumulation_dtype(dtype))
        n, k = X.size(-2), X.size(-1)
        transposed = n < k
        if transposed:
            X = X.mT
            n, k = k, n
        if self.orthogonal_map == _OrthMaps.matrix_exp:  # over the tall X's lower triangle
            X = X.tril()
            if n != k:
                X = torch.cat([X, X.new_zeros(n, n - k).expand(*X.shape[:-2], -1, -1)], dim=-1)
            Q = torch.matrix_exp(X - X.mT)[..., :k]
        else:  # Householder: reflectors below the diagonal, signs on it (not differentiated)
            A = X.tril(diagonal=-1)
            Q = torch.linalg.householder_product(A, 2.0 / (1.0 + (A * A).sum(dim=-2)))
            Q = Q * X.diagonal(dim1=-2, dim2=-1).int().unsqueeze(-2)
        Q = self.base.to(Q.dtype) @ Q  # always trivialised: the base is set in __init__
        return (Q.mT if transposed else Q).to(dtype)


def register_orthonormal(module: nn.Module, name: str) -> None:
    """Make ``module.<name>`` (``[..., n, k]``) a learned orthonormal matrix: as
    ``torch.nn.utils.parametrizations.orthogonal(module, name)`` does, with :class:`Float32Orthogonal`."""
    weight = getattr(module, name)
    square = weight.size(-2) == weight.size(-1)
    parametrization = Float32Orthogonal(weight, _OrthMaps.matrix_exp if square else _OrthMaps.householder)
    parametrize.register_parametrization(module, name, parametrization, unsafe=True)
