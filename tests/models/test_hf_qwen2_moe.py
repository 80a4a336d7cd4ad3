"""The Qwen2-MoE mapping (models/hf_qwen2_moe.py through models/hf_adapter.py) against transformers'
Qwen2MoeForCausalLM, built from its config with random weights: a megazero MoE GPT with a gated
shared expert, q/k/v biases and a dense layer among the sparse ones exported gives the same logits
(fp32, 1e-5) and the same greedy continuation, and imports back bit for bit; a model transformers
made (its sparse-step rule, no top-k renormalisation) imported gives its logits, from its fused
expert tensors or the hub's one-by-one ones; what Qwen2-MoE cannot express is refused naming the option."""

from __future__ import annotations

import pytest
import torch

from megazero.models.config import GPTConfig
from tests.models.transformers_checks import assert_same_logits_and_greedy_tokens
from megazero.models.gpt import GPT, initial_value
from megazero.models.hf_adapter import ConversionError, choose_format, from_hf, gpt_config, hf_config, to_hf

transformers = pytest.importorskip("transformers")
TOKENS = torch.randint(0, 61, (2, 16), generator=torch.Generator().manual_seed(0))


def qwen_like(**extra) -> GPTConfig:
    base = dict(
        vocab_size=61,
        hidden_size=32,
        num_layers=3,
        num_attention_heads=4,
        num_query_groups=2,
        seq_length=16,
        position_embedding="rope",
        rotary_base=1e6,
        activation="swiglu",
        normalization="rmsnorm",
        norm_epsilon=1e-6,
        tie_embeddings=False,
        add_bias_linear=False,
        add_qkv_bias=True,
        hidden_dropout=0.0,
        attention_dropout=0.0,
        num_experts=4,
        moe_router_topk=2,
        moe_ffn_hidden_size=24,
        ffn_hidden_size=40,
        moe_shared_expert_intermediate_size=48,
        moe_shared_expert_gate=True,
        moe_layer_freq=[1, 0, 1],
        init_method_std=0.2,
    )
    return GPTConfig(**{**base, **extra})


def _theirs(hf: dict, state=None):
    keys = {k: v for k, v in hf.items() if k not in ("architectures", "model_type", "torch_dtype")}
    model = transformers.Qwen2MoeForCausalLM(transformers.Qwen2MoeConfig(**keys, attn_implementation="eager"))
    if state is not None:
        loaded = model.load_state_dict(state, strict=True)
        assert not loaded.missing_keys and not loaded.unexpected_keys
    return model.eval()


@pytest.mark.parametrize("extra", [dict(), dict(moe_router_pre_softmax=True, moe_layer_freq=1)])
def test_export_matches_transformers_logits_and_generate_and_imports_back(extra):
    """(Planted: the gate's sigmoid left out, or the gate not applied, fail the logits by more than 2.)"""
    cfg = qwen_like(**extra)
    model = GPT(cfg).eval()
    for name, p in model.named_parameters():
        p.data = initial_value(cfg, name, p.shape, 3)
        if name.endswith(("qkv.bias", "norm.weight")):  # zero / one at init: random so none maps by luck
            p.data = torch.randn(p.shape, generator=torch.Generator().manual_seed(len(name))) * 0.2 + (
                1.0 if "norm" in name else 0.0
            )
    params = dict(model.named_parameters())
    assert choose_format(cfg) == "qwen2_moe"
    state = to_hf(cfg, "auto", lambda n: params[n].detach())
    hf = hf_config(cfg, "qwen2_moe")
    theirs = _theirs(hf, state)
    assert [type(layer.mlp).__name__ for layer in theirs.model.layers] == [
        "Qwen2MoeSparseMoeBlock" if cfg.is_moe_layer(i) else "Qwen2MoeMLP" for i in range(3)
    ]
    assert_same_logits_and_greedy_tokens(model, theirs, TOKENS)
    back_cfg = gpt_config(hf)
    assert (back_cfg.moe_layer_freq, back_cfg.moe_router_pre_softmax, back_cfg.add_qkv_bias) == (
        cfg.moe_layer_freq,
        cfg.moe_router_pre_softmax,
        True,
    )
    back = from_hf(back_cfg, "qwen2_moe", state)
    assert back.keys() == params.keys()
    for name, value in back.items():
        assert torch.equal(value, params[name].detach()), name


def test_transformers_model_imported_gives_its_logits():
    """Their rule for sparse layers ((i + 1) % decoder_sparse_step, less mlp_only_layers) and their
    default norm_topk_prob=False (megazero's pre-softmax), with weights they initialised, perturbed."""
    hf = dict(
        vocab_size=61,
        hidden_size=32,
        intermediate_size=40,
        num_hidden_layers=4,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=16,
        num_experts=4,
        num_experts_per_tok=2,
        moe_intermediate_size=24,
        shared_expert_intermediate_size=48,
        decoder_sparse_step=2,
        mlp_only_layers=[3],
        model_type="qwen2_moe",
    )
    theirs = _theirs(hf)
    generator = torch.Generator().manual_seed(1)
    with torch.no_grad():
        for p in theirs.parameters():
            p.add_(torch.randn(p.shape, generator=generator) * 0.2)
    cfg = gpt_config({**theirs.config.to_dict(), "model_type": "qwen2_moe"})
    assert cfg.moe_layer_freq == [0, 1, 0, 0] and cfg.moe_router_pre_softmax
    model = GPT(cfg).eval()
    fused = dict(theirs.state_dict())
    params = from_hf(cfg, "qwen2_moe", fused)
    model.load_state_dict(params, strict=True)
    with torch.no_grad():
        torch.testing.assert_close(model(TOKENS), theirs(TOKENS).logits, rtol=1e-5, atol=1e-5)
    # the hub's files (transformers 4) keep experts one by one: mlp.experts.{j}.gate_proj/up_proj/down_proj
    per_expert = {k: v for k, v in fused.items() if ".mlp.experts." not in k}
    for name in [k for k in fused if k.endswith("experts.gate_up_proj")]:
        prefix = name[: -len("gate_up_proj")]
        for j, (both, down) in enumerate(zip(fused[name], fused[prefix + "down_proj"])):
            gate, up = both.chunk(2)
            per_expert.update(
                {
                    f"{prefix}{j}.gate_proj.weight": gate,
                    f"{prefix}{j}.up_proj.weight": up,
                    f"{prefix}{j}.down_proj.weight": down,
                }
            )
    for name, value in from_hf(cfg, "qwen2_moe", per_expert).items():
        assert torch.equal(value, params[name]), name


@pytest.mark.parametrize(
    "extra, words",
    [
        (dict(moe_shared_expert_gate=False), "--moe-shared-expert-gate missing"),
        (dict(moe_shared_expert_gate=False, moe_shared_expert_intermediate_size=0), "no shared expert"),
        (dict(moe_router_score_function="sigmoid"), "--moe-router-score-function sigmoid"),
        (dict(moe_expert_capacity_factor=1.0), "dropless"),
        (dict(add_bias_linear=True), "--add-qkv-bias"),
    ],
)
def test_what_qwen2_moe_lacks_is_refused(extra, words):
    with pytest.raises(ConversionError) as err:
        choose_format(qwen_like(**extra), "qwen2_moe")
    assert words in str(err.value)


def test_qkv_bias_alone_is_refused_by_llama_and_mixtral():
    with pytest.raises(ConversionError) as err:
        choose_format(
            qwen_like(moe_shared_expert_intermediate_size=0, moe_shared_expert_gate=False, moe_layer_freq=1), "mixtral"
        )
    assert "--add-qkv-bias without the other linear biases" in str(err.value)
    assert choose_format(qwen_like(moe_router_pre_softmax=True)) == "qwen2_moe"


def test_sliding_window_is_refused_on_import():
    with pytest.raises(ConversionError, match="use_sliding_window"):
        gpt_config({"model_type": "qwen2_moe", "use_sliding_window": True})
