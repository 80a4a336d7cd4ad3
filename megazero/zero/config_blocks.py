"""The nested blocks of DeepSpeed's `zero_optimization`: `offload_optimizer`, `offload_param`,
`zenflow` and `leaf_module`, with DeepSpeed's key names and defaults.

Owns the records and their own checks only (a value out of range, "auto" where a number is needed);
checks that look at the whole ZeRO block (the stage, other keys) live in config.py, which imports
these records and is what the rest of megazero imports them from.
"""

from __future__ import annotations

from typing import Literal, Optional, Union

from pydantic import Field, model_validator

from megazero.core.records import Record

OffloadDevice = Literal["none", "cpu", "nvme"]

# DeepSpeed's leaf_module default: the Hugging Face MoE blocks, whose experts run in an order that
# depends on the data. They match nothing in megazero's GPT, so the default changes nothing here.
DEFAULT_LEAF_CLASSES = [
    "transformers.models.mixtral.modeling_mixtral.MixtralSparseMoeBlock",
    "transformers.models.qwen2_moe.modeling_qwen2_moe.Qwen2MoeSparseMoeBlock",
    "transformers.models.qwen3_moe.modeling_qwen3_moe.Qwen3MoeSparseMoeBlock",
]


class _Block(Record):
    pass


class OffloadConfig(_Block):
    """What both offload blocks say: where the states go, and how host buffers are made."""

    device: OffloadDevice = "none"
    """cpu: host memory; nvme: files under nvme_path."""
    nvme_path: Optional[str] = None
    pin_memory: bool = False
    """Host buffers in page-locked memory (faster device copies; ignored without CUDA)."""


class OffloadOptimizerConfig(OffloadConfig):
    """`offload_optimizer`: where the fp32 master weights and Adam moments live and the step runs
    (on the CPU, by the CPU Adam; with nvme, swapped per sub-group)."""

    buffer_count: int = Field(4, ge=1)
    """nvme: sub-group buffers in host memory for reads ahead and writes behind."""
    pipeline_read: bool = False
    """nvme: read the next sub-group while the current one steps."""
    pipeline_write: bool = False
    """nvme: write a stepped sub-group while the next one steps."""
    ratio: float = Field(1.0, gt=0.0, le=1.0)
    """Stage 3 (partial offload): the fraction of the sub-groups whose states are offloaded, the
    last ones in partition order as DeepSpeed assigns them; the others keep their states on the
    device and are stepped there, while the CPU steps the offloaded ones."""
    fast_init: bool = False


class OffloadParamConfig(OffloadConfig):
    """`offload_param` (stage 3): where each rank's low-precision parameter partition lives."""

    buffer_count: int = Field(5, ge=1)
    """nvme: unit chunks held in host memory at a time (at least two)."""
    buffer_size: int = Field(int(1e8), gt=0)
    """nvme: elements of the largest unit chunk a buffer must hold."""
    max_in_cpu: int = Field(int(1e9), ge=0)
    """nvme: elements of parameters held in host memory at most (two chunks at least)."""


class ZenFlowConfig(_Block):
    """`zenflow`: ZeRO-Offload without the CPU stall (zero/zenflow/optimizer.py). Each step the most important
    gradient columns are updated on the device; the others' gradients accumulate and the CPU Adam
    applies them every `update_interval` steps, in the background with `overlap_step`."""

    topk_ratio: float = Field(0.1, ge=0.0, le=1.0)
    """Fraction of each 2-D parameter's columns updated on the device every step (at least one
    when positive). DeepSpeed asks for 0 < ratio < 1; the two ends are accepted here as the exact
    limits: 1.0 is the device optimizer, 0 with update_interval 1 plain optimizer offload."""
    select_strategy: Literal["auto", "step", "epoch"] = "auto"
    """"step": select_interval counts steps; "epoch": epochs of steps_per_epoch steps; "auto":
    "epoch" with select_interval 1."""
    select_interval: Union[Literal["auto"], int] = "auto"
    """How often the important columns are chosen again (0: only once, after the warm-up)."""
    update_interval: Union[Literal["auto"], int] = "auto"
    """Steps whose accumulated gradients the CPU Adam applies at once. "auto" (DeepSpeed's rule,
    zero/zenflow/windows.py): a window ends when, for auto_ratio of the matrices, the unselected
    columns' gradient L1 summed over the window has caught up, column for column, with the
    selected ones' mean per step."""
    overlap_step: bool = False
    """Run the CPU Adam while the next window's steps compute (its result lands one window later)."""
    offload: bool = False
    """Keep the selected columns' Adam moments in host memory; they visit the device for each step
    (less device memory, two copies of them per step; the same numbers)."""
    auto_ratio: float = Field(0.99, ge=0.0, le=1.0)
    """update_interval "auto": the fraction of matrices that must have caught up."""
    full_warm_up_rounds: int = Field(0, ge=0)
    """Steps of plain optimizer offload before the first selection."""
    pt_reserved_cores_perc: float = Field(0.5, ge=0.0, le=1.0)
    """Fraction of the CPU threads left to the training; the CPU Adam uses the others."""
    steps_per_epoch: Optional[int] = Field(None, ge=1)
    """Steps per epoch for the "epoch" strategy (DeepSpeed fills it from its dataloader). Unset,
    "epoch" selection happens once, as in DeepSpeed without a dataloader."""

    @model_validator(mode="after")
    def _intervals(self):
        if isinstance(self.update_interval, int) and self.update_interval < 1:
            raise ValueError('update_interval must be at least 1 (or "auto")')
        if isinstance(self.select_interval, int) and self.select_interval < 0:
            raise ValueError('select_interval must be at least 0 (or "auto")')
        if self.select_strategy == "auto" and isinstance(self.select_interval, int):
            raise ValueError(
                'select_interval is set but select_strategy is "auto" (once per epoch); '
                'set select_strategy to "step" or "epoch", or remove select_interval'
            )
        if self.select_strategy != "auto" and self.select_interval == "auto":
            raise ValueError(f'select_strategy "{self.select_strategy}" needs a number for select_interval')
        return self

    def select_every(self) -> int:
        """Steps between selections (0: select once)."""
        if self.select_strategy == "step":
            return int(self.select_interval)
        epochs = 1 if self.select_strategy == "auto" else int(self.select_interval)
        return epochs * self.steps_per_epoch if self.steps_per_epoch else 0


class LeafModuleConfig(_Block):
    """`leaf_module` (stage 3): modules gathered whole when entered, their inner modules never
    hooked one by one. Selected by class name (short or fully qualified), by module name (as in
    named_modules()) or by a suffix of the module name."""

    classes: list[str] = Field(default_factory=lambda: list(DEFAULT_LEAF_CLASSES))
    names: list[str] = Field(default_factory=list)
    name_suffixes: list[str] = Field(default_factory=list)

    @model_validator(mode="before")
    @classmethod
    def _lists(cls, values):
        """A single string is a list of one (as DeepSpeed reads it)."""
        if isinstance(values, dict):
            return {k: [v] if isinstance(v, str) else v for k, v in values.items()}
        return values

    def customised(self) -> dict[str, list[str]]:
        """The selectors the user wrote (a default that matches nothing is not an error)."""
        out = {"names": self.names, "name_suffixes": self.name_suffixes}
        if self.classes != DEFAULT_LEAF_CLASSES:
            out["classes"] = self.classes
        return {k: v for k, v in out.items() if v}
