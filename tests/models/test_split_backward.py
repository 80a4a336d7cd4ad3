"""models/split_backward.py with the layers that defer their weight gradients (weight_grad.py's
linear, embedding, bias and norms, loss.py's output layer, moe.py's experts and router): a whole
GPT's B then W equals its plain backward (every gradient bitwise, or to 1e-6 where a MoE layer's
input sums its uses' gradients in another order), and B hands no parameter a gradient. Against autograd (the plain backward of the same model), not a second copy of our code.
Planted: a linear's W computed in B (its weight's gradient arrives in B), a norm's gradient never
handed over, and W run with grad mode on (recording a graph that keeps its GEMMs' inputs) all fail.
"""

import pytest
import torch

from megazero.models.config import GPTConfig
from megazero.models.gpt import GPT, initial_value
from megazero.models.split_backward import WeightGradWork, deferring
from megazero.models.weight_grad import linear

VARIANTS = {
    "gpt2": dict(tie_embeddings=True, add_bias_linear=True),
    "llama-moe": dict(
        tie_embeddings=False,
        position_embedding="rope",
        activation="swiglu",
        normalization="rmsnorm",
        apply_layernorm_1p=True,
        num_query_groups=2,
        add_bias_linear=False,
        num_experts=4,
        moe_router_topk=2,
        moe_ffn_hidden_size=24,
        moe_layer_freq=[0, 1],
        moe_aux_loss_coeff=0.01,
        moe_shared_expert_intermediate_size=16,
        moe_shared_expert_gate=True,
    ),
    "recompute": dict(recompute_granularity="full", recompute_method="uniform", recompute_num_layers=1),
}


def _model(extra: dict) -> GPT:
    cfg = GPTConfig(
        vocab_size=29,
        hidden_size=32,
        num_layers=2,
        num_attention_heads=4,
        ffn_hidden_size=48,
        seq_length=10,
        hidden_dropout=0.0,
        attention_dropout=0.0,
        **extra,
    )
    model = GPT(cfg)
    for name, p in model.named_parameters():
        p.data = initial_value(cfg, name, p.shape, 3) + 0.01 * torch.randn(
            p.shape, generator=torch.Generator().manual_seed(len(name))
        )
    return model


def _grads(model) -> dict:
    return {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}


@pytest.mark.parametrize("variant", sorted(VARIANTS))
def test_b_then_w_is_the_plain_backward(variant):
    model = _model(VARIANTS[variant])
    tokens = torch.randint(0, 29, (3, 11), generator=torch.Generator().manual_seed(2))
    model(tokens[:, :-1], tokens[:, 1:]).sum().backward()
    plain = _grads(model)
    model.zero_grad(set_to_none=True)
    arrived = []
    hooks = [
        p.register_post_accumulate_grad_hook(lambda p, n=n: arrived.append(n) if p.grad is not None else None)
        for n, p in model.named_parameters()
    ]
    work = WeightGradWork()
    with deferring(work):
        loss = model(tokens[:, :-1], tokens[:, 1:]).sum()
        loss.backward()
    assert arrived == [], f"B handed these parameters a gradient: {arrived}"
    assert len(work) > 0
    work.run()
    for h in hooks:
        h.remove()
    split = _grads(model)
    assert sorted(split) == sorted(plain)
    for name in plain:
        if variant == "llama-moe":  # the MoE input's three uses add their gradients in another order
            torch.testing.assert_close(split[name], plain[name], rtol=1e-6, atol=1e-6, msg=name)
        else:
            assert torch.equal(split[name], plain[name]), name
    assert sorted(set(arrived)) == sorted(plain), "each parameter's gradient arrives at W"


def test_a_16_bit_weight_deposits_its_fp32_sum_at_w():
    from megazero.models.param_info import param_info, set_param_info

    weight = torch.nn.Parameter(torch.randn(6, 4).bfloat16())
    set_param_info(weight, fp32_grad=True)
    x = torch.randn(5, 4).bfloat16().requires_grad_()
    work = WeightGradWork()
    with deferring(work):
        y = linear(x, weight)
        y.float().sum().backward()
    assert param_info(weight).pending_fp32_grad is None and weight.grad is None
    work.run()
    expected = torch.ones(5, 6).t() @ x.detach().float()
    assert torch.equal(param_info(weight).pending_fp32_grad, expected)
    # W records no graph (x requires grad): one would keep what each W's GEMMs read until the handover
    assert param_info(weight).pending_fp32_grad.grad_fn is None
    assert torch.equal(weight.grad, torch.zeros_like(weight))
    with pytest.raises(RuntimeError, match="already run"):
        work.run()
