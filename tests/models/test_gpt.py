"""models/gpt.py's own modules: zero-centred norms equal the plain norm with weight + 1 (planted:
`+ 1` dropped fails), and a zero-centred scale starts at 0; selective recomputation gives the same
loss and gradients as none, and recomputes the core attention only.
"""

import pytest
import torch
from torch import nn

from megazero.models.config import GPTConfig
from megazero.models.gpt import GPT, CoreAttention, ZeroCenteredLayerNorm, ZeroCenteredRMSNorm, initial_value


@pytest.mark.parametrize("kind", ["layernorm", "rmsnorm"])
def test_zero_centred_norm_is_the_norm_with_weight_plus_one(kind):
    x = torch.randn(3, 5, 16)
    weight = torch.randn(16) * 0.1
    one_p = ZeroCenteredLayerNorm(16) if kind == "layernorm" else ZeroCenteredRMSNorm(16)
    plain = nn.LayerNorm(16) if kind == "layernorm" else nn.RMSNorm(16)
    with torch.no_grad():
        one_p.weight.copy_(weight)
        plain.weight.copy_(weight + 1)
        if kind == "layernorm":
            one_p.bias.normal_()
            plain.bias.copy_(one_p.bias)
    assert torch.equal(one_p(x), plain(x))
    cfg = GPTConfig(vocab_size=11, hidden_size=16, num_attention_heads=2, apply_layernorm_1p=True)
    assert torch.equal(initial_value(cfg, "layers.0.input_norm.weight", (16,), 0), torch.zeros(16)), (
        "a zero-centred scale starts at 0 (the norm multiplies by 1)"
    )


def test_selective_recomputation_equals_none_and_reruns_the_core_only():
    base = dict(
        vocab_size=29,
        hidden_size=32,
        num_layers=2,
        num_attention_heads=4,
        num_query_groups=2,
        seq_length=10,
        hidden_dropout=0.0,
        attention_dropout=0.0,
        position_embedding="rope",
    )
    models = [GPT(GPTConfig(**base, recompute_granularity=g)) for g in ("none", "selective")]
    for name, p in models[0].named_parameters():
        p.data = initial_value(models[0].config, name, p.shape, 3) + 0.01 * torch.randn(p.shape)
    models[1].load_state_dict(models[0].state_dict())
    tokens = torch.randint(0, 29, (3, 11), generator=torch.Generator().manual_seed(2))
    calls = []
    hook = nn.modules.module.register_module_forward_pre_hook(
        lambda m, a: calls.append(type(m).__name__) if isinstance(m, CoreAttention) else None
    )
    try:
        losses = []
        for model in models:
            calls.clear()
            loss = model(tokens[:, :-1], tokens[:, 1:]).sum()
            loss.backward()
            losses.append((loss.detach(), calls.count("CoreAttention")))
    finally:
        hook.remove()
    assert torch.equal(losses[0][0], losses[1][0])
    assert (losses[0][1], losses[1][1]) == (2, 4), "selective: each layer's core runs again in backward"
    for (name, a), b in zip(models[0].named_parameters(), models[1].parameters()):
        assert torch.equal(a.grad, b.grad), name
