"""ZeRO, the data-parallel axis: stages 0-3 behind one engine (engine.py), one partitioned storage
under every stage (storage.py; flat_group.py for stages 0-2, stage3/ for stage 3), offload of
optimizer states (offload.py, swap.py), ZeRO++'s quantized collectives and DeepSpeed's safe_get_* /
safe_set_* (state_access.py). Knows nothing of tensor or pipeline parallelism.

DeepSpeed's `deepspeed.zero` names, imported on first use (config/ imports this package's records
before torch loads): `Init` (init.py), `GatheredParameters` and `register_external_parameter`
(stage3/gathered.py), `TiledLinear` (megazero.parallel.tiling: the linear cut into tiles that stage 3
gathers one at a time; no module of zero uses it).
"""

_NAMES = {
    "Init": "megazero.zero.init",
    "GatheredParameters": "megazero.zero.stage3.gathered",
    "register_external_parameter": "megazero.zero.stage3.gathered",
}


def __getattr__(name):
    if name in _NAMES:
        import importlib

        return getattr(importlib.import_module(_NAMES[name]), name)
    if name == "TiledLinear":
        from megazero.parallel.tiling import TiledLinear

        return TiledLinear
    raise AttributeError(f"module 'megazero.zero' has no attribute {name!r}")
