"""ZeRO stage 3: parameters partitioned like the gradients and optimizer states, whole only while
a module that uses them runs.

- `units`: the storage, one unit per module (a bucket of the flat layout), its gather and release;
- `coordinator`: when to gather and release, from module hooks and the recorded trace (prefetch, reuse);
- `param_gather`: how a unit's full buffer is assembled (flat, two hops across nodes, hpZ, qwZ);
- `param_offload`: where the partition lives when offloaded (host memory, per-unit files);
- `gathered`: `GatheredParameters` and external parameters, for whole parameters outside training.

Imports zero's shared rooms (storage, groups, config, quantized_comm); zero/shard_domain.py builds it
(one unit storage and coordinator per shard domain).
"""
