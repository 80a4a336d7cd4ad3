# Cluster image: torch 2.13 from PyPI (its Linux wheel is a CUDA 13.0 build that brings the CUDA
# libraries as wheels and cuda-bindings, so the host needs only an NVIDIA driver of the R580 series
# or later and the NVIDIA container toolkit), megazero with its C++ kernels built here, and the
# `cuda` extra (cuda-python) for megazero.core.streams. The torch pin sits inside the package's range
# (pyproject.toml: torch>=2.11,<3) and is the version the CPU tests run against.
# Build:  docker build -t megazero .
# Run:    docker run --gpus all --ipc=host megazero \
#           torchrun --nproc-per-node 8 pretrain_gpt.py --distributed-backend nccl --bf16 \
#             --tensor-model-parallel-size 2 --pipeline-model-parallel-size 2 --zero-stage 3
# Check:  docker run --gpus all --ipc=host megazero bash bench/gpu_check.sh
FROM python:3.11-slim-bookworm

ARG TORCH_VERSION=2.13.0
ENV PYTHONUNBUFFERED=1 \
    MEGAZERO_CACHE=/cache \
    NVIDIA_VISIBLE_DEVICES=all \
    NVIDIA_DRIVER_CAPABILITIES=compute,utility

# A C++ compiler with OpenMP for csrc (the CPU Adam kernel); CUDA itself comes with torch's wheels.
RUN apt-get update \
    && apt-get install -y --no-install-recommends build-essential \
    && rm -rf /var/lib/apt/lists/*

WORKDIR /workspace/megazero
# torch and the dependencies first, so code edits do not invalidate these layers.
RUN pip install --no-cache-dir "torch==${TORCH_VERSION}"
RUN pip install --no-cache-dir "einops>=0.7" "sentencepiece>=0.2" "numpy>=1.24" "pydantic>=2" \
        "pybind11>=2.10" "setuptools>=77" wheel "pytest>=8" "cuda-python>=13,<14"

COPY . .
# The installed torch satisfies the package's range, so pip keeps it; the import proves the C++
# kernel was built for this image's compiler.
RUN pip install --no-cache-dir --no-build-isolation -e ".[dev,cuda]" \
    && python -c "import torch, megazero._C; print('torch', torch.__version__, 'cuda', torch.version.cuda)"

VOLUME ["/cache"]
CMD ["python", "pretrain_gpt.py", "--help"]
