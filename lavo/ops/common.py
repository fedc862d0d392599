"""What the ops of several mechanisms share: input checks (every error names the argument and the shape it
expected), the masking constant, the accumulation dtype and small tensor helpers."""
from __future__ import annotations

import contextlib
import functools
import importlib.metadata
import importlib.util
import os
import warnings

import torch


def neg_inf(dtype: torch.dtype) -> float:
    """A finite stand-in for -inf: masked rows stay NaN-free, and exp() of it is exactly zero."""
    return torch.finfo(dtype).min


def accumulation_dtype(dtype: torch.dtype) -> torch.dtype:
    """float32, or float64 for float64 inputs: the dtype of sums over the context (float16 overflows past ~65K)."""
    return torch.promote_types(dtype, torch.float32)


def dtypes_may_differ(device_type: str) -> bool:
    """Whether tensors of different dtypes may meet here, so that an eager dtype check must stand aside: under
    autocast they mix by design, and under torch.compile the check is not traced (Dynamo before torch 2.5 cannot
    trace the autocast query; a compiled call with mismatched dtypes fails in its first matmul all the same)."""
    return torch.compiler.is_compiling() or torch.is_autocast_enabled(device_type)


def autocast_off(method):
    """For a custom autograd Function's ``forward`` or ``backward`` whose first argument after ``ctx`` is a tensor:
    run it with autocast off, in its inputs' dtypes whatever the caller's autocast (its writes into preallocated
    outputs need them; bfloat16 inputs still compute in bfloat16)."""
    @functools.wraps(method)
    def run(ctx, first, *rest):
        with torch.autocast(first.device.type, enabled=False):
            return method(ctx, first, *rest)
    return run


def without_autocast(op):
    """For an op made of torch operations on tensors of one device: run it in its inputs' dtypes whatever the
    caller's autocast, as the ops' autograd Functions run (:func:`autocast_off`), so that it computes what they
    compute (a cached continuation what one call gives)."""
    @functools.wraps(op)
    def run(*args, **kwargs):
        device = next(x for x in (*args, *kwargs.values()) if isinstance(x, torch.Tensor)).device
        with torch.autocast(device.type, enabled=False):
            return op(*args, **kwargs)
    return run


def first_order_only(op: str, reference: str):
    """For the ``backward`` of a custom autograd Function that is not differentiable (it writes its gradients
    in place): refuse to run it while a graph of the gradients is being built (``create_graph=True``, under which
    backward runs with grad mode on). ``@once_differentiable`` refuses only when a second backward reaches its
    error node, which ``torch.autograd.grad(..., inputs=...)`` can skip: the op's curvature was then silently
    taken as zero."""
    def wrap(backward):
        @functools.wraps(backward)
        def run(ctx, *grads):
            if torch.is_grad_enabled():
                raise RuntimeError(f"{op} has no second derivative (its backward writes its gradients in place), "
                                   "and create_graph=True asks for one (a gradient penalty, a Hessian-vector "
                                   f"product), whose curvature it would miss: use {reference}, which is twice "
                                   "differentiable, for that")
            return backward(ctx, *grads)
        return run
    return wrap


def exclusive_cumsum(x: torch.Tensor, dim: int) -> torch.Tensor:
    """Sums of the entries strictly before each position along ``dim`` (at least one entry long): the running sum
    shifted by one, so that an entry never enters its own sum (taking it out again would lose the sum before a
    large entry to rounding, and keep an inf or NaN)."""
    before = x.cumsum(dim).narrow(dim, 0, x.shape[dim] - 1)
    return torch.cat([torch.zeros_like(x.narrow(dim, 0, 1)), before], dim)


def zero_padding(padding_mask: torch.Tensor | None, *tensors: torch.Tensor) -> tuple[torch.Tensor, ...]:
    """``tensors [B, T, ...]`` with zeros at the padded positions of ``padding_mask [B, T]`` (True = real),
    whatever was there: an op's inputs, since an inf or NaN at a padded position would otherwise reach real
    outputs through its product with a zero weight, and its outputs, whatever it computed at padded queries."""
    if padding_mask is None:
        return tensors
    return tuple(torch.where(padding_mask.view(*padding_mask.shape, *[1] * (t.dim() - 2)), t, 0) for t in tensors)


def normalize(numerator: torch.Tensor, weight_sum: torch.Tensor, eps: float) -> torch.Tensor:
    """``numerator [..., D] / weight_sum [...]``, the sum clamped below at ``eps`` and taken as 1 where it is
    exactly zero: a query with no key to weigh (every key padded) gets zeros and a finite gradient, where dividing
    by a tiny ``eps`` would overflow the backward to inf and NaN."""
    return numerator / torch.where(weight_sum > 0, weight_sum.clamp(min=eps), 1)[..., None]


def reciprocal(x: torch.Tensor) -> torch.Tensor:
    """``1 / x`` of ``x`` clamped below at its dtype's smallest normal number (a sum that is zero or has
    underflowed), with the value of ``1 / x`` and a backward that never forms ``1 / x^2``: torch's overflows
    float32 once ``x`` is below about 1e-19, where ``1 / x`` and the gradients a model needs are still finite.
    ``x`` is brought to about 1 by a power of two first (exact, detached), and the result scaled back."""
    x = x.clamp(min=torch.finfo(x.dtype).tiny)
    scale = torch.exp2(-torch.floor(torch.log2(x.detach())))
    return 1 / (x * scale) * scale


def positive_int(value) -> bool:
    """Whether ``value`` is a Python int of at least 1; not a bool (``True`` would count as 1)."""
    return isinstance(value, int) and not isinstance(value, bool) and value >= 1


def check_positive(owner: str, **options: int) -> None:
    """Raise naming ``owner`` and the option unless every option is a positive integer."""
    for name, value in options.items():
        if not positive_int(value):
            raise ValueError(f"{owner} {name} must be a positive integer, got {value!r}")


def check_switches(owner: str, **switches: bool) -> None:
    """Raise naming ``owner`` and the option unless every switch is True or False ("false" would count as on)."""
    for name, value in switches.items():
        if not isinstance(value, bool):
            raise ValueError(f"{owner} {name} must be True or False, got {value!r}")


def check_window(window: int) -> None:
    if not positive_int(window):
        raise ValueError(f"window must be a positive integer, got {window!r}")


def check_matching(*, same_length: bool = True, same_dtype: bool = True, **tensors: torch.Tensor) -> None:
    """Raise ``ValueError`` unless the tensors are ``[B, T, H, D]`` with ``T >= 1``, of one shape (one ``B``,
    ``H`` and ``D`` when not ``same_length``), dtype (unless not ``same_dtype``) and device (the first named is the
    one the others are held to)."""
    (first_name, first), *rest = tensors.items()
    if first.dim() != 4:
        raise ValueError(f"{first_name} must have shape [B, T, H, D], got {tuple(first.shape)}")
    if first.shape[1] == 0:
        raise ValueError(f"{first_name} has an empty time axis; sequences need at least one position")
    for name, t in rest:
        for what in ("shape", "dtype", "device") if same_dtype else ("shape", "device"):
            if what == "shape" and not same_length and t.dim() == 4:
                if (t.shape[0], *t.shape[2:]) != (first.shape[0], *first.shape[2:]):
                    raise ValueError(f"{name} has shape {tuple(t.shape)} but {first_name} has "
                                     f"{tuple(first.shape)}; they must match in B, H and D")
            else:
                check_same(what, name, t, first_name, first)


def check_same(what: str, name: str, t: torch.Tensor, first_name: str, first: torch.Tensor) -> None:
    """Raise ``ValueError`` unless ``t`` has the ``what`` (``"shape"``, ``"dtype"`` or ``"device"``) of ``first``."""
    if getattr(t, what) != getattr(first, what):
        shown = tuple if what == "shape" else str
        raise ValueError(f"{name} has {what} {shown(getattr(t, what))} but {first_name} has "
                         f"{shown(getattr(first, what))}; they must match")


def check_queries_keys_values(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, *, same_length: bool) -> None:
    """Raise ``ValueError`` unless ``q [B, T, H, D]``, ``k [B, S, H, D]`` and ``v [B, S, H, Dv]`` fit, on one device
    and, where dtypes may not differ (:func:`dtypes_may_differ`: these ops are torch operations, which autocast
    mixes), of one dtype (``S = T`` when ``same_length``), for the ops whose values may have a head size of their
    own: softmax's and the feature maps' (cosFormer, Performer)."""
    same_dtype = not dtypes_may_differ(q.device.type)
    check_matching(q=q, k=k, same_length=same_length, same_dtype=same_dtype)
    if v.dim() != 4 or v.shape[:3] != k.shape[:3]:
        raise ValueError(f"v has shape {tuple(v.shape)} but k has {tuple(k.shape)}; they must match in B, T and H")
    for what in ("dtype", "device") if same_dtype else ("device",):
        check_same(what, "v", v, "q", q)


def check_padding_mask(padding_mask: torch.Tensor | None, batch: int, length: int, name: str = "padding_mask", *,
                       axes: str = "B, T", device: torch.device | None = None) -> None:
    """Raise unless ``padding_mask`` is None or a bool ``[batch, length]`` tensor (on ``device``, when given);
    ``axes`` names the two axes as the caller's docstring does (``"B, S"`` for a source)."""
    if padding_mask is None:
        return
    if not isinstance(padding_mask, torch.Tensor):  # a NumPy array's bool dtype read as "got dtype bool"
        raise ValueError(f"{name} must be a bool tensor (True = real token), got a {type(padding_mask).__name__}: "
                         "convert it with torch.as_tensor")
    if padding_mask.dtype != torch.bool:
        raise ValueError(f"{name} must be a bool tensor (True = real token), got dtype {padding_mask.dtype}")
    if tuple(padding_mask.shape) != (batch, length):
        raise ValueError(f"{name} must have shape [{axes}] = ({batch}, {length}), got {tuple(padding_mask.shape)}")
    if device is not None and padding_mask.device != device:
        raise ValueError(f"{name} is on {padding_mask.device} but the inputs are on {device}; they must be on one "
                         "device")


def pos_bias_size(window: int, causal: bool) -> int:
    """Length of the relative-position table: offsets 0..2w-1 (causal) or -(2w-1)..2w-1 (non-causal)."""
    return 2 * window if causal else 4 * window - 1


def check_pos_bias(pos_bias: torch.Tensor | None, heads: int, window: int, causal: bool) -> None:
    if pos_bias is None:
        return
    expected = (heads, pos_bias_size(window, causal))
    if tuple(pos_bias.shape) != expected:
        kind = "[H, 2w]" if causal else "[H, 4w - 1]"
        raise ValueError(f"pos_bias must have shape {kind} = {expected} for causal={causal}, window={window}; "
                         f"got {tuple(pos_bias.shape)}")


def check_basis(basis: torch.Tensor, heads: int, head_dim: int, length: int | None = None) -> None:
    """Raise unless ``basis`` is ``[heads, r, head_dim]`` with ``1 <= r <= head_dim``. ``length``: the inputs' axis
    1 (their T), so that inputs laid out as SDPA's ``[B, H, T, D]``, whose axis 1 holds the basis's heads, are
    named as such rather than the basis blamed."""
    if basis.dim() != 3 or basis.shape[0] != heads or basis.shape[2] != head_dim:
        message = f"basis must have shape [H, r, D] with H={heads}, D={head_dim}, got {tuple(basis.shape)}"
        if basis.dim() == 3 and basis.shape[0] == length != heads and basis.shape[2] == head_dim:
            message += (f"; the inputs' axis 1 has the basis's {length} heads: lay them out [B, T, H, D] "
                        "(tensors in SDPA's [B, H, T, D] layout need .transpose(1, 2))")
        raise ValueError(message)
    if basis.shape[1] > head_dim:
        raise ValueError(f"rank ({basis.shape[1]}) must be <= head_dim ({head_dim})")
    if basis.shape[1] == 0:
        raise ValueError(f"basis has shape {tuple(basis.shape)}, rank 0: the memory needs at least one slot")


def check_window_inputs(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, window: int,
                        padding_mask: torch.Tensor | None) -> None:
    """What every windowed op checks first: the window, matching ``[B, T, H, D]`` q/k/v with at least one
    sequence (the layers refuse an empty batch alike) and the padding mask."""
    check_window(window)
    check_matching(q=q, k=k, v=v)
    if q.shape[0] == 0:
        raise ValueError(f"q has an empty batch, shape {tuple(q.shape)}; a call needs at least one sequence")
    check_padding_mask(padding_mask, q.shape[0], q.shape[1], device=q.device)


def query_scale(scale: float | None, head_dim: int) -> float:
    """The factor on the scores: ``scale``, or ``head_dim ** -0.5`` when None."""
    return head_dim ** -0.5 if scale is None else scale


def constant_scale(scale: float | None, head_dim: int) -> float:
    """:func:`query_scale` for an op whose autograd Function takes the scale as a constant and gives it no
    gradient: a tensor that requires one is refused, as it would never train."""
    if isinstance(scale, torch.Tensor) and scale.requires_grad:
        raise TypeError("scale is a constant of the op, which gives it no gradient: a learned scale would never "
                        "train; scale q instead (LAVO's layer learns its read temperature with read_temperature=True)")
    return query_scale(scale, head_dim)


BACKENDS = ("auto", "triton", "torch")
# Input dtypes the Triton kernels take (they accumulate in float32, so float64 stays on the torch path).
TRITON_DTYPES = (torch.float16, torch.bfloat16, torch.float32)
# The widest head the kernels' tiles are sized for: at D = 256 the memory read needs up to 409,600 bytes of shared
# memory per block, more than any GPU allows (tests/compile_kernels.py --fast --head-dim 256), so wider heads stay
# on torch.
TRITON_MAX_HEAD_DIM = 128


def _release(version: str) -> tuple[int, ...]:
    """``"3.6.0+cu13"`` -> ``(3, 6)``: the major and minor release of a version string."""
    return tuple(int(part) for part in version.split("+")[0].split(".")[:2])


# The oldest Triton the kernels build with: they use tl.gather, new in Triton 3.3. torch 2.7 and later bring
# such a Triton with their CUDA wheels; torch 2.4 to 2.6 bring 3.0 to 3.2, with which "auto" keeps to torch.
TRITON_MIN_RELEASE = (3, 3)


def installed_triton_version() -> str | None:
    """The version of the installed ``triton`` module, read from its distribution's metadata without importing
    it (``triton``, or another name such as ``pytorch-triton``); None when there is no ``triton`` module, and
    ``"unknown"`` when no installed distribution claims it (a source build)."""
    if importlib.util.find_spec("triton") is None:
        return None
    try:
        return importlib.metadata.version("triton")
    except importlib.metadata.PackageNotFoundError:
        names = importlib.metadata.packages_distributions().get("triton", [])
        return importlib.metadata.version(names[0]) if names else "unknown"


def triton_supported(version: str | None) -> bool:
    """Whether a Triton of ``version`` (as :func:`installed_triton_version` gives it) runs the kernels; one that
    says no version is given the benefit of the doubt."""
    return version is not None and (version == "unknown" or _release(version) >= TRITON_MIN_RELEASE)


# Looked up once, at import: torch.compile (2.11) cannot trace the look-up, and the ops ask at every call.
TRITON_VERSION = installed_triton_version()
TRITON_AVAILABLE = triton_supported(TRITON_VERSION)

# The oldest NVIDIA GPUs the kernels are compiled and checked for (tests/compile_kernels.py): Ampere, sm_80.
MIN_CAPABILITY = (8, 0)
# Shared memory a block may have on an A100 (CUDA's opt-in maximum, bytes), the least of the GPUs the kernels' tile
# sizes are made for. GPUs with less (99 KB: sm_86, sm_89 and sm_120, e.g. the RTX 30, 40 and 50 series, A10, L4,
# L40S) get smaller configurations (:func:`small_shared_memory`).
A100_SHARED_MEMORY = 166912


def capability(q: torch.Tensor) -> tuple[int, int]:
    """The compute capability of ``q``'s GPU (torch.compile folds the look-up into a constant)."""
    properties = torch.cuda.get_device_properties(q.device)
    return properties.major, properties.minor


@functools.cache
def _shared_memory_per_block(device_index: int) -> int:
    import triton
    return triton.runtime.driver.active.utils.get_device_properties(device_index)["max_shared_mem"]


def launching_on(q: torch.Tensor) -> contextlib.AbstractContextManager:
    """Within: ``q``'s GPU is CUDA's current device, which Triton launches on and takes its stream from (a model on
    ``cuda:1`` would otherwise run its kernels on ``cuda:0``'s); nothing for CPU tensors (the interpreter)."""
    return torch.cuda.device(q.device) if q.is_cuda else contextlib.nullcontext()


def make_current(device: torch.device | str) -> None:
    """Make ``device`` CUDA's current device when it names one (``cuda:N``; plain ``cuda`` is the current one):
    Triton's kernels and CUDA graphs run on the current device."""
    device = torch.device(device)
    if device.type == "cuda" and device.index is not None:
        torch.cuda.set_device(device)


def small_shared_memory(q: torch.Tensor) -> bool:
    """Whether the kernels run on a GPU with less shared memory per block than an A100 (False off CUDA: Triton's
    interpreter has no limit). Called by the launchers, which torch.compile does not trace."""
    return q.is_cuda and _shared_memory_per_block(q.device.index) < A100_SHARED_MEMORY


def triton_interpreting() -> bool:
    """Whether Triton runs kernels in its CPU interpreter (``TRITON_INTERPRET=1``, read when a kernel is defined)."""
    return os.environ.get("TRITON_INTERPRET", "0").lower() in ("1", "true", "on", "yes")


def check_interpreter_numpy(triton_version: str, numpy_version: str) -> None:
    """Triton's interpreter before 3.7 turns 1-element arrays into Python ints with ``int()``, which numpy 2.4
    refuses (triton-lang/triton#9171): every kernel with a loop would fail deep inside the interpreter."""
    if _release(triton_version) < (3, 7) and _release(numpy_version) >= (2, 4):
        raise ValueError(f"Triton {triton_version}'s CPU interpreter does not run with numpy {numpy_version}; "
                         f"install numpy<2.4 or triton>=3.7")


def check_backend(backend: str) -> None:
    if backend not in BACKENDS:
        raise ValueError(f"backend must be one of {', '.join(map(repr, BACKENDS))}, got {backend!r}")


def _deterministic_backward(q: torch.Tensor) -> bool:
    """Whether a backward may follow (``q`` takes part in a graph) and torch is asked for deterministic
    algorithms."""
    return torch.are_deterministic_algorithms_enabled() and torch.is_grad_enabled() and q.requires_grad


def uses_triton(backend: str, q: torch.Tensor) -> bool:
    r"""Whether an op with ``backend`` (``"auto"``, ``"triton"`` or ``"torch"``) runs its Triton kernels on ``q``.

    ``auto`` takes them for CUDA tensors of a dtype they handle with heads of at most 128 features, on a GPU of
    compute capability 8.0 or later, when Triton 3.3 or later is installed, the torch path otherwise; ``triton``
    insists, and says why it cannot where it cannot. Under ``torch.use_deterministic_algorithms(True)``, for a
    ``q`` that requires a gradient with grad mode on, ``auto`` takes the torch path and ``triton`` raises (warns,
    with ``warn_only=True``): the kernels' backward adds some gradients atomically.
    """
    check_backend(backend)
    if backend == "torch":
        return False
    if backend == "auto":
        return (q.is_cuda and q.dtype in TRITON_DTYPES and TRITON_AVAILABLE and capability(q) >= MIN_CAPABILITY
                and q.shape[-1] <= TRITON_MAX_HEAD_DIM and not _deterministic_backward(q))
    if TRITON_VERSION is None:
        raise ValueError("backend='triton' needs the triton package (pip install -e '.[gpu]')")
    if not TRITON_AVAILABLE:
        raise ValueError(f"backend='triton' needs triton 3.3 or later (the kernels use tl.gather), found "
                         f"{TRITON_VERSION}; torch 2.7 and later bring a recent enough one, and backend='torch' "
                         f"runs without it")
    if not q.is_cuda:
        if not triton_interpreting():
            raise ValueError(f"backend='triton' runs on CUDA tensors, got a tensor on {q.device}; set "
                             f"TRITON_INTERPRET=1 before importing lavo to run the kernels in Triton's CPU interpreter")
        import numpy
        import triton
        check_interpreter_numpy(triton.__version__, numpy.__version__)
    elif (found := capability(q)) < MIN_CAPABILITY:
        (major, minor), (least_major, least_minor) = found, MIN_CAPABILITY
        raise ValueError(f"backend='triton' needs a GPU of compute capability {least_major}.{least_minor} or later "
                         f"(NVIDIA Ampere), this one has {major}.{minor}; backend='torch' runs on it")
    if q.dtype not in TRITON_DTYPES:
        raise ValueError(f"backend='triton' takes float16, bfloat16 or float32 inputs, got {q.dtype}")
    if q.shape[-1] > TRITON_MAX_HEAD_DIM:
        raise ValueError(f"backend='triton' takes heads of at most {TRITON_MAX_HEAD_DIM} features (the kernels' "
                         f"tiles), got {q.shape[-1]}; backend='torch' (or 'auto', which takes it then) runs any")
    if q.is_cuda and _deterministic_backward(q):
        message = ("backend='triton' adds the position-bias and basis gradients with atomic adds, whose order is "
                   "not deterministic, and torch.use_deterministic_algorithms(True) is set: backend='torch' (or "
                   "'auto', which takes it then) is deterministic")
        if not torch.is_deterministic_algorithms_warn_only_enabled():
            raise RuntimeError(message)
        warnings.warn(message)
    return True
