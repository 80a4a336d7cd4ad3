"""The Muon hyperparameters (Megatron-LM's --muon-* flags, DeepSpeed's "Muon" optimizer block): a plain
record apart from the math (muon.py), so that it imports without torch.

Which parameters Muon steps (every weight matrix but the embeddings, the output layer and the MoE
router) is not a hyperparameter: megazero.training.muon_matrices decides it from the model, and every other
parameter takes Adam(W) with the run's AdamConfig.
"""

from __future__ import annotations

import dataclasses

SCALE_MODES = ("spectral", "unit_rms_norm", "shape_scaling")
COEFFICIENT_TYPES = ("simple", "quintic")
MATMUL_PRECISIONS = ("medium", "high")


@dataclasses.dataclass
class MuonConfig:
    momentum: float = 0.9  # --muon-momentum (Megatron-LM's default; DeepSpeed's is 0.95)
    nesterov: bool = False  # --muon-nesterov
    ns_steps: int = 5  # --muon-num-ns-steps: Newton-Schulz iterations
    coefficient_type: str = "quintic"  # --muon-coefficient-type: "simple" is torch.optim.Muon's (a, b, c)
    scale_mode: str = "spectral"  # --muon-scale-mode: the update's factor from the matrix's shape
    extra_scale_factor: float = 1.0  # --muon-extra-scale-factor
    matmul_precision: str = "medium"  # --muon-fp32-matmul-prec: "medium" iterates in bf16, "high" in fp32
    split_qkv: bool = True  # --muon-no-split-qkv turns it off: Q, K and V orthogonalised apart
    eps: float = 1e-7  # the norm's floor before the iteration (torch.optim.Muon's)
