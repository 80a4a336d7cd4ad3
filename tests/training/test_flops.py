"""The FLOP count behind TFLOP/s and MFU: torch's own counter of the forward's matmuls (FlopCounterMode)
plus the attention matmuls counted by hand (the CPU SDPA kernel is not seen by the counter) must give
megazero.training.flops' number; a training step is 3 forwards (model FLOPs, what MFU counts); recomputation adds
what it reruns (hardware FLOPs, HFU), counted by hand here for each of Megatron's recompute settings.
The count follows Megatron-LM's current formula (causal attention at half), written out here from
its source; the older full count stays available (causal_at_half=False).
Planted: counting block's layers over the whole model instead of per chunk fails the block cases;
the attention counted in full by default fails the Megatron comparison."""

import pytest
import torch
from torch.utils.flop_counter import FlopCounterMode

from megazero.training.flops import forward_flops_per_token, layer_flops_per_token, recompute_flops, step_flops
from megazero.models.config import GPTConfig
from megazero.models.gpt import GPT
from tests.metrics_reading import metrics_records


@pytest.mark.parametrize("activation,groups", [("gelu", 4), ("swiglu", 2)])
def test_forward_flops_match_torch_counter_plus_attention(activation, groups):
    cfg = GPTConfig(
        vocab_size=100,
        padded_vocab_size=128,
        hidden_size=64,
        num_layers=2,
        num_attention_heads=4,
        num_query_groups=groups,
        ffn_hidden_size=256,
        seq_length=32,
        hidden_dropout=0.0,
        attention_dropout=0.0,
        activation=activation,
    )
    batch, seq = 3, cfg.seq_length
    with FlopCounterMode(display=False) as counter:
        GPT(cfg)(torch.randint(0, 100, (batch, seq)))
    # QK^T and attention x V: 2 matmuls of seq x head_dim per head and token, 2 FLOPs per MAC.
    attention = cfg.num_layers * batch * seq * 2 * 2 * seq * cfg.hidden_size
    assert forward_flops_per_token(cfg, causal_at_half=False) * batch * seq == counter.get_total_flops() + attention
    # Megatron-LM's current count: the causal attention's two matmuls at half
    assert forward_flops_per_token(cfg) * batch * seq == counter.get_total_flops() + attention / 2


def test_step_counts_backward_and_recompute():
    cfg = GPTConfig(vocab_size=128, hidden_size=64, num_layers=2, num_attention_heads=4, seq_length=16)
    assert step_flops(cfg, 10) == 3 * 10 * forward_flops_per_token(cfg)


BASE_FIELDS = dict(
    vocab_size=100,
    padded_vocab_size=128,
    hidden_size=64,
    num_layers=3,
    num_attention_heads=4,
    num_query_groups=2,
    kv_channels=24,
    ffn_hidden_size=96,
    seq_length=32,
    activation="swiglu",
)


def test_wider_heads_and_groups_count_as_written_by_hand():
    """h 64, 4 heads of 24 (--kv-channels), 2 query groups, SwiGLU 96, seq 32, 128 rows, 3 layers."""
    cfg = GPTConfig(**BASE_FIELDS)
    q, k, v, out = 64 * 96, 64 * 48, 64 * 48, 96 * 64  # 96 = 4 heads x 24, 48 = 2 groups x 24
    mlp = 3 * 64 * 96
    attention = 2 * 32 * 96 / 2  # QK^T and AV: seq x head width, all heads; causal: half
    per_layer = 2 * (q + k + v + out + mlp + attention)
    assert forward_flops_per_token(cfg) == 3 * per_layer + 2 * 128 * 64
    assert step_flops(cfg, 7) == 3 * 7 * (3 * per_layer + 2 * 128 * 64)
    # recomputation, by hand: selective reruns the attention matmuls of every layer; full/uniform every
    # layer; full/block the first N layers of each model chunk (chunks of 2 and 1 layers, N = 2: 3 layers)
    cases = {
        ("selective", None, 0): 3 * 2 * attention,
        ("full", "uniform", 2): 3 * per_layer,
        ("full", "block", 1): 2 * per_layer,
        ("full", "block", 2): 3 * per_layer,
    }
    for (granularity, method, n), expected in cases.items():
        cfg = GPTConfig(
            **{
                **BASE_FIELDS,
                "recompute_granularity": granularity,
                "recompute_method": method,
                "recompute_num_layers": n,
            }
        )
        assert recompute_flops(cfg, 7, [2, 1]) == 7 * expected, (granularity, method, n)
    assert recompute_flops(GPTConfig(**BASE_FIELDS), 7, [2, 1]) == 0


def test_log_reports_mfu_from_model_flops_and_hfu_with_recompute(tmp_path, monkeypatch):
    """With a known peak, each record's mfu is model FLOPs / time / peak and hfu counts the recomputed
    FLOPs too (full, block, 1 layer: one of the two layers reruns), in the log line and metrics.jsonl."""
    from tests.layouts import setup_training, small_config, with_padded_vocab
    from megazero import training
    from megazero.training.metrics import MetricsLogger
    from megazero.parallel.process_groups import ProcessGroups
    from megazero.training import loop

    monkeypatch.setattr(loop, "peak_tflops", lambda device: 1e-3)
    cfg = with_padded_vocab(
        small_config(
            steps=2,
            layers=2,
            model_extra={"recompute_granularity": "full", "recompute_method": "block", "recompute_num_layers": 1},
        )
    )
    cfg.log_interval = 1
    state, source = setup_training(cfg, ProcessGroups.single())
    metrics = MetricsLogger(str(tmp_path / "metrics.jsonl"), total_iters=2)
    history = training.train(state, source, None, lambda it, _samples: 1e-3, metrics)
    tokens = cfg.global_batch_size * cfg.model.seq_length
    model, extra = step_flops(cfg.model, tokens), recompute_flops(cfg.model, tokens, [2])
    assert extra == tokens * layer_flops_per_token(cfg.model) > 0
    for record in history:
        elapsed = record["ms_per_iter"] / 1000
        assert record["mfu"] == pytest.approx(model / elapsed / 1e12 / 1e-3, rel=1e-9)
        assert record["hfu"] == pytest.approx((model + extra) / elapsed / 1e12 / 1e-3, rel=1e-9)
    logged = metrics_records(tmp_path / "metrics.jsonl")
    assert all({"mfu", "hfu"} <= set(r) for r in logged)


def megatron_step_flops(batch, seq, h, layers, heads, groups, kv_channels, ffn, swiglu, vocab):
    """Megatron-LM's num_floating_point_operations (megatron/training/training.py, transformer_flops)
    for a dense GPT, written from its source: 3 (forward, wgrad, dgrad) x 2 (FMA) per term; the core
    attention's query width x seq / 2 (causal) x 2 (QK^T and (QK^T)V)."""
    q, kv = kv_channels * heads, kv_channels * groups
    attention = 3 * 2 * (h * (q + 2 * kv) + q * seq / 2 * 2 + q * h)
    mlp = 3 * 2 * h * ffn * (3 if swiglu else 2)
    return batch * seq * ((mlp + attention) * layers + 3 * 2 * h * vocab)


@pytest.mark.parametrize(
    "shape",
    [
        # GPT-3 175B (Megatron's recipe), Llama-3 8B at 8192, and BASE_FIELDS' odd widths
        dict(h=12288, layers=96, heads=96, groups=96, kv_channels=128, ffn=49152, swiglu=False, vocab=51200, seq=2048),
        dict(h=4096, layers=32, heads=32, groups=8, kv_channels=128, ffn=14336, swiglu=True, vocab=128256, seq=8192),
        dict(h=64, layers=3, heads=4, groups=2, kv_channels=24, ffn=96, swiglu=True, vocab=128, seq=32),
    ],
)
def test_step_flops_equal_megatrons_current_count(shape):
    cfg = GPTConfig(
        vocab_size=shape["vocab"],
        padded_vocab_size=shape["vocab"],
        hidden_size=shape["h"],
        num_layers=shape["layers"],
        num_attention_heads=shape["heads"],
        num_query_groups=shape["groups"],
        kv_channels=shape["kv_channels"],
        ffn_hidden_size=shape["ffn"],
        seq_length=shape["seq"],
        activation="swiglu" if shape["swiglu"] else "gelu",
    )
    batch = 5
    expected = megatron_step_flops(batch, **shape)
    assert step_flops(cfg, batch * shape["seq"]) == pytest.approx(expected, rel=1e-12)
    # the older count: the attention's two matmuls in full, more by exactly that half
    half = 3 * batch * shape["seq"] * shape["layers"] * 2 * shape["seq"] * shape["heads"] * shape["kv_channels"]
    assert step_flops(cfg, batch * shape["seq"], causal_at_half=False) == pytest.approx(expected + half, rel=1e-12)
