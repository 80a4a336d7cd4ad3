"""The model flags: their parser entries (add_model_flags), and the flags -> GPTConfig with
Megatron-LM's meaning where its flags interact, and the `--compile` check. Part of the edge (megazero.config): raises UsageError before any group exists.

Megatron-LM's rules kept here: --num-query-groups counts only with --group-query-attention (which
defaults it to 1); --recompute-activations is --recompute-granularity selective; full recomputation
needs --recompute-method and --recompute-num-layers between 1 and the layers of a pipeline stage.
"""

from __future__ import annotations

import importlib.util
import shutil

from megazero.config.moe_flags import moe_fields
from megazero.core.errors import UsageError
from megazero.models.config import GPTConfig, padded_vocab_size


def add_model_flags(g, add) -> None:
    """The transformer's shape flags (`add` is flags._add: it records each flag's shown default)."""
    add(g, "--num-layers", type=int, default=4, help="transformer layers")
    add(g, "--hidden-size", type=int, default=256, help="model width")
    add(g, "--num-attention-heads", type=int, default=4, help="attention heads")
    add(
        g,
        "--group-query-attention",
        action="store_true",
        help="grouped-query attention with --num-query-groups key/value heads",
    )
    add(
        g,
        "--num-query-groups",
        type=int,
        default=None,
        help="key/value head groups of --group-query-attention (ignored without it, as in Megatron-LM)",
        shown="1 with --group-query-attention",
    )
    add(
        g,
        "--kv-channels",
        type=int,
        default=None,
        help="width of each attention head",
        shown="hidden size / attention heads",
    )
    add(g, "--ffn-hidden-size", type=int, default=0, help="MLP width; 0: 4 x hidden (8/3 x for SwiGLU)")
    add(g, "--seq-length", type=int, default=256, help="tokens per sample")
    add(g, "--max-position-embeddings", type=int, default=0, help="rows of the position table; 0: seq length")
    add(
        g,
        "--position-embedding-type",
        choices=["learned_absolute", "rope"],
        default="learned_absolute",
        help="position encoding",
    )
    add(g, "--no-position-embedding", action="store_true", help="no learned position table (with rope)")
    add(g, "--rotary-base", type=float, default=10000.0, help="RoPE frequency base")
    add(
        g,
        "--rotary-percent",
        type=float,
        default=1.0,
        help="fraction of each head's dims RoPE rotates (the leading ones), in (0, 1]",
    )
    add(
        g,
        "--attention-backend",
        choices=["auto", "flash", "fused", "unfused", "local"],
        default="auto",
        help="attention kernels: SDPA's choice, its flash or fused (cuDNN/memory-efficient) kernels, or the "
        "math written out (unfused, local)",
    )
    add(g, "--swiglu", action="store_true", help="SwiGLU MLP instead of GELU")
    add(g, "--openai-gelu", action="store_true", help="tanh-approximated GELU (GPT-2's; the default)")
    add(
        g,
        "--no-bias-gelu-fusion",
        action="store_true",
        help="exact (erf) GELU, as Megatron's unfused GELU, unless --openai-gelu",
    )
    add(g, "--normalization", choices=["LayerNorm", "RMSNorm"], default="LayerNorm", help="norm layers")
    add(g, "--norm-epsilon", type=float, default=1e-5, help="epsilon of the norm layers")
    add(
        g,
        "--apply-layernorm-1p",
        action="store_true",
        help="zero-centred norm scale: the norms multiply by weight + 1, weight starts at 0",
    )
    add(
        g,
        "--untie-embeddings-and-output-weights",
        action="store_true",
        help="separate output layer instead of the input embedding",
    )
    add(g, "--disable-bias-linear", action="store_true", help="no biases in linear layers")
    add(g, "--add-qkv-bias", action="store_true", help="biases in the QKV projection, whatever --disable-bias-linear")
    add(g, "--hidden-dropout", type=float, default=0.1, help="dropout on hidden states, in [0, 1)")
    add(g, "--attention-dropout", type=float, default=0.1, help="dropout on attention weights, in [0, 1)")
    add(
        g,
        "--recompute-activations",
        action="store_true",
        help="selective recomputation: each layer's core attention is recomputed in backward "
        "(= --recompute-granularity selective, as in Megatron-LM)",
    )
    add(
        g,
        "--recompute-granularity",
        choices=["full", "selective"],
        default=None,
        help="recompute whole layers (full) or the core attention (selective) in backward",
        shown="none",
    )
    add(
        g,
        "--recompute-method",
        choices=["uniform", "block"],
        default=None,
        help="full: checkpoint groups of --recompute-num-layers layers (uniform), or only the first "
        "--recompute-num-layers layers of each pipeline stage (block)",
        shown="none",
    )
    add(
        g,
        "--recompute-num-layers",
        type=int,
        default=None,
        help="full: layers per group (uniform) or layers recomputed per pipeline stage (block)",
        shown="none",
    )
    add(
        g,
        "--cpu-offloading",
        action="store_true",
        help="activation offload: the first --cpu-offloading-num-layers layers of each pipeline stage keep "
        "their saved activations in host memory between forward and backward (docs/flags.md)",
    )
    add(
        g,
        "--cpu-offloading-num-layers",
        type=int,
        default=None,
        help="activation offload of the first N layers of each pipeline stage (model chunk); N > 0 turns "
        "it on, as in Megatron-LM",
        shown="0, or all layers with --cpu-offloading",
    )
    add(
        g,
        "--cross-entropy-loss-fusion",
        action="store_true",
        help="accepted: the output layer and cross entropy always run fused, chunk by chunk",
    )
    add(g, "--compile", action="store_true", help="torch.compile each transformer layer")
    add(g, "--compile-backend", default="inductor", help="torch.compile backend for --compile")
    add(g, "--init-method-std", type=float, default=0.02, help="std of the normal weight init")
    add(
        g,
        "--make-vocab-size-divisible-by",
        type=int,
        default=128,
        help="pad the vocabulary to a multiple of this x tensor-parallel size",
    )


def model_config(args, vocab: int, tp: int, pp: int, cuda: bool) -> tuple[GPTConfig, list[str]]:
    """The GPTConfig the flags describe, and the notes on flags accepted without effect."""
    notes = []
    groups = _query_groups(args, notes)
    granularity, method, layers = _recompute(args, pp)
    if args.cross_entropy_loss_fusion:
        notes.append(
            "--cross-entropy-loss-fusion has no effect: the output layer and the cross entropy "
            "always run fused, a chunk of tokens at a time (megazero/models/loss.py)"
        )
    if args.attention_backend == "fused" and not cuda:
        notes.append(
            "--attention-backend fused: cuDNN and memory-efficient attention are CUDA kernels; "
            "on CPU the fused kernel is torch's flash attention"
        )
    try:
        config = GPTConfig(
            vocab_size=vocab,
            hidden_size=args.hidden_size,
            num_layers=args.num_layers,
            num_attention_heads=args.num_attention_heads,
            num_query_groups=groups,
            kv_channels=args.kv_channels or 0,
            ffn_hidden_size=args.ffn_hidden_size,
            seq_length=args.seq_length,
            max_position_embeddings=args.max_position_embeddings,
            padded_vocab_size=padded_vocab_size(vocab, args.make_vocab_size_divisible_by, tp),
            position_embedding="rope" if args.position_embedding_type == "rope" else "learned",
            rotary_base=args.rotary_base,
            rotary_percent=args.rotary_percent,
            activation="swiglu" if args.swiglu else "gelu",
            # Megatron: --openai-gelu is the tanh form; its unfused GELU (--no-bias-gelu-fusion) is
            # exact erf; its default fused bias-GELU is tanh, which is megazero's default too.
            gelu_approximate="none" if args.no_bias_gelu_fusion and not args.openai_gelu else "tanh",
            normalization="rmsnorm" if args.normalization == "RMSNorm" else "layernorm",
            norm_epsilon=args.norm_epsilon,
            apply_layernorm_1p=args.apply_layernorm_1p,
            tie_embeddings=not args.untie_embeddings_and_output_weights,
            add_bias_linear=not args.disable_bias_linear,
            add_qkv_bias=args.add_qkv_bias,
            hidden_dropout=args.hidden_dropout,
            attention_dropout=args.attention_dropout,
            attention_backend=args.attention_backend,
            recompute_granularity=granularity,
            recompute_method=method,
            recompute_num_layers=layers,
            init_method_std=args.init_method_std,
            **moe_fields(args),
        )
    except ValueError as err:
        raise UsageError(str(err)) from None
    if getattr(args, "no_position_embedding", False) and config.position_embedding != "rope":
        raise UsageError(
            "--no-position-embedding: megazero has no model without positions; add "
            "--position-embedding-type rope (what Megatron-LM's recipes pair it with)"
        )
    if args.rotary_percent != 1.0 and config.position_embedding != "rope":
        raise UsageError(f"--rotary-percent {args.rotary_percent} needs --position-embedding-type rope")
    return config, notes


def check_attention_precision(model: GPTConfig, half_precision: bool, cuda: bool) -> None:
    """CUDA's flash kernel takes only 16-bit inputs: an fp32 run asking for it would fail at the first
    forward with torch's "no available kernel"; say so before anything starts."""
    if model.attention_backend == "flash" and cuda and not half_precision:
        raise UsageError(
            "--attention-backend flash runs in bf16 or fp16 on CUDA (the flash kernel has no "
            "fp32 form); add --bf16, or choose --attention-backend auto or fused"
        )


def _query_groups(args, notes: list[str]) -> int:
    if args.group_query_attention:
        return args.num_query_groups if args.num_query_groups is not None else 1
    if args.num_query_groups is not None and args.num_query_groups != args.num_attention_heads:
        notes.append(
            f"--num-query-groups {args.num_query_groups} has no effect without "
            f"--group-query-attention (Megatron-LM's meaning): every head has its own key and "
            f"value; add --group-query-attention for grouped-query attention"
        )
    return args.num_attention_heads


def _recompute(args, pp: int) -> tuple[str, str | None, int]:
    granularity = args.recompute_granularity
    if args.recompute_activations:
        if granularity == "full":
            raise UsageError(
                "--recompute-activations is selective recomputation (Megatron-LM's "
                "meaning) and contradicts --recompute-granularity full; remove one"
            )
        granularity = "selective"
    layers = args.recompute_num_layers or 0
    per_stage = args.num_layers // pp
    if granularity == "full" and layers > per_stage:
        raise UsageError(
            f"--recompute-num-layers {layers} is more than the {per_stage} layers of a "
            f"pipeline stage; give 1..{per_stage}"
        )
    return granularity or "none", args.recompute_method, layers


def offloaded_layers(args, chunk_layers: int) -> int:
    """The layers of each model chunk whose saved activations go to the host (the first ones). As in
    Megatron-LM, --cpu-offloading-num-layers N > 0 turns offload on by itself (0, its default: off);
    --cpu-offloading without a count offloads all `chunk_layers` of the smallest chunk (DeepSpeed's
    cpu_checkpointing: every checkpoint's input)."""
    layers = args.cpu_offloading_num_layers
    if layers is None:
        return chunk_layers if args.cpu_offloading else 0
    if layers == 0 and args.cpu_offloading:
        raise UsageError(
            "--cpu-offloading with --cpu-offloading-num-layers 0 offloads nothing; give 1..."
            f"{chunk_layers} layers or remove --cpu-offloading"
        )
    if layers > chunk_layers:
        raise UsageError(
            f"--cpu-offloading-num-layers {layers} is more than the {chunk_layers} layers of a "
            f"pipeline stage's model chunk; give 1..{chunk_layers}"
        )
    return layers


def compile_backend(args, cuda: bool) -> str | None:
    """The torch.compile backend --compile asks for (None without it), checked to be usable here."""
    if not args.compile:
        if args.compile_backend != "inductor":
            raise UsageError(f"--compile-backend {args.compile_backend} needs --compile; add it or remove both")
        return None
    import torch

    if not hasattr(torch, "compile"):
        raise UsageError(f"--compile needs torch >= 2.0 (installed: {torch.__version__}); remove --compile")
    import torch._dynamo

    backend = args.compile_backend
    if backend not in torch._dynamo.list_backends(exclude_tags=()):
        raise UsageError(
            f"--compile-backend {backend!r} is not a torch.compile backend; choose one of "
            f"{', '.join(torch._dynamo.list_backends())}"
        )
    if backend == "inductor" and cuda and importlib.util.find_spec("triton") is None:
        raise UsageError(
            "--compile (inductor) on CUDA needs the triton package, which is not installed; "
            "install triton or pass --compile-backend aot_eager"
        )
    if backend == "inductor" and not cuda and not (shutil.which("g++") or shutil.which("c++")):
        raise UsageError(
            "--compile (inductor) on CPU needs a C++ compiler (g++), which is not on PATH; "
            "install one or pass --compile-backend aot_eager"
        )
    return backend
