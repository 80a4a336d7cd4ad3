"""Name and shape mapping between megazero's GPT and Hugging Face's GPT2LMHeadModel / LlamaForCausalLM
(and its mixtures of experts, MixtralForCausalLM and Qwen2MoeForCausalLM: models/hf_mixtral.py,
models/hf_qwen2_moe.py).

Owns, for every format: which GPTConfig a Hugging Face `config.json` describes and back, which
megazero options a format can express exactly (anything else is refused naming the option, never
exported approximately), and how every parameter maps. Pure functions on dicts and tensors: reading
checkpoints and writing files is tools/convert_checkpoint.py's job. Like the rest of `models`, this
imports neither `parallel` nor `megazero`; refusals are ConversionError (a ValueError) and the tool
reports them as usage errors.

Facts the mapping honours:
- GPT-2's Conv1D computes x @ W + b, so its weights are nn.Linear's transposed; c_attn's output is
  [q of all heads | k | v], where megazero's fused QKV runs group by group, [q_g, k_g, v_g].
- Llama keeps q/k/v and gate/up separate; grouped-query attention pairs head h with key/value head
  h // (heads / groups), as megazero's repeat_interleave does.
- Rotary layout: megazero rotates interleaved pairs (x[2i], x[2i+1]) by angle i; Llama's rotate_half
  rotates (x[i], x[i + d/2]) by the same angle i. Permuting every q and k head's rows (ours 2i -> theirs
  i, ours 2i+1 -> theirs i + d/2) turns one into the other; q.k is unchanged since both move alike.
- Heads may be narrower or wider than hidden / heads (--kv-channels): Llama's `head_dim` says so;
  GPT-2 cannot. Llama rotates whole heads, so a model with --rotary-percent < 1 is refused.
- A zero-centred norm (--apply-layernorm-1p) scales by weight + 1: its weight is exported as weight + 1
  (the value the forward multiplies by, computed in fp32 as the forward does); imports are plain norms.
- Hugging Face embeddings have exactly vocab_size rows: megazero's padding rows (zero by
  construction and never trained) are dropped on export, and a non-zero one is refused.
- Dropout is no part of a model's function: GPT-2's resid/embd_pdrop carry megazero's hidden dropout;
  Llama has attention dropout only, so an imported Llama trains with hidden dropout 0 unless the
  flags say otherwise. Special token ids come from the tokenizer exported with the model (the tool
  passes them in); without one they stay unset.
"""
from __future__ import annotations

from typing import Callable

import torch

from .config import GPTConfig
from .gpt import GPT
from .hf_mixtral import MIXTRAL, fused_experts
from .hf_qwen2_moe import QWEN2_MOE

FORMATS = ("gpt2", "llama", "mixtral", "qwen2_moe")
ARCHITECTURE = {"gpt2": "GPT2LMHeadModel", "llama": "LlamaForCausalLM", "mixtral": "MixtralForCausalLM",
                "qwen2_moe": "Qwen2MoeForCausalLM"}
MOE_FORMATS = {"mixtral": MIXTRAL, "qwen2_moe": QWEN2_MOE}      # Llama's attention with experts
VOCAB_ROWS = ("embedding.word.weight", "output_head.weight")
# GPT-2 activation names (transformers' ACT2FN) -> F.gelu's `approximate`; all compute one of the two.
GPT2_GELU = {"gelu_new": "tanh", "gelu_pytorch_tanh": "tanh", "gelu_fast": "tanh", "gelu": "none"}
GPT2_GELU_EXPORT = {"tanh": "gelu_new", "none": "gelu"}


class ConversionError(ValueError):
    """A model or config one side cannot express exactly; the message names the option."""


# --- which options each format expresses -------------------------------------------------------

def _problems(config: GPTConfig, fmt: str) -> list[str]:
    """Why `config` cannot be written as `fmt` exactly (empty when it can)."""
    target = ARCHITECTURE[fmt]
    if fmt == "gpt2":
        checks = [
            (config.position_embedding == "learned",
             f"--position-embedding-type rope: {target} has learned absolute positions only"),
            (config.activation == "gelu", f"--swiglu: {target}'s MLP is a plain GELU, not gated"),
            (config.normalization == "layernorm", f"--normalization RMSNorm: {target} uses LayerNorm"),
            (config.num_query_groups == config.num_attention_heads,
             f"--num-query-groups {config.num_query_groups}: {target} has one key/value head per query head"),
            (config.add_bias_linear, f"--disable-bias-linear: {target}'s linear layers all have biases"),
            (config.head_dim * config.num_attention_heads == config.hidden_size,
             f"--kv-channels {config.head_dim}: {target}'s heads are hidden size / heads wide"),
        ]
    else:
        checks = [
            (config.position_embedding == "rope",
             f"--position-embedding-type learned_absolute: {target} has rotary positions only"),
            (config.activation == "swiglu", f"a GELU MLP (no --swiglu): {target}'s MLP is SwiGLU"),
            (config.normalization == "rmsnorm", f"--normalization LayerNorm: {target} uses RMSNorm"),
            (config.rotary_percent == 1.0,
             f"--rotary-percent {config.rotary_percent}: {target} rotates every dim of a head"),
            (fmt == "qwen2_moe" or config.add_bias_linear or not config.add_qkv_bias,
             f"--add-qkv-bias without the other linear biases: {target} has no bias on q, k and v alone"),
        ]
    if fmt in MOE_FORMATS:
        checks += [(False, message) for message in MOE_FORMATS[fmt].problems(config)]
    elif config.num_experts:
        checks.append((False, f"--num-experts {config.num_experts}: {target} is dense (--format mixtral "
                              f"or qwen2_moe holds mixtures of experts)"))
    return [message for ok, message in checks if not ok]


def choose_format(config: GPTConfig, fmt: str = "auto") -> str:
    """`fmt`, or for "auto" the family the position embedding says; refuses what it cannot express."""
    if fmt == "auto":
        fmt = ("gpt2" if config.position_embedding == "learned" else "llama" if not config.num_experts
               else "qwen2_moe" if config.moe_shared_expert_intermediate_size else "mixtral")
    if fmt not in FORMATS:
        raise ConversionError(f"--format {fmt!r}: choose one of auto, {', '.join(FORMATS)}")
    problems = _problems(config, fmt)
    if problems:
        other = next((f for f in FORMATS if f != fmt and not _problems(config, f)), None)
        fix = (f"--format {other} expresses this model exactly" if other is not None
               else "no Hugging Face format here expresses this model exactly")
        raise ConversionError(f"cannot export exactly: {problems[0]}; {fix}")
    return fmt


# --- config.json <-> GPTConfig ----------------------------------------------------------------

def hf_config(config: GPTConfig, fmt: str, special_ids: dict | None = None) -> dict:
    """The config.json of `config` (already checked by choose_format) in format `fmt`; `special_ids`
    (bos_token_id, eos_token_id, pad_token_id) are the exported tokenizer's."""
    ids = special_ids or {}
    common = {"architectures": [ARCHITECTURE[fmt]], "model_type": fmt, "vocab_size": config.vocab_size,
              "initializer_range": config.init_method_std, "tie_word_embeddings": config.tie_embeddings,
              "torch_dtype": "float32", "use_cache": True,
              **{key: ids.get(key) for key in ("bos_token_id", "eos_token_id", "pad_token_id")}}
    if fmt == "gpt2":
        return {**common, "n_positions": config.max_position_embeddings, "n_embd": config.hidden_size,
                "n_layer": config.num_layers, "n_head": config.num_attention_heads,
                "n_inner": config.ffn_hidden_size,
                "activation_function": GPT2_GELU_EXPORT[config.gelu_approximate],
                "resid_pdrop": config.hidden_dropout, "embd_pdrop": config.hidden_dropout,
                "attn_pdrop": config.attention_dropout, "layer_norm_epsilon": config.norm_epsilon,
                "scale_attn_weights": True, "scale_attn_by_inverse_layer_idx": False,
                "reorder_and_upcast_attn": False, "add_cross_attention": False}
    llama = {**common, "hidden_size": config.hidden_size, "intermediate_size": config.ffn_hidden_size,
            "num_hidden_layers": config.num_layers, "num_attention_heads": config.num_attention_heads,
            "num_key_value_heads": config.num_query_groups,
            "head_dim": config.head_dim, "hidden_act": "silu",
            "max_position_embeddings": config.max_position_embeddings, "rms_norm_eps": config.norm_epsilon,
            "rope_theta": config.rotary_base, "rope_scaling": None,
            "attention_bias": config.add_bias_linear, "mlp_bias": config.add_bias_linear,
            "attention_dropout": config.attention_dropout}
    if fmt not in MOE_FORMATS:
        return llama
    del llama["attention_bias"], llama["mlp_bias"]
    return {**llama, **MOE_FORMATS[fmt].config_fields(config)}


def hf_format(hf: dict) -> str:
    """Which of FORMATS a config.json describes."""
    fmt = hf.get("model_type")
    if fmt not in FORMATS:
        raise ConversionError(f"config.json: model_type {fmt!r} is not supported; import-hf reads "
                              f"{' and '.join(ARCHITECTURE.values())} checkpoints")
    return fmt


def _require(hf: dict, key: str, allowed, default, ours: str):
    value = hf.get(key, default)
    if value not in allowed:
        raise ConversionError(f"config.json: {key}={value!r} is not supported (megazero's GPT has "
                              f"{ours}); import-hf takes only models it matches exactly")
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
            vocab_size=hf.get("vocab_size", 50257), hidden_size=hidden, num_layers=hf.get("n_layer", 12),
            num_attention_heads=hf.get("n_head", 12), ffn_hidden_size=hf.get("n_inner") or 4 * hidden,
            seq_length=positions, max_position_embeddings=positions, position_embedding="learned",
            activation="gelu", gelu_approximate=GPT2_GELU[act], normalization="layernorm",
            norm_epsilon=hf.get("layer_norm_epsilon", 1e-5),
            tie_embeddings=hf.get("tie_word_embeddings", True), add_bias_linear=True,
            hidden_dropout=hf.get("resid_pdrop", 0.1), attention_dropout=hf.get("attn_pdrop", 0.1),
            init_method_std=hf.get("initializer_range", 0.02))
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
        raise ConversionError(f"config.json: attention_bias={hf.get('attention_bias')} with "
                              f"mlp_bias={hf.get('mlp_bias')} is not supported; megazero's biases are "
                              f"all on or all off (--disable-bias-linear)")
    positions = hf.get("max_position_embeddings", 2048)
    return GPTConfig(
        vocab_size=hf.get("vocab_size", 32000), hidden_size=hidden,
        num_layers=hf.get("num_hidden_layers", 32), num_attention_heads=heads,
        num_query_groups=hf.get("num_key_value_heads") or heads,
        kv_channels=hf.get("head_dim") or hidden // heads,
        ffn_hidden_size=hf.get("intermediate_size", 11008), seq_length=positions,
        max_position_embeddings=positions, position_embedding="rope", rotary_base=rope,
        activation="swiglu", normalization="rmsnorm", norm_epsilon=hf.get("rms_norm_eps", 1e-6),
        tie_embeddings=hf.get("tie_word_embeddings", False),
        add_bias_linear=hf.get("attention_bias", False), hidden_dropout=0.0,
        attention_dropout=hf.get("attention_dropout", 0.0), init_method_std=hf.get("initializer_range", 0.02),
        **moe)


def _rope_theta(hf: dict) -> float:
    """The rotary base of plain RoPE, from either generation of the Llama config (`rope_theta` and
    `rope_scaling`, or `rope_parameters`); scaled or partial rotary embeddings are refused."""
    params = dict(hf.get("rope_parameters") or {})
    scaling = hf.get("rope_scaling") or {}
    kinds = {params.get("rope_type"), scaling.get("rope_type", scaling.get("type"))} - {None, "default"}
    if kinds:
        kind = sorted(kinds)[0]
        raise ConversionError(f"config.json: rope type {kind!r} is not supported; megazero's rotary "
                              f"embedding is plain RoPE (--rotary-base only)")
    partial = params.get("partial_rotary_factor", hf.get("partial_rotary_factor", 1.0))
    if partial != 1.0:
        raise ConversionError(f"config.json: partial_rotary_factor={partial} is not supported; megazero "
                              f"rotates whole heads")
    return float(params.get("rope_theta", hf.get("rope_theta", 10000.0)))


# --- parameters --------------------------------------------------------------------------------
# One entry per megazero parameter: (its name, the Hugging Face names it becomes, split: ours ->
# theirs, join: theirs -> ours). Export and import walk the same table, so they invert each other.

Entry = tuple[str, tuple[str, ...], Callable, Callable]


def _same(name: str, hf_name: str) -> Entry:
    return name, (hf_name,), lambda t: (t,), lambda ts: ts[0]


def _transposed(name: str, hf_name: str) -> Entry:
    return name, (hf_name,), lambda t: (t.t().contiguous(),), lambda ts: ts[0].t().contiguous()


def _qkv_split(config: GPTConfig, t: torch.Tensor) -> tuple[torch.Tensor, ...]:
    """Our group-by-group fused QKV rows -> (q of all heads, k of all groups, v of all groups)."""
    groups, head_dim = config.num_query_groups, config.head_dim
    per_group = config.num_attention_heads // groups
    rows = t.unflatten(0, (groups, per_group + 2, head_dim))
    return (rows[:, :per_group].flatten(0, 2), rows[:, per_group].flatten(0, 1),
            rows[:, per_group + 1].flatten(0, 1))


def _qkv_join(config: GPTConfig, q, k, v) -> torch.Tensor:
    groups, head_dim = config.num_query_groups, config.head_dim
    per_group = config.num_attention_heads // groups
    rows = [q.unflatten(0, (groups, per_group, head_dim)), k.unflatten(0, (groups, 1, head_dim)),
            v.unflatten(0, (groups, 1, head_dim))]
    return torch.cat(rows, dim=1).flatten(0, 2).contiguous()


def _rotary_rows(t: torch.Tensor, head_dim: int, to_hf: bool) -> torch.Tensor:
    """Reorders each head's rows between our interleaved rotary pairs and Llama's halves."""
    order = torch.cat([torch.arange(0, head_dim, 2, device=t.device),
                       torch.arange(1, head_dim, 2, device=t.device)])
    if not to_hf:
        order = torch.argsort(order)
    return t.unflatten(0, (-1, head_dim))[:, order].flatten(0, 1).contiguous()


def _norm_scale(config: GPTConfig, name: str, hf_name: str) -> Entry:
    """A norm's scale; a zero-centred one (weight + 1 in the forward) is exported as weight + 1."""
    if not config.apply_layernorm_1p:
        return _same(name, hf_name)
    return name, (hf_name,), lambda t: (t + 1,), lambda ts: ts[0] - 1


def _gpt2_layer(config: GPTConfig, i: int) -> list[Entry]:
    ours, theirs = f"layers.{i}.", f"transformer.h.{i}."

    def c_attn(kind):         # [q | k | v] columns; weights transposed, biases as they are
        flip = (lambda t: t.t().contiguous()) if kind == "weight" else (lambda t: t)
        return (f"{ours}attention.qkv.{kind}", (f"{theirs}attn.c_attn.{kind}",),
                lambda t: (flip(torch.cat(_qkv_split(config, t))),),
                lambda ts: _qkv_join(config, *flip(ts[0]).chunk(3, dim=0)))

    return [_norm_scale(config, f"{ours}input_norm.weight", f"{theirs}ln_1.weight"),
            _same(f"{ours}input_norm.bias", f"{theirs}ln_1.bias"),
            c_attn("weight"), c_attn("bias"),
            _transposed(f"{ours}attention.proj.weight", f"{theirs}attn.c_proj.weight"),
            _same(f"{ours}attention.proj.bias", f"{theirs}attn.c_proj.bias"),
            _norm_scale(config, f"{ours}mlp_norm.weight", f"{theirs}ln_2.weight"),
            _same(f"{ours}mlp_norm.bias", f"{theirs}ln_2.bias"),
            _transposed(f"{ours}mlp.fc1.weight", f"{theirs}mlp.c_fc.weight"),
            _same(f"{ours}mlp.fc1.bias", f"{theirs}mlp.c_fc.bias"),
            _transposed(f"{ours}mlp.fc2.weight", f"{theirs}mlp.c_proj.weight"),
            _same(f"{ours}mlp.fc2.bias", f"{theirs}mlp.c_proj.bias")]


def _llama_layer(config: GPTConfig, i: int, fmt: str) -> list[Entry]:
    ours, theirs = f"layers.{i}.", f"model.layers.{i}."
    head_dim = config.head_dim

    def qkv(kind):
        names = tuple(f"{theirs}self_attn.{p}_proj.{kind}" for p in "qkv")

        def split(t):
            q, k, v = _qkv_split(config, t)
            return _rotary_rows(q, head_dim, True), _rotary_rows(k, head_dim, True), v

        def join(ts):
            q, k, v = ts
            return _qkv_join(config, _rotary_rows(q, head_dim, False), _rotary_rows(k, head_dim, False), v)
        return f"{ours}attention.qkv.{kind}", names, split, join

    def gate_up(kind):        # our fc1 emits [gate; up]
        return (f"{ours}mlp.fc1.{kind}", (f"{theirs}mlp.gate_proj.{kind}", f"{theirs}mlp.up_proj.{kind}"),
                lambda t: tuple(c.contiguous() for c in t.chunk(2, dim=0)), lambda ts: torch.cat(ts))

    kinds = ("weight", "bias") if config.add_bias_linear else ("weight",)
    moe = config.is_moe_layer(i)
    entries = [_norm_scale(config, f"{ours}input_norm.weight", f"{theirs}input_layernorm.weight"),
               _norm_scale(config, f"{ours}mlp_norm.weight", f"{theirs}post_attention_layernorm.weight")]
    entries += [qkv("weight")] + ([qkv("bias")] if config.add_bias_linear or config.add_qkv_bias else [])
    for kind in kinds:
        entries.append(_same(f"{ours}attention.proj.{kind}", f"{theirs}self_attn.o_proj.{kind}"))
        if not moe:
            entries += [gate_up(kind), _same(f"{ours}mlp.fc2.{kind}", f"{theirs}mlp.down_proj.{kind}")]
    return entries + (MOE_FORMATS[fmt].mlp_entries(i) if moe else [])


def parameter_map(config: GPTConfig, fmt: str) -> list[Entry]:
    """Every parameter of GPT(config) (a tied head once, as the embedding) and its counterparts."""
    if fmt == "gpt2":
        entries = [_same("embedding.word.weight", "transformer.wte.weight"),
                   _same("embedding.position.weight", "transformer.wpe.weight"),
                   _norm_scale(config, "final_norm.weight", "transformer.ln_f.weight"),
                   _same("final_norm.bias", "transformer.ln_f.bias")]
        layer = _gpt2_layer
    else:
        entries = [_same("embedding.word.weight", "model.embed_tokens.weight"),
                   _norm_scale(config, "final_norm.weight", "model.norm.weight")]
        layer = _llama_layer
    if not config.tie_embeddings:
        entries.append(_same("output_head.weight", "lm_head.weight"))
    for i in range(config.num_layers):
        entries += layer(config, i) if fmt == "gpt2" else layer(config, i, fmt)
    return entries


def _drop_padding(config: GPTConfig, name: str, t: torch.Tensor) -> torch.Tensor:
    if name not in VOCAB_ROWS or t.shape[0] == config.vocab_size:
        return t
    padding = t[config.vocab_size:]
    if bool((padding != 0).any()):
        raise ConversionError(f"{name}: vocabulary padding rows {config.vocab_size}..{t.shape[0] - 1} are "
                              f"not zero (megazero never trains them); the checkpoint was altered, zero "
                              f"those rows before exporting")
    return t[:config.vocab_size]


def to_hf(config: GPTConfig, fmt: str, read: Callable[[str], torch.Tensor]) -> dict[str, torch.Tensor]:
    """The Hugging Face state dict of format `fmt`; read(name) gives one full megazero parameter."""
    fmt = choose_format(config, fmt)
    state = {}
    for name, hf_names, split, _ in parameter_map(config, fmt):
        state.update(zip(hf_names, split(_drop_padding(config, name, read(name)))))
    return state


def _canonical_hf_names(fmt: str, state: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """Accepts files saved from the bare GPT2Model (no `transformer.` prefix) and drops GPT-2's
    causal-mask buffers that older files carry; experts saved one by one are fused (hf_mixtral)."""
    if fmt == "gpt2" and not any(k.startswith("transformer.") for k in state):
        state = {(k if k == "lm_head.weight" else f"transformer.{k}"): v for k, v in state.items()}
    if fmt == "gpt2":
        state = {k: v for k, v in state.items() if not k.endswith((".attn.bias", ".attn.masked_bias"))}
    return fused_experts(state) if fmt in MOE_FORMATS else state


def hf_shapes(config: GPTConfig, fmt: str) -> dict[str, tuple[int, ...]]:
    """Each Hugging Face tensor's shape, from GPT(config) built on the meta device."""
    with torch.device("meta"):
        params = dict(GPT(config).named_parameters())
    shapes = {}
    for name, hf_names, split, _ in parameter_map(config, fmt):
        value = params[name][:config.vocab_size] if name in VOCAB_ROWS else params[name]
        shapes.update({n: tuple(t.shape) for n, t in zip(hf_names, split(value.detach()))})
    return shapes


def from_hf(config: GPTConfig, fmt: str, state: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """megazero's full fp32 parameters (a tied head once, as the embedding) from a Hugging Face
    state dict of format `fmt` whose config.json gave `config`."""
    state = _canonical_hf_names(fmt, state)
    expected = hf_shapes(config, fmt)
    missing = sorted(expected.keys() - state.keys())
    if missing:
        raise ConversionError(f"model.safetensors: no tensor {missing[0]!r} ({len(missing)} missing); "
                              f"the weights do not belong to config.json's model")
    extra = sorted(state.keys() - expected.keys() - ({"lm_head.weight"} if config.tie_embeddings else set()))
    if extra:
        raise ConversionError(f"model.safetensors: tensor {extra[0]!r} has no place in megazero's GPT "
                              f"({len(extra)} such); the model has parts megazero lacks")
    for name, shape in expected.items():
        if tuple(state[name].shape) != shape:
            raise ConversionError(f"model.safetensors: {name} has shape {tuple(state[name].shape)}, "
                                  f"config.json's model has {shape}; the files do not belong together")
    return {name: join(tuple(state[n].to(torch.float32) for n in hf_names))
            for name, hf_names, _, join in parameter_map(config, fmt)}
