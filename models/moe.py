"""A mixture-of-experts feed-forward block (pure, single device): a router picks top-k experts per
token, the experts are one grouped weight per projection, an optional shared expert runs on every
token. Megatron-LM's settings (GPTConfig's num_experts and moe_* fields).

Routing (scores in fp32 whatever the activations' dtype):
- softmax: top-k of the logits, then a softmax over the k chosen (Mixtral); with pre-softmax a
  softmax over all experts first and the top-k of those probabilities (Switch, GShard);
- sigmoid: sigmoid scores, the top-k by score (+ the expert bias when enabled, DeepSeek-V3: the
  bias only chooses, it never weights), the k chosen normalised to sum 1 when k > 1;
- times the top-k scaling factor when one is given.

Load balancing, each with its coefficient (its gradient enters through `AuxLossScaler`, so the
model's output stays the per-token loss):
- aux_loss (Switch, eq. 4): E * sum_i f_i P_i, f_i the fraction of the k x T choices that went to
  expert i, P_i the mean over the T tokens of expert i's full score (softmax over all experts;
  sigmoid scores normalised per token), over the tokens of one microbatch;
- seq_aux_loss (DeepSeek-V2): the same per sequence, averaged over the sequences;
- z-loss (ST-MoE, eq. 5): the mean over tokens of logsumexp(logits)^2.
The statistics are sums over the microbatch's tokens; when other ranks hold other tokens of the same
sequences (context or sequence parallelism), `MoELayer.reduce_stats` adds theirs (parallel/ sets
it), so the losses do not depend on the layout.

Capacity (moe_expert_capacity_factor; dropless without): each sequence gives an expert at most
ceil(s x k x factor / E) of its choices, kept by probability or by position, the rest dropped
(their expert output is zero); per sequence so that it does not depend on the layout.

Dispatch is an object (`LocalDispatcher` here; expert parallelism swaps in one that sends rows over
its group): it gets rows sorted by expert and returns the experts' outputs in the same rows.
"""

from __future__ import annotations

import functools
import math

import torch
import torch.nn.functional as F
from torch import nn

from .config import GPTConfig
from .split_backward import deferred_to
from .weight_grad import linear


class AuxLossScaler(torch.autograd.Function):
    """Identity on `x`; the backward also gives `loss` the gradient `weight` (Megatron's
    MoEAuxLossAutoScaler): the load-balancing losses enter the backward without being added to the
    model's output."""

    @staticmethod
    def forward(ctx, x, loss, weight: float):
        ctx.weight = weight
        ctx.save_for_backward(loss)
        return x.view_as(x)

    @staticmethod
    def backward(ctx, grad):
        (loss,) = ctx.saved_tensors
        return grad, torch.full_like(loss, ctx.weight), None


def _identity_stats(t: torch.Tensor) -> torch.Tensor:
    return t


class Router(nn.Module):
    """Scores (T, h) tokens against E experts; returns the top-k probabilities and expert indices
    (T, k) and the balancing loss to add (a scalar, 0 without coefficients)."""

    def __init__(self, config: GPTConfig):
        super().__init__()
        self.num_experts, self.topk = config.num_experts, config.moe_router_topk
        self.weight = nn.Parameter(torch.empty(config.num_experts, config.hidden_size))
        self.score_function, self.pre_softmax = config.moe_router_score_function, config.moe_router_pre_softmax
        self.scaling = config.moe_router_topk_scaling_factor
        self.balancing, self.aux_coeff = config.moe_router_load_balancing_type, config.moe_aux_loss_coeff
        self.z_coeff = config.moe_z_loss_coeff
        self.dtype = {None: None, "fp32": torch.float32, "fp64": torch.float64}[config.moe_router_dtype]
        # DeepSeek-V3's per-expert bias: a buffer, not a parameter (no gradient), updated from the
        # step's loads by `update_expert_bias`; in the state dict (checkpoints save and load it). A
        # model built on the meta device gets its zeros on the first forward's device.
        self.use_bias, self.bias_rate = config.moe_router_enable_expert_bias, config.moe_router_bias_update_rate
        self.register_buffer("expert_bias", torch.zeros(config.num_experts) if self.use_bias else None)

    def logits(self, x: torch.Tensor) -> torch.Tensor:
        dtype = self.dtype or x.dtype
        # weight_grad.linear for a split backward's W; its gradient in autograd's dtype as F.linear's
        return linear(x.to(dtype), self.weight.to(dtype), sum_in_fp32=False).float()

    def forward(self, x: torch.Tensor, sequences: int, reduce_stats=_identity_stats, stats=None):
        logits = self.logits(x)
        if self.use_bias and self.expert_bias.is_meta and not x.is_meta:
            self.expert_bias = torch.zeros(self.num_experts, device=x.device)
        probs, indices = self.top_k(logits)
        loss = self.balancing_loss(logits, indices, sequences, reduce_stats, stats)
        if stats is not None:
            with torch.no_grad():
                load = expert_counts(indices.reshape(-1), self.num_experts).float()
                stats["load"] = stats.get("load", 0) + load
        return probs, indices, loss

    def top_k(self, logits: torch.Tensor):
        if self.score_function == "softmax":
            if self.pre_softmax:
                probs, indices = torch.softmax(logits, dim=-1).topk(self.topk, dim=-1)
            else:
                top, indices = logits.topk(self.topk, dim=-1)
                probs = torch.softmax(top, dim=-1)
        else:
            scores = torch.sigmoid(logits)
            choose = scores + self.expert_bias if self.use_bias else scores
            indices = choose.topk(self.topk, dim=-1).indices
            probs = scores.gather(1, indices)
            if self.topk > 1:
                probs = probs / (probs.sum(dim=-1, keepdim=True) + 1e-20)
        if self.scaling is not None:
            probs = probs * self.scaling
        return probs, indices

    def full_scores(self, logits: torch.Tensor) -> torch.Tensor:
        """Every expert's score per token, summing to 1: what the balancing losses average."""
        if self.score_function == "softmax":
            return torch.softmax(logits, dim=-1)
        scores = torch.sigmoid(logits)
        return scores / (scores.sum(dim=-1, keepdim=True) + 1e-20)

    def balancing_loss(self, logits, indices, sequences: int, reduce_stats, stats) -> torch.Tensor:
        loss = logits.new_zeros(())
        e, k = self.num_experts, self.topk
        if self.balancing in ("aux_loss", "seq_aux_loss") and self.aux_coeff > 0:
            groups = 1 if self.balancing == "aux_loss" else sequences  # token sets balanced
            scores = self.full_scores(logits).view(groups, -1, e)
            chosen = F.one_hot(indices, e).sum(1).float().view(groups, -1, e)
            tokens = logits.new_full((groups, 1), scores.shape[1])
            # one reduction for all three sums: [prob sums | choice counts | token count]
            total = reduce_stats(torch.cat([scores.sum(1), chosen.sum(1), tokens], dim=1))
            prob_sum, counts, count = total[:, :e], total[:, e : 2 * e], total[:, 2 * e :]
            aux = (e / (k * count * count) * (counts * prob_sum)).sum(1).mean()
            loss = loss + self.aux_coeff * aux
            if stats is not None:
                stats["aux"] = stats.get("aux", 0) + aux.detach()
        if self.z_coeff > 0:
            lse = torch.logsumexp(logits, dim=-1)
            total = reduce_stats(torch.stack([lse.square().sum(), logits.new_tensor(float(lse.numel()))]))
            z = total[0] / total[1]
            loss = loss + self.z_coeff * z
            if stats is not None:
                stats["z"] = stats.get("z", 0) + z.detach()
        return loss

    @torch.no_grad()
    def update_expert_bias(self, load: torch.Tensor) -> None:
        """DeepSeek-V3's aux-loss-free step: each expert's bias moves by the rate towards balance,
        up when it got fewer tokens than the mean, down when more. `load`: the step's token counts
        per expert summed over every token of the global batch (so every rank moves alike)."""
        if self.expert_bias.is_meta and not load.is_meta:
            self.expert_bias = torch.zeros(self.num_experts, device=load.device)
        self.expert_bias += self.bias_rate * torch.sign(load.mean() - load)


def expert_capacity(s: int, k: int, factor: float, num_experts: int) -> int:
    """The choices of one sequence (s tokens, top-k) an expert keeps: ceil(s x k x factor / E)."""
    return min(math.ceil(s * k * factor / num_experts), s * k)


def balanced_kept(sequences: int, s: int, k: int, num_experts: int, capacity: int) -> int:
    """The choices kept under balanced routing: each sequence's s x k spread evenly over the experts
    (the first ones one more), each expert keeping at most `capacity` of them. What a dry run's
    meta tensors stand for (they have no values to route by; see MoELayer.route)."""
    n = s * k
    return sequences * sum(min(capacity, n // num_experts + (e < n % num_experts)) for e in range(num_experts))


def capacity_keep(probs, indices, sequences: int, num_experts: int, factor: float, policy: str):
    """(T, k) bool: which choices each sequence's experts keep, at most ceil(s x k x factor / E)
    per expert and sequence; by probability ("probs") or the earliest tokens ("position")."""
    t, k = indices.shape
    s = t // sequences
    capacity = expert_capacity(s, k, factor, num_experts)
    chosen = F.one_hot(indices.reshape(sequences, s * k), num_experts).bool()  # (b, s*k, E)
    if policy == "probs":
        key = probs.detach().reshape(sequences, s * k, 1).expand_as(chosen)
    else:  # earlier tokens first: a larger key for a smaller position
        key = -torch.arange(s * k, device=probs.device, dtype=probs.dtype).view(1, -1, 1).expand_as(chosen)
    key = torch.where(chosen, key, torch.full_like(key, -math.inf))
    kept_rows = key.topk(capacity, dim=1).indices  # (b, capacity, E)
    keep = torch.zeros_like(chosen).scatter_(1, kept_rows, True) & chosen
    return keep.any(dim=2).view(t, k)


def expert_counts(experts: torch.Tensor, num_experts: int) -> torch.Tensor:
    """How many of `experts` (expert indices) name each expert: bincount with minlength E, as a
    scatter-add, whose output shape does not depend on the values (meta tensors have none)."""
    return torch.zeros(num_experts, dtype=torch.long, device=experts.device).index_add_(
        0, experts, torch.ones_like(experts)
    )


def sort_by_expert(indices, keep, num_experts: int, pad_to: int | None = None, read_kept=int):
    """Rows for the experts, sorted by expert: (slots, counts). `slots[r]` is the flat choice
    (token x k + j) row r computes, -1 for a padding row; `counts[e]` how many rows expert e gets
    (`pad_to` each when padding to capacity). The dropped choices (not in `keep`) sort last, as an
    expert past the last one, so every shape is fixed but the number of rows kept without padding:
    `read_kept` turns that count (a 0-dim device tensor) into the host's int (a host sync, as the
    nonzero it replaces was on a GPU; the dispatcher gives it, see MoELayer.route)."""
    flat = indices.reshape(-1)
    if keep is None:
        return torch.argsort(flat, stable=True), expert_counts(flat, num_experts)
    key = torch.where(keep.reshape(-1), flat, num_experts)
    order = torch.argsort(key, stable=True)  # kept choices by (expert, position), then the dropped
    counts = expert_counts(key, num_experts + 1)
    if pad_to is None:
        return order[: read_kept(counts[:num_experts].sum())], counts[:num_experts]
    # expert e's i-th row at e x pad_to + i; the dropped ones past every expert's rows, cut off
    experts = key[order]
    starts = torch.cumsum(counts, 0) - counts
    place = experts * pad_to + torch.arange(order.numel(), device=order.device) - starts[experts]
    slots = torch.full((num_experts * pad_to + order.numel(),), -1, dtype=order.dtype, device=order.device)
    slots = slots.index_copy(0, place, order)[: num_experts * pad_to]
    return slots, torch.full_like(counts[:num_experts], pad_to)


def grouped_mm_usable(x: torch.Tensor, weight: torch.Tensor) -> bool:
    """torch._grouped_mm needs rows of whole 16-byte blocks (and an fp32/bf16/fp16 kernel)."""
    if not hasattr(torch, "_grouped_mm") or x.dtype not in (torch.float32, torch.bfloat16, torch.float16):
        return False
    return all((d * x.element_size()) % 16 == 0 for d in (x.shape[-1], weight.shape[-1]))


class _ContiguousGrad(torch.autograd.Function):
    """Identity whose backward hands on a contiguous gradient (grouped_mm's backward needs one)."""

    @staticmethod
    def forward(ctx, x):
        return x.view_as(x)

    @staticmethod
    def backward(ctx, grad):
        return grad.contiguous()


def grouped_matmul(
    x: torch.Tensor, weight: torch.Tensor, counts: torch.Tensor, grouped: bool, sizes: list[int] | None = None
) -> torch.Tensor:
    """Rows of x (n, a) times weight[e] (E, a, b) for the counts[e] rows of each expert e, in order:
    one torch._grouped_mm where it runs, else a loop of matmuls (the same products). `sizes`: the
    counts as the host already read them (the loop needs them there), if it has. In a split
    backward (models/split_backward.py) the experts' weight gradient waits for W."""
    work = deferred_to(weight)
    if work is not None:
        use_grouped = grouped and grouped_mm_usable(x, weight)
        if not use_grouped and sizes is None:
            sizes = counts.tolist()
        return _DeferredGroupedMatmul.apply(x, weight, counts, use_grouped, sizes, work)
    if grouped and grouped_mm_usable(x, weight):
        offsets = torch.cumsum(counts, 0).to(torch.int32)
        return _ContiguousGrad.apply(torch._grouped_mm(x, weight, offs=offsets))
    return _looped_matmul(x, weight, sizes if sizes is not None else counts.tolist())


def _looped_matmul(x, weight, sizes: list[int]) -> torch.Tensor:
    pieces = x.split(sizes)
    return (
        torch.cat([piece @ weight[e] for e, piece in enumerate(pieces)]) if pieces else x.new_zeros(0, weight.shape[-1])
    )


class _DeferredGroupedMatmul(torch.autograd.Function):
    """grouped_matmul in a split backward: B gives the rows' gradient, W each expert's weight
    gradient x_e^T g_e, from the rows and their gradient held until then; the same products as
    autograd's backward of either form (grouped: torch._grouped_mm; looped: one matmul per expert)."""

    @staticmethod
    def forward(ctx, x, weight, counts, grouped: bool, sizes, work):
        ctx.save_for_backward(x, weight, counts)
        ctx.grouped, ctx.sizes, ctx.work, ctx.param = grouped, sizes, work, weight
        if grouped:
            return torch._grouped_mm(x, weight, offs=torch.cumsum(counts, 0).to(torch.int32))
        return _looped_matmul(x, weight, sizes)

    @staticmethod
    def backward(ctx, grad):
        x, weight, counts = ctx.saved_tensors
        grad, param, sizes = grad.contiguous(), ctx.param, ctx.sizes
        if ctx.grouped:
            offsets = torch.cumsum(counts, 0).to(torch.int32)
            grad_x = torch._grouped_mm(grad, weight.transpose(-2, -1), offs=offsets)
            ctx.work.add(lambda _: [(param, torch._grouped_mm(x.t(), grad, offs=offsets))])
        else:
            grad_x = (
                torch.cat([g @ weight[e].t() for e, g in enumerate(grad.split(sizes))])
                if sizes
                else torch.zeros_like(x)
            )
            ctx.work.add(
                lambda _: [(param, torch.stack([p.t() @ g for p, g in zip(x.split(sizes), grad.split(sizes))]))]
            )
        return grad_x, None, None, None, None, None


class GroupedExperts(nn.Module):
    """`num_experts` experts, each an MLP without biases (Mixtral's), as one weight per projection:
    weight1 (E, h, f) or, with SwiGLU, (E, h, 2f) holding [gate | up]; weight2 (E, f, h)."""

    def __init__(
        self,
        num_experts: int,
        hidden: int,
        ffn: int,
        *,
        swiglu: bool,
        gelu_approximate="tanh",
        grouped: bool = False,
        device=None,
        dtype=None,
    ):
        super().__init__()
        self.swiglu, self.gelu_approximate, self.grouped = swiglu, gelu_approximate, grouped
        self.weight1 = nn.Parameter(
            torch.empty(num_experts, hidden, ffn * (2 if swiglu else 1), device=device, dtype=dtype)
        )
        self.weight2 = nn.Parameter(torch.empty(num_experts, ffn, hidden, device=device, dtype=dtype))

    @classmethod
    def of(cls, config: GPTConfig) -> "GroupedExperts":
        return cls(
            config.num_experts,
            config.hidden_size,
            config.moe_ffn_hidden_size,
            swiglu=config.activation == "swiglu",
            gelu_approximate=config.gelu_approximate,
            grouped=config.moe_grouped_gemm,
        )

    def forward(self, x: torch.Tensor, counts: torch.Tensor, sizes: list[int] | None = None) -> torch.Tensor:
        """x (n, h): rows sorted by expert, counts[e] of them for expert e (`sizes`: the same
        counts on the host, where the caller has read them)."""
        y = grouped_matmul(x, self.weight1, counts, self.grouped, sizes)
        if self.swiglu:
            gate, up = y.chunk(2, dim=-1)
            y = F.silu(gate) * up
        else:
            y = F.gelu(y, approximate=self.gelu_approximate)
        return grouped_matmul(y, self.weight2, counts, self.grouped, sizes)


class LocalDispatcher:
    """Every expert on this device: the rows go straight to them."""

    def rows_kept(self, count: torch.Tensor, healthy: int) -> int:
        """The number of choices a capacity kept (a device count) on the host; `healthy`: the count
        under balanced routing, which parallel/'s dispatchers answer a meta tensor with."""
        return int(count)

    def __call__(self, experts: GroupedExperts, rows: torch.Tensor, counts: torch.Tensor) -> torch.Tensor:
        return experts(rows, counts)


class MoELayer(nn.Module):
    """The MoE block in a transformer layer's MLP place: forward(x (b, s, h)) -> (b, s, h)."""

    def __init__(self, config: GPTConfig, shared_experts: nn.Module | None = None):
        """`shared_experts`: the MLP every token also goes through (gpt.py builds the dense MLP, gated by
        sigmoid(x . w) with --moe-shared-expert-gate, at
        --moe-shared-expert-intermediate-size), or None."""
        super().__init__()
        self.num_experts, self.topk = config.num_experts, config.moe_router_topk
        self.capacity_factor, self.drop_policy = config.moe_expert_capacity_factor, config.moe_token_drop_policy
        self.pad_to_capacity = config.moe_pad_expert_input_to_capacity
        self.router = Router(config)
        self.experts = GroupedExperts.of(config)
        self.shared_experts = shared_experts
        self.dispatcher = LocalDispatcher()
        # The factor the balancing losses' gradient enters with: the training loop sets this
        # microbatch's share of the global batch (times the loss scale); 1 alone.
        self.aux_loss_weight = 1.0
        self.reduce_stats = _identity_stats  # see the module docstring; parallel/ sets it
        self.stats: dict[str, torch.Tensor] | None = None  # a dict to gather loads and losses into

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, h = x.shape[0], x.shape[-1]
        tokens = x.reshape(-1, h)
        probs, indices, loss = self.router(tokens, b, self.reduce_stats, self.stats)
        if loss.requires_grad:
            probs = AuxLossScaler.apply(probs, loss, self.aux_loss_weight)
        y = self.route(tokens, probs, indices, b).view_as(x)
        if self.shared_experts is not None:
            y = y + self.shared_experts(x)
        return y

    def route(self, tokens, probs, indices, sequences: int) -> torch.Tensor:
        """Drops (with a capacity), sorts the choices by expert, runs the experts through the
        dispatcher and sums each token's k outputs weighted by their probabilities."""
        t, k = indices.shape
        keep, pad_to, read_kept = None, None, int
        if self.capacity_factor is not None:
            s = t // sequences
            capacity = expert_capacity(s, k, self.capacity_factor, self.num_experts)
            keep = capacity_keep(probs, indices, sequences, self.num_experts, self.capacity_factor, self.drop_policy)
            if self.stats is not None:
                self.stats["dropped"] = self.stats.get("dropped", 0) + (~keep).sum().float()
            if self.pad_to_capacity:  # fixed shapes: nothing read on the host here
                pad_to = sequences * capacity
            else:  # the rows kept: one host read (the dispatcher's)
                healthy = balanced_kept(sequences, s, k, self.num_experts, capacity)
                read_kept = functools.partial(self.dispatcher.rows_kept, healthy=healthy)
        slots, counts = sort_by_expert(indices, keep, self.num_experts, pad_to, read_kept)
        padded = torch.cat([tokens, tokens.new_zeros(1, tokens.shape[1])])
        rows = padded[torch.where(slots >= 0, slots // k, t)]
        out = self.dispatcher(self.experts, rows, counts)
        placed = out.new_zeros(t * k + 1, out.shape[1]).index_copy(0, torch.where(slots >= 0, slots, t * k), out)
        return (placed[: t * k].view(t, k, -1) * probs.unsqueeze(-1).to(out.dtype)).sum(1)
