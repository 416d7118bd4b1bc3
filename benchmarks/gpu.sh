#!/usr/bin/env bash
# The package on MLX's CUDA backend against torch on the same GPU, in one run (issue 47; benchmarks/GPU.md):
# the GPU and MLX's device, the reference matmul rates, the test suite on the GPU, then encode, fine-tuning,
# GPT-2 decoding and the server, each against its torch peer. Every phase logs to DIR/<phase>.log under a time
# limit taken from --budget; DIR/figures.md is rewritten after each phase, so a run cut short keeps what it measured.
#
#     bash benchmarks/gpu.sh --check .whl                  # call 1: GPU, Python, packages, the first carried part
#     bash benchmarks/gpu.sh --bundle .whl [DIR]           # call 2: install MLX from both parts, then everything
#     bash benchmarks/gpu.sh --dry-run [DIR]               # here: tiny sizes, a few tests, the CPU; a few minutes
#
# DIR: default $OUT when set, else gpu-run. Options: --budget SECONDS (default 540, dry run 300), --phases
# info,tests,encode,train,generate,serve (any subset). PYTHON: the interpreter (default python3).
set -uo pipefail
cd "$(dirname "$0")/.."
REPO=$PWD
PY=${PYTHON:-python3}
DRY=0 BUNDLE="" BUDGET="" DIR="" PHASES=info,tests,encode,train,generate,serve
SITE=/tmp/site  # where --bundle unpacks MLX and the rest
while [ $# -gt 0 ]; do
    case $1 in
        --dry-run) DRY=1 ;;
        --check) exec "$PY" benchmarks/gpu.py check "$2" ;;
        --bundle) BUNDLE=$2; shift ;;
        --budget) BUDGET=$2; shift ;;
        --phases) PHASES=$2; shift ;;
        -h | --help) sed -n '2,13p' "$0"; exit 0 ;;
        -*) echo "unknown option $1 (see --help)" >&2; exit 2 ;;
        *) DIR=$1 ;;
    esac
    shift
done
DIR=${DIR:-${OUT:-gpu-run}}
mkdir -p "$DIR" && DIR=$(cd "$DIR" && pwd)
rm -f "$DIR"/*.log "$DIR/results.jsonl" "$DIR/figures.md"

# Float32 is IEEE float32 on both sides (torch's products use no TF32 by default); nothing reaches the network.
export MLX_ENABLE_TF32=0 PYTHONUNBUFFERED=1 HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1 TOKENIZERS_PARALLELISM=false
export TQDM_DISABLE=1 PYTHONPATH=$REPO${PYTHONPATH:+:$PYTHONPATH}
if [ -n "$BUNDLE" ]; then
    "$PY" benchmarks/gpu.py install "$BUNDLE" "$SITE" 2>&1 | tee "$DIR/info.log" || exit 1
    export PYTHONPATH=$PYTHONPATH:$SITE
    check="import mlx.core as mx; mx.eval(mx.ones(4) + 1); print('MLX', mx.__version__, mx.default_device())
assert mx.default_device() == mx.gpu, 'MLX did not find the GPU'"
    if ! "$PY" -c "$check" 2>&1 | tee -a "$DIR/info.log"; then
        ldd "$SITE/mlx/lib/libmlx.so" | grep "not found" | tee -a "$DIR/info.log"  # what libmlx could not load
        exit 1
    fi
fi

# The suite on the GPU: parity, gradients, quantized, half precision, training, generation, serving, embeddings,
# in that order (a run cut short keeps the first). CPU-only tests skip themselves (tests/conftest.py, `cpu_only`);
# the openai SDK, which the README block and two serving tests call, is not on the GPU image.
TESTS=(tests/test_parity.py tests/test_quantized.py tests/test_dtype.py tests/test_numerics.py tests/test_gradients.py
    tests/test_train_parity.py tests/test_trainer.py tests/test_train_optim.py tests/test_lora.py
    tests/test_generation.py tests/test_gpt2.py tests/test_serve.py tests/test_sentence.py tests/test_sentence_api.py)
TEST_FILTER="not openai_sdk and not readme"
if [ $DRY = 1 ]; then
    DEVICE=cpu FLAG=--dry-run BUDGET=${BUDGET:-300}
    TESTS=(tests/test_dtype.py tests/test_quantized.py tests/test_sentence.py)
    TEST_FILTER="explicit_dtype or every_mode or slices_cover_each_batch"
    TRAIN=(--models minilm --batch-size 4 --max-length 32 --warmup 1 --steps 1 --train-examples 40 --test-examples 8)
    GENERATE=(--models tiny --batches 1 --prompt-tokens 8 --new-tokens 8 --repeats 1)
    SERVE=(--clients 2 --seconds 2 --texts 32 --servers serve)
    CAPS=(info=60 tests=90 encode=90 train=60 generate=60 serve=60)
else
    DEVICE=cuda FLAG="" BUDGET=${BUDGET:-540}
    TRAIN=(--models bert-base,minilm --batch-size 32 --max-length 128 --warmup 3 --steps 10 --train-examples 1000)
    GENERATE=(--models small --batches 1,8 --prompt-tokens 128 --new-tokens 64 --repeats 2)
    SERVE=(--clients 64 --seconds 6 --servers serve,baseline)
    CAPS=(info=40 tests=225 encode=100 train=60 generate=55 serve=50)
fi
TEST_OPTIONS=() TEST_ENV=(PYTHONPATH=$PYTHONPATH:$REPO/benchmarks)  # benchmarks/: the gpu_pytest plugin
"$PY" -c "import pytest_timeout" 2>/dev/null && TEST_OPTIONS+=(--timeout 120)
# four workers when pytest-xdist is there (the GPU image has it), each with torch on four threads
"$PY" -c "import xdist" 2>/dev/null && TEST_OPTIONS+=(-n 4 -p gpu_pytest) && TEST_ENV+=(OMP_NUM_THREADS=4)

START=$(date +%s)
RESERVE=10  # seconds kept for the last table

# phase NAME COMMAND...: run it under the smaller of its cap and the budget left, log it, record its exit.
phase() {
    local name=$1 cap=0 entry
    shift
    case ",$PHASES," in *",$name,"*) ;; *) return ;; esac
    for entry in "${CAPS[@]}"; do [ "${entry%%=*}" = "$name" ] && cap=${entry#*=}; done
    local left=$((BUDGET - $(date +%s) + START - RESERVE))
    local limit=$((cap < left ? cap : left)) began=$(date +%s) rc summary
    if [ "$limit" -lt 15 ]; then
        rc=skipped summary="no time left in the ${BUDGET}s budget"
    else
        echo "== $name (limit ${limit}s): $*" | tee -a "$DIR/$name.log"
        # SIGINT first: pytest and the benchmarks print what they have before they stop
        timeout -s INT -k 20 "$limit" "$@" 2>&1 | tee -a "$DIR/$name.log"
        rc=${PIPESTATUS[0]}
        summary=$(grep -v '^\s*$' "$DIR/$name.log" | tail -n 1 | tr -d '"\\|' | cut -c1-160)
        [ "$rc" = 124 ] && summary="stopped at its ${limit}s limit; last line: $summary"
    fi
    printf '{"phase": "status", "name": "%s", "rc": "%s", "seconds": %d, "summary": "%s"}\n' \
        "$name" "$rc" $(($(date +%s) - began)) "$summary" >>"$DIR/results.jsonl"
    "$PY" benchmarks/gpu.py table "$DIR" >/dev/null
}

phase info "$PY" benchmarks/gpu.py info "$DIR" $FLAG
phase tests env "${TEST_ENV[@]}" "$PY" -m pytest -q -ra -p no:cacheprovider -m "not slow" --maxfail=25 \
    "${TEST_OPTIONS[@]}" "${TESTS[@]}" -k "$TEST_FILTER"
phase encode "$PY" benchmarks/gpu.py encode "$DIR" $FLAG
phase train "$PY" benchmarks/train.py --device $DEVICE --parts throughput "${TRAIN[@]}"
phase generate "$PY" benchmarks/generate.py --device $DEVICE "${GENERATE[@]}"
phase serve "$PY" benchmarks/serve.py "${SERVE[@]}"
cat "$DIR/figures.md"
