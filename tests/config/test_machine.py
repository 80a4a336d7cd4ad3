"""The machine the flags are read for (megazero.config.machine.Machine) and the flags' Namespace:
config_from_args writes nothing on the caller's Namespace (the machine is a record, what a DeepSpeed
config gives for flags goes into a copy), so one parse can be read for two machines."""

import argparse
import json

from megazero.config.machine import Machine
from megazero.config.train_flags import config_from_args, parse_args


def test_the_machine_picks_the_backend_unless_the_flag_does():
    gpu, cpu = Machine.of(8, 4, cuda_available=True), Machine.of(8, 4, cuda_available=False)
    assert (gpu.backend(None), cpu.backend(None), cpu.backend("nccl")) == ("nccl", "gloo", "nccl")
    assert gpu.uses_cuda(None) and not gpu.uses_cuda("gloo") and cpu.uses_cuda("nccl")
    assert (gpu.world_size, gpu.local_world_size) == (8, 4)


def test_the_flags_namespace_is_left_as_parsed(tmp_path):
    ds = tmp_path / "ds.json"
    ds.write_text(
        json.dumps(
            {
                "bf16": {"enabled": True},
                "activation_checkpointing": {},
                "scheduler": {"type": "WarmupLR", "params": {"warmup_num_steps": 3}},
            }
        )
    )
    args = parse_args(["--deepspeed_config", str(ds), "--mock-data", "--run-dir", "r"])
    parsed = argparse.Namespace(**vars(args))
    on_cpu = config_from_args(args, 2, cuda_available=False)
    # no cuda_available, zero_config_flag, zero_config, tokenizer_type, scheduler or recomputation flags
    assert vars(args) == vars(parsed)
    on_gpu = config_from_args(args, 2, cuda_available=True)
    assert (on_cpu.parallel.distributed_backend, on_gpu.parallel.distributed_backend) == ("gloo", "nccl")
    assert on_cpu.optimizer.warmup_iters == on_gpu.optimizer.warmup_iters == 3
    assert on_cpu.model.recompute_granularity == "full" and on_cpu.batch_from is None
