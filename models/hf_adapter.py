"""Name and shape mapping between megazero's GPT and Hugging Face's GPT2LMHeadModel / LlamaForCausalLM
(and its mixtures of experts, MixtralForCausalLM and Qwen2MoeForCausalLM: models/hf_mixtral.py,
models/hf_qwen2_moe.py).

Owns, for every format: which megazero options a format can express exactly (anything else is
refused naming the option, never exported approximately) and how every parameter maps; which
GPTConfig a Hugging Face `config.json` describes and back is models/hf_config.py's (re-exported
here). Pure functions on dicts and tensors: reading checkpoints and writing files is
tools/convert_checkpoint.py's job. Like the rest of `models`, this imports neither `parallel` nor
`megazero`; refusals are ConversionError (a ValueError) and the tool reports them as usage errors.

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
from .hf_config import (  # noqa: F401 - config.json's side, re-exported: the tool and the tests take it from here
    ARCHITECTURE,
    FORMATS,
    MOE_FORMATS,
    ConversionError,
    gpt_config,
    hf_config,
    hf_format,
)
from .hf_mixtral import fused_experts

VOCAB_ROWS = ("embedding.word.weight", "output_head.weight")


# --- which options each format expresses -------------------------------------------------------


def _problems(config: GPTConfig, fmt: str) -> list[str]:
    """Why `config` cannot be written as `fmt` exactly (empty when it can)."""
    target = ARCHITECTURE[fmt]
    if fmt == "gpt2":
        checks = [
            (
                config.position_embedding == "learned",
                f"--position-embedding-type rope: {target} has learned absolute positions only",
            ),
            (config.activation == "gelu", f"--swiglu: {target}'s MLP is a plain GELU, not gated"),
            (config.normalization == "layernorm", f"--normalization RMSNorm: {target} uses LayerNorm"),
            (
                config.num_query_groups == config.num_attention_heads,
                f"--num-query-groups {config.num_query_groups}: {target} has one key/value head per query head",
            ),
            (config.add_bias_linear, f"--disable-bias-linear: {target}'s linear layers all have biases"),
            (
                config.head_dim * config.num_attention_heads == config.hidden_size,
                f"--kv-channels {config.head_dim}: {target}'s heads are hidden size / heads wide",
            ),
        ]
    else:
        checks = [
            (
                config.position_embedding == "rope",
                f"--position-embedding-type learned_absolute: {target} has rotary positions only",
            ),
            (config.activation == "swiglu", f"a GELU MLP (no --swiglu): {target}'s MLP is SwiGLU"),
            (config.normalization == "rmsnorm", f"--normalization LayerNorm: {target} uses RMSNorm"),
            (
                config.rotary_percent == 1.0,
                f"--rotary-percent {config.rotary_percent}: {target} rotates every dim of a head",
            ),
            (
                fmt == "qwen2_moe" or config.add_bias_linear or not config.add_qkv_bias,
                f"--add-qkv-bias without the other linear biases: {target} has no bias on q, k and v alone",
            ),
        ]
    if fmt in MOE_FORMATS:
        checks += [(False, message) for message in MOE_FORMATS[fmt].problems(config)]
    elif config.num_experts:
        checks.append(
            (
                False,
                f"--num-experts {config.num_experts}: {target} is dense (--format mixtral "
                f"or qwen2_moe holds mixtures of experts)",
            )
        )
    return [message for ok, message in checks if not ok]


def choose_format(config: GPTConfig, fmt: str = "auto") -> str:
    """`fmt`, or for "auto" the family the position embedding says; refuses what it cannot express."""
    if fmt == "auto":
        fmt = (
            "gpt2"
            if config.position_embedding == "learned"
            else "llama"
            if not config.num_experts
            else "qwen2_moe"
            if config.moe_shared_expert_intermediate_size
            else "mixtral"
        )
    if fmt not in FORMATS:
        raise ConversionError(f"--format {fmt!r}: choose one of auto, {', '.join(FORMATS)}")
    problems = _problems(config, fmt)
    if problems:
        other = next((f for f in FORMATS if f != fmt and not _problems(config, f)), None)
        fix = (
            f"--format {other} expresses this model exactly"
            if other is not None
            else "no Hugging Face format here expresses this model exactly"
        )
        raise ConversionError(f"cannot export exactly: {problems[0]}; {fix}")
    return fmt


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
    return (rows[:, :per_group].flatten(0, 2), rows[:, per_group].flatten(0, 1), rows[:, per_group + 1].flatten(0, 1))


def _qkv_join(config: GPTConfig, q, k, v) -> torch.Tensor:
    groups, head_dim = config.num_query_groups, config.head_dim
    per_group = config.num_attention_heads // groups
    rows = [
        q.unflatten(0, (groups, per_group, head_dim)),
        k.unflatten(0, (groups, 1, head_dim)),
        v.unflatten(0, (groups, 1, head_dim)),
    ]
    return torch.cat(rows, dim=1).flatten(0, 2).contiguous()


def _rotary_rows(t: torch.Tensor, head_dim: int, to_hf: bool) -> torch.Tensor:
    """Reorders each head's rows between our interleaved rotary pairs and Llama's halves."""
    order = torch.cat([torch.arange(0, head_dim, 2, device=t.device), torch.arange(1, head_dim, 2, device=t.device)])
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

    def c_attn(kind):  # [q | k | v] columns; weights transposed, biases as they are
        flip = (lambda t: t.t().contiguous()) if kind == "weight" else (lambda t: t)
        return (
            f"{ours}attention.qkv.{kind}",
            (f"{theirs}attn.c_attn.{kind}",),
            lambda t: (flip(torch.cat(_qkv_split(config, t))),),
            lambda ts: _qkv_join(config, *flip(ts[0]).chunk(3, dim=0)),
        )

    return [
        _norm_scale(config, f"{ours}input_norm.weight", f"{theirs}ln_1.weight"),
        _same(f"{ours}input_norm.bias", f"{theirs}ln_1.bias"),
        c_attn("weight"),
        c_attn("bias"),
        _transposed(f"{ours}attention.proj.weight", f"{theirs}attn.c_proj.weight"),
        _same(f"{ours}attention.proj.bias", f"{theirs}attn.c_proj.bias"),
        _norm_scale(config, f"{ours}mlp_norm.weight", f"{theirs}ln_2.weight"),
        _same(f"{ours}mlp_norm.bias", f"{theirs}ln_2.bias"),
        _transposed(f"{ours}mlp.fc1.weight", f"{theirs}mlp.c_fc.weight"),
        _same(f"{ours}mlp.fc1.bias", f"{theirs}mlp.c_fc.bias"),
        _transposed(f"{ours}mlp.fc2.weight", f"{theirs}mlp.c_proj.weight"),
        _same(f"{ours}mlp.fc2.bias", f"{theirs}mlp.c_proj.bias"),
    ]


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

    def gate_up(kind):  # our fc1 emits [gate; up]
        return (
            f"{ours}mlp.fc1.{kind}",
            (f"{theirs}mlp.gate_proj.{kind}", f"{theirs}mlp.up_proj.{kind}"),
            lambda t: tuple(c.contiguous() for c in t.chunk(2, dim=0)),
            lambda ts: torch.cat(ts),
        )

    kinds = ("weight", "bias") if config.add_bias_linear else ("weight",)
    moe = config.is_moe_layer(i)
    entries = [
        _norm_scale(config, f"{ours}input_norm.weight", f"{theirs}input_layernorm.weight"),
        _norm_scale(config, f"{ours}mlp_norm.weight", f"{theirs}post_attention_layernorm.weight"),
    ]
    entries += [qkv("weight")] + ([qkv("bias")] if config.add_bias_linear or config.add_qkv_bias else [])
    for kind in kinds:
        entries.append(_same(f"{ours}attention.proj.{kind}", f"{theirs}self_attn.o_proj.{kind}"))
        if not moe:
            entries += [gate_up(kind), _same(f"{ours}mlp.fc2.{kind}", f"{theirs}mlp.down_proj.{kind}")]
    return entries + (MOE_FORMATS[fmt].mlp_entries(i) if moe else [])


def parameter_map(config: GPTConfig, fmt: str) -> list[Entry]:
    """Every parameter of GPT(config) (a tied head once, as the embedding) and its counterparts."""
    if fmt == "gpt2":
        entries = [
            _same("embedding.word.weight", "transformer.wte.weight"),
            _same("embedding.position.weight", "transformer.wpe.weight"),
            _norm_scale(config, "final_norm.weight", "transformer.ln_f.weight"),
            _same("final_norm.bias", "transformer.ln_f.bias"),
        ]
        layer = _gpt2_layer
    else:
        entries = [
            _same("embedding.word.weight", "model.embed_tokens.weight"),
            _norm_scale(config, "final_norm.weight", "model.norm.weight"),
        ]
        layer = _llama_layer
    if not config.tie_embeddings:
        entries.append(_same("output_head.weight", "lm_head.weight"))
    for i in range(config.num_layers):
        entries += layer(config, i) if fmt == "gpt2" else layer(config, i, fmt)
    return entries


def _drop_padding(config: GPTConfig, name: str, t: torch.Tensor) -> torch.Tensor:
    if name not in VOCAB_ROWS or t.shape[0] == config.vocab_size:
        return t
    padding = t[config.vocab_size :]
    if bool((padding != 0).any()):
        raise ConversionError(
            f"{name}: vocabulary padding rows {config.vocab_size}..{t.shape[0] - 1} are "
            f"not zero (megazero never trains them); the checkpoint was altered, zero "
            f"those rows before exporting"
        )
    return t[: config.vocab_size]


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
        value = params[name][: config.vocab_size] if name in VOCAB_ROWS else params[name]
        shapes.update({n: tuple(t.shape) for n, t in zip(hf_names, split(value.detach()))})
    return shapes


def from_hf(config: GPTConfig, fmt: str, state: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """megazero's full fp32 parameters (a tied head once, as the embedding) from a Hugging Face
    state dict of format `fmt` whose config.json gave `config`."""
    state = _canonical_hf_names(fmt, state)
    expected = hf_shapes(config, fmt)
    missing = sorted(expected.keys() - state.keys())
    if missing:
        raise ConversionError(
            f"model.safetensors: no tensor {missing[0]!r} ({len(missing)} missing); "
            f"the weights do not belong to config.json's model"
        )
    extra = sorted(state.keys() - expected.keys() - ({"lm_head.weight"} if config.tie_embeddings else set()))
    if extra:
        raise ConversionError(
            f"model.safetensors: tensor {extra[0]!r} has no place in megazero's GPT "
            f"({len(extra)} such); the model has parts megazero lacks"
        )
    for name, shape in expected.items():
        if tuple(state[name].shape) != shape:
            raise ConversionError(
                f"model.safetensors: {name} has shape {tuple(state[name].shape)}, "
                f"config.json's model has {shape}; the files do not belong together"
            )
    return {
        name: join(tuple(state[n].to(torch.float32) for n in hf_names))
        for name, hf_names, _, join in parameter_map(config, fmt)
    }
