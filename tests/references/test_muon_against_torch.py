"""megazero's Muon (one process, the ZeRO engine's step) against torch.optim.Muon and torch.optim.AdamW.

The engine trains the small GPT with gradient accumulation and clipping. Before each of its steps the
test hands the same gradients (the engine's, summed over the microbatches) to a torch copy of the
model, which steps torch.optim.Muon on the weight matrices (reference_rules.muon_matrix_names, written
from Megatron-LM's and torch's rule) and AdamW on the rest. After every step every parameter, and every
Muon momentum, must agree within 1e-6 relative.

The gradients are clipped by one coefficient on both sides: the global norm torch computes
(get_total_norm, fp32) must equal the engine's (float64 sums) within 1e-6, but the coefficient is
the engine's. torch.optim.Muon iterates in bf16, whose rounding makes its result a step function of
its input: a last-bit difference in one gradient element (fp32 and float64 norms give clip
coefficients a bit apart) moves the update by ~0.4% (bf16's precision) wherever it crosses a
rounding boundary, measured 2.7e-3 relative on a (32, 64) weight after one step. With equal inputs the
two implementations agree bitwise on the matrices.

A mixture-of-experts case adds the grouped experts, whose weight holds one (in, out) matrix per
expert: torch.optim.Muon steps each expert's (out, in) transpose, the form of a linear's weight, as a
parameter of its own (of rectangular shape: the scale's rows are the output features).

Kills (planted, one at a time): Muon run once per microbatch (DeepSpeed's bug: the momentum advanced
`gradient_accumulation_steps` times per step); no Nesterov look-ahead; the momentum as a plain sum
(B <- mu B + g); weight decay after the update; the scale read from the transposed shape; Adam's runs
covering Muon's matrices too; an expert's scale read from its stored (in, out) shape (MoE case:
weight1 differs by 1.5e-2 after step 2).
"""

from __future__ import annotations

import pytest
import torch

from megazero.data.sampler import MicrobatchSource
from megazero.data.synthetic import ArithmeticTokens
from megazero.training.lr_schedule import step_learning_rate
from megazero.ops.muon_config import MuonConfig
from megazero.parallel.process_groups import ProcessGroups
from megazero.training import setup, train_step
from megazero.zero.state_access import safe_get_full_fp32_param, safe_get_full_grad, safe_get_full_optimizer_state
from tests.layouts import small_config, with_padded_vocab
from tests.references.reference_rules import muon_matrix_names, plain_gpt, relative_gap

STEPS = 6
# torch.optim.Muon's two lr adjustments as Megatron-LM's scale modes (see megazero.ops.muon).
ORIGINAL = (dict(momentum=0.95, nesterov=True, scale_mode="shape_scaling"), dict(nesterov=True))
CASES = {
    "original": ORIGINAL,
    "match_rms_adamw": (
        dict(momentum=0.9, nesterov=False, scale_mode="spectral", extra_scale_factor=0.2),
        dict(nesterov=False, adjust_lr_fn="match_rms_adamw"),
    ),
    "experts": ORIGINAL,
}
# Rectangular experts (hidden 32 -> 48), so that a transposed scale would show.
MOE = dict(
    num_experts=4,
    moe_router_topk=2,
    moe_ffn_hidden_size=48,
    moe_shared_expert_intermediate_size=16,
    moe_shared_expert_gate=True,
    add_bias_linear=False,
)


class ExpertLeaves:
    """Each expert's matrix of the grouped weights, as the (out, in) parameter torch.optim.Muon steps."""

    def __init__(self, named: dict, names: set[str]):
        self.weights = {n: named[n] for n in sorted(names) if named[n].ndim == 3}
        self.leaves = {
            n: [w[e].detach().T.clone().requires_grad_() for e in range(w.size(0))] for n, w in self.weights.items()
        }

    def all(self) -> list:
        return [leaf for leaves in self.leaves.values() for leaf in leaves]

    def take_grads(self) -> None:
        for n, w in self.weights.items():
            for e, leaf in enumerate(self.leaves[n]):
                leaf.grad = w.grad[e].T.clone()

    def give_back(self) -> None:
        with torch.no_grad():
            for n, w in self.weights.items():
                for e, leaf in enumerate(self.leaves[n]):
                    w[e].copy_(leaf.T)

    def momentum(self, muon, name: str) -> torch.Tensor:
        return torch.stack([muon.state[leaf]["momentum_buffer"].T for leaf in self.leaves[name]])


def torch_optimizers(model, names: set[str], cfg, torch_kwargs, experts: ExpertLeaves):
    adam = cfg.optimizer.adam
    matrices = [p for n, p in model.named_parameters() if n in names and p.ndim == 2] + experts.all()
    decay = [p for n, p in model.named_parameters() if n not in names and not (n.endswith(".bias") or p.ndim == 1)]
    rest = [p for n, p in model.named_parameters() if n not in names and (n.endswith(".bias") or p.ndim == 1)]
    muon = torch.optim.Muon(
        matrices, lr=0.0, weight_decay=adam.weight_decay, momentum=cfg.optimizer.muon.momentum, **torch_kwargs
    )
    adamw = torch.optim.AdamW(
        [{"params": decay, "weight_decay": adam.weight_decay}, {"params": rest, "weight_decay": 0.0}],
        lr=0.0,
        betas=(adam.beta1, adam.beta2),
        eps=adam.eps,
    )
    return muon, adamw


@pytest.mark.parametrize("case", sorted(CASES))
def test_muon_steps_as_torch_optim_muon(case):
    ours, theirs = CASES[case]
    moe = case == "experts"  # its gradient norms run 0.83-0.94: a clip between them
    cfg = with_padded_vocab(
        small_config(
            steps=STEPS,
            layers=2,
            micro=2,
            global_batch=8,
            tied=False,
            clip=0.88 if moe else 1.2,
            lr=2e-2,
            model_extra=MOE if moe else None,
        )
    )
    cfg.optimizer.muon = MuonConfig(coefficient_type="simple", matmul_precision="medium", split_qkv=False, **ours)
    state = setup(cfg, ProcessGroups.single())
    model = plain_gpt(cfg.model, cfg.seed)
    named = dict(model.named_parameters())
    engine_params = {n: p for n, p in state.chunks[0].named_parameters()}
    names = muon_matrix_names(model)
    assert names and {n for n in names if "qkv" in n or "fc" in n or "proj" in n or "experts" in n} == names
    experts = ExpertLeaves(named, names)
    assert bool(experts.weights) == moe
    muon, adamw = torch_optimizers(model, names, cfg, theirs, experts)
    engine_step = state.engine.step
    lrs = []

    def step_both(lr):
        for n, p in engine_params.items():  # the engine's gradients, before it clips them
            named[n].grad = safe_get_full_grad(p).view_as(named[n]).clone()
        norm, clip = state.engine.grad_norm(), cfg.optimizer.clip_grad
        theirs = float(torch.nn.utils.get_total_norm([p.grad for p in model.parameters()]))
        assert abs(theirs - norm) <= 1e-6 * norm, f"{case}: gradient norm {norm} vs torch's {theirs}"
        if norm > clip:
            for p in model.parameters():
                p.grad.mul_(clip / (norm + 1e-6))  # clip_grad_norm_'s coefficient, from one norm
        experts.take_grads()
        for optimizer in (muon, adamw):
            for group in optimizer.param_groups:
                group["lr"] = lr
            optimizer.step()
        experts.give_back()
        lrs.append(lr)
        return engine_step(lr)

    state.engine.step = step_both
    data = ArithmeticTokens(cfg.model.vocab_size, cfg.model.seq_length, seed=3)
    source = MicrobatchSource(data, cfg.global_batch_size, cfg.micro_batch_size, 0, 1)
    clipped, norms = 0, []
    for it in range(STEPS):
        lr = step_learning_rate(cfg.optimizer, it + 1, STEPS, cfg.consumed_before(it))
        result = train_step(state, source.batch(it), lr)
        clipped += result.grad_norm > cfg.optimizer.clip_grad
        norms.append(result.grad_norm)
        for n, p in engine_params.items():
            gap = relative_gap(safe_get_full_fp32_param(p).view_as(named[n]), named[n].detach())
            assert gap <= 1e-6, f"{case}: step {it + 1}: {n} differs by {gap:.2e}"
            if n in names:
                mine = safe_get_full_optimizer_state(p, "exp_avg").view_as(named[n])
                theirs = experts.momentum(muon, n) if n in experts.weights else muon.state[named[n]]["momentum_buffer"]
                gap = relative_gap(mine, theirs)
                assert gap <= 1e-6, f"{case}: step {it + 1}: {n}'s momentum differs by {gap:.2e}"
    assert len(lrs) == STEPS and lrs[-1] > 0 and 0 < clipped < STEPS, (lrs, clipped, norms)
