"""Standalone operators built on megazero's kernels, usable without the ZeRO engine.

- `CPUAdam`: a torch.optim.Optimizer (Adam / AdamW) over CPU fp32 tensors that steps with the fused
  C++ kernel of megazero.ops.adam (AVX-512 / AVX2 / scalar, chosen at run time), as DeepSpeed's
  DeepSpeedCPUAdam does.
- `megazero.ops.quantize`: block-wise int8/int4 quantize, dequantize and dequantize-and-reduce (the
  C++ extension megazero._quant, loaded when first used, with a torch reference for each kernel).
- `AdamConfig` (adam_config.py): the Adam hyperparameters, a plain record that imports no torch.

The names load on first use (PEP 562), so that the records import without torch.
"""

import importlib

_WHERE = {"CPUAdam": "megazero.ops.cpu_adam", "quantize": "megazero.ops.quantize"}

__all__ = ["CPUAdam", "quantize"]


def __getattr__(name):
    if name not in _WHERE:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    module = importlib.import_module(_WHERE[name])
    return module if name == "quantize" else getattr(module, name)
