"""The mixture-of-experts flags (megazero/config/moe_flags.py): Megatron-LM's names reach GPTConfig,
Megatron-DeepSpeed's aliases mean the same, and each bad combination is one line before any group."""

from __future__ import annotations

import pytest

from megazero.config.flags import parse_args
from megazero.config.train_flags import config_from_args
from megazero.core.errors import UsageError


def _config(line: str, world: int = 4):
    return config_from_args(parse_args((line + " --mock-data").split()), world_size=world, cuda_available=False)


def test_megatron_flags_reach_the_model_and_the_layout():
    cfg = _config(
        "--num-experts 8 --moe-router-topk 2 --moe-ffn-hidden-size 96 --moe-aux-loss-coeff 0.01 "
        "--moe-z-loss-coeff 0.001 --moe-router-score-function sigmoid --moe-router-enable-expert-bias "
        "--moe-router-topk-scaling-factor 2.5 --moe-router-dtype fp32 --moe-layer-freq ([1]*1+[0]*1)*2 "
        "--moe-shared-expert-intermediate-size 64 --moe-shared-expert-gate --moe-grouped-gemm "
        "--expert-model-parallel-size 4 --add-qkv-bias --disable-bias-linear "
        "--moe-token-dispatcher-type allgather"
    )
    m = cfg.model
    assert (m.num_experts, m.moe_router_topk, m.moe_ffn_hidden_size, m.moe_layer_freq) == (8, 2, 96, [1, 0, 1, 0])
    assert (m.moe_aux_loss_coeff, m.moe_z_loss_coeff, m.moe_router_topk_scaling_factor) == (0.01, 0.001, 2.5)
    assert m.moe_router_enable_expert_bias and m.moe_grouped_gemm and m.moe_router_dtype == "fp32"
    assert m.moe_shared_expert_gate and m.add_qkv_bias and not m.add_bias_linear
    assert (cfg.parallel.expert_parallel, cfg.parallel.moe_dispatcher) == (4, "allgather")


def test_megatron_deepspeed_aliases():
    cfg = _config(
        "--num-experts 4 --topk 1 --moe-train-capacity-factor 1.5 --moe-loss-coeff 0.1 --moe-expert-parallel-size 2"
    )
    m = cfg.model
    assert (m.moe_router_topk, m.moe_expert_capacity_factor, m.moe_aux_loss_coeff) == (1, 1.5, 0.1)
    assert cfg.parallel.expert_parallel == 2


@pytest.mark.parametrize(
    "line, words",
    [
        (
            "--num-experts 3 --expert-model-parallel-size 2",
            "--num-experts 3 is not divisible by --expert-model-parallel-size 2",
        ),
        (
            "--num-experts 4 --expert-model-parallel-size 3",
            "--expert-model-parallel-size 3 must divide the data-parallel",
        ),
        ("--num-experts 4 --moe-router-topk 5", "--moe-router-topk 5 must be between 1 and --num-experts 4"),
        ("--num-experts 4 --topk 3 --moe-router-topk 2", "--topk 3 contradicts --moe-router-topk 2"),
        ("--expert-model-parallel-size 2", "--expert-model-parallel-size needs --num-experts N"),
        ("--moe-router-topk 2", "--moe-router-topk needs --num-experts N"),
        ("--moe-shared-expert-gate", "--moe-shared-expert-gate needs --num-experts N"),
        ("--num-experts 4 --moe-shared-expert-gate", "it needs --moe-shared-expert-intermediate-size N"),
        ("--num-experts 4 --moe-pad-expert-input-to-capacity", "needs --moe-expert-capacity-factor"),
        ("--num-experts 4 --moe-router-pre-softmax --moe-router-score-function sigmoid", "--moe-router-pre-softmax"),
        ("--num-experts 4 --moe-layer-freq [1,0]", "one 0 (dense) or 1 (MoE) per layer: 4 entries"),
        ("--num-experts 4 --moe-layer-freq __import__('os')", "--moe-layer-freq"),
        ("--num-experts 4 --moe-layer-freq [1]*9999999999999999999", "counts up to 9999999999999999999, beyond any"),
        (
            "--num-experts 4 --tensor-model-parallel-size 4 --expert-tensor-parallel-size 2",
            "--expert-tensor-parallel-size 2 must be 1 or --tensor-model-parallel-size 4",
        ),
        (
            "--num-experts 8 --tensor-model-parallel-size 2 --expert-tensor-parallel-size 1 --expert-model-parallel-size 8",
            "--expert-model-parallel-size 8 must divide tensor-parallel x data-parallel x context-parallel size 4",
        ),
        (
            "--num-experts 4 --tensor-model-parallel-size 2 --expert-tensor-parallel-size 1 --moe-expert-capacity-factor 1",
            "--expert-tensor-parallel-size 1 splits each sequence's tokens over the tensor-parallel ranks",
        ),
        (
            "--num-experts 4 --tensor-model-parallel-size 2 --expert-tensor-parallel-size 1 --seq-length 15 "
            "--max-position-embeddings 16",
            "--seq-length 15 / cp 1 must be divisible by --tensor-model-parallel-size 2",
        ),
        (
            "--num-experts 4 --moe-expert-capacity-factor 1 --context-parallel-size 2 --attention-dropout 0",
            "--moe-expert-capacity-factor counts each sequence's tokens",
        ),
    ],
)
def test_bad_combinations_are_one_line(line, words):
    with pytest.raises(UsageError) as err:
        _config(line)
    assert words in str(err.value) and "\n" not in str(err.value)


def test_whole_experts_fold_the_tensor_parallel_ranks():
    cfg = _config(
        "--num-experts 4 --tensor-model-parallel-size 2 --expert-tensor-parallel-size 1 --expert-model-parallel-size 4"
    )
    assert (cfg.parallel.expert_tensor_parallel, cfg.parallel.expert_parallel) == (1, 4)
    assert _config("--num-experts 4 --tensor-model-parallel-size 2").parallel.expert_tensor_parallel == 2


@pytest.mark.parametrize(
    "line, mics, words",
    [
        ("--expert-model-parallel-size 2", 4, None),
        ("--expert-model-parallel-size 4", 2, None),
        (
            "--expert-model-parallel-size 3 --num-experts 6",
            4,
            "mics_shard_size 4 and --expert-model-parallel-size 3: one must divide the other",
        ),
        (
            "--tensor-model-parallel-size 2 --expert-tensor-parallel-size 1 --expert-model-parallel-size 2",
            2,
            "MiCS shard groups (mics_shard_size) with --expert-tensor-parallel-size 1",
        ),
    ],
)
def test_mics_with_expert_parallelism(tmp_path, line, mics, words):
    path = tmp_path / "zero.json"
    path.write_text(f'{{"zero_optimization": {{"stage": 3, "mics_shard_size": {mics}}}}}')
    world = 12 if "size 3" in line else 8
    line = (
        f"--num-experts 4 {line} --zero-config {path}"
        if "--num-experts" not in line
        else f"{line} --zero-config {path}"
    )
    if words is None:
        assert _config(line, world).parallel.expert_parallel > 1
        return
    with pytest.raises(UsageError) as err:
        _config(line, world)
    assert words in str(err.value) and "\n" not in str(err.value)
