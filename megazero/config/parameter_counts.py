"""Parameter counts the memory planner needs, read off a one-layer model of the configuration built
on the meta device (shapes only): the embedding, one dense transformer layer and the head, what
ZeRO-3 keeps whole under its persistence threshold, the largest module and parameter.

Owns the counting; the bytes per count are config/memory_estimate.py's, MoE layers'
config/moe_memory.py's. Must not allocate real memory (everything is built on meta).
"""

from __future__ import annotations

import dataclasses

import torch

from megazero.config.moe_memory import dense_layer_config


def _one_layer_model(model_cfg):
    """A one-layer model of `model_cfg`'s dense layer (config/moe_memory.py adds what MoE layers hold);
    the last few kept, read only: a layout search plans thousands of layouts of one model."""
    from megazero.models.gpt import GPT

    layer = dataclasses.replace(dense_layer_config(model_cfg), num_layers=1)
    if repr(layer) not in _ONE_LAYER:
        with torch.device("meta"):  # shapes only: nothing is allocated
            _ONE_LAYER[repr(layer)] = GPT(layer)
        while len(_ONE_LAYER) > 16:
            _ONE_LAYER.pop(next(iter(_ONE_LAYER)))
    return _ONE_LAYER[repr(layer)]


_ONE_LAYER: dict[str, object] = {}


def parameter_counts(model_cfg) -> tuple[int, int, int]:
    """(embedding, one transformer layer, final norm + untied output layer) parameter counts."""
    model = _one_layer_model(model_cfg)
    count = lambda module: sum(p.numel() for p in module.parameters())  # noqa: E731
    head = count(model.final_norm) + (0 if model_cfg.tie_embeddings else model.output_head.weight.numel())
    return count(model.embedding), count(model.layers["0"]), head


def persistent_counts(model_cfg, tp: int, threshold: int) -> tuple[int, int, int]:
    """parameter_counts' three parts, counting only the parameters stage 3 keeps whole (at most
    `threshold` elements on a rank). 2-D weights split over TP (the position table excepted)."""
    model = _one_layer_model(model_cfg)

    def count(module) -> int:
        total = 0
        for name, p in module.named_parameters():
            local = p.numel() // tp if p.dim() == 2 and "position" not in name else p.numel()
            total += p.numel() if local <= threshold else 0
        return total

    head = model.output_head.weight.numel() if not model_cfg.tie_embeddings else 0
    head = head if head // tp <= threshold else 0
    return count(model.embedding), count(model.layers["0"]), count(model.final_norm) + head


def largest_module_params(model_cfg) -> int:
    """Parameters of the largest single module (stage 3's largest unit, before the TP split)."""
    model = _one_layer_model(model_cfg)
    return max(sum(p.numel() for p in m.parameters(recurse=False)) for m in model.modules())


def largest_param(model_cfg, tp: int) -> int:
    """Elements of the largest single parameter on a rank (2-D weights split over TP, as in
    persistent_counts): autograd hands each gradient over as a tensor of its own before it is
    added to (or staged in) ZeRO's buffers."""
    model = _one_layer_model(model_cfg)
    return max(
        p.numel() // tp if p.dim() == 2 and "position" not in name else p.numel()
        for name, p in model.named_parameters()
    )
