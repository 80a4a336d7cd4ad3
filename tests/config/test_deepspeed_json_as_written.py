"""DeepSpeed configs as people have them: every top-level key DeepSpeed documents is known (mapped
onto a megazero setting, or refused as "not supported yet"), "auto" values come from the flags, the
schedulers become the lr schedule and activation_checkpointing turns recomputation on. Pure parses,
plus two tiny in-process runs (a Trainer-style config, an activation-checkpointing config)."""

import json
from pathlib import Path

import pytest

from megazero.config.train_flags import config_from_args, parse_args
from megazero.config.deepspeed_json import KNOWN_TOP_LEVEL, NOT_SUPPORTED_YET_TOP, parse_deepspeed_config
from megazero.config.deepspeed_blocks import flags_from_config
from megazero.core.errors import UsageError

from tests.driver import TINY as DRIVER_TINY
from tests.driver import run_main as _main
from tests.metrics_reading import metrics_records

TINY = DRIVER_TINY + ["--micro-batch-size", "2"]

# The top-level keys of DeepSpeed's configuration documentation (config-json), written out here so
# that a key dropped from megazero's tables is caught.
DOCUMENTED = """train_batch_size train_micro_batch_size_per_gpu gradient_accumulation_steps optimizer
scheduler communication_data_type prescale_gradients gradient_predivide_factor sparse_gradients fp16
bf16 amp gradient_clipping graph_harvesting data_types zero_optimization zero_allow_untested_optimizer
zero_force_ds_cpu_optimizer aio activation_checkpointing sparse_attention data_efficiency
curriculum_learning flops_profiler steps_per_print wall_clock_breakdown dump_state tensorboard wandb
csv_monitor comet comms_logger autotuning elasticity compression_training checkpoint pipeline
memory_breakdown timers dataloader_drop_last compile managed_gradient_accumulation""".split()

# DeepSpeedZeroConfig's fields and aliases (deepspeed/runtime/zero/config.py of release 0.19.8, plus
# current master's stage3_adaptive_prefetch_* and stage3_partition_stream_chunk_size, whose unit tests
# assert the defaults False / 1e7 / 5e8 and 0), and the fields of its nested blocks.
DOCUMENTED_ZERO = """stage contiguous_gradients reduce_scatter reduce_bucket_size use_multi_rank_bucket_allreduce
allgather_partitions allgather_bucket_size overlap_comm compute_grad_norm load_from_fp32_weights
elastic_checkpoint offload_param offload_optimizer zenflow sub_group_size cpu_offload_param
cpu_offload_use_pin_memory cpu_offload prefetch_bucket_size stage3_prefetch_bucket_size
param_persistence_threshold stage3_param_persistence_threshold model_persistence_threshold
stage3_model_persistence_threshold max_live_parameters stage3_max_live_parameters max_reuse_distance
stage3_max_reuse_distance gather_16bit_weights_on_model_save stage3_gather_16bit_weights_on_model_save
module_granularity_threshold stage3_module_granularity_threshold use_all_reduce_for_fetch_params
stage3_use_all_reduce_for_fetch_params allgather_sequential stage3_allgather_sequential
stage3_gather_fp16_weights_on_model_save ignore_unused_parameters legacy_stage1 round_robin_gradients
parameter_alignment zero_hpz_partition_size zero_quantized_weights zero_quantized_nontrainable_weights
zero_quantized_gradients zeropp_loco_param mics_shard_size mics_hierarchical_params_gather
memory_efficient_linear pipeline_loading_checkpoint override_module_apply log_trace_cache_warnings
enable_sanity_checks save_muon_momentum_buffer_in_memory leaf_module
stage3_adaptive_prefetch_bucket_size stage3_adaptive_prefetch_min_size stage3_adaptive_prefetch_max_size
stage3_partition_stream_chunk_size partition_stream_chunk_size""".split()
DOCUMENTED_BLOCKS = {
    "offload_optimizer": "device nvme_path buffer_count pin_memory pipeline_read pipeline_write fast_init ratio",
    "offload_param": "device nvme_path buffer_count buffer_size max_in_cpu pin_memory",
    "zenflow": "topk_ratio select_strategy select_interval update_interval overlap_step offload auto_ratio "
    "full_warm_up_rounds pt_reserved_cores_perc steps_per_epoch",
    "leaf_module": "classes names name_suffixes",
}

# As the Hugging Face Trainer's documentation writes a ZeRO-2 config: "auto" wherever it fills in its
# own arguments.
TRAINER_STYLE = {
    "fp16": {
        "enabled": "auto",
        "loss_scale": 0,
        "loss_scale_window": 1000,
        "initial_scale_power": 16,
        "hysteresis": 2,
        "min_loss_scale": 1,
    },
    "bf16": {"enabled": "auto"},
    "optimizer": {"type": "AdamW", "params": {"lr": "auto", "betas": "auto", "eps": "auto", "weight_decay": "auto"}},
    "scheduler": {
        "type": "WarmupDecayLR",
        "params": {
            "warmup_min_lr": "auto",
            "warmup_max_lr": "auto",
            "warmup_num_steps": "auto",
            "total_num_steps": "auto",
        },
    },
    "zero_optimization": {
        "stage": 2,
        "offload_optimizer": {"device": "none", "pin_memory": True},
        "allgather_partitions": True,
        "allgather_bucket_size": 2e8,
        "overlap_comm": True,
        "reduce_scatter": True,
        "reduce_bucket_size": "auto",
        "contiguous_gradients": True,
    },
    "gradient_accumulation_steps": "auto",
    "gradient_clipping": "auto",
    "train_batch_size": "auto",
    "train_micro_batch_size_per_gpu": "auto",
    "wall_clock_breakdown": False,
}
ACTIVATION = {
    "zero_optimization": {"stage": 1},
    "activation_checkpointing": {
        "partition_activations": True,
        "contiguous_memory_optimization": False,
        "number_checkpoints": None,
        "synchronize_checkpoint_boundary": False,
        "profile": False,
    },
}


def _write(tmp_path, ds: dict) -> str:
    path = tmp_path / "ds.json"
    path.write_text(json.dumps(ds))
    return str(path)


def _config(tmp_path, ds: dict, *flags: str):
    return config_from_args(parse_args(["--zero-config", _write(tmp_path, ds), "--run-dir", "r", *flags]))


def _error(call) -> str:
    with pytest.raises(UsageError) as err:
        call()
    assert "\n" not in str(err.value)
    return str(err.value)


def test_every_documented_top_level_key_is_known():
    assert set(DOCUMENTED) <= KNOWN_TOP_LEVEL, set(DOCUMENTED) - KNOWN_TOP_LEVEL
    message = _error(lambda: parse_deepspeed_config({"zero_optimisation": {}}, "ds.json"))
    assert message == "unknown key 'zero_optimisation' in ds.json; did you mean 'zero_optimization'?"


def test_every_deepspeed_zero_key_is_known_with_deepspeeds_defaults():
    """Each key of DeepSpeedZeroConfig is accepted at its DeepSpeed default (implemented, noted, or a
    do-nothing value of a key refused otherwise), and so is each key of the nested blocks."""
    from megazero.zero.config import ZeroConfig, _key_names
    from megazero.zero.config_blocks import (
        DEFAULT_LEAF_CLASSES,
        LeafModuleConfig,
        OffloadOptimizerConfig,
        OffloadParamConfig,
        ZenFlowConfig,
    )

    assert set(DOCUMENTED_ZERO) <= _key_names(), set(DOCUMENTED_ZERO) - _key_names()
    records = {
        "offload_optimizer": OffloadOptimizerConfig,
        "offload_param": OffloadParamConfig,
        "zenflow": ZenFlowConfig,
        "leaf_module": LeafModuleConfig,
    }
    for block, keys in DOCUMENTED_BLOCKS.items():
        assert set(keys.split()) == set(records[block].model_fields), block
    zero = ZeroConfig(stage=3)
    assert (zero.adaptive_prefetch_bucket_size, zero.adaptive_prefetch_min_size, zero.adaptive_prefetch_max_size) == (
        False,
        int(1e7),
        int(5e8),
    )
    assert zero.compute_grad_norm is True and zero.parameter_alignment is False and zero.zenflow is None
    assert zero.leaf_module.classes == DEFAULT_LEAF_CLASSES and zero.leaf_module.names == []
    flow = ZenFlowConfig()
    assert (
        flow.topk_ratio,
        flow.select_strategy,
        flow.select_interval,
        flow.update_interval,
        flow.overlap_step,
        flow.offload,
        flow.auto_ratio,
        flow.full_warm_up_rounds,
        flow.pt_reserved_cores_perc,
    ) == (0.1, "auto", "auto", "auto", False, False, 0.99, 0, 0.5)
    assert OffloadOptimizerConfig().ratio == 1.0
    defaults = {
        "stage": 2,
        "compute_grad_norm": True,
        "parameter_alignment": False,
        "save_muon_momentum_buffer_in_memory": False,
        "stage3_adaptive_prefetch_bucket_size": False,
        "stage3_adaptive_prefetch_min_size": 1e7,
        "stage3_adaptive_prefetch_max_size": 5e8,
        "stage3_partition_stream_chunk_size": 0,
        "leaf_module": {},
    }
    settings = parse_deepspeed_config({"zero_optimization": defaults}, "ds.json")
    assert settings.notes == [] and settings.zero.stage == 2


@pytest.mark.parametrize("key", sorted(NOT_SUPPORTED_YET_TOP))
def test_keys_without_an_equivalent_are_not_supported_yet_unless_they_ask_for_nothing(key):
    message = _error(lambda: parse_deepspeed_config({key: {"enabled": True, "x": 1}}, "ds.json"))
    assert message.startswith(f"ds.json: {key} is not supported yet"), message
    for nothing in ({"enabled": False}, False, None, {}):
        assert parse_deepspeed_config({key: nothing}, "ds.json").values == {}


def test_auto_values_come_from_the_flags(tmp_path):
    flags = [
        "--lr",
        "2e-3",
        "--min-lr",
        "1e-4",
        "--lr-warmup-iters",
        "3",
        "--train-iters",
        "40",
        "--micro-batch-size",
        "2",
        "--global-batch-size",
        "8",
        "--clip-grad",
        "0.5",
        "--adam-beta2",
        "0.99",
    ]
    cfg = _config(tmp_path, TRAINER_STYLE, *flags)
    plain = config_from_args(parse_args(["--run-dir", "r", *flags, "--zero-stage", "2", "--lr-decay-style", "linear"]))
    assert cfg.optimizer == plain.optimizer and cfg.precision == plain.precision
    assert (cfg.micro_batch_size, cfg.global_batch_size) == (2, 8)
    assert cfg.zero.reduce_bucket_size == plain.zero.reduce_bucket_size  # "auto": the default
    assert cfg.zero.stage == 2 and cfg.zero.allgather_bucket_size == int(2e8)
    assert cfg.optimizer.decay_style == "linear" and cfg.optimizer.decay_iters == 40


@pytest.mark.parametrize(
    "scheduler,flags,expected",
    [
        (
            {"type": "WarmupLR", "params": {"warmup_max_lr": 0.01, "warmup_num_steps": 7, "warmup_type": "linear"}},
            [],
            {"lr": 0.01, "warmup_iters": 7, "decay_style": "constant"},
        ),
        (
            {
                "type": "WarmupDecayLR",
                "params": {"warmup_min_lr": 1e-5, "warmup_max_lr": 0.01, "warmup_num_steps": 4, "total_num_steps": 30},
            },
            [],
            {"lr": 0.01, "min_lr": 1e-5, "warmup_iters": 4, "decay_iters": 30, "decay_style": "linear"},
        ),
        (
            {"type": "WarmupCosineLR", "params": {"total_num_steps": 30, "cos_min_ratio": 0.1}},
            ["--lr", "0.02", "--lr-warmup-iters", "2"],
            {"lr": 0.02, "min_lr": 0.002, "warmup_iters": 2, "decay_iters": 30, "decay_style": "cosine"},
        ),
    ],
)
def test_schedulers_become_the_lr_schedule(tmp_path, scheduler, flags, expected):
    cfg = _config(tmp_path, {"scheduler": scheduler}, *flags)
    got = {name: getattr(cfg.optimizer, name) for name in expected}
    assert got == {k: pytest.approx(v) if isinstance(v, float) else v for k, v in expected.items()}
    logs = [n for n in cfg.notes if "warmup_type" in n]
    assert len(logs) == (0 if scheduler["params"].get("warmup_type") == "linear" else 1), cfg.notes


@pytest.mark.parametrize(
    "ds,flags,expected",
    [
        (
            {"scheduler": {"type": "WarmupDecayLR", "params": {"total_num_steps": 30}}},
            ["--lr-decay-iters", "20"],
            "--lr-decay-iters 20 contradicts scheduler.params.total_num_steps = 30 in",
        ),
        (
            {"scheduler": {"type": "WarmupLR", "params": {"warmup_num_steps": 3}}},
            ["--lr-warmup-fraction", "0.1"],
            "--lr-warmup-fraction contradicts scheduler.params.warmup_num_steps in",
        ),
        (
            {"scheduler": {"type": "WarmupLR"}},
            ["--lr-decay-style", "linear"],
            '--lr-decay-style linear contradicts scheduler.type = "constant"',
        ),
        (
            {
                "scheduler": {"type": "WarmupLR", "params": {"warmup_max_lr": 0.1}},
                "optimizer": {"type": "Adam", "params": {"lr": 0.2}},
            },
            [],
            "scheduler.params.warmup_max_lr = 0.1 contradicts optimizer.params.lr = 0.2; remove one",
        ),
        (
            {"scheduler": {"type": "WarmupDecayLR", "params": {"total_num_steps": 0}}},
            [],
            "scheduler.params.total_num_steps must be >= 1, got 0",
        ),
        ({"scheduler": {"type": "OneCycle"}}, [], "scheduler type OneCycle is not supported yet"),
        ({"scheduler": {"type": "WarmupCosine"}}, [], '"WarmupCosine" is not a DeepSpeed scheduler'),
        (
            {"scheduler": {"type": "WarmupLR", "params": {"total_num_steps": 3}}},
            [],
            "unknown key 'total_num_steps' in {path}: scheduler.params",
        ),
        (
            {"scheduler": {"type": "WarmupDecayLR", "params": {"warmup_min_lr": 0.5}}},
            ["--lr", "0.1"],
            "gives a final learning rate 0.5 above the peak 0.1",
        ),
        ({"activation_checkpointing": {"cpu_checkpointing": "yes"}}, [], "cpu_checkpointing"),
        ({"activation_checkpointing": {"partition_activation": True}}, [], "did you mean 'partition_activations'"),
        (
            {"zero_optimization": {"stage": 0, "offload_optimizer": {"device": "cpu"}}},
            [],
            "offload_optimizer needs ZeRO stage 1-3",
        ),
        (
            {"zero_optimization": {"stage": 2, "offload_optimizer": {"device": "cpu", "ratio": 0.5}}},
            [],
            "offload_optimizer.ratio = 0.5: partial offload splits stage 3's sub-groups",
        ),
        (
            {"zero_optimization": {"stage": 3, "compute_grad_norm": False}},
            [],
            "compute_grad_norm = false is supported only at ZeRO stage 1 or 2",
        ),
        ({"zero_optimization": {"stage": 2, "zenflow": {}}}, [], "zenflow works on optimizer offload to host"),
        (
            {
                "zero_optimization": {
                    "stage": 2,
                    "offload_optimizer": {"device": "cpu"},
                    "zenflow": {"select_strategy": "step", "select_interval": 2, "update_interval": 4},
                }
            },
            [],
            "select_interval must be at least update_interval",
        ),
        (
            {"zero_optimization": {"stage": 2, "leaf_module": {"classes": ["MLP"]}}},
            [],
            "leaf_module acts on stage 3's units",
        ),
        (
            {"zero_optimization": {"stage": 3, "offload_param": {"device": "nvme"}}},
            [],
            'offload_param.device "nvme" needs nvme_path',
        ),
        (
            {"zero_optimization": {"stage": 2, "zero_hpz_partition_size": 4}},
            [],
            "zero_hpz_partition_size acts on partitioned parameters, which only ZeRO stage 3 has",
        ),
    ],
)
def test_errors_name_the_key(tmp_path, ds, flags, expected):
    message = _error(lambda: _config(tmp_path, ds, *flags))
    assert expected.format(path=tmp_path / "ds.json") in message, message


def test_zenflow_tutorial_config_is_taken_as_written(tmp_path):
    """DeepSpeed's ZenFlow tutorial block ("auto" selection and update interval) is accepted: the
    "auto" update interval is zenflow/windows.py's rule (it was refused before it existed)."""
    block = {
        "topk_ratio": 0.05,
        "select_strategy": "auto",
        "select_interval": "auto",
        "update_interval": "auto",
        "full_warm_up_rounds": 0,
        "overlap_step": True,
    }
    offload = {"device": "cpu", "pin_memory": True}
    flow = _config(
        tmp_path, {"zero_optimization": {"stage": 2, "offload_optimizer": offload, "zenflow": block}}
    ).zero.zenflow
    assert (flow.update_interval, flow.select_strategy, flow.topk_ratio, flow.overlap_step) == (
        "auto",
        "auto",
        0.05,
        True,
    )
    assert flow.select_every() == 0  # "epoch" without steps_per_epoch: selected once
    assert not [
        n
        for n in _config(
            tmp_path, {"zero_optimization": {"stage": 2, "offload_optimizer": offload, "zenflow": block}}
        ).notes
        if "zenflow" in n
    ]
    accumulating = _config(
        tmp_path,
        {"zero_optimization": {"stage": 2, "offload_optimizer": offload, "zenflow": block}},
        "--micro-batch-size",
        "2",
        "--global-batch-size",
        "8",
    )
    assert [n for n in accumulating.notes if n.startswith("zenflow with 4 microbatches per step")], accumulating.notes


def test_deepspeed_defaults_yield_to_flags(tmp_path):
    """A default the user did not write (warmup_num_steps 1000, warmup_min_lr 0) is no contradiction."""
    ds = {"scheduler": {"type": "WarmupDecayLR", "params": {"total_num_steps": 3000}}}
    assert _config(tmp_path, ds).optimizer.warmup_iters == 1000
    cfg = _config(tmp_path, ds, "--lr-warmup-iters", "5", "--min-lr", "1e-5")
    assert (cfg.optimizer.warmup_iters, cfg.optimizer.min_lr) == (5, 1e-5)


def test_activation_checkpointing_turns_recomputation_on(tmp_path):
    cfg = _config(tmp_path, ACTIVATION)
    m = cfg.model  # DeepSpeed's recomputation: every layer whole
    assert (m.recompute_granularity, m.recompute_method, m.recompute_num_layers) == ("full", "uniform", 1)
    assert [n for n in cfg.notes if "activation_checkpointing" in n] == [
        f"{tmp_path / 'ds.json'}: activation_checkpointing.partition_activations = true has no effect: each "
        f"layer's saved input is not split across tensor-parallel ranks (--sequence-parallel splits it along "
        f"the sequence)"
    ]
    assert _config(tmp_path, {"zero_optimization": {"stage": 1}}).model.recompute_granularity == "none"
    message = _error(lambda: _config(tmp_path, ACTIVATION, "--recompute-granularity", "selective"))
    assert message == (
        f'--recompute-granularity selective contradicts activation_checkpointing = "full" in '
        f"{tmp_path / 'ds.json'}; remove one"
    )


def test_cpu_checkpointing_offloads_every_checkpointed_input(tmp_path):
    """DeepSpeed's cpu_checkpointing: each checkpoint's input (every layer's, the block recomputing
    each layer whole) kept in host memory, i.e. --cpu-offloading over all layers of a stage."""
    offloaded = {
        **ACTIVATION,
        "activation_checkpointing": {**ACTIVATION["activation_checkpointing"], "cpu_checkpointing": True},
    }
    cfg = _config(tmp_path, offloaded, "--num-layers", "4")
    assert cfg.model.recompute_granularity == "full" and cfg.parallel.cpu_offloading_num_layers == 4
    assert _config(tmp_path, ACTIVATION).parallel.cpu_offloading_num_layers == 0
    assert _config(tmp_path, offloaded, "--cpu-offloading").parallel.cpu_offloading_num_layers > 0
    assert _config(tmp_path, offloaded, "--cpu-offloading-num-layers", "1").parallel.cpu_offloading_num_layers == 1


def test_monitors_map_onto_the_monitor_flags():
    settings = parse_deepspeed_config(
        {
            "wandb": {"enabled": True, "project": "p", "team": "t"},
            "tensorboard": {"enabled": True, "output_path": "tb", "job_name": "j"},
            "csv_monitor": {"enabled": True},
        },
        "ds.json",
    )
    flags = {"wandb_project": None, "wandb_entity": None, "tensorboard_dir": None}
    assert flags_from_config(settings, flags, 1e-3, "ds.json") == {
        "wandb_project": "p",
        "wandb_entity": "t",
        "tensorboard_dir": str(Path("tb") / "j"),
    }
    assert settings.notes == [
        "ds.json: csv_monitor has no effect: every logged record goes to metrics.jsonl "
        "in the run directory (--metrics-file)"
    ]
    # where the monitors write is no training setting: the flag wins, with a note
    given = flags_from_config(settings, {**flags, "wandb_project": "q"}, 1e-3, "ds.json")
    assert "wandb_project" not in given and given["wandb_entity"] == "t"
    assert settings.notes[-1] == '--wandb-project q wins over wandb.project = "p" in ds.json'
    off = parse_deepspeed_config({"wandb": {"enabled": False, "project": "p"}}, "ds.json")
    assert off.values == {} and off.notes == []


def test_a_trainer_style_config_runs_on_the_flags_schedule(tmp_path, capsys, monkeypatch):
    monkeypatch.chdir(tmp_path)
    path = _write(tmp_path, TRAINER_STYLE)
    code, out = _main(
        TINY
        + [
            "--train-iters",
            "3",
            "--zero-config",
            path,
            "--lr",
            "1e-3",
            "--min-lr",
            "1e-4",
            "--lr-warmup-iters",
            "1",
            "--metrics-file",
            "m.jsonl",
        ],
        capsys,
    )
    assert code == 0, out.err
    lrs = [r["lr"] for r in metrics_records(tmp_path / "m.jsonl")]
    # Megatron's schedule after 0, 1, 2 steps: warmup from 0 to --lr, then WarmupDecayLR's linear
    # decay, halfway to --min-lr after 2 of its 3 steps
    assert lrs == pytest.approx([0.0, 1e-3, 5.5e-4])


def test_an_activation_checkpointing_config_runs_with_recomputation(tmp_path, capsys, monkeypatch):
    monkeypatch.chdir(tmp_path)
    path = _write(tmp_path, ACTIVATION)
    assert config_from_args(parse_args(["--zero-config", path])).model.recompute_granularity == "full"
    code, out = _main(TINY + ["--train-iters", "1", "--zero-config", path, "--metrics-file", "m.jsonl"], capsys)
    assert code == 0, out.err
    assert "partition_activations = true has no effect" in out.out + out.err
    assert [r["iteration"] for r in metrics_records(tmp_path / "m.jsonl")] == [1]
