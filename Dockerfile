# Cluster image: CUDA PyTorch, megazero with its C++ kernels built for the image's compiler.
# Build:  docker build -t megazero .
# Run:    docker run --gpus all --ipc=host megazero \
#           torchrun --nproc-per-node 8 pretrain_gpt.py --distributed-backend nccl --bf16 \
#             --tensor-model-parallel-size 2 --pipeline-model-parallel-size 2 --zero-stage 3
FROM pytorch/pytorch:2.5.1-cuda12.4-cudnn9-devel

ENV PYTHONUNBUFFERED=1 \
    MEGAZERO_CACHE=/cache
WORKDIR /workspace/megazero

# Dependencies first, so code edits do not invalidate this layer.
COPY pyproject.toml setup.py README.md ./
COPY csrc ./csrc
RUN pip install --no-cache-dir "einops>=0.7" "sentencepiece>=0.2" "numpy>=1.24" "pydantic>=2" "pybind11>=2.10" pytest

COPY . .
# The installed torch satisfies the package's range, so pip keeps the image's CUDA build.
RUN pip install --no-cache-dir -e ".[dev]"

VOLUME ["/cache"]
CMD ["python", "pretrain_gpt.py", "--help"]
