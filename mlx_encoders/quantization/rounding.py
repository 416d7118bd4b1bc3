"""Rounding float weights onto MLX's affine grid with less error than round to nearest (`mx.quantize`).

`affine_grid` fits each group's scale and bias by least squares; `gptq` is GPTQ (Frantar et al. 2022,
"GPTQ: Accurate Post-Training Quantization for Generative Pre-trained Transformers", Algorithm 1) with
act-order and static groups. Both produce `mx.quantize`'s layout (codes packed into uint32 words, one
scale and bias per group), so `nn.QuantizedLinear` and `nn.QuantizedEmbedding` read the result unchanged.
"""

import mlx.core as mx
import mlx.nn as nn
import numpy as np
from tqdm import tqdm

GRID_ITERATIONS = 8  # alternating refits of each group's scale and bias (see `affine_grid`)
GRID_ROWS = 4096  # rows fitted at once, to bound the memory of large embedding matrices
GPTQ_BLOCK = 128  # columns rounded one by one before their errors reach the later columns in one matmul
REFIT_BYTES = 1 << 26  # working memory of `refit_grid`'s per-row systems, built this many bytes at a time


def pack(codes: np.ndarray, bits: int) -> np.ndarray:
    """MLX's affine packing: each row's codes as a little-endian bit stream, read as uint32 words."""
    rows, width = codes.shape
    if 32 % bits == 0:  # 2, 4 and 8 bits: whole codes per word, the first in the lowest bits
        shifts = np.arange(0, 32, bits, dtype=np.uint32)
        words = codes.reshape(rows, -1, 32 // bits).astype(np.uint32) << shifts
        return np.ascontiguousarray(words.sum(-1, dtype=np.uint32))
    stream = (codes[..., None].astype(np.uint32) >> np.arange(bits, dtype=np.uint32)) & 1
    return np.packbits(stream.reshape(rows, width * bits).astype(np.uint8), axis=-1, bitorder="little").view(np.uint32)


# numpy has no bfloat16: scales stored in it are fitted as rounded to it by hand (`stored`), held in float32
BFLOAT16 = "bfloat16"


def holder(dtype) -> np.dtype:
    """The numpy dtype that holds values of `dtype` exactly."""
    return np.dtype(np.float32) if dtype == BFLOAT16 else np.dtype(dtype)


def stored(x: np.ndarray, dtype) -> np.ndarray:
    """`x` as it reads back after storing in `dtype` (float16 and bfloat16 scales must be fitted as stored)."""
    if dtype == BFLOAT16:  # round to nearest, ties to even, on the top 16 bits of each float32
        bits = np.asarray(x, np.float32).view(np.uint32).astype(np.uint64)
        bits = ((bits + 0x7FFF + ((bits >> 16) & 1)) & 0xFFFF0000).astype(np.uint32)
        return bits.view(np.float32).astype(np.float64)
    return x.astype(dtype).astype(np.float64)


def affine_grid(
    weight: np.ndarray, bits: int, group_size: int, dtype: np.dtype, importance: np.ndarray | None = None
) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Codes, scales and biases per group minimising the (column-`importance` weighted) squared error.

    Starts from the min-max grid and alternates rounding with the least-squares refit of scale and bias
    for the codes (no snapping of 0 onto the grid, unlike `mx.quantize`), keeping each group's best fit.
    Scales and biases are rounded to `dtype` before use, so the codes fit the stored values. A group whose
    rounded scale and bias come back unchanged has reached a fixed point and leaves the loop.
    """
    rows, width = weight.shape
    groups = width // group_size
    w = weight.astype(np.float64).reshape(-1, group_size)  # (rows * groups, group_size): one group per line
    imp = None if importance is None else importance.astype(np.float64).reshape(groups, group_size)
    levels = 2**bits - 1
    low = w.min(-1)
    scale, bias = stored(np.maximum((w.max(-1) - low) / levels, 1e-7), dtype), stored(low, dtype)
    best = [np.full(len(w), np.inf), scale, bias]  # error, scale, bias
    weighted_w = w if imp is None else np.tile(imp, (rows, 1)) * w
    n = np.full(len(w), float(group_size)) if imp is None else np.tile(imp.sum(-1), rows)
    sx, sxx = weighted_w.sum(-1), np.einsum("ij,ij->i", weighted_w, w)
    active, w_active, imp_active, previous = np.arange(len(w)), w, None, None
    codes, products = np.empty_like(w), np.empty_like(w)  # buffers, their first rows in use
    for _ in range(GRID_ITERATIONS):
        scale, bias = stored(np.maximum(scale, 1e-7), dtype), stored(bias, dtype)
        if previous is not None and not (moving := (scale != previous[0]) | (bias != previous[1])).all():
            active, w_active, scale, bias = active[moving], w_active[moving], scale[moving], bias[moving]
            imp_active = None
            if not len(active):
                break
        if imp is not None and imp_active is None:
            imp_active = imp[active % groups]
        previous = scale, bias
        q = codes[: len(active)]
        np.subtract(w_active, bias[:, None], out=q)
        np.divide(q, scale[:, None], out=q)
        np.clip(np.round(q, out=q), 0, levels, out=q)
        weighted = q if imp is None else np.multiply(imp_active, q, out=products[: len(active)])
        sq, sqq, sqx = weighted.sum(-1), np.einsum("ij,ij->i", weighted, q), np.einsum("ij,ij->i", weighted, w_active)
        n_active, sx_active = n[active], sx[active]
        # The weighted squared error of q * scale + bias - w, expanded into the sums (no pass over the group).
        error = scale * (scale * sqq + 2 * bias * sq - 2 * sqx) + bias * (bias * n_active - 2 * sx_active) + sxx[active]
        better = error < best[0][active]
        for kept, new in zip(best, (error, scale, bias), strict=True):
            kept[active[better]] = new[better]
        det = n_active * sqq - sq * sq
        ok = det > 1e-12 * np.maximum(n_active * sqq, 1e-30)
        safe = np.where(ok, det, 1.0)
        scale = np.where(ok, (n_active * sqx - sq * sx_active) / safe, scale)
        bias = np.where(ok, (sqq * sx_active - sq * sqx) / safe, bias)
    _, scale, bias = best
    codes = np.clip(np.round((w - bias[:, None]) / scale[:, None]), 0, levels)
    return codes.reshape(rows, width).astype(np.int64), scale.reshape(rows, groups), bias.reshape(rows, groups)


def fit_grid(weight: np.ndarray, bits: int, group_size: int, dtype: np.dtype) -> tuple:
    """`affine_grid` row block by row block (large embeddings), packed: (weight, scales, biases)."""
    parts = [affine_grid(weight[i : i + GRID_ROWS], bits, group_size, dtype) for i in range(0, len(weight), GRID_ROWS)]
    codes, scales, biases = (np.concatenate(p) for p in zip(*parts, strict=True))
    return pack(codes, bits), scales.astype(holder(dtype)), biases.astype(holder(dtype))


def product(a: np.ndarray, b: np.ndarray) -> np.ndarray:
    """a @ b in float64 through MLX's BLAS (MLX takes no negative strides)."""
    a, b = (mx.array(np.ascontiguousarray(x), dtype=mx.float64) for x in (a, b))
    return np.array(mx.matmul(a, b, stream=mx.cpu))


def inverse_cholesky(hessian: np.ndarray, order: np.ndarray) -> mx.array:
    """The upper triangular U with U^T U = H^-1 for H = `hessian` with rows and columns in `order`, from one
    Cholesky factorisation and one triangular inverse (a third of the work of inverting H and factorising H^-1).

    With J the order-reversing permutation, J H J = L L^T gives H = R R^T for the upper R = J L J, so
    H^-1 = R^-T R^-1 and U = R^-1 = J L^-1 J. numpy has no triangular inverse; MLX's LAPACK runs in float64 on
    the CPU, on MLX's own thread (`mx.async_eval`) while the caller goes on: `checked` waits for it.
    """
    reverse = order[::-1]
    with mx.stream(mx.cpu):
        lower = mx.linalg.cholesky(mx.array(hessian[np.ix_(reverse, reverse)], dtype=mx.float64))
        upper = mx.linalg.tri_inv(lower, upper=False)[::-1, ::-1]
    mx.async_eval(upper)
    return upper


def checked(upper: mx.array) -> np.ndarray:
    """`inverse_cholesky`'s factor, once computed; MLX's LAPACK does not raise on a matrix that is not positive
    definite, it leaves a non-positive or non-finite diagonal."""
    upper = np.array(upper)
    if not (np.all(np.isfinite(upper)) and np.all(np.diag(upper) > 0)):
        raise np.linalg.LinAlgError("the damped input Hessian is not positive definite")
    return upper


def gptq(
    weight: np.ndarray,
    hessian: np.ndarray,
    bits: int,
    group_size: int,
    dtype=np.float16,
    damp: float = 0.01,
    act_order: bool = True,
) -> tuple:
    """GPTQ (Frantar et al. 2022, Algorithm 1) with act-order and static groups, into MLX affine triplets.

    Each group's grid is first fitted to the float weights (`affine_grid`, weighted by the Hessian's
    diagonal): MLX groups are runs of adjacent columns, so the grid cannot follow the column order. The
    columns are then rounded in order of decreasing Hessian diagonal (the inputs that carry the most
    energy first, "act-order"), each rounding error pushed onto the columns not yet rounded through the
    inverse Hessian of the layer's inputs, so the layer's outputs on calibration data move less than with
    plain rounding (`act_order=False` rounds left to right). At the end `refit_grid` re-solves every scale
    and bias for the chosen codes. Rows are independent: stacking the weights of Linears that share an input
    (query, key, value) rounds each as alone. Returns (packed uint32 weight, scales, biases).
    """
    levels = 2**bits - 1
    h = hessian.astype(np.float64)
    h[np.diag_indices_from(h)] += damp * np.mean(np.diag(hessian))
    order = np.argsort(-np.diag(h), kind="stable") if act_order else np.arange(len(h))
    u = inverse_cholesky(h, order)  # computed while the grid is fitted
    _, steps, lows = affine_grid(weight, bits, group_size, dtype, np.diag(h))
    u = checked(u)
    # Column-major copies in rounding order (one row per input column) keep each step's reads contiguous.
    w = weight.T.astype(np.float64)[order]
    steps_t, lows_t = steps.T[order // group_size], lows.T[order // group_size]
    codes = np.empty(w.shape, np.int64)
    for start in range(0, len(order), GPTQ_BLOCK):  # lazy batch updates (the paper's section 3.2): same result
        end = min(start + GPTQ_BLOCK, len(order))
        errors = np.empty((end - start, w.shape[1]))
        for i in range(start, end):  # the errors of the block's earlier columns reach column i as it is rounded
            column = w[i] - np.einsum("k,kr->r", u[start:i, i], errors[: i - start])
            code = np.minimum(np.maximum(np.rint((column - lows_t[i]) / steps_t[i]), 0), levels)
            errors[i - start] = (column - (code * steps_t[i] + lows_t[i])) / u[i, i]
            codes[order[i]] = code
        w[end:] -= product(u[start:end, end:].T, errors)
    codes = codes.T
    scales, biases = refit_grid(weight, h, codes, steps, lows, dtype)
    return pack(codes, bits), scales.astype(holder(dtype)), biases.astype(holder(dtype))


def output_error(weight: np.ndarray, hessian: np.ndarray, codes: np.ndarray, scales, biases) -> np.ndarray:
    """Per output row, the squared output error on calibration data: (W' - W) H (W' - W)^T."""
    rows, width = codes.shape
    restored = codes.reshape(rows, scales.shape[1], -1) * scales[..., None] + biases[..., None]
    delta = restored.reshape(rows, width) - weight
    return ((delta @ hessian) * delta).sum(-1)


def code_products(hessian: np.ndarray, q: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """For the codes q (rows, G, size) of every row, (rows, G, G) q_g H_gh q_h and q_g H_gh 1, one matmul per
    group g (only h >= g for the first: it is symmetric), in one MLX graph per REFIT_BYTES of rows."""
    rows, groups, size = q.shape
    quadratic, linear = np.empty((rows, groups, groups)), np.empty((rows, groups, groups))
    chunk = max(1, REFIT_BYTES // (8 * groups * size))
    with mx.stream(mx.cpu):  # float64 runs on the CPU only
        h = mx.array(hessian, dtype=mx.float64)
        summed = h.reshape(groups, size, groups, size).sum(-1)  # (G, size, G): H's rows summed over each group
        for r in range(0, rows, chunk):
            codes = mx.array(q[r : r + chunk], dtype=mx.float64)
            parts = [(codes.transpose(1, 0, 2) @ summed).transpose(1, 0, 2)]
            for g in range(groups):
                products = codes[:, g] @ h[g * size : (g + 1) * size, g * size :]  # (chunk, (G - g) * size)
                parts.append((products.reshape(len(codes), groups - g, size) * codes[:, g:]).sum(-1))
            mx.eval(parts)
            linear[r : r + chunk] = np.array(parts[0])
            for g, part in enumerate(parts[1:]):
                quadratic[r : r + chunk, g, g:] = quadratic[r : r + chunk, g:, g] = np.array(part)
    return quadratic, linear


def refit_grid(
    weight: np.ndarray, hessian: np.ndarray, codes: np.ndarray, scales: np.ndarray, biases: np.ndarray, dtype
) -> tuple[np.ndarray, np.ndarray]:
    """Every group's scale and bias of a row solved jointly for the row's codes, minimising `output_error`.

    For fixed codes the restored row is linear in its 2G scales and biases, so the optimum is one small
    linear system per row; rows where it does not lower the error (after rounding to `dtype`) keep theirs.
    """
    w = weight.astype(np.float64)
    rows, width = codes.shape
    groups = scales.shape[1]
    size = width // groups
    q = codes.reshape(rows, groups, size).astype(np.float64)
    hw = product(w, hessian).reshape(rows, groups, size)
    system = np.empty((rows, 2 * groups, 2 * groups))  # [[q_g H_gh q_h, q_g H_gh 1], [1 H_gh q_h, 1 H_gh 1]]
    system[:, :groups, :groups], system[:, :groups, groups:] = code_products(hessian, q)
    system[:, groups:, :groups] = system[:, :groups, groups:].transpose(0, 2, 1)
    system[:, groups:, groups:] = hessian.reshape(groups, size, groups, size).sum((1, 3))
    rhs = np.concatenate([(q * hw).sum(-1), hw.sum(-1)], 1)
    regularised = system + 1e-9 * np.trace(hessian) / width * np.eye(2 * groups)
    solution = np.linalg.solve(regularised, rhs[..., None])[..., 0]
    new_scales, new_biases = stored(solution[:, :groups], dtype), stored(solution[:, groups:], dtype)
    new_scales = np.where(np.isfinite(new_scales), new_scales, scales)
    new_biases = np.where(np.isfinite(new_biases), new_biases, biases)
    # A row's output_error is t system t - 2 t rhs + w H w for t = (scales, biases): the change from old to
    # new t is (new - old) system (new + old) - 2 (new - old) rhs, without another pass over H.
    old, new = np.concatenate([scales, biases], 1), np.concatenate([new_scales, new_biases], 1)
    change = new - old
    gain = np.einsum("ri,rij,rj->r", change, system, new + old) - 2 * (change * rhs).sum(-1)
    better = gain < 0
    return np.where(better[:, None], new_scales, scales), np.where(better[:, None], new_biases, biases)


def shared_fits(modules: list[tuple[str, nn.Module]], hessians: dict[str, np.ndarray]) -> list[tuple]:
    """(bits, group size, dtype, Hessian or None, members) per fit: Linears with equal Hessians and settings
    (query, key and value read one input) share one, as stacked rows; every other module fits alone."""
    fits = []
    for path, module in modules:
        hessian = hessians.get(path) if isinstance(module, nn.QuantizedLinear) else None
        settings = (module.bits, module.group_size, module.scales.dtype)
        for fit in fits:
            same = hessian is not None and fit[3] is not None and fit[3].shape == hessian.shape
            if same and fit[:3] == settings and np.array_equal(fit[3], hessian):
                fit[4].append((path, module))
                break
        else:
            fits.append((*settings, hessian, [(path, module)]))
    return fits


def apply_gptq(model: nn.Module, hessians: dict[str, np.ndarray], floats: dict[str, np.ndarray]) -> None:
    """Re-fit each affine quantized module from its float weight, same layout: GPTQ for Linears with a
    Hessian, the least-squares grid (`affine_grid`) for the rest (embeddings, modules calibration missed).
    Rows are independent in both, so Linears sharing a Hessian are fitted as one stacked weight."""
    modules = [
        (path, m)
        for path, m in model.named_modules()
        if isinstance(m, (nn.QuantizedLinear, nn.QuantizedEmbedding)) and m.mode == "affine" and path in floats
    ]
    with tqdm(total=len(modules), desc="GPTQ", unit="module", leave=False) as progress:
        for bits, group_size, dtype, hessian, members in shared_fits(modules, hessians):
            np_dtype = {mx.float16: np.float16, mx.bfloat16: BFLOAT16}.get(dtype, np.float32)
            weight = np.concatenate([floats[path] for path, _ in members])
            if hessian is not None:
                packed, scales, biases = gptq(weight, hessian, bits, group_size, np_dtype)
            else:
                packed, scales, biases = fit_grid(weight, bits, group_size, np_dtype)
            start = 0
            for path, module in members:
                end = start + len(floats[path])
                module.weight, module.scales = mx.array(packed[start:end]), mx.array(scales[start:end]).astype(dtype)
                module.biases = mx.array(biases[start:end]).astype(dtype)
                start = end
            progress.update(len(members))
