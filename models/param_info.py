"""What megazero attaches to a parameter, in one record.

The model is pure, but the rooms above it need to know things about a parameter that its tensor
cannot say: which slice of the full weight a tensor-parallel rank holds, which name its
initialisation is drawn from, which ZeRO storage keeps it. Each of those used to be an attribute
of its own set on the parameter and read back with `getattr(p, "...", None)`; they are the fields
of `ParamInfo` now, read with `param_info(p)` and written with `set_param_info(p, ...)`, so the
whole list is here and a misspelt field fails loudly.

The record lives in models/ because models/ is the one room every other imports (weight_grad.py
reads `fp32_grad` itself); models/ knows nothing of the values' types. The record is frozen: a
set replaces it, so a record read earlier never changes under its reader, and the default read from
a parameter that has none can be shared.

Fields, by the room that sets them:
- parallel (parallelize, layers, pipeline split, tiling):
  `init_name`      the name the init draws this parameter from (a tied embedding on the last stage
                   is drawn as the first stage's word embedding), None: its own name
  `tp_shard`       parallel.layers.TPShard: how this tensor-parallel rank's tensor maps to the full one
  `tensor_parallel` split over the TP ranks (each holds a different piece); replicated otherwise
  `sequence_parallel` replicated over TP, but its gradient is partial per rank under sequence
                   parallelism (norms, row-parallel biases): summed over TP before the step
  `shared_embedding` the input embedding or its tied output copy on another stage: its gradient is
                   summed over the embedding group
  `tile_shard`     parallel.tiling.TileShard: a tile of a linear cut into tiles, and where it sits
  `expert_parallel` an expert weight of a MoE layer (parallel.moe): each expert-parallel rank holds
                   other experts; its gradient is reduced, and its states sharded, over the
                   expert-data-parallel group
- zero (the engine and stage 3):
  `zero_storage`   the storage that holds this parameter's partition (a flat group or stage 3's units)
  `zero_engine`    a weak reference to the engine (call it for the engine)
  `fp32_grad`      the backward writes this parameter's gradient in fp32 (models.weight_grad)
  `zero_unit`, `zero_index`, `zero_full_shape`  stage 3: its unit, its place there, its full shape
  `init_shard`     zero.Init (zero/init.py): this rank's slice of a parameter built on the meta
                   device, until megazero.initialize hands it to the engine
  `external_users` modules that use this parameter without owning it (register_external_parameter
                   before the engine exists; the engine gathers it around them at stage 3)
- models.weight_grad (the backward), taken by the engine (zero/precision.take_grad):
  `pending_fp32_grad` the fp32 gradient the layers summed since the engine last took it
"""

from __future__ import annotations

import dataclasses


@dataclasses.dataclass(frozen=True)
class ParamInfo:
    init_name: str | None = None
    tp_shard: object = None
    tensor_parallel: bool = False
    sequence_parallel: bool = False
    shared_embedding: bool = False
    tile_shard: object = None
    expert_parallel: bool = False
    zero_storage: object = None
    zero_engine: object = None
    fp32_grad: bool = False
    zero_unit: object = None
    zero_index: int | None = None
    zero_full_shape: tuple | None = None
    init_shard: object = None
    external_users: tuple = ()
    pending_fp32_grad: object = None


_ATTRIBUTE = "megazero"  # the parameter's Python attribute holding its ParamInfo
_NONE = ParamInfo()


def param_info(param) -> ParamInfo:
    """The record attached to `param` (a tensor), or the empty one: never None."""
    return getattr(param, _ATTRIBUTE, _NONE)


def set_param_info(param, **fields) -> ParamInfo:
    """Sets `fields` of `param`'s record (the others kept); a name ParamInfo lacks raises TypeError."""
    record = dataclasses.replace(param_info(param), **fields)
    setattr(param, _ATTRIBUTE, record)
    return record


def carry_param_info(source, target, **fields) -> ParamInfo:
    """`target` (a parameter taking `source`'s place) gets `source`'s record, with `fields` set."""
    record = dataclasses.replace(param_info(source), **fields)
    setattr(target, _ATTRIBUTE, record)
    return record
