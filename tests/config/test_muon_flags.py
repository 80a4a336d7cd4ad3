"""The Muon flags (megazero/config/muon_flags.py): Megatron-LM's --optimizer muon and --muon-* names
reach OptimizerConfig.muon, DeepSpeed's "optimizer": {"type": "Muon"} block gives DeepSpeed's Muon's
fixed choices as defaults, and each bad value or combination is one line before any group."""

from __future__ import annotations

import json

import pytest

from megazero.config.flags import parse_args
from megazero.config.train_flags import config_from_args
from megazero.core.errors import UsageError
from megazero.ops.muon_config import MuonConfig


def _config(line: str, ds: dict | None = None, tmp_path=None):
    extra = []
    if ds is not None:
        path = tmp_path / "ds.json"
        path.write_text(json.dumps(ds))
        extra = ["--zero-config", str(path)]
    return config_from_args(
        parse_args(line.split() + ["--mock-data", "--run-dir", "r"] + extra), world_size=4, cuda_available=False
    )


def _error(call) -> str:
    with pytest.raises(UsageError) as err:
        call()
    assert "\n" not in str(err.value)
    return str(err.value)


def test_adam_by_default_and_megatron_defaults_for_muon():
    assert _config("").optimizer.muon is None
    assert _config("--optimizer muon").optimizer.muon == MuonConfig()
    assert (MuonConfig().momentum, MuonConfig().coefficient_type, MuonConfig().scale_mode) == (
        0.9,
        "quintic",
        "spectral",
    )


def test_tensor_parallel_muon_notes_megatrons_other_default():
    cfg = _config("--optimizer muon --tensor-model-parallel-size 2")
    assert any("Megatron-LM's default, blockwise" in n for n in cfg.notes), cfg.notes
    assert not any(
        "blockwise" in n
        for n in _config("--optimizer muon --tensor-model-parallel-size 2 --muon-tp-mode duplicated").notes
    )


def test_megatron_flags_reach_the_config():
    muon = _config(
        "--optimizer dist_muon --muon-momentum 0.8 --muon-use-nesterov --muon-num-ns-steps 6 "
        "--muon-coefficient-type simple --muon-scale-mode unit_rms_norm --muon-extra-scale-factor 0.2 "
        "--muon-fp32-matmul-prec high --muon-no-split-qkv --muon-tp-mode distributed "
        "--muon-scalar-optimizer adam"
    ).optimizer.muon
    assert muon == MuonConfig(
        momentum=0.8,
        nesterov=True,
        ns_steps=6,
        coefficient_type="simple",
        scale_mode="unit_rms_norm",
        extra_scale_factor=0.2,
        matmul_precision="high",
        split_qkv=False,
    )


def test_deepspeed_muon_block_gives_deepspeeds_defaults_and_flags_win(tmp_path):
    ds = {
        "optimizer": {
            "type": "Muon",
            "params": {"lr": 0.02, "momentum": 0.9, "weight_decay": 0.1, "betas": [0.9, 0.95], "ns_method": "gram"},
        }
    }
    cfg = _config("", ds, tmp_path)
    assert cfg.optimizer.muon == MuonConfig(
        momentum=0.9, nesterov=True, scale_mode="shape_scaling", coefficient_type="simple", split_qkv=False
    )
    assert (cfg.optimizer.lr, cfg.optimizer.adam.weight_decay, cfg.optimizer.adam.beta2) == (0.02, 0.1, 0.95)
    assert _config("--muon-num-ns-steps 7", ds, tmp_path).optimizer.muon.ns_steps == 7
    assert _config("--optimizer muon --muon-nesterov").optimizer.muon.nesterov  # the spelling
    assert (
        _config(
            "--optimizer muon",
            {"zero_optimization": {"stage": 3, "save_muon_momentum_buffer_in_memory": False}},
            tmp_path,
        ).optimizer.muon
        == MuonConfig()
    )


@pytest.mark.parametrize(
    "line, ds, words",
    [
        ("--muon-momentum 0.5", None, "--muon-momentum needs --optimizer muon"),
        ("--muon-no-split-qkv", None, "--muon-no-split-qkv needs --optimizer muon"),
        ("--muon-use-nesterov", None, "--muon-use-nesterov needs --optimizer muon"),
        ("--optimizer muon --muon-momentum 1", None, "--muon-momentum must be in [0, 1), got 1.0"),
        ("--optimizer muon --muon-num-ns-steps 0", None, "--muon-num-ns-steps must be in [1, 100), got 0"),
        ("--optimizer muon --muon-extra-scale-factor 0", None, "--muon-extra-scale-factor must be > 0"),
        (
            "--optimizer muon --muon-tp-mode blockwise",
            None,
            "--muon-tp-mode blockwise is not supported yet (it orthogonalises each tensor-parallel shard apart",
        ),
        (
            "--optimizer muon --muon-coefficient-type polar_express",
            None,
            "--muon-coefficient-type polar_express is not supported yet; use simple or quintic",
        ),
        ("--optimizer muon --muon-scale-mode huge", None, "--muon-scale-mode 'huge' is not a choice"),
        ("--optimizer muon --muon-fp32-matmul-prec low", None, "torch has no 'low' float32 matmul precision"),
        ("--muon-use-syrk", None, "--muon-use-syrk"),
        (
            "",
            {"optimizer": {"type": "Muon", "params": {"per_head_muon": True}}},
            "per_head_muon = true is not supported",
        ),
        (
            "",
            {"optimizer": {"type": "Muon", "params": {"lr": 0.01, "adam_lr": 0.001}}},
            "optimizer.params.adam_lr = 0.001 is not supported yet",
        ),
        ("", {"optimizer": {"type": "Muon", "params": {"ns_method": "svd"}}}, 'ns_method must be "gram" or'),
        ("", {"optimizer": {"type": "Adam", "params": {"momentum": 0.9}}}, "unknown key 'momentum'"),
        ("", {"optimizer": {"type": "Lion"}}, "use Adam, AdamW or Muon"),
        ("--optimizer adam", {"optimizer": {"type": "Muon"}}, "--optimizer"),
        (
            "--optimizer muon --zero-stage 2",
            {"zero_optimization": {"stage": 2, "offload_optimizer": {"device": "cpu"}, "zenflow": {"topk_ratio": 0.1}}},
            "--optimizer muon with zero_optimization.zenflow is not supported",
        ),
        (
            "--bf16",
            {"optimizer": {"type": "Muon"}, "bf16": {"enabled": True, "bf16_optimizer_states": True}},
            "Muon keeps its momentum in fp32",
        ),
    ],
)
def test_bad_muon_settings_are_one_line(tmp_path, line, ds, words):
    message = _error(lambda: _config(line, ds, tmp_path))
    assert words in message, message
