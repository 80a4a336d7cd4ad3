"""The FLOP count behind TFLOP/s and MFU: a training step is 3 forwards, 4 with full recomputation
(Megatron's older convention). The count itself against torch's FlopCounterMode over a real forward
and backward is tests/test_references.py's."""
from megazero.flops import forward_flops_per_token, step_flops
from megazero.models.config import GPTConfig


def test_step_counts_backward_and_recompute():
    cfg = GPTConfig(vocab_size=128, hidden_size=64, num_layers=2, num_attention_heads=4, seq_length=16)
    assert step_flops(cfg, 10) == 3 * 10 * forward_flops_per_token(cfg)
    cfg.recompute_activations = True
    assert step_flops(cfg, 10) == 4 * 10 * forward_flops_per_token(cfg)
