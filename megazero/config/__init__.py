"""The command-line edge: everything that turns flags and a DeepSpeed JSON into one typed
`TrainConfig` (train_config.py) and checks it before any process group or file is touched.

- `flags`: the parser (Megatron-LM's flag names) and `zero_arguments`: the ZeRO flags;
- `ds_config` and `ds_settings`: DeepSpeed JSON keys onto flags and `ZeroConfig`;
- `arguments` (with `monitor_flags`): flags -> `TrainConfig`, every cross-flag check;
- `preflight` and `memory_estimate`: checks against this machine, its files and its memory.

The runtime reads only `TrainConfig`; nothing here creates process groups or tensors on a device.
"""
