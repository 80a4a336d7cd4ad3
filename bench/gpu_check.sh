#!/usr/bin/env bash
# The GPU check, one command, at most 9 minutes on one H200 (installs included). bench/README.md
# says how to launch it on a lent GPU machine.
#
#   bash bench/gpu_check.sh --prepare                    # here, with network: the wheels it needs
#   GPU_CHECK_OUT=/some/dir bash bench/gpu_check.sh      # there; default GPU_CHECK_OUT: bench/out
#
# The GPU image (Python 3.12, torch 2.11, no network) lacks pydantic and may lack pytest and a
# setuptools that builds the package: --prepare downloads them and their dependencies, as CPython
# 3.12 x86-64 wheels, into GPU_CHECK_WHEELS (default .whl, kept out of git) and says what to carry.
# The check itself reaches for no network (PIP_NO_INDEX=1, PIP_BREAK_SYSTEM_PACKAGES=1 for a system
# Python): it installs from those wheels, then the package editable without build isolation.
# Steps, most valuable first, each with a time limit; the limits add up to the whole budget
# (GPU_CHECK_BUDGET seconds, default 540), and each step runs even when an earlier one failed:
#   versions, parity (fp32 GPU vs CPU, ZeRO-3 vs ZeRO-0, offload vs device), pytest tests/gpu (junit
#   report judged by bench/gpu_check.py: the one-GPU expected skips are listed below),
#   bench_gpu_step (~1.3B bf16: tokens/s, MFU with HFU beside it, step-time ratio to plain torch
#   with fused AdamW, memory against the planner's figure computed there), streams, overlap
#   (profiler: stage-3 prefetch gathers overlapping compute), adam_norm (bench_adam_norm.py: ZeRO's
#   fused Adam and foreach norm on the 1.3B partition against the reference paths), gloo_cuda
#   (2 ranks on the GPU over gloo, or "unverified"), then the summary.
# GPU_CHECK_OUT gets gpu_check.log (everything printed) and gpu_check.json (every figure, pass or
# fail, and what one GPU cannot show). Exit 1 naming each failed step or figure.
set -uo pipefail
WHEELS=${GPU_CHECK_WHEELS:-.whl}
PY=${PYTHON:-python3}
if [ "${1:-}" = "--prepare" ]; then
    cd "$(dirname "$0")/.." || exit 1
    mkdir -p "$WHEELS" || exit 1
    # Every platform tag pip must match exactly for CPython 3.12 x86-64 (pydantic-core is the one
    # binary wheel); --only-binary resolves the dependencies for that target, not for this Python.
    "$PY" -m pip download -q --only-binary=:all: --python-version 3.12 --implementation cp --abi cp312 \
        --platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 \
        --platform any -d "$WHEELS" "pydantic>=2" "pytest>=8" "setuptools>=77" wheel "pybind11>=2.10" || {
        echo "gpu_check --prepare: pip could not download the wheels into $WHEELS (see above)" >&2; exit 1; }
    case "$WHEELS" in        # a folder inside the checkout travels with it: keep it out of git
        /*) ;;
        *) if [ -d .git ] && ! grep -qxF "/$WHEELS/" .git/info/exclude 2>/dev/null; then
               echo "/$WHEELS/" >> .git/info/exclude
           fi ;;
    esac
    echo "gpu_check --prepare: $(ls "$WHEELS" | wc -l) wheels, $(du -sh "$WHEELS" | cut -f1), in $WHEELS (ignored by git)"
    echo "carry: $WHEELS   (device tool: run with carry [\"$WHEELS\"], command: bash bench/gpu_check.sh)"
    exit 0
fi
if ! command -v nvidia-smi >/dev/null 2>&1 || ! nvidia-smi -L >/dev/null 2>&1; then
    echo "gpu_check: no usable NVIDIA GPU here (nvidia-smi is missing or fails); run it on a GPU machine" >&2
    exit 1
fi
cd "$(dirname "$0")/.." || exit 1
OUT=${GPU_CHECK_OUT:-bench/out}
WORK=${GPU_CHECK_WORK:-$(mktemp -d "${TMPDIR:-/tmp}/gpu_check.XXXXXX")}
BUDGET=${GPU_CHECK_BUDGET:-540}
mkdir -p "$OUT" "$WORK" || exit 1
: > "$WORK/steps.tsv"
export PYTHONUNBUFFERED=1 PIP_NO_INDEX=1 PIP_DISABLE_PIP_VERSION_CHECK=1 PIP_BREAK_SYSTEM_PACKAGES=1 \
    CUBLAS_WORKSPACE_CONFIG=:4096:8

# Tests that need two GPUs (tests/gpu/test_trainer_gpu.py): skipped on one, and only there.
EXPECTED_SKIPS="test_two_gpus_nccl_match_one_process_fp32[dp2-zero3],\
test_two_gpus_nccl_match_one_process_fp32[pp2-interleaved],\
test_two_gpus_nccl_match_one_process_fp32[tp2],\
test_two_gpus_zeropp_as_two_nodes_stay_near_the_unquantized_curve"

step() {      # step NAME LIMIT COMMAND...: runs within its limit and the budget, records its exit code
    local name=$1 limit=$2
    shift 2
    local left=$((BUDGET - SECONDS))
    if [ "$left" -lt 15 ]; then
        echo "=== $name: not run, the ${BUDGET}s budget is spent ==="
        printf '%s\t%s\t%s\n' "$name" 124 0 >> "$WORK/steps.tsv"
        return
    fi
    [ "$limit" -gt "$left" ] && limit=$left
    echo
    echo "=== $name ($(date +%T), limit ${limit}s, ${SECONDS}s into the check) ==="
    local started=$SECONDS rc=0
    timeout --kill-after=10 "$limit" "$@" || rc=$?
    echo "=== $name: exit $rc after $((SECONDS - started))s ==="
    printf '%s\t%s\t%s\n' "$name" "$rc" "$((SECONDS - started))" >> "$WORK/steps.tsv"
}

main() {
    echo "=== machine ==="
    nvidia-smi
    nproc
    "$PY" --version
    if [ "$(nvidia-smi -L | wc -l)" -ge 2 ]; then EXPECTED_SKIPS=""; fi

    if "$PY" -c "import megazero.training, pytest" 2>/dev/null; then
        echo "megazero is importable already: no install"
    elif [ ! -d "$WHEELS" ]; then
        echo "gpu_check: no wheel folder $WHEELS: run 'bash bench/gpu_check.sh --prepare' where pip reaches PyPI, and carry it"
    else
        step install 100 bash -c "'$PY' -m pip install -q --no-index --find-links '$WHEELS' 'setuptools>=77' pytest \
            && '$PY' -m pip install -q --no-index --find-links '$WHEELS' --no-build-isolation -e ."
    fi

    step versions 15 "$PY" - <<'EOF'
import torch, pydantic
import megazero.core.streams
print(f"torch {torch.__version__}  cuda {torch.version.cuda}  cudnn {torch.backends.cudnn.version()}  "
      f"nccl {'.'.join(map(str, torch.cuda.nccl.version()))}  pydantic {pydantic.VERSION}")
for i in range(torch.cuda.device_count()):
    p = torch.cuda.get_device_properties(i)
    print(f"cuda:{i} {p.name} {p.total_memory / 2**30:.0f} GiB sm_{p.major}{p.minor}")
try:
    import cuda.bindings
    print(f"cuda-python (cuda.bindings) {cuda.bindings.__version__}")
except ImportError:
    print("cuda-python: not installed")
print(f"megazero.core.streams backend on CUDA: {megazero.core.streams.default_cuda_backend().name}")
try:
    import megazero._C, megazero._quant
    print("megazero C++ kernels: built")
except ImportError as err:
    print(f"megazero C++ kernels: not built ({err}); the torch references run")
EOF

    step parity 75 "$PY" bench/gpu_check.py parity --work "$WORK"
    step pytest 90 "$PY" -m pytest -q tests/gpu -ra -p no:cacheprovider --junitxml="$WORK/pytest.xml"
    step "pytest report" 10 "$PY" bench/gpu_check.py pytest --work "$WORK" --xml "$WORK/pytest.xml" \
        --expected-skips "$EXPECTED_SKIPS"
    step bench_gpu_step 120 "$PY" bench/bench_gpu_step.py --json "$WORK/bench_gpu_step.json"
    step streams 20 "$PY" - <<'EOF'
import torch
from megazero.core.streams import Streams, Timers, copy_to_device
streams = Streams("cuda")
print(streams.describe())
for side in (streams.copy, streams.prefetch, streams.reduce):
    print(f"{side.name}: torch reports priority {side.stream.priority}, handle {side.stream.cuda_stream:#x}")
host = torch.randn(64 << 20)                         # 256 MiB
timers = Timers("cuda")
for _ in range(3):
    timers.start("h2d on the copy stream")
    out = copy_to_device(host, "cuda", streams)
    timers.stop("h2d on the copy stream")
assert torch.equal(out.cpu(), host)
ms = timers.elapsed_ms()["h2d on the copy stream"] / 3
print(f"pinned copy of 256 MiB: {ms:.2f} ms ({host.numel() * 4 / ms / 1e6:.1f} GB/s), result checked")
EOF
    step overlap 40 "$PY" bench/gpu_check.py overlap --work "$WORK"
    step adam_norm 30 "$PY" bench/bench_adam_norm.py --device cuda --rounds 2 --json "$WORK/adam_norm.json"
    step gloo_cuda 40 "$PY" bench/gpu_check.py gloo-cuda --work "$WORK"

    if [ -f "$WORK/stage3_trace.json" ]; then
        gzip -c "$WORK/stage3_trace.json" > "$OUT/stage3_trace.json.gz"
    fi
    "$PY" bench/gpu_check.py summary --work "$WORK" --out "$OUT"
}

main 2>&1 | tee "$OUT/gpu_check.log"
exit "${PIPESTATUS[0]}"
