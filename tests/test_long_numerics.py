"""Long-run numerics: a LAVO layer streamed over 1,000,000+ tokens in bfloat16 through its cache stays finite
and as close to float32 at the end as at the start.

The memory is a running mean over every token seen. Its sums are kept in float32 whatever the input dtype
(``LavoCache``), because a bfloat16 (or float16) running sum stops growing once the sum dwarfs each new term.
This test holds that: with the sums in float32 the bfloat16 output's relative error stays at bfloat16's
rounding level (about 0.4%) over 2^20 tokens. Slow (about 30 s on one CPU thread):
``pytest -m slow tests/test_long_numerics.py -s`` prints the errors.
"""
import pytest
import torch

from lavo import LavoAttention

TOKENS, CHUNK = 2 ** 20, 4096
TOLERANCE = 1e-2  # relative error of each chunk's bfloat16 output against float32
GROWTH = 1.25  # the last chunks' error may exceed the first chunks' by at most this factor


@pytest.mark.slow
def test_a_million_bfloat16_tokens_through_the_cache_stay_close_to_float32():
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        torch.manual_seed(0)
        exact = LavoAttention(64, 2, rank=32, window=64).eval()
        torch.nn.init.normal_(exact.pos_bias, 0, 0.5)
        low = LavoAttention(64, 2, rank=32, window=64).eval()
        low.load_state_dict(exact.state_dict())
        low = low.to(torch.bfloat16)
        offset = torch.randn(64)  # inputs with a mean, so that the memory holds more than noise
        generator = torch.Generator().manual_seed(1)
        exact_cache = low_cache = None
        errors = []
        with torch.no_grad():
            for _ in range(TOKENS // CHUNK):
                x = torch.randn(1, CHUNK, 64, generator=generator) + offset
                y, exact_cache = exact(x, cache=exact_cache)
                y_low, low_cache = low(x.bfloat16(), cache=low_cache)
                assert torch.isfinite(y_low).all()
                errors.append(((y_low.float() - y).norm() / y.norm()).item())
    finally:
        torch.set_num_threads(threads)
    print(f"relative error of bfloat16 vs float32: first chunk {errors[0]:.2e}, last {errors[-1]:.2e}, "
          f"largest {max(errors):.2e} over {TOKENS:,} tokens")
    assert max(errors) < TOLERANCE
    assert max(errors[-16:]) < GROWTH * max(errors[:16])
    assert low_cache.memory_sum.dtype == torch.float32 and low_cache.position == TOKENS
    assert low_cache.memory_count.item() == TOKENS  # counted exactly (float32 is exact to 2^24)
    exact_mean = exact_cache.memory_sum / exact_cache.memory_count
    low_mean = low_cache.memory_sum / low_cache.memory_count
    assert (low_mean - exact_mean).norm() < TOLERANCE * exact_mean.norm()
