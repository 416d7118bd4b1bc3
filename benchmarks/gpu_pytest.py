"""A pytest plugin for benchmarks/gpu.sh (`-p gpu_pytest`): each pytest-xdist worker keeps MLX's compiled CUDA
kernels in a cache folder of its own. MLX writes a cache file in place, so one worker could read a file another is
still writing; MLX reads MLX_PTX_CACHE_DIR at its first kernel compilation, after this module is imported."""

import os

worker = os.environ.get("PYTEST_XDIST_WORKER")
if worker:
    os.environ["MLX_PTX_CACHE_DIR"] = os.path.join(os.environ.get("MLX_PTX_CACHE_DIR", "/tmp/mlx-ptx"), worker)
