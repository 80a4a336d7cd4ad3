"""The MoE layer (models/moe.py) against a plain PyTorch mixture of experts written here, token by
token, from the papers' formulas: Switch/GShard routing and auxiliary loss, Mixtral's top-k softmax,
DeepSeek-V3's sigmoid scores and expert bias, DeepSeek-V2's sequence-wise loss, ST-MoE's z-loss,
capacity with dropping. Outputs and every gradient (input, router, experts, shared expert) to 1e-5."""

from __future__ import annotations

import math

import pytest
import torch
import torch.nn.functional as F

from megazero.models.config import GPTConfig
from megazero.models.gpt import GPT, initial_value, shared_expert
from megazero.models.moe import (
    MoELayer,
    balanced_kept,
    expert_capacity,
    grouped_matmul,
    grouped_mm_usable,
    sort_by_expert,
)

H, F_MOE, E, B, S = 16, 8, 4, 3, 6


def moe_config(**extra) -> GPTConfig:
    base = dict(
        vocab_size=31,
        hidden_size=H,
        num_layers=2,
        num_attention_heads=2,
        seq_length=S,
        num_experts=E,
        moe_router_topk=2,
        moe_ffn_hidden_size=F_MOE,
        hidden_dropout=0.0,
        attention_dropout=0.0,
        activation="swiglu",
    )
    return GPTConfig(**{**base, **extra})


def make_layer(cfg: GPTConfig, seed=0) -> MoELayer:
    torch.manual_seed(seed)
    layer = MoELayer(cfg, shared_expert(cfg))
    for name, p in layer.named_parameters():
        # larger than the model's init so that routing and losses are far from uniform
        p.data = initial_value(cfg, "layers.0.mlp." + name, p.shape, seed) * 20
    return layer


def plain_expert(x, w1, w2, swiglu):
    y = x @ w1
    if swiglu:
        gate, up = y.chunk(2, dim=-1)
        y = F.silu(gate) * up
    else:
        y = F.gelu(y, approximate="tanh")
    return y @ w2


def plain_moe(x, cfg: GPTConfig, router_w, w1, w2, shared=None, bias=None):
    """Token by token: (output (b, s, h), aux, z, kept choices per token)."""
    b, s, h = x.shape
    tokens = x.reshape(-1, h)
    e, k = cfg.num_experts, cfg.moe_router_topk
    logits = tokens @ router_w.t()
    choices, weights = [], []
    for t in range(tokens.shape[0]):
        row = logits[t]
        if cfg.moe_router_score_function == "sigmoid":
            score = torch.sigmoid(row)
            pick = torch.argsort(score + (bias if bias is not None else 0), descending=True)[:k]
            w = score[pick]
            w = w / w.sum() if k > 1 else w
        elif cfg.moe_router_pre_softmax:
            p = torch.exp(row - row.max()) / torch.exp(row - row.max()).sum()
            pick = torch.argsort(p, descending=True)[:k]
            w = p[pick]
        else:
            pick = torch.argsort(row, descending=True)[:k]
            w = torch.exp(row[pick] - row[pick].max())
            w = w / w.sum()
        if cfg.moe_router_topk_scaling_factor:
            w = w * cfg.moe_router_topk_scaling_factor
        choices.append(pick.tolist())
        weights.append(w)
    kept = [[True] * k for _ in choices]
    if cfg.moe_expert_capacity_factor is not None:
        cap = math.ceil(s * k * cfg.moe_expert_capacity_factor / e)
        for seq in range(b):
            for ex in range(e):
                rows = [(t, j) for t in range(seq * s, seq * s + s) for j in range(k) if choices[t][j] == ex]
                if cfg.moe_token_drop_policy == "probs":
                    rows.sort(key=lambda tj: -float(weights[tj[0]][tj[1]].detach()))
                for t, j in rows[cap:]:
                    kept[t][j] = False
    outs = []
    for t in range(tokens.shape[0]):
        y = torch.zeros(h)
        for j, ex in enumerate(choices[t]):
            if kept[t][j]:
                y = y + weights[t][j] * plain_expert(tokens[t], w1[ex], w2[ex], cfg.activation == "swiglu")
        if shared is not None:
            y = y + shared(tokens[t])
        outs.append(y)

    # Switch eq. 4 over a token set: E * sum_i (fraction of choices to i) * (mean full score of i)
    def switch(token_ids):
        full = (
            torch.softmax(logits[token_ids], -1)
            if cfg.moe_router_score_function == "softmax"
            else torch.sigmoid(logits[token_ids]) / torch.sigmoid(logits[token_ids]).sum(-1, keepdim=True)
        )
        f = torch.tensor([sum(choices[t].count(i) for t in token_ids) / (k * len(token_ids)) for i in range(e)])
        return e * (f * full.mean(0)).sum()

    if cfg.moe_router_load_balancing_type == "seq_aux_loss":
        aux = sum(switch(list(range(q * s, q * s + s))) for q in range(b)) / b
    else:
        aux = switch(list(range(b * s)))
    z = (torch.logsumexp(logits, -1) ** 2).mean()
    return torch.stack(outs).view(b, s, h), aux, z, kept


def _compare(cfg: GPTConfig, shared=False):
    layer = make_layer(cfg)
    x = torch.randn(B, S, H, generator=torch.Generator().manual_seed(1), requires_grad=True)
    g = torch.randn(B, S, H, generator=torch.Generator().manual_seed(2))
    layer.stats = {}
    y = layer(x)
    ((y * g).sum()).backward()
    params = {n: p.detach().clone().requires_grad_() for n, p in layer.named_parameters()}
    x2 = x.detach().clone().requires_grad_()
    shared_fn = None
    if shared:
        w1, b1 = params["shared_experts.fc1.weight"], params["shared_experts.fc1.bias"]
        w2, b2 = params["shared_experts.fc2.weight"], params["shared_experts.fc2.bias"]

        gate_w = params.get("shared_experts.gate_weight")

        def shared_fn(t):
            gate, up = (w1 @ t + b1).chunk(2)
            out = w2 @ (F.silu(gate) * up) + b2
            # Megatron's --moe-shared-expert-gate, Qwen2-MoE's shared_expert_gate: sigmoid(w . x) scales it
            return out if gate_w is None else out * torch.sigmoid(gate_w[0] @ t)

    ref, aux, z, kept = plain_moe(
        x2,
        cfg,
        params["router.weight"],
        params["experts.weight1"],
        params["experts.weight2"],
        shared_fn,
        layer.router.expert_bias,
    )
    coeff_loss = cfg.moe_aux_loss_coeff * aux + cfg.moe_z_loss_coeff * z
    ((ref * g).sum() + coeff_loss).backward()
    torch.testing.assert_close(y, ref, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(x.grad, x2.grad, rtol=1e-5, atol=1e-5)
    for name, p in layer.named_parameters():
        torch.testing.assert_close(p.grad, params[name].grad, rtol=1e-5, atol=1e-5, msg=name)
    if cfg.moe_aux_loss_coeff:
        torch.testing.assert_close(layer.stats["aux"], aux.detach(), rtol=1e-5, atol=1e-7)
    if cfg.moe_z_loss_coeff:
        torch.testing.assert_close(layer.stats["z"], z.detach(), rtol=1e-5, atol=1e-7)
    dropped = sum(not v for row in kept for v in row)
    assert float(layer.stats.get("dropped", 0)) == dropped
    return layer, dropped


@pytest.mark.parametrize(
    "extra",
    [
        dict(),  # Mixtral: top-2 softmax
        dict(moe_router_pre_softmax=True, moe_router_topk=1, activation="gelu"),  # Switch
        dict(moe_router_score_function="sigmoid", moe_router_topk_scaling_factor=2.5, moe_router_topk=3),
        dict(moe_aux_loss_coeff=0.3, moe_z_loss_coeff=0.02),
        dict(moe_router_load_balancing_type="seq_aux_loss", moe_aux_loss_coeff=0.5),
        dict(moe_router_score_function="sigmoid", moe_aux_loss_coeff=0.3, moe_router_dtype="fp64"),
        dict(moe_grouped_gemm=True, moe_aux_loss_coeff=0.1),
    ],
)
def test_layer_matches_plain_moe(extra):
    _compare(moe_config(**extra))


@pytest.mark.parametrize("gate", [False, True])
def test_shared_expert_matches_plain_moe(gate):
    layer, _ = _compare(moe_config(moe_shared_expert_intermediate_size=12, moe_shared_expert_gate=gate), shared=True)
    assert ("shared_experts.gate_weight" in dict(layer.named_parameters())) == gate


@pytest.mark.parametrize("policy", ["probs", "position"])
@pytest.mark.parametrize("pad", [False, True])
def test_capacity_drops_match_plain_moe(policy, pad):
    _, dropped = _compare(
        moe_config(
            moe_expert_capacity_factor=0.75,
            moe_token_drop_policy=policy,
            moe_pad_expert_input_to_capacity=pad,
            moe_aux_loss_coeff=0.1,
        )
    )
    assert dropped > 0  # the capacity did cut something, so the drop path was exercised


def test_expert_bias_chooses_and_moves_towards_balance():
    cfg = moe_config(
        moe_router_score_function="sigmoid", moe_router_enable_expert_bias=True, moe_router_bias_update_rate=0.5
    )
    layer = make_layer(cfg)
    x = torch.randn(B, S, H, generator=torch.Generator().manual_seed(1))
    layer(x)
    load = torch.tensor([10.0, 2.0, 6.0, 6.0])
    layer.router.update_expert_bias(load)
    assert layer.router.expert_bias.tolist() == [-0.5, 0.5, 0.0, 0.0]
    layer.router.expert_bias = torch.tensor([0.0, 0.0, 0.0, 5.0])  # expert 3 chosen by every token
    y = layer(x.requires_grad_())
    _, indices, _ = layer.router(x.reshape(-1, H), B)
    assert (indices == 3).any(dim=1).all()
    assert torch.isfinite(y).all()


def test_expert_bias_matches_plain_moe():
    cfg = moe_config(moe_router_score_function="sigmoid", moe_router_enable_expert_bias=True)
    layer = make_layer(cfg)
    layer.router.expert_bias = torch.tensor([0.3, -0.2, 0.0, 0.1])
    x = torch.randn(B, S, H, generator=torch.Generator().manual_seed(1))
    params = dict(layer.named_parameters())
    ref, *_ = plain_moe(
        x,
        cfg,
        params["router.weight"],
        params["experts.weight1"],
        params["experts.weight2"],
        bias=layer.router.expert_bias,
    )
    torch.testing.assert_close(layer(x), ref, rtol=1e-5, atol=1e-5)


def test_grouped_gemm_equals_the_loop():
    x = torch.randn(10, 16, requires_grad=True)
    w = torch.randn(3, 16, 8, requires_grad=True)
    counts = torch.tensor([4, 0, 6])
    assert grouped_mm_usable(x, w)
    g = torch.randn(10, 8)
    grouped_matmul(x, w, counts, True).backward(g)
    x2, w2 = x.detach().clone().requires_grad_(), w.detach().clone().requires_grad_()
    loop = grouped_matmul(x2, w2, counts, False)
    loop.backward(g)
    torch.testing.assert_close(grouped_matmul(x, w, counts, True), loop, rtol=1e-6, atol=1e-6)
    torch.testing.assert_close(x.grad, x2.grad, rtol=1e-6, atol=1e-6)
    torch.testing.assert_close(w.grad, w2.grad, rtol=1e-6, atol=1e-6)
    assert not grouped_mm_usable(torch.randn(4, 5), torch.randn(2, 5, 3))  # rows not 16-byte blocks


def test_layer_freq_mixes_dense_and_moe_and_the_gpt_trains():
    cfg = moe_config(num_layers=4, moe_layer_freq=[1, 0, 0, 1], moe_aux_loss_coeff=0.01)
    model = GPT(cfg)
    kinds = [type(layer.mlp).__name__ for layer in model.layers.values()]
    assert kinds == ["MoELayer", "MLP", "MLP", "MoELayer"]
    assert [type(layer.mlp).__name__ for layer in GPT(moe_config(num_layers=4, moe_layer_freq=2)).layers.values()] == [
        "MoELayer",
        "MLP",
        "MoELayer",
        "MLP",
    ]
    for name, p in model.named_parameters():
        p.data = initial_value(cfg, name, p.shape, 0)
    tokens = torch.randint(0, 31, (2, S + 1), generator=torch.Generator().manual_seed(0))
    opt = torch.optim.Adam(model.parameters(), lr=1e-2)
    losses = []
    for _ in range(8):
        loss = model(tokens[:, :-1], tokens[:, 1:]).mean()
        opt.zero_grad()
        loss.backward()
        opt.step()
        losses.append(loss.item())
    assert losses[-1] < losses[0]
    assert model.layers["0"].mlp.experts.weight1.grad.abs().sum() > 0


@pytest.mark.parametrize(
    "extra, words",
    [
        (dict(moe_router_topk=5), "--moe-router-topk 5 must be between 1 and --num-experts 4"),
        (dict(moe_router_pre_softmax=True, moe_router_score_function="sigmoid"), "--moe-router-pre-softmax"),
        (dict(moe_router_enable_expert_bias=True), "add --moe-router-score-function sigmoid"),
        (dict(moe_pad_expert_input_to_capacity=True), "needs --moe-expert-capacity-factor"),
        (dict(moe_expert_capacity_factor=0.0), "--moe-expert-capacity-factor must be > 0"),
        (dict(moe_token_drop_policy="random"), "--moe-token-drop-policy 'random'"),
        (dict(moe_router_load_balancing_type="sinkhorn"), "--moe-router-load-balancing-type 'sinkhorn'"),
        (dict(moe_layer_freq=[1, 0, 1]), "one 0 (dense) or 1 (MoE) per layer: 2 entries"),
        (dict(moe_layer_freq=0), "--moe-layer-freq 0 must be >= 1"),
        (dict(moe_router_dtype="bf16"), "--moe-router-dtype 'bf16'"),
        (dict(moe_aux_loss_coeff=-1.0), "--moe-aux-loss-coeff must be >= 0"),
    ],
)
def test_bad_moe_settings_are_one_line(extra, words):
    with pytest.raises(ValueError) as err:
        moe_config(**extra)
    assert words in str(err.value) and "\n" not in str(err.value)


def test_capacity_rows_have_fixed_shapes_padded_and_one_host_count_unpadded():
    """The sort by expert on meta tensors (no values, as in the dry run): padded to the capacity
    every shape is fixed and nothing is read; without padding the rows kept are the one count the
    host reads (the dispatcher's read, answered there with the balanced count)."""
    t, k = B * S, 2
    indices = torch.empty(t, k, dtype=torch.long, device="meta")
    keep = torch.empty(t, k, dtype=torch.bool, device="meta")
    capacity = expert_capacity(S, k, 0.5, E)
    slots, counts = sort_by_expert(indices, keep, E, pad_to=B * capacity, read_kept=None)
    assert slots.shape == (E * B * capacity,) and counts.shape == (E,)
    reads = []
    slots, counts = sort_by_expert(indices, keep, E, read_kept=lambda n: reads.append(n.shape) or 7)
    assert reads == [()] and slots.shape == (7,) and counts.shape == (E,)
    # balanced: S x k = 12 choices a sequence, 3 an expert; a capacity of 2 keeps 2 of them
    assert capacity == 2 and balanced_kept(B, S, k, E, capacity) == B * E * 2
    assert balanced_kept(B, S, k, E, expert_capacity(S, k, 1.0, E)) == B * S * k
