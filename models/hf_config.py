"""The config.json side of the Hugging Face mapping (models/hf_adapter.py): which GPTConfig a
Hugging Face `config.json` describes, and the config.json of a GPTConfig, for every format
(GPT2LMHeadModel, LlamaForCausalLM, and through models/hf_mixtral.py and models/hf_qwen2_moe.py the
mixtures of experts). Options megazero cannot match exactly are refused with a ConversionError naming
the key; which megazero options a format can express is hf_adapter's choose_format.
"""

from __future__ import annotations

from .config import GPTConfig
from .hf_mixtral import MIXTRAL
from .hf_qwen2_moe import QWEN2_MOE

FORMATS = ("gpt2", "llama", "mixtral", "qwen2_moe")
ARCHITECTURE = {
    "gpt2": "GPT2LMHeadModel",
    "llama": "LlamaForCausalLM",
    "mixtral": "MixtralForCausalLM",
    "qwen2_moe": "Qwen2MoeForCausalLM",
}
MOE_FORMATS = {"mixtral": MIXTRAL, "qwen2_moe": QWEN2_MOE}  # Llama's attention with experts
# GPT-2 activation names (transformers' ACT2FN) -> F.gelu's `approximate`; all compute one of the two.
GPT2_GELU = {"gelu_new": "tanh", "gelu_pytorch_tanh": "tanh", "gelu_fast": "tanh", "gelu": "none"}
GPT2_GELU_EXPORT = {"tanh": "gelu_new", "none": "gelu"}


class ConversionError(ValueError):
    """A model or config one side cannot express exactly; the message names the option."""


def hf_config(config: GPTConfig, fmt: str, special_ids: dict | None = None) -> dict:
    """The config.json of `config` (already checked by choose_format) in format `fmt`; `special_ids`
    (bos_token_id, eos_token_id, pad_token_id) are the exported tokenizer's."""
    ids = special_ids or {}
    common = {
        "architectures": [ARCHITECTURE[fmt]],
        "model_type": fmt,
        "vocab_size": config.vocab_size,
        "initializer_range": config.init_method_std,
        "tie_word_embeddings": config.tie_embeddings,
        "torch_dtype": "float32",
        "use_cache": True,
        **{key: ids.get(key) for key in ("bos_token_id", "eos_token_id", "pad_token_id")},
    }
    if fmt == "gpt2":
        return {
            **common,
            "n_positions": config.max_position_embeddings,
            "n_embd": config.hidden_size,
            "n_layer": config.num_layers,
            "n_head": config.num_attention_heads,
            "n_inner": config.ffn_hidden_size,
            "activation_function": GPT2_GELU_EXPORT[config.gelu_approximate],
            "resid_pdrop": config.hidden_dropout,
            "embd_pdrop": config.hidden_dropout,
            "attn_pdrop": config.attention_dropout,
            "layer_norm_epsilon": config.norm_epsilon,
            "scale_attn_weights": True,
            "scale_attn_by_inverse_layer_idx": False,
            "reorder_and_upcast_attn": False,
            "add_cross_attention": False,
        }
    llama = {
        **common,
        "hidden_size": config.hidden_size,
        "intermediate_size": config.ffn_hidden_size,
        "num_hidden_layers": config.num_layers,
        "num_attention_heads": config.num_attention_heads,
        "num_key_value_heads": config.num_query_groups,
        "head_dim": config.head_dim,
        "hidden_act": "silu",
        "max_position_embeddings": config.max_position_embeddings,
        "rms_norm_eps": config.norm_epsilon,
        "rope_theta": config.rotary_base,
        "rope_scaling": None,
        "attention_bias": config.add_bias_linear,
        "mlp_bias": config.add_bias_linear,
        "attention_dropout": config.attention_dropout,
    }
    if fmt not in MOE_FORMATS:
        return llama
    del llama["attention_bias"], llama["mlp_bias"]
    return {**llama, **MOE_FORMATS[fmt].config_fields(config)}


def hf_format(hf: dict) -> str:
    """Which of FORMATS a config.json describes."""
    fmt = hf.get("model_type")
    if fmt not in FORMATS:
        raise ConversionError(
            f"config.json: model_type {fmt!r} is not supported; import-hf reads "
            f"{' and '.join(ARCHITECTURE.values())} checkpoints"
        )
    return fmt


def _require(hf: dict, key: str, allowed, default, ours: str):
    value = hf.get(key, default)
    if value not in allowed:
        raise ConversionError(
            f"config.json: {key}={value!r} is not supported (megazero's GPT has "
            f"{ours}); import-hf takes only models it matches exactly"
        )
    return value


def gpt_config(hf: dict) -> GPTConfig:
    """The GPTConfig of a Hugging Face config.json; refuses options megazero cannot match exactly."""
    fmt = hf_format(hf)
    if fmt == "gpt2":
        act = _require(hf, "activation_function", GPT2_GELU, "gelu_new", "GELU, tanh or erf")
        _require(hf, "scale_attn_weights", (True,), True, "attention scaled by 1/sqrt(head size)")
        _require(hf, "scale_attn_by_inverse_layer_idx", (False,), False, "no per-layer attention scaling")
        _require(hf, "add_cross_attention", (False,), False, "no cross-attention")
        hidden, positions = hf.get("n_embd", 768), hf.get("n_positions", 1024)
        return GPTConfig(
            vocab_size=hf.get("vocab_size", 50257),
            hidden_size=hidden,
            num_layers=hf.get("n_layer", 12),
            num_attention_heads=hf.get("n_head", 12),
            ffn_hidden_size=hf.get("n_inner") or 4 * hidden,
            seq_length=positions,
            max_position_embeddings=positions,
            position_embedding="learned",
            activation="gelu",
            gelu_approximate=GPT2_GELU[act],
            normalization="layernorm",
            norm_epsilon=hf.get("layer_norm_epsilon", 1e-5),
            tie_embeddings=hf.get("tie_word_embeddings", True),
            add_bias_linear=True,
            hidden_dropout=hf.get("resid_pdrop", 0.1),
            attention_dropout=hf.get("attn_pdrop", 0.1),
            init_method_std=hf.get("initializer_range", 0.02),
        )
    _require(hf, "hidden_act", ("silu", "swish"), "silu", "SwiGLU MLPs")
    moe = {}
    if fmt in MOE_FORMATS:
        problems = MOE_FORMATS[fmt].hf_problems(hf)
        if problems:
            raise ConversionError(problems[0])
        moe = MOE_FORMATS[fmt].fields_from_hf(hf)
    hidden, heads = hf.get("hidden_size", 4096), hf.get("num_attention_heads", 32)
    rope = _rope_theta(hf)
    if hf.get("attention_bias", False) != hf.get("mlp_bias", False):
        raise ConversionError(
            f"config.json: attention_bias={hf.get('attention_bias')} with "
            f"mlp_bias={hf.get('mlp_bias')} is not supported; megazero's biases are "
            f"all on or all off (--disable-bias-linear)"
        )
    positions = hf.get("max_position_embeddings", 2048)
    return GPTConfig(
        vocab_size=hf.get("vocab_size", 32000),
        hidden_size=hidden,
        num_layers=hf.get("num_hidden_layers", 32),
        num_attention_heads=heads,
        num_query_groups=hf.get("num_key_value_heads") or heads,
        kv_channels=hf.get("head_dim") or hidden // heads,
        ffn_hidden_size=hf.get("intermediate_size", 11008),
        seq_length=positions,
        max_position_embeddings=positions,
        position_embedding="rope",
        rotary_base=rope,
        activation="swiglu",
        normalization="rmsnorm",
        norm_epsilon=hf.get("rms_norm_eps", 1e-6),
        tie_embeddings=hf.get("tie_word_embeddings", False),
        add_bias_linear=hf.get("attention_bias", False),
        hidden_dropout=0.0,
        attention_dropout=hf.get("attention_dropout", 0.0),
        init_method_std=hf.get("initializer_range", 0.02),
        **moe,
    )


def _rope_theta(hf: dict) -> float:
    """The rotary base of plain RoPE, from either generation of the Llama config (`rope_theta` and
    `rope_scaling`, or `rope_parameters`); scaled or partial rotary embeddings are refused."""
    params = dict(hf.get("rope_parameters") or {})
    scaling = hf.get("rope_scaling") or {}
    kinds = {params.get("rope_type"), scaling.get("rope_type", scaling.get("type"))} - {None, "default"}
    if kinds:
        kind = sorted(kinds)[0]
        raise ConversionError(
            f"config.json: rope type {kind!r} is not supported; megazero's rotary "
            f"embedding is plain RoPE (--rotary-base only)"
        )
    partial = params.get("partial_rotary_factor", hf.get("partial_rotary_factor", 1.0))
    if partial != 1.0:
        raise ConversionError(
            f"config.json: partial_rotary_factor={partial} is not supported; megazero rotates whole heads"
        )
    return float(params.get("rope_theta", hf.get("rope_theta", 10000.0)))
