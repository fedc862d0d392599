"""The PyTorch paths of the mechanisms on 16-bit inputs: as accurate as the same op with float32 internals (its
inputs widened, its output rounded back), outputs and gradients against float64 on the same rounded inputs, on
sharp heads (queries and keys four times unit scale, where the exponents and scores reach tens). Was: Performer
14 to 36 times that error in bfloat16 and NaN gradients in float16, long-short 9 to 27 times, cosFormer 2 to 4
times, ABC under bfloat16 autocast 9 to 27 times, the LAVO decoding step 4 times the whole sequence's error (its
softmax in bfloat16)."""
import pytest
import torch

from lavo.cache import LavoCache, LavoStepCache
from lavo.ops import lavo_attention, lavo_decode_step, local_attention, orthogonal_basis
from lavo.ops.abc import abc_attention
from lavo.ops.cosformer import cosformer_attention, cosformer_attention_causal
from lavo.ops.longshort import longshort_attention
from lavo.ops.performer import orthogonal_random_features, performer_attention, performer_attention_causal

B, T, H, D = 1, 192, 2, 32
_g = torch.Generator().manual_seed(0)
Q, K, V = (scale * torch.randn(B, T, H, D, generator=_g) for scale in (4, 4, 1))
# parameters exact in bfloat16, so every run sees the same ones
PROJECTION = orthogonal_random_features(64, D, generator=_g).bfloat16().float()
LANDMARKS = (torch.randn(H, D, 8, generator=_g) / 8).bfloat16().float()
CONTROL = (torch.randn(H, 16, D, generator=_g) / 8).bfloat16().float()
BASIS = orthogonal_basis(H, D, D, generator=_g).bfloat16().float()

OPS = {
    "performer": lambda q, k, v: performer_attention(q, k, v, PROJECTION.to(q.dtype)),
    "performer causal": lambda q, k, v: performer_attention_causal(q, k, v, PROJECTION.to(q.dtype), chunk=32)[0],
    "cosformer": lambda q, k, v: cosformer_attention(q, k, v),
    "cosformer causal": lambda q, k, v: cosformer_attention_causal(q, k, v, max_length=T)[0],
    "longshort": lambda q, k, v: longshort_attention(q, k, v, LANDMARKS.to(q.dtype), window=32, causal=False),
    "longshort causal": lambda q, k, v: longshort_attention(q, k, v, LANDMARKS.to(q.dtype), window=32),
    "abc causal": lambda q, k, v: abc_attention(q, k, v, CONTROL.to(q.dtype), chunk=32)[0],
}


def relative_errors(op, dtype, autocast=False, values=V):
    """Errors of the output and of the three input gradients of ``op`` on ``dtype`` inputs (float32 inputs under
    ``dtype`` autocast with ``autocast``), against float64 on the same rounded inputs."""
    rounded = [x.to(dtype) for x in (Q, K, values)]
    grad_out = torch.randn(B, T, H, D, generator=torch.Generator().manual_seed(1)).to(dtype)
    exact = [x.double().requires_grad_() for x in rounded]
    low = [(x.float() if autocast else x).requires_grad_() for x in rounded]
    reference = op(*exact)
    reference_grads = torch.autograd.grad(reference, exact, grad_out.double())
    with torch.autocast("cpu", dtype=dtype, enabled=autocast):
        out = op(*low)
    grads = torch.autograd.grad(out, low, grad_out.to(out.dtype))
    return [((a.double() - b).norm() / b.norm()).item() for a, b in zip((out, *grads), (reference, *reference_grads))]


def float32_inside(op):
    """``op`` on inputs widened to float32, its output rounded back: the yardstick."""
    return lambda q, k, v: op(q.float(), k.float(), v.float()).to(q.dtype)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=["bfloat16", "float16"])
@pytest.mark.parametrize("name", [name for name in OPS if name != "abc causal"])
def test_16_bit_inputs_are_as_accurate_as_float32_internals(name, dtype):
    ours, yardstick = relative_errors(OPS[name], dtype), relative_errors(float32_inside(OPS[name]), dtype)
    assert all(mine < 1.5 * best for mine, best in zip(ours, yardstick)), (ours, yardstick)


@pytest.mark.parametrize("name", ["abc causal", "performer causal", "longshort"])
def test_bfloat16_autocast_leaves_the_float32_internals_alone(name):
    """A float32 call under bfloat16 autocast, as models train: the op's float32 casts are not undone."""
    ours = relative_errors(OPS[name], torch.bfloat16, autocast=True)
    yardstick = relative_errors(float32_inside(OPS[name]), torch.bfloat16)
    assert all(mine < 1.5 * best for mine, best in zip(ours, yardstick)), (ours, yardstick)


def test_the_decoding_steps_softmax_is_as_accurate_as_the_whole_sequences():
    rounded = [x[:, :48].bfloat16() for x in (Q, K, V)]
    basis = BASIS.bfloat16()
    cache = LavoStepCache.from_cache(LavoCache.empty(B, H, D, D, dtype=torch.bfloat16, window=8), 8)
    steps = torch.cat([lavo_decode_step(*(x[:, t:t + 1] for x in rounded), basis, cache, backend="torch")[0]
                       for t in range(48)], 1)
    exact = lavo_attention(*(x.double() for x in rounded), basis.double(), window=8)
    whole = lavo_attention(*rounded, basis, window=8, backend="torch")
    step_error, whole_error = ((x.double() - exact).norm() / exact.norm() for x in (steps, whole))
    assert step_error < 1.5 * whole_error, (step_error, whole_error)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=["bfloat16", "float16"])
def test_local_attentions_backward_does_not_take_the_rounded_output(dtype):
    """Values sharing a large offset, where dO . O taken from the output rounded to 16 bits cancels badly: 13 to 15
    times float32 internals' error in the q and k gradients; it is summed from the float32 weights and dO V^T
    instead (at most 2 times)."""
    def local(q, k, v):
        return local_attention(q, k, v, window=64, backend="torch")
    offset = V + 3 * torch.randn(1, 1, H, D, generator=torch.Generator().manual_seed(2))
    ours = relative_errors(local, dtype, values=offset)
    yardstick = relative_errors(float32_inside(local), dtype, values=offset)
    assert all(mine < 3 * best for mine, best in zip(ours, yardstick)), (ours, yardstick)
