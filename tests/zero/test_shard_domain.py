"""Shard domains (megazero/zero/shard_domain.py): a third family of parameters is one more ShardDomain
handed to the engine, with no branch for it anywhere; and the engine's methods name no family.

The third family stands in for LoRA adapters or frozen weights: the biases, replicated on both ranks
(ZeRO groups whose shard group is one rank, the data-parallel ranks its MiCS replicas), while the
other weights shard over both. On 2 gloo ranks, stages 1-3, against torch.optim.Adam on one process
fed both ranks' batches (the engine sums gradients over data parallelism): losses, the gradient norm
(a replicated bias counted once, not once per rank) and the parameters after 3 steps, rtol 1e-5.
"""

import ast
import zlib
from pathlib import Path

import pytest
import torch
from torch import nn

from megazero.models.param_info import param_info
from megazero.ops.adam_config import AdamConfig
from megazero.parallel.topology import Topology
from megazero.training.assembly import zero_groups
from megazero.zero.config import ZeroConfig
from megazero.zero.engine import ZeroEngine
from megazero.zero.shard_domain import ReduceWhenComplete, ShardDomain
from megazero.zero.state_access import safe_get_full_fp32_param
from megazero.zero.zero_groups import ZeroGroups

LR, STEPS, HANG = 1e-2, 3, 120


class Mlp(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc1, self.fc2 = nn.Linear(4, 8), nn.Linear(8, 2)

    def forward(self, x):
        return self.fc2(torch.tanh(self.fc1(x)))


def _init(name, p):
    g = torch.Generator().manual_seed(zlib.crc32(name.encode()))
    return torch.randn(p.shape, generator=g) * 0.5


def _batch(step, rank):
    return torch.randn(3, 4, generator=torch.Generator().manual_seed(100 * step + rank))


def three_families(ctx):
    """Per stage: (losses, gradient norms, full parameters, each parameter's domain) on this rank."""
    groups = ctx.groups(Topology(world_size=2))
    dense = zero_groups(groups)
    replicated = ZeroGroups(
        dp=dense.dp,
        shard=groups.tp,
        replica=dense.dp,  # tp: one rank here
        model_parallel=dense.model_parallel,
    )
    out = {}
    for stage in (1, 2, 3):
        biases = ShardDomain("biases", replicated, ReduceWhenComplete(), claims=lambda p: p.dim() == 1)
        with torch.device("meta"):
            model = Mlp()
        engine = ZeroEngine(
            [model],
            _init,
            groups=dense,
            zero=ZeroConfig(stage=stage, param_persistence_threshold=0),
            adam=AdamConfig(lr=LR, weight_decay=0.0),
            domains=[biases],
        )
        losses, norms = [], []
        for step in range(STEPS):
            engine.begin_step()
            loss = model(_batch(step, ctx.rank)).pow(2).sum()
            engine.backward(loss)
            norms.append(engine.step(LR).grad_norm)
            losses.append(loss.item())
        out[stage] = (
            losses,
            norms,
            {n: safe_get_full_fp32_param(p) for n, p in model.named_parameters()},
            {n: engine.domain_of(param_info(p).zero_storage).name for n, p in model.named_parameters()},
        )
    return out


def _torch_reference():
    model = Mlp()
    with torch.no_grad():
        for name, p in model.named_parameters():
            p.copy_(_init(name, p))
    adam = torch.optim.Adam(model.parameters(), lr=LR, betas=(0.9, 0.999), eps=1e-8)
    losses, norms = [], []
    for step in range(STEPS):
        adam.zero_grad()
        loss = model(torch.cat([_batch(step, 0), _batch(step, 1)])).pow(2).sum()
        loss.backward()
        norms.append(torch.linalg.vector_norm(torch.cat([p.grad.reshape(-1) for p in model.parameters()])).item())
        losses.append(loss.item())
        adam.step()
    return losses, norms, dict(model.named_parameters())


def test_a_third_domain_trains_as_torch_adam_does(dist_pool):
    ref_losses, ref_norms, ref_params = _torch_reference()
    rank0, rank1 = dist_pool(2).run(three_families, timeout=HANG)
    for stage in (1, 2, 3):
        (l0, n0, p0, where), (l1, n1, p1, _) = rank0[stage], rank1[stage]
        assert where == {"fc1.weight": "dense", "fc1.bias": "biases", "fc2.weight": "dense", "fc2.bias": "biases"}
        assert [a + b for a, b in zip(l0, l1)] == pytest.approx(ref_losses, rel=1e-5), f"stage {stage}"
        assert n0 == pytest.approx(ref_norms, rel=1e-5) and n1 == n0, f"stage {stage}: norms {n0} {n1} vs {ref_norms}"
        for name, ref in ref_params.items():
            for got in (p0[name], p1[name]):
                torch.testing.assert_close(got, ref.detach(), rtol=1e-5, atol=1e-6, msg=f"stage {stage} {name}")


def test_the_engine_names_no_family():
    """Only ZeroEngine.__init__ (its expert_groups / expert_parallel arguments) names the expert
    family; every other method runs over the domains alike, and shard_domain.py names none."""
    root = Path(__file__).resolve().parents[2] / "megazero" / "zero"
    engine = next(
        n
        for n in ast.parse((root / "engine.py").read_text()).body
        if isinstance(n, ast.ClassDef) and n.name == "ZeroEngine"
    )
    named = {
        f.name
        for f in engine.body
        if isinstance(f, ast.FunctionDef)
        and f.name != "__init__"
        and any("expert" in _identifier(x) for x in ast.walk(f))
    }
    assert named == set(), f"ZeroEngine methods naming the expert family: {sorted(named)}"
    domain = [_identifier(x) for x in ast.walk(ast.parse((root / "shard_domain.py").read_text()))]
    assert not [x for x in domain if "expert" in x]


def _identifier(node) -> str:
    return (
        getattr(node, "id", None)
        or getattr(node, "attr", None)
        or getattr(node, "name", None)
        or getattr(node, "arg", None)
        or ""
    ).lower()
