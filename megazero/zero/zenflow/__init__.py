"""ZenFlow (DeepSpeed's `zero_optimization.zenflow`): the important columns of each matrix stepped
on the device every step, the rest by the CPU Adam once per window, overlapped with training.

- `optimizer`: the ZenFlow optimizer state and step (`ZenFlowOffload`), the strategy the engine holds;
- `columns`: which columns are chosen (column norms, top-k, a tensor-parallel split's share);
- `windows`: `update_interval: "auto"`, DeepSpeed's rule for when a window ends.
"""
