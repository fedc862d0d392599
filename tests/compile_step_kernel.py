"""``python compile_step_kernel.py``: compile LAVO's decoding-step kernel (lavo/ops/lavo/step_kernel.py) for an
H100/H200 (sm_90) down to PTX, without a GPU, for each input dtype, with each switch on in one and off in another;
prints ``compiled N``. Triton's interpreter runs what compiled Triton refuses (e.g. a plain global in a kernel), so
tests/test_decode_step.py runs this with the interpreter off. Nothing in the package knows of it.
"""
import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource

from lavo.ops.lavo.step_kernel import _step

FLOAT32 = dict(BASIS="*fp32", BIAS="*fp32", READ_SCALE="*fp32", MEMORY_SUM="*fp32", MEMORY_COUNT="*fp32",
               WINDOW_SUM="*fp32", WINDOW_COUNT="*fp32", scale="fp32")


def signature(dtype: str, switches: dict) -> dict:
    inputs = {name: f"*{dtype}" for name in ("Q", "K", "V", "RING_K", "RING_V", "OUT")}
    types = {**inputs, **FLOAT32, "REAL": "*u8", "KEY_MASK": "*u8", "STEPS": "*i64"}
    return {name: "constexpr" if name in switches else types.get(name, "i32") for name in _step.arg_names}


compiled = 0
for dtype, bias, read_scale, dissection in (("fp32", False, False, True), ("bf16", True, True, False),
                                            ("fp16", True, False, True)):
    switches = dict(HAS_BIAS=bias, HAS_READ_SCALE=read_scale, DISSECTION=dissection, BLOCK_S=256, BLOCK_D=64,
                    BLOCK_R=32)
    switches.update({name: None for name, on in (("BIAS", bias), ("READ_SCALE", read_scale)) if not on})
    kernel = triton.compile(ASTSource(fn=_step, signature=signature(dtype, switches), constexprs=switches),
                            target=GPUTarget("cuda", 90, 32), options=dict(num_warps=8))
    compiled += "ptx" in kernel.asm
print(f"compiled {compiled}")
