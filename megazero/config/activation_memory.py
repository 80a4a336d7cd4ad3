"""One rank's activation memory, for the memory planner (megazero/config/memory_estimate.py).

Activations, roughly: Korthikanti et al. (2022) count 34 s·b·h bytes per layer in 16 bits plus
5 a·s²·b for attention scores (the attention terms scaled here to the heads' real widths, with
--kv-channels and grouped-query attention); attention here runs through scaled_dot_product_attention,
which need not keep the scores, so only the first term is counted (twice that in fp32) unless the
attention is the written-out math (--attention-backend local/unfused) without selective
recomputation; the MLP's terms at its real width (SwiGLU keeps more), no dropout masks at
probability 0; the attention's and the MLP's inputs and the norms' inputs whole on every tensor
parallel rank without sequence parallelism, the rest split (`layer_activation_split`); for the
microbatches a pipeline stage holds at once (the pipeline size under 1F1B, all of them under GPipe,
the interleaved schedule's longer warm-up: `interleaved_in_flight`; a zero-bubble schedule's stages,
read off its list of actions, each waiting weight-gradient pass weighed by what its GEMMs keep:
`zero_bubble_peaks`, `weight_grad_bytes`). The dry run
(tools/dry_run.py, docs/dry_run.md) measures what these formulas predict at scale. Full recomputation keeps only the input
of each checkpointed layer group. The fused output layer and loss (models/loss.py, chunked by its
memory budget) add one chunk of fp32 logits, their gradient's 16-bit copy when the weights are 16-bit,
and the output weight's fp32 gradient twice over (the sum, and one chunk's product added to it); when
the whole head is one chunk, the forward keeps that chunk (exp(logits - max)) for the backward, once
per microbatch in flight.
Mixtures of experts: config/moe_memory.py's terms (their saved tensors per MoE layer, their dispatch
buffers, which run inside a layer and count as far as they exceed the output layer's buffers).
Context parallelism (cp ranks) divides every token count by cp and adds what its attention saves
(`cp_saved_per_layer`, and allgather's mask once, `cp_mask_bytes`) and, to the comm buffers, its
transient blocks (`cp_transient_bytes`).
Document masking (--reset-position-ids, --reset-attention-mask, --eod-mask-loss; models/documents.py)
keeps what its kernels keep (`document_bytes`): the attention is counted as one causal call over the
sequence (flash: the output and one log-sum-exp per query; the math kernel the whole sequence's
s x s), which bounds what the varlen kernels and the CPU's per-document calls, recomputed in the
backward, keep, plus the step's document tensors and,
per forward in flight, the rotary tables read at the documents' positions and the masks of the
written-out math and of allgather.
"""

from __future__ import annotations

import math

from megazero.config.train_config import TrainConfig
from megazero.config.attention_memory import math_kernel_bytes
from megazero.parallel.pipeline.actions import holdings
from megazero.parallel.pipeline.zero_bubble import zero_bubble_schedule
from megazero.config.moe_memory import moe_layer_activation_extra, routed_rows, stage_moe_layers
from megazero.models.loss import chunk_tokens_for, keeps_softmax


def layer_activation_split(model_cfg, sequence_parallel: bool = False) -> tuple[float, float]:
    """(whole, split): one layer's bytes per token in 16 bits, in units of the hidden size, that every
    tensor-parallel rank keeps whole, and that the ranks split. Korthikanti et al.'s 34 = 11
    (attention: its input 2, q 2, k 2, v 2, the projection's input 2, the output dropout's mask 1) +
    19 (MLP: its input 2, the first linear's output 8, GeLU's output 8, the dropout mask 1) + 4 (the
    norms' inputs), with the attention terms at their real widths (heads x head size for q and the
    projection input, query groups x head size for k and v) and the MLP's at its width (SwiGLU: the
    first linear's output 4 x ffn, the gate's activation 2 x ffn, the product 2 x ffn); a dropout of
    probability 0 keeps no mask. Without sequence parallelism the inputs of the attention and the MLP,
    the norms' inputs and the masks (10 units) are whole on every tensor-parallel rank; with it
    everything is split: the column-parallel GEMMs keep their input's sequence shard and gather it
    again in backward (parallel/layers.py)."""
    h, m = model_cfg.hidden_size, model_cfg
    width = m.num_attention_heads * m.head_dim
    kv = m.num_query_groups * m.head_dim
    masks = 2 * h if m.hidden_dropout > 0 else 0
    mlp = (8 if m.activation == "swiglu" else 4) * m.ffn_hidden_size
    inputs, norms = 4 * h, 4 * h
    split_part = 4 * width + 4 * kv + mlp
    if sequence_parallel:
        return 0.0, (inputs + split_part + norms + masks) / h
    return (inputs + norms + masks) / h, split_part / h


def layer_activation_units(model_cfg) -> float:
    """One layer's bytes per token in 16 bits, in hidden sizes (`layer_activation_split`'s sum)."""
    return sum(layer_activation_split(model_cfg))


def output_layer_bytes(tokens: int, model_cfg, tp: int, weight_bytes: int, in_flight: int = 1) -> float:
    """What the fused output layer and loss (models/loss.py) hold at once in backward: one chunk of
    fp32 logits (chunk_tokens_for's policy) and, with 16-bit weights, its gradient in their dtype,
    and the output weight's fp32 gradient with one chunk's fp32 product being added to it. A head
    run as one chunk keeps it from forward to backward: the other microbatches in flight hold theirs."""
    vocab = model_cfg.padded_vocab_size / tp
    chunk = chunk_tokens_for(tokens, math.ceil(vocab))
    sixteen_bit_copy = weight_bytes if weight_bytes < 4 else 0
    held = chunk * vocab * (4 + sixteen_bit_copy) + 2 * vocab * model_cfg.hidden_size * 4
    if keeps_softmax(tokens, chunk):
        held += (in_flight - 1) * tokens * vocab * 4
    return held


def activation_bytes(
    seq: int,
    micro: int,
    model_cfg,
    layers: int,
    tp: int,
    in_flight: int,
    weight_bytes: int,
    chunk_layers: list[int],
    cp: int = 1,
    cp_comm_type: str = "p2p",
    sequence_parallel: bool = False,
    with_head: bool = True,
    ep: int = 1,
    kernel: str = "unknown",
    documents=None,
    microbatches: int = 1,
    offloaded: int = 0,
    host: bool = False,
) -> float:
    """Activations one rank holds at its peak: `layers` of its stage x `in_flight` microbatches.
    `kernel`: the attention kernel the device runs (config/attention_memory.py); SDPA's math kernel
    adds its (b, heads, s, s) tensors, kept per layer and at one layer's peak.

    Full recomputation keeps a checkpointed group's input only, and holds one group's (or layer's)
    full set while it is recomputed; selective recomputation saves the attention scores, which only
    the written-out attention (--attention-backend local/unfused) keeps. Context parallelism keeps
    seq / cp tokens per rank, plus what its attention saves (`cp_saved_per_layer`). MoE layers add
    config/moe_memory.py's term, spread over the stage's layers in their proportion. `documents`: a
    DataConfig with document masking on (`document_bytes`), over the step's `microbatches`.

    Activation offload (--cpu-offloading, the first `offloaded` layers of each chunk): what those
    layers save (their checkpointed inputs, under full recomputation) leaves the device for every
    microbatch in flight; the backward brings back two units at a time (the one running, the one
    fetched ahead), beyond what the layers above them held. `host`: the bytes in host memory instead."""
    m = model_cfg
    tokens, hidden = seq * micro // cp, m.hidden_size
    whole, split = layer_activation_split(m, sequence_parallel and tp > 1)
    full_layer = (whole + split / tp) * tokens * hidden * weight_bytes / 2
    full_layer += cp_saved_per_layer(seq, micro, m, tp, cp, cp_comm_type, weight_bytes)
    if m.num_experts:
        moe = stage_moe_layers(m, range(layers)) / layers
        full_layer += moe * moe_layer_activation_extra(m, tokens, micro, tp, weight_bytes, ep)
    written_out = m.attention_backend in ("local", "unfused") and not (cp > 1 and cp_comm_type == "p2p")
    if written_out and m.recompute_granularity != "selective":
        # every rank's queries (or, Ulysses, heads) over the whole sequence: 1/cp of the scores
        full_layer += 5 * m.num_attention_heads * seq * seq * micro * weight_bytes / 2 / tp / cp
    workspace = 0.0
    if kernel == "math" and cp == 1:
        kept, peak = math_kernel_bytes(micro, m.num_attention_heads / tp, seq, weight_bytes)
        selective = m.recompute_granularity == "selective"
        full_layer += 0 if selective else kept
        workspace = peak - (0 if selective else kept)  # beyond what the layer keeps
    kept_input = tokens * hidden * weight_bytes
    if m.recompute_granularity == "full" and m.recompute_method == "uniform":
        group = min(m.recompute_num_layers, layers)
        per_micro = math.ceil(layers / group) * kept_input + group * full_layer
    elif m.recompute_granularity == "full":  # block: the first N layers of each chunk
        recomputed = min(layers, sum(min(m.recompute_num_layers, n) for n in chunk_layers))
        per_micro = recomputed * kept_input + (layers - recomputed) * full_layer + full_layer
    else:
        per_micro = layers * full_layer
    away, unit = offloaded_per_micro(m, chunk_layers, offloaded, full_layer, kept_input)
    if host:
        return away * in_flight
    if away:
        # the backward's two units back at a time (the one running, the one fetched ahead) come after
        # the layers above them let their own go: they add only what exceeds those
        per_micro -= away
        workspace += max(0.0, min(2, offloaded) * unit - per_micro)
    head = output_layer_bytes(tokens, m, tp, weight_bytes, in_flight) if with_head else 0.0
    separate = documents is not None and documents.reset_attention_mask
    mask = 0.0 if separate else cp_mask_bytes(seq, cp, cp_comm_type, weight_bytes)
    if documents is not None:
        mask += document_bytes(
            seq, micro, m, cp, cp_comm_type, weight_bytes, documents, in_flight * len(chunk_layers), microbatches
        )
    return per_micro * in_flight + workspace + head + mask


def document_bytes(
    seq: int,
    micro: int,
    model_cfg,
    cp: int,
    cp_comm_type: str,
    weight_bytes: int,
    documents,
    forwards: float,
    microbatches: int,
) -> float:
    """What document masking adds (models/documents.py, `documents` a DataConfig's flags): every
    microbatch of the step's positions (int64), document numbers (int32) and this rank's loss mask
    (fp32), copied to the device up front as its tokens are; and per chunk forward in flight
    (`forwards`), what the layers share: RoPE's cos and sin read at each local token's position, the
    written-out math's (b, 1, s, s) bool mask, allgather's (b, 1, s/cp, s) additive mask (in place
    of its one (s/cp, s) mask: `cp_mask_bytes`). The attention kernels keep what the unmasked ones
    keep (one causal call per document)."""
    m, local = model_cfg, seq * micro / cp
    step = (
        microbatches
        * seq
        * micro
        * ((8 if documents.reset_position_ids else 0) + (4 if documents.reset_attention_mask else 0))
    )
    step += microbatches * local * (4 if documents.eod_mask_loss else 0)
    shared = 0.0
    if documents.reset_position_ids and m.position_embedding == "rope":
        shared += 2 * local * m.head_dim * weight_bytes
    if documents.reset_attention_mask:
        written_out = m.attention_backend in ("local", "unfused") and not (cp > 1 and cp_comm_type != "a2a")
        shared += micro * seq * seq if written_out else 0.0
        shared += local * seq * weight_bytes if cp > 1 and cp_comm_type == "allgather" else 0.0
    return step + forwards * shared


def offloaded_per_micro(
    model_cfg, chunk_layers: list[int], offloaded: int, full_layer: float, kept_input: float
) -> tuple[float, float]:
    """(bytes, largest unit): what the first `offloaded` layers of each chunk save for one microbatch,
    and the most one unit (a layer, or a checkpointed group) saves: a recomputed layer its group's
    input (parallel/activation_offload.py: the checkpoint call is the unit), any other its full set."""
    m, total, unit = model_cfg, 0.0, 0.0
    for n in chunk_layers:
        k = min(offloaded, n)
        if k == 0:
            continue
        if m.recompute_granularity == "full" and m.recompute_method == "uniform":
            total, unit = total + math.ceil(k / min(m.recompute_num_layers, n)) * kept_input, max(unit, kept_input)
        elif m.recompute_granularity == "full":
            recomputed = min(m.recompute_num_layers, k)
            total += recomputed * kept_input + (k - recomputed) * full_layer
            unit = max(unit, full_layer if k > recomputed else kept_input)
        else:
            total, unit = total + k * full_layer, max(unit, full_layer)
    return total, unit


def cp_saved_per_layer(seq: int, micro: int, model_cfg, tp: int, cp: int, comm_type: str, weight_bytes: int) -> float:
    """What a context-parallel attention saves for its backward beyond the layer's usual
    activations: the ring keeps its merged output in fp32 and one fp32 log-sum-exp per query and head;
    allgather keeps the gathered keys and values (the whole sequence's); Ulysses nothing extra
    (its head-split tensors are the local ones' size)."""
    if cp == 1:
        return 0.0
    m, local = model_cfg, seq * micro / cp
    heads, groups = m.num_attention_heads / tp, m.num_query_groups / tp
    if comm_type == "p2p":
        return local * heads * (m.head_dim + 1) * 4
    if comm_type == "allgather":
        return 2 * seq * micro * groups * m.head_dim * weight_bytes
    return 0.0


def cp_mask_bytes(seq: int, cp: int, comm_type: str, weight_bytes: int) -> float:
    """allgather's additive mask of the local queries over the whole sequence, in the activations'
    dtype: one tensor that every layer's attention saves (parallel.context_parallel._visible_bias)."""
    return seq / cp * seq * weight_bytes if cp > 1 and comm_type == "allgather" else 0.0


def cp_transient_bytes(cfg: TrainConfig) -> float:
    """The peak of a context-parallel attention's own buffers inside one layer's backward: the ring's
    K/V held and in flight with their fp32 gradient accumulators (4 blocks), q, out and dq in fp32,
    and one block's fp32 scores, probabilities and score gradients; allgather's gathered K/V
    gradients before the reduce-scatter and a copy for gloo; Ulysses' head-split q, k, v, out and
    their gradients (8 local-sized tensors)."""
    par, m = cfg.parallel, cfg.model
    cp, tp, micro = par.context_parallel, par.tensor_parallel, cfg.micro_batch_size
    if cp == 1:
        return 0.0
    local = m.seq_length * micro / cp
    heads, groups = m.num_attention_heads / tp, m.num_query_groups / tp
    weight_bytes = 2 if cfg.precision.bf16 or cfg.precision.fp16 else 4
    if par.cp_comm_type == "p2p":  # (and a block's document mask, bool, under document masking)
        return (
            4 * 2 * local * groups * m.head_dim * 4
            + 3 * local * heads * m.head_dim * 4
            + 3 * heads * local * local / micro * 4
            + cfg.data.reset_attention_mask * local * local / micro
        )
    if par.cp_comm_type == "allgather":
        return 2 * 2 * m.seq_length * micro * groups * m.head_dim * weight_bytes
    return 8 * local * heads * m.head_dim * weight_bytes


def weight_grad_bytes(
    tokens: int, model_cfg, layers: int, tp: int, weight_bytes: int, sequence_parallel: bool = False, ep: int = 1
) -> tuple[float, float]:
    """(inputs, output gradients): what one waiting W of `layers` layers holds for one microbatch of
    `tokens` tokens (seq x micro / cp) on a rank: each deferred GEMM keeps its input and its output's
    gradient until W (models/weight_grad.py `_Linear`, parallel/layers.py), in the activations'
    dtype. Per token of a dense layer: qkv's input (h, or h / tp under sequence parallelism: its
    shard, gathered again at W) and its output's gradient ((heads + 2 groups) x head size / tp); the
    projection's input (heads x head size / tp) and its output's gradient (h, whole: the
    reduce-scatter's backward gathers it); fc1's input as qkv's, its output's gradient (ffn / tp, 2 ffn
    under SwiGLU); fc2's input (ffn / tp) and its output's gradient (h). A MoE layer's experts keep
    their routed rows' (moe_memory.routed_rows) inputs and output gradients at the experts' width, the
    router its input and its fp32 logits' gradient, a shared expert what a dense MLP of its width
    keeps, in place of the dense MLP. Norms and biases keep parameter-sized sums (left out)."""
    m, h = model_cfg, model_cfg.hidden_size
    mult = 2 if m.activation == "swiglu" else 1
    col_in = h / tp if sequence_parallel and tp > 1 else h
    width, kv = m.num_attention_heads * m.head_dim, m.num_query_groups * m.head_dim
    attn_in, attn_grad = col_in + width / tp, (width + 2 * kv) / tp + h

    def mlp(ffn):
        return col_in + ffn / tp, mult * ffn / tp + h

    dense_in, dense_grad = mlp(m.ffn_hidden_size)
    moe_layers = stage_moe_layers(m, range(layers)) if m.num_experts else 0
    inputs = (layers * attn_in + (layers - moe_layers) * dense_in) * tokens * weight_bytes
    grads = (layers * attn_grad + (layers - moe_layers) * dense_grad) * tokens * weight_bytes
    if moe_layers:
        rows, ffn = routed_rows(m, tokens, 1), m.moe_ffn_hidden_size
        inputs += moe_layers * (rows * (h + ffn / tp) + tokens * h) * weight_bytes
        grads += moe_layers * (rows * (mult * ffn / tp + h) * weight_bytes + tokens * m.num_experts * 4)
        if m.moe_shared_expert_intermediate_size:
            shared_in, shared_grad = mlp(m.moe_shared_expert_intermediate_size)
            inputs += moe_layers * shared_in * tokens * weight_bytes
            grads += moe_layers * shared_grad * tokens * weight_bytes
    return inputs, grads


def zero_bubble_peaks(
    schedule: str,
    pp: int,
    virtual: int,
    microbatches: int,
    activations: float,
    waiting_inputs: float,
    waiting_grads: float,
    w_transient: float = 0.0,
    loss_transient: float = 0.0,
    loss_stage: int | None = None,
) -> list[float]:
    """Per stage, the most bytes a zero-bubble schedule has it hold on the ideal timeline of its list
    (parallel/pipeline/actions.py `holdings`): `activations` (one microbatch of the stage's layers)
    per forward whose B has not run, `waiting_inputs + waiting_grads` (weight_grad_bytes) per B whose
    W waits; while a B runs, beside what was held before it, the output gradients it makes for its W
    (its chunk's share: they are made layer by layer above activations the B frees only as it goes
    down the layers); while a W runs, beside what was held before it, `w_transient` (a chunk's: the
    gradients it makes before handing them over at once, models/split_backward.py `run`); while the
    loss's chunk (the last chunk of `loss_stage`) runs its B or its W, `loss_transient` (the output
    layer's logits and their gradient, made again in each: models/loss.py)."""
    lists = zero_bubble_schedule(schedule, pp, virtual, microbatches)
    share, wait = 1.0 / lists.layout.chunks, waiting_inputs + waiting_grads
    peaks = []
    for stage, (actions, series) in enumerate(zip(lists.ranks, holdings(lists))):
        before, peak = 0.0, 0.0
        for action, (held, deferred) in zip(actions, series):
            now = held * activations + deferred * wait
            loss = loss_transient if stage == loss_stage and action.chunk == lists.layout.chunks - 1 else 0.0
            if action.kind in ("B", "BW"):
                peak = max(peak, before + share * waiting_grads + loss)
            if action.kind in ("W", "BW"):
                during = before if action.kind == "W" else now + share * wait
                peak = max(peak, during + w_transient + loss)
            peak, before = max(peak, now), now
        peaks.append(peak)
    return peaks


def zero_bubble_in_flight(schedule: str, pp: int, virtual: int, microbatches: int) -> list[float]:
    """Per stage, the list's peak of microbatches held (activations and waiting Ws alike, each as a
    microbatch of the stage): the count tools/dry_run.py prints; the planner weighs the two apart
    (`zero_bubble_peaks`)."""
    lists = zero_bubble_schedule(schedule, pp, virtual, microbatches)
    return [max(held + deferred for held, deferred in rank) for rank in holdings(lists)]


def interleaved_in_flight(pp: int, virtual: int, microbatches: int) -> float:
    """Microbatches' worth of a whole stage the first stage holds under the interleaved 1F1B: its
    warm-up runs 2 (pp - 1) + (virtual - 1) pp chunk forwards before the first backward, and one
    more (Narayanan et al. 2021; the factor 1 + (pp - 1) / (pp virtual) of pp microbatches)."""
    chunks = min(microbatches * virtual, 2 * (pp - 1) + (virtual - 1) * pp + 1)
    return chunks / virtual
