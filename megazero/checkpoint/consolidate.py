"""One full fp32 state dict from a sharded checkpoint of any layout, written one parameter at a time.

`consolidate(load, output)` writes `output/model.safetensors` with exactly the keys and shapes of
`GPT(config).state_dict()` (a tied head appears under both of its names, as in the state dict; the
routers' expert biases, buffers, are in it) and
`output/config.json` with the GPTConfig fields, so

    model = GPT(GPTConfig(**json.load(open("config.json"))))
    model.load_state_dict(safetensors.torch.load_file("model.safetensors"), strict=True)

works. The safetensors file is streamed: its header (names, dtypes, shapes, offsets) is known from
the checkpoint's index before any tensor is read, so peak memory is about one parameter, not the
model. `with_optimizer` also writes `optimizer.safetensors` (`<name>.exp_avg`, `<name>.exp_avg_sq`)
and `optimizer.json` (Adam's step count).
"""

from __future__ import annotations

import json
import math
import struct
from pathlib import Path

import torch

from megazero.models.config import GPTConfig
from megazero.models.gpt import GPT
from .files import write_json_atomic
from .reader import CheckpointReader

TIED_HEAD = "output_head.weight"


def model_keys(config: GPTConfig) -> dict[str, tuple[int, ...]]:
    """GPT(config).state_dict()'s keys and shapes, from a model built on the meta device."""
    with torch.device("meta"):
        model = GPT(config)
    return {name: tuple(t.shape) for name, t in model.state_dict(keep_vars=True).items()}


def write_safetensors_streaming(path: Path, entries: list[tuple[str, tuple[int, ...]]], produce) -> None:
    """Writes fp32 tensors `entries` (name, shape) to a safetensors file, calling produce(name) for
    one tensor at a time. Format: u64 little-endian header size, JSON header, raw data."""
    header, offset = {}, 0
    for name, shape in entries:
        nbytes = 4 * math.prod(shape)
        header[name] = {"dtype": "F32", "shape": list(shape), "data_offsets": [offset, offset + nbytes]}
        offset += nbytes
    blob = json.dumps(header, separators=(",", ":")).encode()
    blob += b" " * (-len(blob) % 8)  # data starts 8-byte aligned
    with open(path, "wb") as f:
        f.write(struct.pack("<Q", len(blob)))
        f.write(blob)
        for name, shape in entries:
            tensor = produce(name).to(torch.float32).contiguous()
            if tuple(tensor.shape) != tuple(shape):
                raise ValueError(f"{name}: produced shape {tuple(tensor.shape)}, header says {shape}")
            f.write(tensor.numpy().tobytes())


def consolidate(load: str | Path, output: str | Path, with_optimizer: bool = False) -> dict:
    """Writes the consolidated model (and optimizer states); returns what was written."""
    reader = CheckpointReader(load)
    config = GPTConfig(**reader.metadata["model"])
    keys = model_keys(config)
    out = Path(output)
    out.mkdir(parents=True, exist_ok=True)

    def produce(name: str, kind: str) -> torch.Tensor:
        if name in reader.buffers:  # an expert bias: one saved tensor, no optimizer state
            return reader.buffer(name)
        tensor = reader.full_tensor(source(name), kind)
        reader.close()  # files are memory-mapped: keep one parameter resident
        return tensor

    def source(name: str) -> str:
        if name not in reader.where and name == TIED_HEAD and config.tie_embeddings:
            return "embedding.word.weight"
        return name

    missing = [k for k in keys if source(k) not in reader.where and k not in reader.buffers]
    if missing:
        raise ValueError(f"{reader.path}: no saved values for {missing[:3]}; not a checkpoint of this model")
    entries = list(keys.items())
    write_safetensors_streaming(out / "model.safetensors", entries, lambda name: produce(name, "fp32"))
    write_json_atomic(out / "config.json", reader.metadata["model"])
    written = {"model.safetensors": len(entries), "config.json": 1}
    if with_optimizer:
        names = sorted({source(k) for k in keys if k not in reader.buffers})
        opt_entries = [(f"{n}.{kind}", reader.full_shape(n)) for n in names for kind in ("exp_avg", "exp_avg_sq")]
        write_safetensors_streaming(
            out / "optimizer.safetensors", opt_entries, lambda key: produce(*key.rsplit(".", 1))
        )
        write_json_atomic(
            out / "optimizer.json",
            {"step": reader.metadata["engine"]["step_count"], "iteration": reader.metadata["iteration"]},
        )
        written["optimizer.safetensors"] = len(opt_entries)
    return written
