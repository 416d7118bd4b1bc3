"""Exact, fast forms of the element-wise functions encoders spend their time in: exp, erf (GELU), layer norm, the
linear product, rotary positions, and the hashed words dropout masks come from.

MLX's CPU backend computes transcendental functions one element at a time; the forms here are multiply-adds and
integer shifts that `mx.compile` fuses and the C++ compiler vectorises, within float32 rounding of the exact
function (tests/test_numerics.py), their gradients the exact functions' (tests/test_gradients.py). They are pure
MLX: on a GPU, where MLX's own kernels are fast, the functions that have a fused form step aside for it.
"""

import collections
import contextvars
import functools
import math
import threading
from collections.abc import Iterator, Sequence
from contextlib import contextmanager

import mlx.core as mx
import mlx.nn as nn
import numpy as np

from .runtime import on_cpu

# erf(z) = z N(z^2) / D(z^2) on [-4, 4], highest power first (Eigen's / XLA's float32 erf, within ~2 ulp;
# |erf| rounds to 1 beyond 4).
ERF_NUMERATOR = (-2.72614225801306e-10, 2.77068142495902e-08, -2.10102402082508e-06, -5.69250639462346e-05,
                 -7.34990630326855e-04, -2.95459980854025e-03, -1.60960333262415e-02)  # fmt: skip
ERF_DENOMINATOR = (-1.45660718464996e-05, -2.13374055278905e-04, -1.68282697438203e-03, -7.37332916720468e-03,
                   -1.42647390514189e-02)  # fmt: skip


def erf(z: mx.array) -> mx.array:
    """erf(z) for float32 z in [-4, 4], both polynomials of the ratio in Estrin's form, so their dependency chains
    are short enough for mx.compile to fuse all of it (it is inlined into the compiled functions below)."""
    n0, n1, n2, n3, n4, n5, n6 = ERF_NUMERATOR
    d0, d1, d2, d3, d4 = ERF_DENOMINATOR
    z2 = z * z
    z4 = z2 * z2
    z8 = z4 * z4
    numerator = (n6 + n5 * z2) + z4 * (n4 + n3 * z2) + z8 * (n2 + n1 * z2 + n0 * z4)
    denominator = (d4 + d3 * z2) + z4 * (d2 + d1 * z2) + z8 * d0
    return z * numerator / denominator


@mx.compile
def gelu_from(x: mx.array, z: mx.array) -> mx.array:
    """x (1 + erf(z)) / 2 for float32 x and z = x / sqrt(2) clipped to [-4, 4]."""
    return x * (1 + erf(z)) / 2


@mx.compile
def gelu_slope_from(x: mx.array, z: mx.array, density: mx.array) -> mx.array:
    """GELU'(x) = Phi(x) + x phi(x), from z as in gelu_from and density = exp(-x^2 / 2)."""
    return (1 + erf(z)) / 2 + x * density * (1 / math.sqrt(2 * math.pi))


def unfused(x: mx.array) -> mx.array:
    """`x` itself, as a kernel boundary on the CPU: mx.compile does not fuse through a bit-cast (`view`), which
    for a contiguous array shares its buffer (no copy). The training step compiles all of its graph as one, and
    there MLX fused these functions' stages into kernels its C++ compiler does not vectorise: one `maximum` or
    `where` in a loop makes all of it scalar. Apart, the stages run as in an eager call. Float32 only; only in
    graphs that are not differentiated (custom-vjp bodies); elsewhere (GPUs, other dtypes) a no-op."""
    if x.dtype != mx.float32 or not on_cpu():
        return x
    return x.view(mx.uint32).view(mx.float32)


@mx.compile
def clip_z(x32: mx.array) -> mx.array:
    """x / sqrt(2) clipped to [-4, 4] (NaN stays NaN), with selects: alone, they vectorise, where mx.clip's
    minimum and maximum do not."""
    z = x32 * (1 / math.sqrt(2))
    return mx.where(z > 4.0, 4.0, mx.where(z < -4.0, -4.0, z))


def clipped_z(x32: mx.array) -> mx.array:
    # Apart from the rest (`unfused`): fused with it, the selects made the whole kernel scalar.
    return unfused(clip_z(x32))


@mx.custom_function
def gelu(x: mx.array) -> mx.array:
    """Exact (erf) GELU, as torch's nn.GELU(): a fused rational erf replaces mx.erf, which is several times
    slower on MLX's CPU backend; within 1.1e-6 of the exact GELU on [-12, 12] (tests/test_numerics.py).
    Half-precision inputs are computed in float32 (the small coefficients underflow in float16), as torch does."""
    x32 = x.astype(mx.float32)
    return gelu_from(x32, clipped_z(x32)).astype(x.dtype)


@gelu.vjp
def gelu_vjp(x: mx.array, cotangent: mx.array, output: mx.array) -> mx.array:
    """The exact GELU's derivative, within 2.6e-7 (differentiating the rational erf and its clip: 7.5e-6 off)."""
    x32 = x.astype(mx.float32)
    slope = gelu_slope_from(x32, clipped_z(x32), exp_nonpositive(unfused(x32 * x32 * -0.5)))
    return (cotangent.astype(mx.float32) * unfused(slope)).astype(x.dtype)


# exp(x) = 2^n * exp(r), n = round(x / ln 2), r = x - n ln 2 in [-ln2/2, ln2/2] (Cody-Waite: ln 2 in two parts);
# exp(r) = 1 + r + r^2 P(r), Cephes' float32 expf polynomial (within 1 ulp of exp).
LOG2E = 1.4426950408889634
LN2_HIGH, LN2_LOW = 0.693359375, -2.12194440e-4
EXP_POLYNOMIAL = (1.9875691500e-4, 1.3981999507e-3, 8.3334519073e-3, 4.1665795894e-2, 1.6666665459e-1,
                  5.0000001201e-1)  # fmt: skip
ROUNDING = 12582912.0  # 1.5 * 2^23: adding it rounds a float32 of magnitude < 2^22 to an integer, in its low bits
# Below this, exp is 0: x rounds to n = -127, whose 2^n bit pattern is all zeros. Masked scores land here, and
# must give exactly 0, never a subnormal: x86 arithmetic on subnormals slows a backward pass over padded batches
# by an order of magnitude (torch's softmax gives 0 there too).
FLUSH_TO_ZERO = -88.0


@mx.compile
def exp_reduce(x: mx.array) -> tuple[mx.array, mx.array]:
    """(x / ln 2 + ROUNDING, whose low bits hold n; r)."""
    shifted = x * LOG2E + ROUNDING
    n = shifted - ROUNDING
    return shifted, (x - n * LN2_HIGH) - n * LN2_LOW


@mx.compile
def exp_small(r: mx.array, scale: mx.array) -> mx.array:
    """exp(r) * scale for |r| <= ln2 / 2, the polynomial in Estrin's form (short dependency chains)."""
    c0, c1, c2, c3, c4, c5 = EXP_POLYNOMIAL
    r2 = r * r
    p = (c5 + c4 * r) + r2 * (c3 + c2 * r) + (r2 * r2) * (c1 + c0 * r)
    return (p * r2 + r + 1) * scale


@mx.compile
def exponent_bits(shifted_bits: mx.array) -> mx.array:
    """The float32 bit pattern of 2^n, from the (uint32) bits of x / ln 2 + ROUNDING, whose low bits hold n."""
    return (shifted_bits + 127) << 23


@mx.custom_function
def exp_nonpositive(x: mx.array) -> mx.array:
    """exp of float32 x <= 0, within 1 ulp for x >= ln(2^-126) (about -87.34); below about -87.68 it is 0.
    Positive x are outside its contract (past 88 the exponent overflows); softmax only needs x <= 0.

    MLX's CPU backend computes mx.exp one element at a time, about 10 ns each (and up to 64 ulp off); these
    multiply-adds and integer shifts vectorise. They run as separate kernels (`unfused`), also inside a larger
    compiled graph: MLX's CPU kernels do not vectorise `maximum`, which therefore runs alone, and fused with
    the range reduction the polynomial would not vectorise either.
    """
    shifted, r = exp_reduce(unfused(mx.maximum(x, FLUSH_TO_ZERO)))
    scale = unfused(exponent_bits(shifted.view(mx.uint32)).view(mx.float32))
    return exp_small(unfused(r), scale)


@exp_nonpositive.vjp
def exp_nonpositive_vjp(x: mx.array, cotangent: mx.array, output: mx.array) -> mx.array:
    """exp' = exp. MLX cannot differentiate the bit-casts, and the range reduction would differentiate wrongly."""
    return cotangent * output


@mx.compile
def negative_magnitude(x: mx.array) -> mx.array:
    return -mx.abs(x)


@mx.compile
def sigmoid_from(x: mx.array, t: mx.array) -> mx.array:
    """sigmoid(x) from t = exp(-|x|): 1 / (1 + t) for x >= 0, t / (1 + t) below, with no select (a `where` would
    keep the kernel from vectorising)."""
    above = (x >= 0).astype(x.dtype)
    return (above + (1 - above) * t) / (1 + t)


def sigmoid32(x32: mx.array) -> mx.array:
    """sigmoid of float32 x through exp_nonpositive, its stages apart (`unfused`); no gradient of its own."""
    return unfused(sigmoid_from(x32, unfused(exp_nonpositive(unfused(negative_magnitude(x32))))))


@mx.custom_function
def _silu(x: mx.array) -> mx.array:
    x32 = x.astype(mx.float32)
    return (x32 * sigmoid32(x32)).astype(x.dtype)


@_silu.vjp
def _silu_vjp(x: mx.array, cotangent: mx.array, output: mx.array) -> mx.array:
    x32 = x.astype(mx.float32)
    s = sigmoid32(x32)
    return (cotangent.astype(mx.float32) * (s * (1 + x32 * (1 - s)))).astype(x.dtype)


def silu(x: mx.array) -> mx.array:
    """x sigmoid(x) (torch's SiLU), the sigmoid through exp_nonpositive on the CPU, where mx.sigmoid runs one element
    at a time; within 1e-6 relative of the exact SiLU (tests/test_numerics.py). Elsewhere nn.silu."""
    return _silu(x) if on_cpu() else nn.silu(x)


# tanh-approximated GELU: 0.5 x (1 + tanh(u)) = x sigmoid(2u), u = sqrt(2 / pi) (x + 0.044715 x^3).
GELU_TANH_LINEAR = 2 * math.sqrt(2 / math.pi)
GELU_TANH_CUBIC = GELU_TANH_LINEAR * 0.044715


@mx.compile
def gelu_tanh_argument(x: mx.array) -> mx.array:
    return x * (GELU_TANH_LINEAR + GELU_TANH_CUBIC * (x * x))


@mx.custom_function
def _gelu_tanh(x: mx.array) -> mx.array:
    x32 = x.astype(mx.float32)
    return (x32 * sigmoid32(gelu_tanh_argument(x32))).astype(x.dtype)


@_gelu_tanh.vjp
def _gelu_tanh_vjp(x: mx.array, cotangent: mx.array, output: mx.array) -> mx.array:
    x32 = x.astype(mx.float32)
    s = sigmoid32(gelu_tanh_argument(x32))
    near = mx.clip(x32, -20, 20)  # beyond, s (1 - s) is 0 and the cubic's slope would make it 0 * inf
    slope = s + near * s * (1 - s) * (GELU_TANH_LINEAR + 3 * GELU_TANH_CUBIC * (near * near))
    return (cotangent.astype(mx.float32) * slope).astype(x.dtype)


def gelu_tanh(x: mx.array) -> mx.array:
    """torch's GELU(approximate="tanh") as x sigmoid(2u), the sigmoid through exp_nonpositive on the CPU (mx.tanh runs
    one element at a time there); elsewhere nn.gelu_approx."""
    return _gelu_tanh(x) if on_cpu() else nn.gelu_approx(x)


# Dropout masks: MLX's own draws a threefry word per element on one thread; hashing each element's index under
# two drawn keys is one vectorised kernel.
HASH_MULTIPLIERS = (0x7FEB352D, 0x846CA68B)
MAX_HASHED = 2**32  # elements a uint32 index tells apart


_KEYS: contextvars.ContextVar[list | None] = contextvars.ContextVar("random_keys", default=None)


@contextmanager
def drawing_from(state: list[mx.array]) -> Iterator[None]:
    """Inside, `random_words` draws from the one-key list `state`, advancing it as MLX advances its global key
    (the same sequence of draws), and leaves MLX's global key alone. `state` may be a compiled function's input
    and output, as mx.random.state is."""
    token = _KEYS.set(state)
    try:
        yield
    finally:
        _KEYS.reset(token)


def drawing_state() -> list[mx.array] | None:
    """The one-key list of the enclosing `drawing_from` block, or None outside one."""
    return _KEYS.get()


def next_key() -> mx.array | None:
    """The next key of the enclosing `drawing_from` block's state, or None (MLX's global key) outside one."""
    state = _KEYS.get()
    if state is None:
        return None
    state[0], key = mx.random.split(state[0])
    return key


def mix32(h: mx.array) -> mx.array:
    """lowbias32 (Chris Wellons' hash-prospector): a bijection of uint32 words in which every input bit flips each
    output bit with probability close to 1/2."""
    h = (h ^ (h >> 16)) * HASH_MULTIPLIERS[0]
    h = (h ^ (h >> 15)) * HASH_MULTIPLIERS[1]
    return h ^ (h >> 16)


def random_words(shape: Sequence[int]) -> mx.array:
    """uint32 random words of `shape`: mix32(mix32(i + k1) ^ k2) of each element's index i, with two 32-bit keys
    drawn from the key of the enclosing `drawing_from` block, else from MLX's global key (so mx.random.seed and a
    compiled step's random state govern them as they do mx.random's draws). Two calls' index windows i + k1
    overlap with probability (elements) / 2^31, and even then the second key sets them apart."""
    halves = mx.random.randint(0, 1 << 16, (4,), dtype=mx.uint32, key=next_key())
    k1, k2 = (halves[0] << 16) | halves[1], (halves[2] << 16) | halves[3]
    index = mx.arange(math.prod(shape), dtype=mx.uint32).reshape(shape)
    return mix32(mix32(index + k1) ^ k2)


# Up to this many elements a layer norm's last step runs as one compiled kernel, whose one dispatch beats four;
# above it MLX's own broadcasting element-wise kernels are faster than the compiled kernel's generic indexing.
COMPILED_SCALE_MAX_ELEMENTS = 2**14


@mx.compile
def scale_and_shift(centred: mx.array, error: mx.array, inverse_std: mx.array, weight: mx.array, bias: mx.array):
    return (centred - error) * inverse_std * weight + bias


@functools.cache
def averaging_vector(width: int) -> mx.array:
    """(width, 1) of 1 / width, made from data so that a first call inside a compiled function caches no tracer."""
    return mx.array(np.full((width, 1), 1.0 / width, np.float32))


def layer_norm(x: mx.array, weight: mx.array | None, bias: mx.array | None, eps: float) -> mx.array:
    """mx.fast.layer_norm(x, weight, bias, eps). On the CPU, for float32 x, the mean and the variance over the last
    axis are matrix-vector products with a vector of 1 / H (BLAS): MLX's CPU layer norm is its composed fallback,
    whose row reductions are slower. It stays within 2e-6 of torch's float64 layer norm relative to the output's
    scale, gradients too (tests/test_numerics.py): the mean's rounding error, which a BLAS's summation order sets
    and a large common offset magnifies, is measured on the centred values and taken off; it is too small for its
    square to change the variance, the centred values' mean square."""
    if not on_cpu() or x.dtype != mx.float32:
        return mx.fast.layer_norm(x, weight, bias, eps)
    average = averaging_vector(x.shape[-1])
    centred = x - x @ average
    error = centred @ average
    inverse_std = mx.rsqrt(mx.addmm(mx.array(eps, mx.float32), centred * centred, average))  # eps added in the product
    if weight is not None and bias is not None and x.size <= COMPILED_SCALE_MAX_ELEMENTS:
        return scale_and_shift(centred, error, inverse_std, weight, bias)
    y = (centred - error) * inverse_std
    y = y if weight is None else y * weight
    return y if bias is None else y + bias


def linear(x: mx.array, weight: mx.array, bias: mx.array | None = None) -> mx.array:
    """x @ weight.T (+ bias): nn.Linear's product."""
    return x @ weight.T if bias is None else mx.addmm(bias, x, weight.T)


def linear_in_eval(x: mx.array, weight: mx.array, bias: mx.array | None) -> mx.array:
    """nn.Linear's product. On the CPU with a bias: the product, then the bias added; MLX's CPU addmm first copies
    the bias into every output row through its general strided copy, which is slower (training keeps addmm,
    `linear_with_bias`, where two ops were slower)."""
    if bias is not None and on_cpu():
        return x @ weight.T + bias
    return linear(x, weight, bias)


@mx.custom_function
def linear_with_bias(x: mx.array, weight: mx.array, bias: mx.array) -> mx.array:
    """`linear(x, weight, bias)`, its gradients laid out as the weights are (`Linear`)."""
    return linear(x, weight, bias)


@linear_with_bias.vjp
def _linear_with_bias_vjp(primals: tuple, cotangent: mx.array, output: mx.array) -> tuple:
    x, weight, bias = primals
    dx, dw = _linear_cotangents(x, weight, cotangent)
    return dx, dw, cotangent.reshape(-1, cotangent.shape[-1]).sum(axis=0).astype(bias.dtype)


@mx.custom_function
def linear_without_bias(x: mx.array, weight: mx.array) -> mx.array:
    """`linear(x, weight)`, its gradients laid out as the weights are (`Linear`)."""
    return linear(x, weight)


@linear_without_bias.vjp
def _linear_without_bias_vjp(primals: tuple, cotangent: mx.array, output: mx.array) -> tuple:
    return _linear_cotangents(*primals, cotangent)


def _linear_cotangents(x: mx.array, weight: mx.array, cotangent: mx.array) -> tuple[mx.array, mx.array]:
    """d/dx = g W and d/dW = g^T x over all leading axes at once: one (out, in) product in W's row-major layout.
    MLX's own is (x^T g)^T, a transposed view, which the optimizer's fused update then reads through strides
    and the gradient norm across the cache."""
    rows = cotangent.reshape(-1, cotangent.shape[-1])
    dw = rows.T @ x.reshape(-1, x.shape[-1])
    return (cotangent @ weight).astype(x.dtype), dw.astype(weight.dtype)


@functools.lru_cache(maxsize=64)
def rope_wavelengths(dims: int, base: float) -> mx.array:
    """What mx.fast.rope divides positions by: one over transformers' float32 inverse frequencies 1 / base^(2i/dims).
    MLX's own `base=` rounds them in another last bit, which moves the angles by 1e-4 a few thousand positions in."""
    inverse = 1.0 / mx.power(mx.array(base, mx.float32), mx.arange(0, dims, 2, dtype=mx.float32) / dims)
    wavelengths = 1.0 / inverse
    mx.eval(wavelengths)  # now: a graph left lazy would run on another thread's stream (the server's worker)
    return wavelengths


# Rotation tables grow to the longest length asked for (at least doubling, in whole blocks of this many positions),
# for at most ROTATION_KEYS shapes at once, the least recently used let go: a dynamic-NTK base (Nomic BERT, GTE)
# changes with every input length past the trained one.
ROTATION_ROWS = 512
ROTATION_KEYS = 16
_rotations: collections.OrderedDict[tuple[int, float, float], tuple[mx.array, mx.array]] = collections.OrderedDict()
_rotations_lock = threading.Lock()


def rotation_tables(length: int, dims: int, base: float, scale: float) -> tuple[mx.array, mx.array]:
    """(cos, sin) of the rotary angles of positions 0..length-1, (length, dims / 2) float32 constants: the angles in
    float32 as mx.fast.rope forms them (position * scale / wavelength), their cosines and sines correctly rounded
    from float64. Made in numpy, so a pass's graph holds no ops for the angles: on the CPU mx.fast.rope computes
    them in every layer, a side branch of a dozen ops that, in a group of passes evaluated together, helped push
    MLX's order past its breadth limit (runtime.widen_evaluation)."""
    key = (dims, base, scale)
    with _rotations_lock:
        tables = _rotations.get(key)
        if tables is None or tables[0].shape[0] < length:
            grown = max(length, 2 * tables[0].shape[0]) if tables is not None else length
            rows = -(-grown // ROTATION_ROWS) * ROTATION_ROWS
            inverse = np.reciprocal(np.array(rope_wavelengths(dims, base), np.float32))
            angles = (np.arange(rows, dtype=np.float32) * np.float32(scale))[:, None] * inverse[None]
            angles = angles.astype(np.float64)
            tables = (mx.array(np.cos(angles).astype(np.float32)), mx.array(np.sin(angles).astype(np.float32)))
            _rotations[key] = tables
        _rotations.move_to_end(key)
        while len(_rotations) > ROTATION_KEYS:
            _rotations.popitem(last=False)
    cos, sin = tables
    return (cos, sin) if cos.shape[0] == length else (cos[:length], sin[:length])


def rope(x: mx.array, base: float, scale: float = 1.0) -> mx.array:
    """Rotate-half rotary embedding of (B, nh, L, hd) `x` at positions 0..L-1 (times `scale`: linear scaling), as
    transformers' default rope with `rope_theta` = `base`. On the CPU the same products as mx.fast.rope's composed
    form over `rotation_tables`; elsewhere MLX's fused kernel."""
    dims = x.shape[-1]
    if not on_cpu():
        return mx.fast.rope(
            x, dims, traditional=False, base=None, scale=scale, offset=0, freqs=rope_wavelengths(dims, base)
        )
    cos, sin = rotation_tables(x.shape[-2], dims, base, scale)
    if x.dtype != mx.float32:
        cos, sin = cos.astype(x.dtype), sin.astype(x.dtype)
    half = dims // 2
    x1, x2 = x[..., :half], x[..., half:]
    return mx.concatenate([x1 * cos - x2 * sin, x1 * sin + x2 * cos], axis=-1)
