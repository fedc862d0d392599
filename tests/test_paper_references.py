"""Each layer (LAVO's and the baselines') against its paper's equations, written out here one query (or one
step) at a time on a fixed small input. Nothing is shared with the layer but its parameters, so an error in a
helper the fast form and its in-package reference share still shows."""
import math

import pytest
import torch

from lavo import build_attention

DIM, HEADS, T = 8, 2, 11
D = DIM // HEADS


def _layer(name, **options):
    torch.manual_seed(0)
    layer = build_attention(name, DIM, HEADS, causal=True, **options).double()
    with torch.no_grad():  # zero-initialised biases and unit norms would hide terms
        for p in layer.parameters():
            p.add_(0.3 * torch.randn_like(p))
    return layer


def _input():
    return torch.randn(1, T, DIM, dtype=torch.float64, generator=torch.Generator().manual_seed(1))


def _heads(layer, x):
    """q, k, v ``[T, H, D]`` of batch row 0: ``x W_qkv^T`` split into three, then into heads."""
    qkv = x[0] @ layer.to_qkv.weight.T
    return [qkv[:, i * DIM:(i + 1) * DIM].reshape(T, HEADS, D) for i in range(3)]


def _output(layer, out):
    """``[T, H, D]`` per-head outputs -> ``[1, T, dim]`` through the output projection."""
    return (out.reshape(T, DIM) @ layer.to_out.weight.T)[None]


def _softmax_read(scores, values):
    """``softmax(scores) @ values`` written out: ``scores [J]``, ``values [J, D]``."""
    weights = torch.exp(scores - scores.max())
    return (weights[:, None] * values).sum(0) / weights.sum()


def _layer_norm(x, weight, bias):
    """Normalise the ``H D`` numbers of ``x [H, D]``: mean 0, variance 1 (epsilon 1e-5), then scale and shift."""
    flat = x.reshape(-1)
    centred = flat - flat.mean()
    return (centred / torch.sqrt((centred ** 2).mean() + 1e-5) * weight + bias).reshape(x.shape)


def _rotate(x, position):
    """RoPE (Su et al. 2021): feature pair ``(2i, 2i + 1)`` of ``x [H, D]`` turned by ``position / 10000^(2i/D)``."""
    out = x.clone()
    for i in range(D // 2):
        angle = position / 10000 ** (2 * i / D)
        a, b = x[:, 2 * i], x[:, 2 * i + 1]
        cos, sin = math.cos(angle), math.sin(angle)
        out[:, 2 * i], out[:, 2 * i + 1] = a * cos - b * sin, a * sin + b * cos
    return out


def softmax_reference(layer, x):
    q, k, v = _heads(layer, x)
    out = torch.zeros(T, HEADS, D, dtype=x.dtype)
    for t in range(T):
        for h in range(HEADS):
            keys = torch.stack([_rotate(k[j], j)[h] for j in range(t + 1)])
            out[t, h] = _softmax_read(keys @ _rotate(q[t], t)[h] / math.sqrt(D), v[:t + 1, h])
    return _output(layer, out)


def _window_keys(t, window):
    """LAVO's window rule: query ``t`` sees keys from the start of the previous window to ``t``."""
    return range(max(0, (t // window - 1) * window), t + 1)


def _local(layer, q, k, v):
    """Sliding-window attention with the relative-position bias ``P[h, t - j]``, ``[T, H, D]``."""
    out = torch.zeros(T, HEADS, D, dtype=q.dtype)
    for t in range(T):
        js = list(_window_keys(t, layer.window))
        for h in range(HEADS):
            scores = torch.stack([q[t, h] @ k[j, h] / math.sqrt(D) + layer.pos_bias[h, t - j] for j in js])
            out[t, h] = _softmax_read(scores, v[js, h])
    return out


def local_reference(layer, x):
    return _output(layer, _local(layer, *_heads(layer, x)))


def lavo_reference(layer, x):
    """Zhang et al. 2023: ``o_t = (o_loc_t + o_glb_t) / 2``. The local branch as above. The memory compresses
    features ``f_j`` (context dissection: the local outputs of the whole windows before ``t``'s; without it the
    values ``v_j``, ``j <= t``) onto the basis rows ``b_i``: ``H_i = mean_j b_i . f_j``, slot ``i`` is ``H_i b_i``,
    key and value both; ``o_glb_t = sum_i softmax_i(H_i b_i . q_t / sqrt(D)) H_i b_i`` (zero with no feature)."""
    q, k, v = _heads(layer, x)
    local = _local(layer, q, k, v)
    features = local if layer.dissection else v
    out = torch.zeros(T, HEADS, D, dtype=x.dtype)
    for t in range(T):
        js = range(t // layer.window * layer.window) if layer.dissection else range(t + 1)
        for h in range(HEADS):
            memory = torch.zeros(layer.rank, D, dtype=x.dtype)
            if len(js):
                for i, b in enumerate(layer.basis[h]):
                    memory[i] = sum(b @ features[j, h] for j in js) / len(js) * b
            out[t, h] = (local[t, h] + (_softmax_read(memory @ q[t, h] / math.sqrt(D), memory) if len(js) else 0)) / 2
    return _output(layer, out)


def abc_reference(layer, x):
    """Peng et al. 2022, learned control: ``alpha_{j,s} = exp(a_{j,s}) / sum_{i <= t} exp(a_{i,s})`` with
    ``a_j = W_phi k_j``; slots ``K~ = alpha^T K``, ``V~ = alpha^T V``; read ``softmax(q K~^T / sqrt(D)) V~``."""
    q, k, v = _heads(layer, x)
    out = torch.zeros(T, HEADS, D, dtype=x.dtype)
    for t in range(T):
        for h in range(HEADS):
            logits = k[:t + 1, h] @ layer.control[h].T  # [t + 1, r]
            alpha = torch.exp(logits) / torch.exp(logits).sum(0)
            out[t, h] = _softmax_read((alpha.T @ k[:t + 1, h]) @ q[t, h] / math.sqrt(D), alpha.T @ v[:t + 1, h])
    return _output(layer, out)


def longshort_reference(layer, x):
    """Zhu et al. 2021, causal: window keys and values through DualLN's first norm; each completed segment of
    ``w`` positions compressed to landmarks ``P^T K``, ``P^T V`` with ``P = softmax over the segment of K W_p``,
    through the second norm; one softmax over both."""
    q, k, v = _heads(layer, x)
    w = layer.window
    short = [(layer.short_norm.weight, layer.short_norm.bias)]
    long = [(layer.long_norm.weight, layer.long_norm.bias)]
    landmarks = []
    for start in range(0, T - w + 1, w):
        segment = range(start, start + w)
        p = torch.stack([torch.softmax(k[segment, h] @ layer.projection[h], 0) for h in range(HEADS)])  # [H, w, r]
        keys = torch.stack([p[h].T @ k[segment, h] for h in range(HEADS)], 1)  # [r, H, D]
        values = torch.stack([p[h].T @ v[segment, h] for h in range(HEADS)], 1)
        landmarks.append(([_layer_norm(key, *long[0]) for key in keys], [_layer_norm(val, *long[0]) for val in values]))
    out = torch.zeros(T, HEADS, D, dtype=x.dtype)
    for t in range(T):
        js = list(_window_keys(t, w))
        keys = [_layer_norm(k[j], *short[0]) for j in js] + [key for s in landmarks[:t // w] for key in s[0]]
        values = [_layer_norm(v[j], *short[0]) for j in js] + [val for s in landmarks[:t // w] for val in s[1]]
        keys, values = torch.stack(keys), torch.stack(values)  # [J, H, D]
        for h in range(HEADS):
            out[t, h] = _softmax_read(keys[:, h] @ q[t, h] / math.sqrt(D), values[:, h])
    return _output(layer, out)


def performer_reference(layer, x):
    """Choromanski et al. 2021, FAVOR+: ``phi(x)_f = exp(w_f . x' - |x'|^2 / 2)``, ``x' = x / D^(1/4)``;
    ``o_t = sum_{j <= t} phi(q_t) . phi(k_j) v_j / sum_{j <= t} phi(q_t) . phi(k_j)``."""
    q, k, v = _heads(layer, x)

    def phi(vector):
        scaled = vector / D ** 0.25
        return torch.exp(layer.projection @ scaled - scaled @ scaled / 2)

    out = torch.zeros(T, HEADS, D, dtype=x.dtype)
    for t in range(T):
        for h in range(HEADS):
            weights = torch.stack([phi(q[t, h]) @ phi(k[j, h]) for j in range(t + 1)])
            out[t, h] = (weights[:, None] * v[:t + 1, h]).sum(0) / weights.sum()
    return _output(layer, out)


def cosformer_reference(layer, x):
    """Qin et al. 2022: ``o_t = sum_{j <= t} w_tj v_j / sum_{j <= t} w_tj`` with
    ``w_tj = relu(q_t) . relu(k_j) cos(pi/2 (t - j) / M)``."""
    q, k, v = _heads(layer, x)
    out = torch.zeros(T, HEADS, D, dtype=x.dtype)
    for t in range(T):
        for h in range(HEADS):
            weights = torch.stack([torch.relu(q[t, h]) @ torch.relu(k[j, h])
                                   * math.cos(math.pi / 2 * (t - j) / layer.max_length) for j in range(t + 1)])
            out[t, h] = (weights[:, None] * v[:t + 1, h]).sum(0) / weights.sum().clamp(min=1e-6)
    return _output(layer, out)


def s4d_reference(layer, x):
    """Gu et al. 2022, S4D-Lin with zero-order hold, per channel: ``A = -exp(a_re) + i a_im``,
    ``A_bar = exp(dt A)``, ``B_bar = (exp(dt A) - 1) / A`` (with ``B = 1``), ``x_t = A_bar x_{t-1} + B_bar u_t``,
    ``y_t = 2 Re(C x_t) + D u_t`` (conjugate pairs), then GELU, a linear map to ``2 dim`` and a GLU."""
    a = torch.complex(-layer.log_a_real.exp(), layer.a_imag)  # [dim, N/2]
    step = layer.log_dt.exp()[:, None]
    a_bar = torch.exp(step * a)
    b_bar = (a_bar - 1) / a
    c = torch.view_as_complex(layer.c[0].contiguous())
    state = torch.zeros_like(a)
    y = torch.zeros(T, DIM, dtype=x.dtype)
    for t in range(T):
        state = a_bar * state + b_bar * x[0, t][:, None]
        y[t] = 2 * (c * state).sum(-1).real + layer.skip * x[0, t]
    y = torch.nn.functional.gelu(y) @ layer.to_glu.weight.T + layer.to_glu.bias
    return (y[:, :DIM] * torch.sigmoid(y[:, DIM:]))[None]


REFERENCES = {
    "softmax": (dict(rotary=True), softmax_reference),
    "local": (dict(window=3), local_reference),
    "lavo": (dict(window=3, rank=3), lavo_reference),
    "lavo, no dissection": (dict(window=3, rank=3, dissection=False), lavo_reference),
    "abc": (dict(slots=3), abc_reference),
    "longshort": (dict(window=3, landmarks=2), longshort_reference),
    "performer": (dict(features=6), performer_reference),
    "cosformer": (dict(max_length=16), cosformer_reference),
    "s4d": (dict(state_size=6), s4d_reference),
}


@pytest.mark.parametrize("name", sorted(REFERENCES))
def test_layer_matches_the_paper_written_out(name):
    options, reference = REFERENCES[name]
    layer = _layer(name.split(",")[0], **options)
    x = _input()
    with torch.no_grad():
        expected = reference(layer, x)
        got, _ = layer(x)
    torch.testing.assert_close(got, expected)
