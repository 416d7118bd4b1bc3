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
    stream = (codes[..., None].astype(np.uint32) >> np.arange(bits, dtype=np.uint32)) & 1
    return np.packbits(stream.reshape(rows, width * bits).astype(np.uint8), axis=-1, bitorder="little").view(np.uint32)


def stored(x: np.ndarray, dtype: np.dtype) -> np.ndarray:
    """`x` as it reads back after storing in `dtype` (float16 scales must be fitted as stored)."""
    return x.astype(dtype).astype(np.float64)


def affine_grid(
    weight: np.ndarray, bits: int, group_size: int, dtype: np.dtype, importance: np.ndarray | None = None
) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Codes, scales and biases per group minimising the (column-`importance` weighted) squared error.

    Starts from the min-max grid and alternates rounding with the least-squares refit of scale and bias
    for the codes (no snapping of 0 onto the grid, unlike `mx.quantize`), keeping each group's best fit.
    Scales and biases are rounded to `dtype` before use, so the codes fit the stored values.
    """
    w = weight.astype(np.float64).reshape(weight.shape[0], -1, group_size)
    imp = np.ones_like(w) if importance is None else np.broadcast_to(importance.reshape(1, -1, group_size), w.shape)
    levels = 2**bits - 1
    low = w.min(-1, keepdims=True)
    scale, bias = np.maximum((w.max(-1, keepdims=True) - low) / levels, 1e-7), low
    n, best = imp.sum(-1, keepdims=True), None
    for _ in range(GRID_ITERATIONS):
        scale, bias = stored(np.maximum(scale, 1e-7), dtype), stored(bias, dtype)
        codes = np.clip(np.round((w - bias) / scale), 0, levels)
        error = (imp * (codes * scale + bias - w) ** 2).sum(-1, keepdims=True)
        if best is None:
            best = [error, codes, scale, bias]
        else:
            better = error < best[0]
            best = [np.where(better, new, old) for new, old in zip((error, codes, scale, bias), best, strict=True)]
        sq, sqq = (imp * codes).sum(-1, keepdims=True), (imp * codes * codes).sum(-1, keepdims=True)
        sx, sqx = (imp * w).sum(-1, keepdims=True), (imp * codes * w).sum(-1, keepdims=True)
        det = n * sqq - sq * sq
        ok = det > 1e-12 * np.maximum(n * sqq, 1e-30)
        safe = np.where(ok, det, 1.0)
        scale = np.where(ok, (n * sqx - sq * sx) / safe, scale)
        bias = np.where(ok, (sqq * sx - sq * sqx) / safe, bias)
    _, codes, scale, bias = best
    return codes.reshape(weight.shape).astype(np.int64), scale[..., 0], bias[..., 0]


def fit_grid(weight: np.ndarray, bits: int, group_size: int, dtype: np.dtype) -> tuple:
    """`affine_grid` row block by row block (large embeddings), packed: (weight, scales, biases)."""
    parts = [affine_grid(weight[i : i + GRID_ROWS], bits, group_size, dtype) for i in range(0, len(weight), GRID_ROWS)]
    codes, scales, biases = (np.concatenate(p) for p in zip(*parts, strict=True))
    return pack(codes, bits), scales.astype(dtype), biases.astype(dtype)


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
    and bias for the chosen codes. Returns (packed uint32 weight, scales, biases).
    """
    levels = 2**bits - 1
    h = hessian.astype(np.float64) + damp * np.mean(np.diag(hessian)) * np.eye(len(hessian))
    _, steps, lows = affine_grid(weight, bits, group_size, dtype, np.diag(h))
    order = np.argsort(-np.diag(h), kind="stable") if act_order else np.arange(len(h))
    u = np.linalg.cholesky(np.linalg.inv(h[order][:, order])).T  # upper Cholesky factor of H^-1, permuted
    # Column-major copies (one row per input column) keep each step's reads and writes contiguous.
    w = weight.T.astype(np.float64)[order]
    steps_t, lows_t = steps.T.copy(), lows.T.copy()
    codes = np.zeros(w.shape, np.int64)  # transposed, in the original column order
    for start in range(0, len(order), GPTQ_BLOCK):  # lazy batch updates (the paper's section 3.2): same result
        end = min(start + GPTQ_BLOCK, len(order))
        errors = np.empty((end - start, w.shape[1]))
        for i in range(start, end):
            column = order[i]
            step, low = steps_t[column // group_size], lows_t[column // group_size]
            codes[column] = np.clip(np.round((w[i] - low) / step), 0, levels)
            errors[i - start] = error = (w[i] - (codes[column] * step + low)) / u[i, i]
            w[i + 1 : end] -= np.outer(u[i, i + 1 : end], error)
        w[end:] -= u[start:end, end:].T @ errors
    codes = codes.T
    scales, biases = refit_grid(weight, h, codes, steps, lows, dtype)
    return pack(codes, bits), scales.astype(dtype), biases.astype(dtype)


def output_error(weight: np.ndarray, hessian: np.ndarray, codes: np.ndarray, scales, biases) -> np.ndarray:
    """Per output row, the squared output error on calibration data: (W' - W) H (W' - W)^T."""
    rows, width = codes.shape
    restored = codes.reshape(rows, scales.shape[1], -1) * scales[..., None] + biases[..., None]
    delta = restored.reshape(rows, width) - weight
    return ((delta @ hessian) * delta).sum(-1)


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
    q = codes.reshape(rows, groups, -1).astype(np.float64)
    size = width // groups
    hw = (w @ hessian).reshape(rows, groups, -1)
    system = np.empty((rows, 2 * groups, 2 * groups))
    system[:, groups:, groups:] = hessian.reshape(groups, size, groups, size).sum((1, 3))
    step = max(1, REFIT_BYTES // (8 * groups * width))
    for r in range(0, rows, step):  # qh[g, r, h, k] = sum_j q[r, g, j] H[g j, h k]: one matmul per group
        qh = np.matmul(q[r : r + step].transpose(1, 0, 2), hessian.reshape(groups, size, width))
        qh = qh.reshape(groups, -1, groups, size)
        system[r : r + step, :groups, :groups] = np.einsum("grhk,rhk->rgh", qh, q[r : r + step])
        system[r : r + step, :groups, groups:] = qh.sum(-1).transpose(1, 0, 2)
    system[:, groups:, :groups] = system[:, :groups, groups:].transpose(0, 2, 1)
    system += 1e-9 * np.trace(hessian) / width * np.eye(2 * groups)
    rhs = np.concatenate([(q * hw).sum(-1), hw.sum(-1)], 1)
    solution = np.linalg.solve(system, rhs[..., None])[..., 0]
    new_scales, new_biases = stored(solution[:, :groups], dtype), stored(solution[:, groups:], dtype)
    new_scales = np.where(np.isfinite(new_scales), new_scales, scales)
    new_biases = np.where(np.isfinite(new_biases), new_biases, biases)
    better = output_error(w, hessian, codes, new_scales, new_biases) < output_error(w, hessian, codes, scales, biases)
    return np.where(better[:, None], new_scales, scales), np.where(better[:, None], new_biases, biases)


def apply_gptq(model: nn.Module, hessians: dict[str, np.ndarray], floats: dict[str, np.ndarray]) -> None:
    """Re-fit each affine quantized module from its float weight, same layout: GPTQ for Linears with a
    Hessian, the least-squares grid (`affine_grid`) for the rest (embeddings, modules calibration missed)."""
    modules = [
        (path, m)
        for path, m in model.named_modules()
        if isinstance(m, (nn.QuantizedLinear, nn.QuantizedEmbedding)) and m.mode == "affine" and path in floats
    ]
    for path, module in tqdm(modules, desc="GPTQ", unit="module", leave=False):
        dtype = module.scales.dtype
        np_dtype = np.float16 if dtype == mx.float16 else np.float32  # bfloat16 is fitted as float32
        if isinstance(module, nn.QuantizedLinear) and path in hessians:
            packed, scales, biases = gptq(floats[path], hessians[path], module.bits, module.group_size, np_dtype)
        else:
            packed, scales, biases = fit_grid(floats[path], module.bits, module.group_size, np_dtype)
        module.weight, module.scales = mx.array(packed), mx.array(scales).astype(dtype)
        module.biases = mx.array(biases).astype(dtype)
