"""Standalone operators built on megazero's kernels, usable without the ZeRO engine.

- `CPUAdam`: a torch.optim.Optimizer (Adam / AdamW) over CPU fp32 tensors that steps with the fused
  C++ kernel of megazero.zero.adam (AVX-512 / AVX2 / scalar, chosen at run time), as DeepSpeed's
  DeepSpeedCPUAdam does.
"""
from megazero.ops.cpu_adam import CPUAdam

__all__ = ["CPUAdam"]
