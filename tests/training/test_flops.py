"""The FLOP count behind TFLOP/s and MFU: torch's own counter of the forward's matmuls (FlopCounterMode)
plus the attention matmuls counted by hand (the CPU SDPA kernel is not seen by the counter) must give
megazero.training.flops' number; a training step is 3 forwards (model FLOPs, what MFU counts); recomputation adds
what it reruns (hardware FLOPs, HFU), counted by hand here for each of Megatron's recompute settings.
Planted: counting block's layers over the whole model instead of per chunk fails the block cases."""
import pytest
import torch
from torch.utils.flop_counter import FlopCounterMode

from megazero.training.flops import forward_flops_per_token, layer_flops_per_token, recompute_flops, step_flops
from megazero.models.config import GPTConfig
from megazero.models.gpt import GPT


@pytest.mark.parametrize("activation,groups", [("gelu", 4), ("swiglu", 2)])
def test_forward_flops_match_torch_counter_plus_attention(activation, groups):
    cfg = GPTConfig(vocab_size=100, padded_vocab_size=128, hidden_size=64, num_layers=2,
                    num_attention_heads=4, num_query_groups=groups, ffn_hidden_size=256, seq_length=32,
                    hidden_dropout=0.0, attention_dropout=0.0, activation=activation)
    batch, seq = 3, cfg.seq_length
    with FlopCounterMode(display=False) as counter:
        GPT(cfg)(torch.randint(0, 100, (batch, seq)))
    # QK^T and attention x V: 2 matmuls of seq x head_dim per head and token, 2 FLOPs per MAC.
    attention = cfg.num_layers * batch * seq * 2 * 2 * seq * cfg.hidden_size
    assert forward_flops_per_token(cfg) * batch * seq == counter.get_total_flops() + attention


def test_step_counts_backward_and_recompute():
    cfg = GPTConfig(vocab_size=128, hidden_size=64, num_layers=2, num_attention_heads=4, seq_length=16)
    assert step_flops(cfg, 10) == 3 * 10 * forward_flops_per_token(cfg)


BASE_FIELDS = dict(vocab_size=100, padded_vocab_size=128, hidden_size=64, num_layers=3, num_attention_heads=4,
                   num_query_groups=2, kv_channels=24, ffn_hidden_size=96, seq_length=32, activation="swiglu")


def test_wider_heads_and_groups_count_as_written_by_hand():
    """h 64, 4 heads of 24 (--kv-channels), 2 query groups, SwiGLU 96, seq 32, 128 rows, 3 layers."""
    cfg = GPTConfig(**BASE_FIELDS)
    q, k, v, out = 64 * 96, 64 * 48, 64 * 48, 96 * 64          # 96 = 4 heads x 24, 48 = 2 groups x 24
    mlp = 3 * 64 * 96
    attention = 2 * 32 * 96                                     # QK^T and AV: seq x head width, all heads
    per_layer = 2 * (q + k + v + out + mlp + attention)
    assert forward_flops_per_token(cfg) == 3 * per_layer + 2 * 128 * 64
    assert step_flops(cfg, 7) == 3 * 7 * (3 * per_layer + 2 * 128 * 64)
    # recomputation, by hand: selective reruns the attention matmuls of every layer; full/uniform every
    # layer; full/block the first N layers of each model chunk (chunks of 2 and 1 layers, N = 2: 3 layers)
    cases = {("selective", None, 0): 3 * 2 * attention, ("full", "uniform", 2): 3 * per_layer,
             ("full", "block", 1): 2 * per_layer, ("full", "block", 2): 3 * per_layer}
    for (granularity, method, n), expected in cases.items():
        cfg = GPTConfig(**{**BASE_FIELDS, "recompute_granularity": granularity, "recompute_method": method,
                           "recompute_num_layers": n})
        assert recompute_flops(cfg, 7, [2, 1]) == 7 * expected, (granularity, method, n)
    assert recompute_flops(GPTConfig(**BASE_FIELDS), 7, [2, 1]) == 0


def test_log_reports_mfu_from_model_flops_and_hfu_with_recompute(tmp_path, monkeypatch):
    """With a known peak, each record's mfu is model FLOPs / time / peak and hfu counts the recomputed
    FLOPs too (full, block, 1 layer: one of the two layers reruns), in the log line and metrics.jsonl."""
    import json

    from tests.layouts import small_config, with_padded_vocab
    from megazero import training
    from megazero.data.sampler import MicrobatchSource
    from megazero.data.synthetic import ArithmeticTokens
    from megazero.training.metrics import MetricsLogger
    from megazero.parallel.process_groups import ProcessGroups
    from megazero.training import loop
    monkeypatch.setattr(loop, "peak_tflops", lambda device: 1e-3)
    cfg = with_padded_vocab(small_config(steps=2, layers=2, model_extra={
        "recompute_granularity": "full", "recompute_method": "block", "recompute_num_layers": 1}))
    cfg.log_interval = 1
    state = training.setup(cfg, ProcessGroups.single())
    source = MicrobatchSource(ArithmeticTokens(cfg.model.vocab_size, cfg.model.seq_length, seed=3),
                                       cfg.global_batch_size, cfg.micro_batch_size, 0, 1)
    metrics = MetricsLogger(str(tmp_path / "metrics.jsonl"), total_iters=2)
    history = training.train(state, source, None, lambda it, _samples: 1e-3, metrics)
    tokens = cfg.global_batch_size * cfg.model.seq_length
    model, extra = step_flops(cfg.model, tokens), recompute_flops(cfg.model, tokens, [2])
    assert extra == tokens * layer_flops_per_token(cfg.model) > 0
    for record in history:
        elapsed = record["ms_per_iter"] / 1000
        assert record["mfu"] == pytest.approx(model / elapsed / 1e12 / 1e-3, rel=1e-9)
        assert record["hfu"] == pytest.approx((model + extra) / elapsed / 1e12 / 1e-3, rel=1e-9)
    logged = [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    assert all({"mfu", "hfu"} <= set(r) for r in logged)
