#!/usr/bin/env bash
# The GPU check, in one script (~8 minutes on one H200, installs included): versions, the package
# with its `cuda` extra, tests/gpu, a streams report, and the ~1.3B-parameter bf16 step benchmark.
# Every step runs even when an earlier one failed; the script exits 1 if any did.
#
#   bash bench/gpu_check.sh 2>&1 | tee gpu_check.log
set -euo pipefail
cd "$(dirname "$0")/.."
export PYTHONUNBUFFERED=1
PY=${PYTHON:-python}
failed=()

step() {      # step NAME SECONDS COMMAND...: runs with a time limit, records a failure, goes on
    local name=$1 limit=$2
    shift 2
    echo
    echo "=== $name ($(date +%T), limit ${limit}s) ==="
    local started=$SECONDS rc=0
    timeout "$limit" "$@" || rc=$?
    echo "=== $name: exit $rc after $((SECONDS - started))s ==="
    if [ "$rc" -ne 0 ]; then failed+=("$name (exit $rc)"); fi
}

echo "=== machine ==="
nvidia-smi || { echo "nvidia-smi failed: no usable NVIDIA GPU here"; exit 1; }
nproc
"$PY" --version

# torch: keep an installed CUDA build inside the package's range, else install one from PyPI
# (its Linux wheels are CUDA builds).
if ! "$PY" -c "import torch, sys; sys.exit(0 if torch.version.cuda else 1)" 2>/dev/null; then
    echo "no CUDA build of torch: installing torch 2.13 from PyPI"
    "$PY" -m pip install "torch>=2.13,<2.14"
fi

# cuda-python's major version must not exceed the driver's CUDA major, so pick it from the driver.
driver_cuda=$(nvidia-smi | sed -n 's/.*CUDA Version: *\([0-9]*\)\..*/\1/p' | head -n 1)
if ! "$PY" -c "import megazero.core.streams as s, sys; sys.exit(0 if s.import_cudart() else 1)" 2>/dev/null; then
    echo "installing cuda-python ${driver_cuda}.x for the driver's CUDA ${driver_cuda}"
    "$PY" -m pip install "cuda-python==${driver_cuda}.*" \
        || echo "cuda-python could not be installed: megazero.core.streams falls back to torch.cuda"
fi
if ! "$PY" -c "import megazero.training, pytest" 2>/dev/null; then
    "$PY" -m pip install -e ".[dev,cuda]" \
        || "$PY" -m pip install --no-deps --no-build-isolation -e .
fi

step "versions" 60 "$PY" - <<'EOF'
import torch
print(f"torch {torch.__version__}  cuda {torch.version.cuda}  cudnn {torch.backends.cudnn.version()}  "
      f"nccl {'.'.join(map(str, torch.cuda.nccl.version()))}")
for i in range(torch.cuda.device_count()):
    p = torch.cuda.get_device_properties(i)
    print(f"cuda:{i} {p.name} {p.total_memory / 2**30:.0f} GiB sm_{p.major}{p.minor}")
try:
    import cuda.bindings
    print(f"cuda-python (cuda.bindings) {cuda.bindings.__version__}")
except ImportError:
    print("cuda-python: not installed")
import megazero.core.streams
print(f"megazero.core.streams backend on CUDA: {megazero.core.streams.default_cuda_backend().name}")
EOF

step "pytest tests/gpu" 240 "$PY" -m pytest -q tests/gpu -ra

step "streams" 60 "$PY" - <<'EOF'
import torch
from megazero.core.streams import Event, Streams, Timers, copy_to_device
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

step "bench_gpu_step" 240 "$PY" bench/bench_gpu_step.py

echo
if [ "${#failed[@]}" -ne 0 ]; then
    echo "FAILED: ${failed[*]}"
    exit 1
fi
echo "gpu_check: all steps passed"
