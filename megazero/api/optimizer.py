"""The optimizer megazero.initialize returns, and the rule for an optimizer the user brings.

ZeRO partitions the optimizer states, so the step is megazero's own Adam on each rank's partition
(the math of torch.optim.Adam / AdamW). What the user chooses is its hyperparameters:

- the config's `optimizer` block (type Adam or AdamW, DeepSpeed's defaults), or
- a torch.optim.Adam / torch.optim.AdamW built on the model's parameters (or DeepSpeed's FusedAdam /
  DeepSpeedCPUAdam, by their class names): its param groups' lr and weight_decay, and the betas / eps
  all groups share, are read; the object itself never steps. Any other optimizer is refused, as is
  one with amsgrad, maximize or differing betas: megazero has no kernel for them.

`ZeroOptimizer` is a torch.optim.Optimizer whose param groups hold the engine's parameters, each
group's "lr" and "weight_decay": torch's lr schedulers (and schedulers.py's) write "lr" there and the
engine reads it at every step; its own step() is refused (engine.step() steps). Owns the groups,
nothing of the states (the engine's storages hold them).
"""

from __future__ import annotations

import dataclasses

import torch

from megazero.core.errors import UsageError
from megazero.ops.adam_config import AdamConfig

# Optimizers whose math is megazero's Adam: class name -> decoupled weight decay (None: read the
# object's adam_w_mode / decoupled_weight_decay).
ADAM_CLASSES = {"Adam": None, "AdamW": True, "FusedAdam": None, "DeepSpeedCPUAdam": None}


@dataclasses.dataclass
class GroupSpec:
    """One param group before the engine exists: the user's parameters, lr and weight decay."""

    params: list
    lr: float
    weight_decay: float


def groups_from_parameters(model_parameters, model, adam: AdamConfig) -> list[GroupSpec]:
    """`model_parameters` as DeepSpeed takes it (None: the model's; parameters; or param-group dicts
    with their own "lr" / "weight_decay"), with the config's Adam for what a group does not say."""
    if model_parameters is None:
        return [GroupSpec(list(model.parameters()), adam.lr, adam.weight_decay)]
    items = list(model_parameters)
    if items and all(isinstance(item, dict) for item in items):
        groups = []
        for item in items:
            unknown = set(item) - {"params", "lr", "weight_decay", "name", "betas", "eps"}
            if unknown:
                raise UsageError(
                    f"model_parameters: param group key {sorted(unknown)[0]!r} is not supported; "
                    f"groups may set lr and weight_decay"
                )
            if (
                tuple(item.get("betas", (adam.beta1, adam.beta2))) != (adam.beta1, adam.beta2)
                or item.get("eps", adam.eps) != adam.eps
            ):
                raise UsageError(
                    "model_parameters: a param group with its own betas or eps is not "
                    "supported; every group shares the optimizer's (lr and weight_decay may differ)"
                )
            params = item["params"]
            params = [params] if isinstance(params, torch.Tensor) else list(params)
            groups.append(
                GroupSpec(params, float(item.get("lr", adam.lr)), float(item.get("weight_decay", adam.weight_decay)))
            )
        return groups
    if any(isinstance(item, dict) for item in items):
        raise UsageError("model_parameters mixes param-group dicts and parameters; give one kind")
    if items and isinstance(items[0], tuple):  # named_parameters()
        items = [p for _, p in items]
    return [GroupSpec(items, adam.lr, adam.weight_decay)]


def from_client_optimizer(optimizer) -> tuple[AdamConfig, list[GroupSpec]]:
    """The Adam hyperparameters and param groups of a user's optimizer (see the module docstring)."""
    kind = type(optimizer).__name__
    if kind not in ADAM_CLASSES or not hasattr(optimizer, "param_groups"):
        raise UsageError(
            f"optimizer {kind} is not supported: megazero's ZeRO steps its own Adam/AdamW on "
            f"each rank's partition; pass torch.optim.Adam or torch.optim.AdamW (their "
            f'hyperparameters are used), or an "optimizer" block in the config'
        )
    groups = optimizer.param_groups
    first = groups[0]
    for group in groups:
        for key, bad in (("amsgrad", True), ("maximize", True)):
            if group.get(key, False) == bad:
                raise UsageError(f"optimizer {kind} with {key}=True is not supported; megazero's Adam has no {key}")
        if tuple(group.get("betas", (0.9, 0.999))) != tuple(first.get("betas", (0.9, 0.999))) or group.get(
            "eps", 1e-8
        ) != first.get("eps", 1e-8):
            raise UsageError(
                f"optimizer {kind}: param groups with different betas or eps are not "
                f"supported; give every group the same (lr and weight_decay may differ)"
            )
    decoupled = ADAM_CLASSES[kind]
    if decoupled is None:
        decoupled = bool(getattr(optimizer, "adam_w_mode", first.get("decoupled_weight_decay", False)))
    beta1, beta2 = first.get("betas", (0.9, 0.999))
    lr = float(first["lr"])
    adam = AdamConfig(
        lr=lr,
        beta1=float(beta1),
        beta2=float(beta2),
        eps=float(first.get("eps", 1e-8)),
        weight_decay=float(first.get("weight_decay", 0.0)),
        decoupled_weight_decay=decoupled,
    )
    return adam, [GroupSpec(list(g["params"]), float(g["lr"]), float(g.get("weight_decay", 0.0))) for g in groups]


class ZeroOptimizer(torch.optim.Optimizer):
    """The engine's param groups (see the module docstring): torch's lr schedulers work on it."""

    def __init__(self, groups: list[GroupSpec], adam: AdamConfig, engine, lr_source=None):
        betas = (adam.beta1, adam.beta2)
        super().__init__(
            [{"params": g.params, "lr": g.lr, "weight_decay": g.weight_decay} for g in groups],
            {"lr": adam.lr, "betas": betas, "eps": adam.eps, "weight_decay": adam.weight_decay},
        )
        self.adam, self.engine = adam, engine
        self.lr_source = lr_source  # the user's optimizer: its groups' rates (its scheduler's) lead

    def lrs(self):
        """The step's learning rate: a float for one group, one per group otherwise (ZeroEngine.step)."""
        if self.lr_source is not None:
            for mine, theirs in zip(self.param_groups, self.lr_source.param_groups):
                mine["lr"] = float(theirs["lr"])
        rates = [float(group["lr"]) for group in self.param_groups]
        return rates[0] if len(rates) == 1 else rates

    def step(self, closure=None):
        raise UsageError(
            "optimizer.step() does not step a megazero engine: call engine.step() after "
            "engine.backward(loss), as with DeepSpeed"
        )

    def zero_grad(self, set_to_none: bool = True) -> None:
        """Gradients live in the engine's partitions, zeroed after each optimizer step."""


def muon_matrix(name: str, param, shape: tuple):
    """DeepSpeed's rule for which parameters its Muon steps (deepspeed.set_optimizer_flags): the
    matrices (2-D by the layer's shape) whose names hold neither "embed" nor "lm_head"; AdamW steps
    the rest. A parameter of more dimensions (a convolution's) is refused: megazero's Muon
    orthogonalises matrices only."""
    from megazero.zero.muon import MuonMatrix

    if len(shape) < 2 or any(word in name.lower() for word in ("embed", "lm_head")):
        return None
    if len(shape) > 2:
        raise UsageError(
            f"optimizer.type Muon: parameter {name!r} has shape {tuple(shape)}; megazero's Muon "
            f"steps 2-D matrices only (use AdamW, or reshape the weight to 2-D)"
        )
    return MuonMatrix(tuple(shape))
