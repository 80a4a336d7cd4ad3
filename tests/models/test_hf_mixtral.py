"""The Mixtral mapping (models/hf_mixtral.py through models/hf_adapter.py) against transformers'
MixtralForCausalLM: a megazero MoE GPT exported gives the same logits (fp32, 1e-5) and the same
greedy continuation, imports back to the same parameters, and a model Mixtral cannot express is refused naming the option."""

from __future__ import annotations

import pytest
import torch

from megazero.models.config import GPTConfig
from tests.models.transformers_checks import assert_same_logits_and_greedy_tokens
from megazero.models.gpt import GPT, initial_value
from megazero.models.hf_adapter import ConversionError, choose_format, from_hf, gpt_config, hf_config, to_hf

transformers = pytest.importorskip("transformers")


def mixtral_like(**extra) -> GPTConfig:
    base = dict(
        vocab_size=61,
        hidden_size=32,
        num_layers=2,
        num_attention_heads=4,
        num_query_groups=2,
        seq_length=16,
        position_embedding="rope",
        rotary_base=1e6,
        activation="swiglu",
        normalization="rmsnorm",
        norm_epsilon=1e-5,
        tie_embeddings=False,
        add_bias_linear=False,
        hidden_dropout=0.0,
        attention_dropout=0.0,
        num_experts=4,
        moe_router_topk=2,
        moe_ffn_hidden_size=24,
        ffn_hidden_size=24,
        init_method_std=0.2,
    )
    return GPTConfig(**{**base, **extra})


def test_export_matches_transformers_logits_and_imports_back():
    cfg = mixtral_like()
    model = GPT(cfg).eval()
    for name, p in model.named_parameters():
        p.data = initial_value(cfg, name, p.shape, 3)
    params = dict(model.named_parameters())
    assert choose_format(cfg) == "mixtral"
    state = to_hf(cfg, "auto", lambda n: params[n].detach())
    hf = hf_config(cfg, "mixtral")
    keys = {k: v for k, v in hf.items() if k not in ("architectures", "model_type", "torch_dtype")}
    theirs = transformers.MixtralForCausalLM(transformers.MixtralConfig(**keys, attn_implementation="eager")).eval()
    loaded = theirs.load_state_dict(state, strict=True)
    assert not loaded.missing_keys and not loaded.unexpected_keys
    tokens = torch.randint(0, cfg.vocab_size, (2, 16), generator=torch.Generator().manual_seed(0))
    assert_same_logits_and_greedy_tokens(model, theirs, tokens)
    back = from_hf(gpt_config(hf), "mixtral", state)
    assert gpt_config(hf).num_experts == 4 and gpt_config(hf).moe_ffn_hidden_size == 24
    for name, value in back.items():
        assert torch.equal(value, params[name].detach()), name
    # the hub's Mixtral files: block_sparse_moe.gate and experts.{j}.w1 (gate), w3 (up), w2 (down)
    old = {
        k.replace(".mlp.gate.", ".block_sparse_moe.gate."): v
        for k, v in state.items()
        if ".mlp." not in k or ".mlp.gate." in k
    }
    for i in range(cfg.num_layers):
        prefix = f"model.layers.{i}."
        for j, (both, down) in enumerate(
            zip(state[f"{prefix}mlp.experts.gate_up_proj"], state[f"{prefix}mlp.experts.down_proj"])
        ):
            gate, up = both.chunk(2)
            old.update(
                {
                    f"{prefix}block_sparse_moe.experts.{j}.{w}.weight": t
                    for w, t in (("w1", gate), ("w3", up), ("w2", down))
                }
            )
    for name, value in from_hf(gpt_config(hf), "mixtral", old).items():
        assert torch.equal(value, params[name].detach()), name


@pytest.mark.parametrize(
    "extra, words",
    [
        (dict(moe_shared_expert_intermediate_size=8), "--moe-shared-expert-intermediate-size"),
        (dict(moe_router_pre_softmax=True), "--moe-router-pre-softmax"),
        (dict(moe_layer_freq=2), "--moe-layer-freq 2"),
        (dict(moe_expert_capacity_factor=1.0), "dropless"),
    ],
)
def test_what_mixtral_lacks_is_refused(extra, words):
    with pytest.raises(ConversionError) as err:
        choose_format(mixtral_like(**extra), "mixtral")
    assert words in str(err.value)


def test_dense_formats_refuse_experts():
    with pytest.raises(ConversionError) as err:
        choose_format(mixtral_like(), "llama")
    assert "--num-experts 4" in str(err.value) and "--format mixtral" in str(err.value)
