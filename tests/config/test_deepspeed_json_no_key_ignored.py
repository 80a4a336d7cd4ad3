"""No DeepSpeed key is silently ignored: every key megazero accepts either changes the TrainConfig or
yields a start-up note, and the errors name what the user wrote. Pure: no processes, no data."""

import json
import re

import pytest

from megazero.config.train_flags import config_from_args, parse_args
from megazero.config.train_config import TrainConfig
from megazero.config.deepspeed_json import (
    FP16_KEYS,
    OPTIMIZER_PARAMS,
    TOP_LEVEL,
    TOP_LEVEL_BY_DESIGN,
    parse_deepspeed_config,
)
from megazero.core.errors import UsageError
from megazero.zero.config import (
    FIXED_BY_DESIGN,
    NOT_SUPPORTED_YET,
    SAVING_NOT_SUPPORTED_YET,
    ZeroConfig,
    parse_zero_config,
)


def _config(tmp_path, ds: dict, *flags: str, world: int = 1) -> TrainConfig:
    path = tmp_path / "ds.json"
    path.write_text(json.dumps(ds))
    return config_from_args(parse_args(["--zero-config", str(path), "--run-dir", "r", *flags]), world_size=world)


def _error(tmp_path, ds: dict, *flags: str) -> str:
    with pytest.raises(UsageError) as err:
        _config(tmp_path, ds, *flags)
    message = str(err.value)
    assert "\n" not in message
    return message


def _comparable(cfg: TrainConfig) -> dict:
    """The config minus what differs between any two parses (notes, the zero model's set fields)."""
    out = {k: v for k, v in vars(cfg).items() if k not in ("notes", "zero")}
    return {**out, "zero": cfg.zero.model_dump()}


# One accepted value per key that differs from what a run without the key does. Keys whose only
# accepted value is their default (bias_correction, the not-supported-yet keys) are in the error tests.
ZERO_VALUES = {
    "stage": 2,
    "reduce_scatter": False,
    "reduce_bucket_size": 1e6,
    "allgather_bucket_size": 1e6,
    "overlap_comm": False,
    "prefetch_bucket_size": 7,
    "stage3_prefetch_bucket_size": 7,
    "param_persistence_threshold": 7,
    "stage3_param_persistence_threshold": 7,
    "max_live_parameters": 7,
    "stage3_max_live_parameters": 7,
    "max_reuse_distance": 7,
    "stage3_max_reuse_distance": 7,
    "mics_shard_size": 1,
    "keep_params_gathered_across_microbatches": True,
    "offload_optimizer": {"device": "cpu"},
    "offload_param": {"device": "cpu"},
    "cpu_offload": True,
    "cpu_offload_param": True,
    "sub_group_size": 1000,
    "zero_hpz_partition_size": 2,
    "zero_quantized_weights": True,
    "zero_quantized_gradients": True,
    "mics_hierarchical_params_gather": True,
    "stage3_granularity": "layer",
    "leaf_module": {"classes": ["MLP"]},
    "adaptive_prefetch_bucket_size": True,
    "stage3_adaptive_prefetch_bucket_size": True,
    "adaptive_prefetch_min_size": 7,
    "stage3_adaptive_prefetch_min_size": 7,
    "adaptive_prefetch_max_size": 7e9,
    "stage3_adaptive_prefetch_max_size": 7e9,
    "parameter_alignment": True,
    "cpu_optimizer_threads": 3,
}
# Keys that need another base than stage 3 alone: key -> (base block, value).
ZERO_VALUES_ON = {
    "compute_grad_norm": ({"stage": 2}, False),
    "zenflow": ({"stage": 3, "offload_optimizer": {"device": "cpu"}}, {"topk_ratio": 0.5, "update_interval": 4}),
}
# Keys inside the offload blocks, each with a value that changes the config or yields a note.
OFFLOAD_VALUES = {
    "offload_optimizer": {
        "device": "nvme",
        "nvme_path": "/tmp/swap",
        "pin_memory": True,
        "buffer_count": 2,
        "pipeline_read": True,
        "pipeline_write": True,
        "fast_init": True,
    },
    "offload_param": {
        "device": "nvme",
        "nvme_path": "/tmp/swap",
        "pin_memory": True,
        "buffer_count": 2,
        "buffer_size": 1000,
        "max_in_cpu": 1000,
    },
}
TOP_VALUES = {
    "train_batch_size": 32,
    "train_micro_batch_size_per_gpu": 4,
    "gradient_accumulation_steps": 4,
    "gradient_clipping": 0.5,
    "steps_per_print": 3,
    "wall_clock_breakdown": True,
    "zero_allow_untested_optimizer": True,
    "prescale_gradients": False,
    "gradient_predivide_factor": 2.0,
    "communication_data_type": "bf16",
    "data_types": {"grad_accum_dtype": "bf16"},
    "seed": 5,
    "bf16": {"enabled": False},
    "dump_state": True,
    "optimizer": {"type": "AdamW", "params": {"lr": 0.1}},
}
FP16_VALUES = {
    "enabled": False,
    "loss_scale": 64,
    "initial_scale_power": 8,
    "loss_scale_window": 10,
    "hysteresis": 3,
    "min_loss_scale": 0.5,
    "auto_cast": True,
    "consecutive_hysteresis": True,
}
OPTIMIZER_VALUES = {
    "lr": 0.1,
    "betas": [0.5, 0.6],
    "eps": 0.1,
    "weight_decay": 0.5,
    "adam_w_mode": False,
    "torch_adam": True,
}


def _cases():
    """(name, a config without the key, the same config with it)."""
    stage3 = {"stage": 3}
    for key, value in ZERO_VALUES.items():
        yield f"zero:{key}", {"zero_optimization": stage3}, {"zero_optimization": {**stage3, key: value}}
    for key, (block, value) in ZERO_VALUES_ON.items():
        yield f"zero:{key}", {"zero_optimization": block}, {"zero_optimization": {**block, key: value}}
    for key, (fixed, _) in FIXED_BY_DESIGN.items():
        other = (not fixed) if isinstance(fixed, bool) else fixed // 2 + 1
        yield f"zero:{key}", {"zero_optimization": stage3}, {"zero_optimization": {**stage3, key: other}}
    for block, values in OFFLOAD_VALUES.items():
        for key, value in values.items():
            if key not in ("device", "nvme_path"):
                nvme = {"device": "nvme", "nvme_path": "/tmp/swap"}
                yield (
                    f"{block}:{key}",
                    {"zero_optimization": {**stage3, block: nvme}},
                    {"zero_optimization": {**stage3, block: {**nvme, key: value}}},
                )
    base = {"zero_optimization": {"stage": 1}, "bf16": {"enabled": True}}
    for key, value in TOP_VALUES.items():
        yield f"top:{key}", base, {**base, key: value}
    base = {"zero_optimization": {"stage": 1}, "fp16": {"enabled": True}}
    for key, value in FP16_VALUES.items():
        yield f"fp16:{key}", base, {**base, "fp16": {"enabled": True, key: value}}
    base = {"zero_optimization": {"stage": 1}, "optimizer": {"type": "Adam"}}
    for key, value in OPTIMIZER_VALUES.items():
        yield f"optimizer:{key}", base, {**base, "optimizer": {"type": "Adam", "params": {key: value}}}


CASES = list(_cases())


def test_every_accepted_key_has_a_case():
    """The cases below cover every key the readers accept, so a key added later needs a case."""
    named = {name.split(":", 1)[1] for name, _, _ in CASES}
    zero_fields = {n for n in ZeroConfig.model_fields} | {f.alias for f in ZeroConfig.model_fields.values() if f.alias}
    for keys in (
        zero_fields,
        FIXED_BY_DESIGN,
        TOP_LEVEL - {"fp16", "zero_optimization"},
        FP16_KEYS,
        OPTIMIZER_PARAMS - {"bias_correction"},
    ):
        assert set(keys) <= named, set(keys) - named


@pytest.mark.parametrize("name,base,with_key", CASES, ids=[c[0] for c in CASES])
def test_every_accepted_key_changes_the_config_or_yields_a_note(tmp_path, name, base, with_key):
    before = _config(tmp_path, base, world=2)
    after = _config(tmp_path, with_key, world=2)
    key = name.split(":", 1)[1]
    new_notes = [n for n in after.notes if n not in before.notes]
    assert _comparable(before) != _comparable(after) or any(key in n for n in new_notes), f"{name} was silently ignored"
    for note in after.notes:  # one line each, naming the file the key came from
        assert "\n" not in note and str(tmp_path / "ds.json") in note, note


def test_keys_the_design_fixes_are_quiet_at_the_value_megazero_has():
    block = {"stage": 2, **{key: fixed for key, (fixed, _) in FIXED_BY_DESIGN.items()}}
    settings = parse_deepspeed_config(
        {"zero_optimization": block, "prescale_gradients": True, "zero_allow_untested_optimizer": False}, "ds.json"
    )
    assert settings.notes == []
    settings = parse_deepspeed_config({"stage": 2, "contiguous_gradients": False}, "ds.json")
    assert settings.notes == [
        "ds.json: zero_optimization.contiguous_gradients = false has no effect: "
        "gradients always go into contiguous buckets here"
    ]
    assert set(TOP_LEVEL_BY_DESIGN) <= TOP_LEVEL


def test_new_settings_reach_the_config(tmp_path):
    cfg = _config(
        tmp_path,
        {
            "bf16": {"enabled": True},
            "communication_data_type": "BF16",
            "data_types": {"grad_accum_dtype": "bf16"},
            "wall_clock_breakdown": True,
            "zero_optimization": {"stage": 3, "reduce_scatter": False},
        },
    )
    assert (cfg.precision.reduce_dtype, cfg.precision.grad_accum_dtype) == ("bf16", "bf16")
    assert cfg.wall_clock_breakdown and cfg.zero.stage == 3 and not cfg.zero.reduce_scatter
    cfg = _config(tmp_path, {"fp16": {"enabled": True, "consecutive_hysteresis": True}})
    assert cfg.precision.consecutive_hysteresis and cfg.precision.reduce_dtype == "fp32"
    cfg = config_from_args(parse_args(["--bf16", "--grad-reduce-in-bf16"]))
    assert cfg.precision.reduce_dtype == "bf16" and cfg.precision.grad_accum_dtype == "fp32"
    assert cfg.notes == [] and not cfg.wall_clock_breakdown


def test_settings_that_cannot_act_in_this_run_are_noted(tmp_path):
    cfg = _config(
        tmp_path, {"zero_optimization": {"stage": 1, "stage3_prefetch_bucket_size": 10, "reduce_scatter": False}}
    )
    assert any("stage3_prefetch_bucket_size has no effect at ZeRO stage 1" in n for n in cfg.notes)
    cfg = _config(tmp_path, {"zero_optimization": {"reduce_scatter": False}}, "--zero-stage", "0")
    assert any("reduce_scatter has no effect at ZeRO stage 0" in n for n in cfg.notes)
    cfg = config_from_args(parse_args(["--hysteresis", "4"]))
    assert cfg.notes == ["--hysteresis has no effect: the run is not fp16"]
    cfg = _config(tmp_path, {"fp16": {"enabled": True, "loss_scale": 128, "loss_scale_window": 5}})
    assert cfg.notes == [
        f"fp16.loss_scale_window ({tmp_path / 'ds.json'}) has no effect: the loss scale is static (128)"
    ]


@pytest.mark.parametrize(
    "ds,flags,expected",
    [
        (
            {"zero_optimization": {"stage": 1, "pipeline_loading_checkpoint": True}},
            [],
            "checkpoints are sharded (--save)",
        ),
        (
            {"zero_optimization": {"stage": 2, "contiguous_gradients": "no"}},
            [],
            "contiguous_gradients must be true or false",
        ),
        (
            {"optimizer": {"type": "Adam", "params": {"bias_correction": False}}},
            [],
            "optimizer.params.bias_correction = false is not supported",
        ),
        ({"optimizer": {"type": "AdamW", "params": {"adam_w_mode": False}}}, [], "use type Adam for L2"),
        ({"optimizer": {"type": "AdamW", "parms": {}}}, [], "did you mean 'params'"),
        ({"optimizer": {"type": "Adam", "params": {"lr": "fast"}}}, [], "optimizer.params.lr must be a number"),
        ({"fp16": {"enabled": "yes"}}, [], 'fp16.enabled must be true or false, got "yes"'),
        ({"fp16": {"enabled": False}}, ["--fp16"], "--fp16 contradicts fp16.enabled = false"),
        ({"fp16": {"enabled": True}}, ["--bf16"], "--bf16 and fp16.enabled in"),
        ({"data_types": {"grad_acum_dtype": "fp32"}}, [], "did you mean 'grad_accum_dtype'"),
        ({"data_types": {"grad_accum_dtype": "float8"}}, [], 'data_types.grad_accum_dtype = "float8" is not'),
        (
            {"data_types": {"grad_accum_dtype": "bf16"}},
            [],
            'data_types.grad_accum_dtype in {path} asks for bf16 but the parameters are fp32; set it to "fp32"',
        ),
        (
            {"communication_data_type": "fp16", "bf16": {"enabled": True}},
            [],
            "communication_data_type in {path} asks for fp16 but the parameters are bf16",
        ),
        (
            {"communication_data_type": "fp32"},
            ["--bf16", "--grad-reduce-in-bf16"],
            '--grad-reduce-in-bf16 contradicts communication_data_type = "fp32" in {path}; remove one',
        ),
        ({}, ["--fp16", "--grad-reduce-in-bf16"], "--grad-reduce-in-bf16 asks for bf16 but the parameters are fp16"),
        ({"fp16": {"enabled": True, "hysteresis": 0}}, [], "fp16.hysteresis in {path} must be >= 1"),
        (
            {"fp16": {"initial_scale_power": 8}},
            ["--initial-loss-scale", "1024"],
            "--initial-loss-scale 1024 contradicts fp16.initial_scale_power = 8",
        ),
        ({}, ["--initial-loss-scale", "1000"], "must be a power of two"),
        ({"wall_clock_breakdown": 1}, [], "wall_clock_breakdown must be true or false"),
    ],
)
def test_errors_name_what_the_user_wrote(tmp_path, ds, flags, expected):
    message = _error(tmp_path, ds, *flags)
    assert expected.format(path=tmp_path / "ds.json") in message, message


def test_not_supported_yet_keys_accept_only_their_do_nothing_value():
    for table in (NOT_SUPPORTED_YET, SAVING_NOT_SUPPORTED_YET):
        for key, nothing in table.items():
            assert parse_zero_config({"stage": 3, key: nothing}) == ZeroConfig(stage=3)
            with pytest.raises(UsageError, match=f"{key} = .* is not supported yet"):
                parse_zero_config({"stage": 3, key: 7})


@pytest.mark.parametrize(
    "flags,expected",
    [
        (["--zero-hierarchical-gather", "--ranks-per-node", "3"], "has [2, 3, 3] ranks on its 3 nodes"),
        (["--zero-hpz-partition-size", "3", "--ranks-per-node", "4"], "must divide the 4 ranks"),
        (["--zero-quantized-gradients", "--ranks-per-node", "4", "--zero-config", "{ds}"], None),
    ],
)
def test_zero_plus_plus_layouts_are_checked_against_the_nodes(tmp_path, flags, expected):
    """hpZ, the hierarchical gather and qgZ split shard groups by node: uneven splits are refused."""
    path = tmp_path / "ds.json"
    path.write_text(json.dumps({"zero_optimization": {"stage": 3, "mics_shard_size": 4}}))
    argv = ["--zero-stage", "3"] + [f.format(ds=path) for f in flags]
    if expected is None:  # mics 4 on nodes of 4: every shard group lies inside one node
        assert config_from_args(parse_args(argv), world_size=8).zero.zero_quantized_gradients
        return
    with pytest.raises(UsageError, match=re.escape(expected)):
        config_from_args(parse_args(argv), world_size=8)
