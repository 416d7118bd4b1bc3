"""One-row float32 products through the BLAS's matrix-vector routine: a decoding step multiplies one row by every
weight, and OpenBLAS's sgemm first packs the whole weight into blocks (half of its time), where its sgemv streams
the weight once. `forwarding_sgemm(blas)` is a function with cblas_sgemm's signature that sends products with one
row (or one column) to the library's cblas_sgemv and all others to its cblas_sgemm; `runtime.one_row_products`
gives it to MLX when decoding first needs it, never at import.

It is a few lines of C, compiled on first need (`helpers.build`); without a compiler MLX keeps the library's sgemm,
which only costs speed.
"""

import ctypes

from .helpers import build

SOURCE = r"""
typedef void (*sgemm_fn)(int, int, int, int, int, int, float, const float *, int, const float *, int, float,
                         float *, int);
typedef void (*sgemv_fn)(int, int, int, int, float, const float *, int, const float *, int, float, float *, int);
static sgemm_fn real_sgemm;
static sgemv_fn real_sgemv;
enum { ROW_MAJOR = 101, NO_TRANS = 111, TRANS = 112 };

void forwarding_init(sgemm_fn gemm, sgemv_fn gemv) { real_sgemm = gemm; real_sgemv = gemv; }

/* sgemm leaves nothing of c when beta is 0, but some sgemv builds scale it (NaN * 0): clear it first */
static void clear(float *y, int count, int stride) {
  for (int i = 0; i < count; i++) y[(long)i * stride] = 0.0f;
}

void forwarding_sgemm(int order, int ta, int tb, int m, int n, int k, float alpha, const float *a, int lda,
                      const float *b, int ldb, float beta, float *c, int ldc) {
  if (order == ROW_MAJOR && m == 1 && k > 0) { /* c (1 x n) = op(a) (1 x k) op(b) (k x n) = op(b)^T a */
    int inca = ta == NO_TRANS ? 1 : lda;
    if (beta == 0.0f) clear(c, n, 1);
    if (tb == NO_TRANS) real_sgemv(ROW_MAJOR, TRANS, k, n, alpha, b, ldb, a, inca, beta, c, 1);
    else real_sgemv(ROW_MAJOR, NO_TRANS, n, k, alpha, b, ldb, a, inca, beta, c, 1);
    return;
  }
  if (order == ROW_MAJOR && n == 1 && k > 0) { /* c (m x 1) = op(a) (m x k) op(b) (k x 1) */
    int incb = tb == NO_TRANS ? ldb : 1;
    if (beta == 0.0f) clear(c, m, ldc);
    if (ta == NO_TRANS) real_sgemv(ROW_MAJOR, NO_TRANS, m, k, alpha, a, lda, b, incb, beta, c, ldc);
    else real_sgemv(ROW_MAJOR, TRANS, k, m, alpha, a, lda, b, incb, beta, c, ldc);
    return;
  }
  real_sgemm(order, ta, tb, m, n, k, alpha, a, lda, b, ldb, beta, c, ldc);
}
"""


def forwarding_sgemm(blas) -> int | None:
    """The address of a cblas_sgemm that sends one-row and one-column products of `blas` (a `runtime.Blas`) to its
    cblas_sgemv, or None (no sgemv in `blas`, no compiler)."""
    if not hasattr(blas, "cblas_sgemv"):
        return None
    path = build(SOURCE, "forwarding-sgemm")
    if path is None:
        return None
    try:
        library = ctypes.CDLL(str(path), mode=ctypes.RTLD_LOCAL)
    except OSError:
        return None
    address = ctypes.c_void_p
    library.forwarding_init.argtypes = [address, address]
    library.forwarding_init(ctypes.cast(blas.cblas_sgemm, address), ctypes.cast(blas.cblas_sgemv, address))
    FORWARDING.append(library)  # kept loaded for as long as MLX calls it
    return ctypes.cast(library.forwarding_sgemm, address).value


FORWARDING: list[ctypes.CDLL] = []
