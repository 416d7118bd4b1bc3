"""Device-specific speed behind narrow seams: everything that makes MLX's CPU backend fast lives here, and on Metal
and CUDA it steps aside for MLX's own kernels.

- `ops`: exact, fast element-wise forms (exp, erf/GELU, layer norm, the linear product, dropout's hashed words).
- `attention`: attention written out for the CPU, with dropout, and by query blocks for long inputs.
- `runtime`: the BLAS MLX's products use, threads, streams and the allocator: every process-wide setting.
- `batching`: the one runner every front end batches through (`run_batches`).
- `quantized`: quantized layers as dequantize-then-BLAS products on the CPU.
- `optim`: the fused AdamW update and the gradient norm.
"""

from .runtime import on_cpu

__all__ = ["on_cpu"]
