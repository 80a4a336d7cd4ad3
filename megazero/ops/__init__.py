"""Standalone operators built on megazero's kernels, usable without the ZeRO engine.

- `CPUAdam`: a torch.optim.Optimizer (Adam / AdamW) over CPU fp32 tensors that steps with the fused
  C++ kernel of megazero.ops.adam (AVX-512 / AVX2 / scalar, chosen at run time), as DeepSpeed's
  DeepSpeedCPUAdam does.
- `megazero.ops.quantize`: block-wise int8/int4 quantize, dequantize and dequantize-and-reduce (the
  C++ extension megazero._quant, loaded when first used, with a torch reference for each kernel).
"""
from megazero.ops import quantize
from megazero.ops.cpu_adam import CPUAdam

__all__ = ["CPUAdam", "quantize"]
