"""The command-line edge: everything that turns flags and a DeepSpeed JSON into one typed
`TrainConfig` (train_config.py) and checks it before any process group or file is touched.

- `flags`: the parser (Megatron-LM's flag names, one-line helps with defaults);
- `train_flags`: flags -> `TrainConfig`, every cross-flag check, read against a `Machine`
  (`machine`: the ranks, CUDA or not), with each area's `*_flags` module (model, parallel, data,
  zero, run, checkpoint, monitor, moe, muon, precision, optimizer, optimizer_state) adding its flags
  to the parser and mapping them onto its record;
- `deepspeed_json` and `deepspeed_blocks`: DeepSpeed JSON keys onto flags and `ZeroConfig`;
- `machine_checks` and `memory_estimate`: checks against this machine, its files and its memory.

The runtime reads only `TrainConfig`; nothing here creates process groups or tensors on a device.
"""
