"""The FLOP count behind TFLOP/s and MFU: torch's own counter of the forward's matmuls (FlopCounterMode)
plus the attention matmuls counted by hand (the CPU SDPA kernel is not seen by the counter) must give
megazero.flops' number; a training step is 3 forwards, 4 with full recomputation."""
import pytest
import torch
from torch.utils.flop_counter import FlopCounterMode

from megazero.flops import forward_flops_per_token, step_flops
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
