"""The peers' own models, started from megazero's initial weights: what a user of DDP, FSDP2 or
plain torch trains instead of megazero's GPT, so that a same-run ratio includes the model's code.

    hf_model(cfg, seed)     transformers' GPT2LMHeadModel (GELU, LayerNorm, learned positions) or
                            LlamaForCausalLM (RMSNorm, SwiGLU, RoPE, GQA), SDPA attention, built
                            from megazero's Hugging Face export (megazero.models.hf_adapter: the
                            config.json and the state dict tools/convert_checkpoint.py writes) of
                            GPT(cfg) as make_init_fn(cfg, seed) initialises it: the same function
                            (tests/test_hf_conversion.py), so both sides' first losses agree
    hf_loss(model, tokens)  transformers' own loss (its ForCausalLM loss: fp32 logits, cross
                            entropy summed over the tokens and divided by `num_items_in_batch`),
                            fed the next-token labels megazero trains on
    layers_of(model)        the transformer layers of either model (for FSDP2 and compile)

Used by bench_step_vs_torch.py and bench_zero_vs_fsdp.py; bench_gpu_step.py's peer is a plain
PyTorch GPT (bench/plain_gpt.py) loading `initial_hf_state`, since the GPU image need not have
transformers.
"""

from __future__ import annotations

import torch

from megazero.training.model_builder import make_init_fn
from megazero.models import hf_adapter
from megazero.models.config import GPTConfig
from megazero.models.gpt import GPT


def initialised_gpt(cfg: GPTConfig, seed: int) -> GPT:
    """megazero's GPT with its layout-independent initial weights (by seed and parameter name)."""
    model = GPT(cfg)
    init = make_init_fn(cfg, seed)
    with torch.no_grad():
        for name, p in model.named_parameters():  # a tied head appears once, as the embedding
            p.copy_(init(name, p))
    return model


def initial_hf_state(cfg: GPTConfig, seed: int, fmt: str) -> dict[str, torch.Tensor]:
    """megazero's initial weights of GPT(cfg) as the Hugging Face state dict of format `fmt`,
    generated one parameter at a time (the GPT itself is built on the meta device)."""
    with torch.device("meta"):
        params = dict(GPT(cfg).named_parameters())
    init = make_init_fn(cfg, seed)
    return hf_adapter.to_hf(cfg, fmt, lambda name: init(name, params[name]))


def hf_model(cfg: GPTConfig, seed: int, attention: str = "sdpa"):
    """transformers' model of megazero's `cfg` (GPT-2 or Llama, whichever expresses it exactly)
    holding megazero's initial weights, in train mode."""
    import transformers

    fmt = hf_adapter.choose_format(cfg, "auto")
    config_json = hf_adapter.hf_config(cfg, fmt)
    architecture = config_json.pop("architectures")[0]
    config = transformers.AutoConfig.for_model(**config_json)
    config._attn_implementation = attention
    model = getattr(transformers, architecture)(config)
    model.loss_type = "ForCausalLM"  # transformers' causal-LM loss (its default, named)
    result = model.load_state_dict(initial_hf_state(cfg, seed, fmt), strict=False)
    tied = {"lm_head.weight"} if cfg.tie_embeddings else set()
    if result.unexpected_keys or set(result.missing_keys) - tied:
        raise RuntimeError(f"export does not fit {architecture}: {result}")
    if cfg.tie_embeddings:
        model.tie_weights()
        assert model.get_output_embeddings().weight is model.get_input_embeddings().weight
    return model.train()


def hf_loss(model, tokens: torch.Tensor, normalizer) -> torch.Tensor:
    """transformers' loss of `tokens` (b, s + 1): inputs tokens[:, :-1], next-token labels
    tokens[:, 1:] (given as its shift_labels, so nothing is cut), summed over tokens / normalizer."""
    inputs, labels = tokens[:, :-1], tokens[:, 1:].contiguous()
    return model(
        input_ids=inputs, labels=labels, shift_labels=labels, num_items_in_batch=normalizer, use_cache=False
    ).loss


def layers_of(model) -> list[torch.nn.Module]:
    """The transformer layers of megazero's GPT or of transformers' GPT-2 / Llama."""
    if isinstance(model, GPT):
        return list(model.layers.values())
    inner = getattr(model, "transformer", None) or model.model
    return list(getattr(inner, "h", None) or inner.layers)
