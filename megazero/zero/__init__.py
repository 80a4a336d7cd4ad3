"""ZeRO, the data-parallel axis: stages 0-3 behind one engine (engine.py), one partitioned storage
under every stage (storage.py; flat_group.py for stages 0-2, stage3/ for stage 3), offload of
optimizer states (offload.py, swap.py), ZeRO++'s quantized collectives and DeepSpeed's safe_get_* /
safe_set_* (state_access.py). Knows nothing of tensor or pipeline parallelism.
"""
