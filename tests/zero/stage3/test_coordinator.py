"""ZeRO stage 3 in detail, on layers with known weights (2 gloo ranks).

Integer-valued weights and inputs make every activation and gradient exact in fp32, so the checks are
equalities against a float64 formula, not a second run of the same code.
"""

import warnings

import numpy as np
import torch
from torch import nn

from megazero.parallel.topology import Topology
from megazero.training.assembly import zero_groups
from megazero.zero.config import ZeroConfig
from megazero.ops.adam_config import AdamConfig
from megazero.zero.engine import ZeroEngine
from megazero.zero.stage3.gathered import GatheredParameters, register_external_parameter
from megazero.zero.stage3.units import ParamStatus
from megazero.models.param_info import param_info

W1 = np.array([[1, 2], [3, -4], [5, 6]], dtype=np.float64)  # fc1: 2 -> 3 (6 + 3 = 9 elements:
B1 = np.array([1, 0, -2], dtype=np.float64)  #  over 2 ranks, 5 each, 1 padding)
W2 = np.array([[2, -1, 3]], dtype=np.float64)  # fc2: 3 -> 1
B2 = np.array([4], dtype=np.float64)
KNOWN = {"fc1.weight": W1, "fc1.bias": B1, "fc2.weight": W2, "fc2.bias": B2}


class TwoLinear(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc1, self.fc2 = nn.Linear(2, 3), nn.Linear(3, 1)

    def forward(self, x):
        return self.fc2(self.fc1(x))


def _engine(ctx, model, zero: ZeroConfig, init):
    groups = ctx.groups(Topology(world_size=2))
    return ZeroEngine([model], init, groups=zero_groups(groups), zero=zero, adam=AdamConfig(lr=0.0, weight_decay=0.0))


def _inputs(rank):
    x = np.array([[1, rank + 1], [2, -1]], dtype=np.float64)
    c = np.array([[1], [-2]], dtype=np.float64)
    return x, c


def _expected(world=2):
    """Activations of this rank and the DP-summed gradients, by the chain rule in float64."""
    grads = {k: np.zeros_like(v) for k, v in KNOWN.items()}
    acts = []
    for r in range(world):
        x, c = _inputs(r)
        h = x @ W1.T + B1
        y = h @ W2.T + B2
        acts.append((h, y))
        dh = c @ W2
        grads["fc2.weight"] += c.T @ h
        grads["fc2.bias"] += c.sum(0)
        grads["fc1.weight"] += dh.T @ x
        grads["fc1.bias"] += dh.sum(0)
    return acts, grads


def analytic_stage3(ctx):
    groups_world = 2
    if ctx.rank >= groups_world:
        ctx.groups(Topology(world_size=2))
        return None
    with torch.device("meta"):
        model = TwoLinear()
    init = lambda name, p: torch.tensor(KNOWN[name], dtype=torch.float32)  # noqa: E731
    engine = _engine(ctx, model, ZeroConfig(stage=3, param_persistence_threshold=0), init)
    seen = {}
    for name in ("fc1", "fc2"):
        getattr(model, name).register_forward_hook(lambda m, a, out, n=name: seen.__setitem__(n, out.detach()))
    x, c = _inputs(ctx.rank)
    engine.begin_step()
    y = model(torch.tensor(x, dtype=torch.float32))
    engine.backward((y * torch.tensor(c, dtype=torch.float32)).sum())
    engine.finish_gradients()
    acts, grads = _expected()
    h, y_expected = acts[ctx.rank]
    assert torch.equal(seen["fc1"], torch.tensor(h, dtype=torch.float32))
    assert torch.equal(seen["fc2"], torch.tensor(y_expected, dtype=torch.float32))
    store = engine.unit_storage
    partitions = {}
    for unit in store.units:
        flat = np.concatenate([grads[f"{unit.name}.{n}"].ravel() for n in ("weight", "bias")])
        padded = np.zeros(unit.total)
        padded[: flat.size] = flat
        expected = padded[ctx.rank * unit.part_size : (ctx.rank + 1) * unit.part_size]
        got = store.unit_slice(store.grad_part, unit)
        assert torch.equal(got, torch.tensor(expected, dtype=torch.float32)), (unit.name, got, expected)
        partitions[unit.name] = (unit.part_size, unit.total - unit.numel)
    engine.step(lr=0.0)
    for p in model.parameters():
        assert param_info(p).zero_unit.status is ParamStatus.NOT_AVAILABLE and p.data.numel() == 0
    return partitions


def test_stage3_exact_activations_and_gradient_partitions(dist_pool):
    results = dist_pool(2).run(analytic_stage3)
    # A unit is a bucket of the flat layout: padded so each rank's chunk is a multiple of
    # CHUNK_ALIGN (8) elements. fc1 has 9 elements (16 in all, 7 padding), fc2 has 4 (12 padding).
    assert results[0] == results[1] == {"fc1": (8, 7), "fc2": (8, 12)}


class Stack(nn.Module):
    def __init__(self, n=4, width=8):
        super().__init__()
        self.layers = nn.Sequential(*[nn.Linear(width, width) for _ in range(n)])

    def forward(self, x):
        return self.layers(x)


def live_bound(ctx, max_live):
    if ctx.rank >= 2:
        ctx.groups(Topology(world_size=2))
        return None
    with torch.device("meta"):
        model = Stack()
    init = lambda name, p: torch.full(p.shape, 0.1)  # noqa: E731
    zero = ZeroConfig(
        stage=3,
        param_persistence_threshold=0,
        max_live_parameters=max_live,
        prefetch_bucket_size=10**6,
        max_reuse_distance=10**6,
    )
    engine = _engine(ctx, model, zero, init)
    live_after_steps = []
    for _ in range(3):
        engine.begin_step()
        engine.backward(model(torch.ones(2, 8)).sum())
        engine.step(lr=0.0)
        live_after_steps.append(engine.unit_storage.live_numel)
    return engine.unit_storage.peak_live_numel, live_after_steps, engine.gather.trace_names()


def test_stage3_live_parameter_bound_and_trace(dist_pool):
    unit = 8 * 8 + 8  # one Linear's gathered elements (72 over 2 ranks: 36 each)
    bounded = dist_pool(2).run(live_bound, 2 * unit)
    unbounded = dist_pool(2).run(live_bound, 10**9)
    for peak, live_after, trace in bounded[:2]:
        assert peak <= 2 * unit, f"gathered {peak} elements with max_live_parameters {2 * unit}"
        assert live_after == [0, 0, 0]
        assert trace[:4] == ["layers.0", "layers.1", "layers.2", "layers.3"] and len(trace) == 8
    assert unbounded[0][0] > 2 * unit, "without the bound, prefetch and reuse would hold more"


def tied_and_gathered(ctx):
    """A head using the embedding's weight (shared registration), an explicitly registered external
    parameter, and GatheredParameters editing a weight that survives the optimizer step."""
    if ctx.rank >= 2:
        ctx.groups(Topology(world_size=2))
        return None

    class UsesOther(nn.Module):
        """Multiplies by another module's weight, reached through an unregistered reference."""

        def __init__(self, owner):
            super().__init__()
            self.__dict__["owner"] = owner

        def forward(self, x):
            return x @ self.owner.weight

    class Tied(nn.Module):
        def __init__(self):
            super().__init__()
            self.emb = nn.Embedding(10, 4)
            self.head = nn.Linear(4, 10, bias=False)
            self.head.weight = self.emb.weight  # tied by shared registration
            self.scale = nn.Linear(4, 4, bias=False)
            self.user = UsesOther(self.scale)

        def forward(self, t):
            return self.head(self.user(self.emb(t)))

    with torch.device("meta"):
        model = Tied()
    init = lambda name, p: torch.arange(p.numel(), dtype=torch.float32).view(p.shape) / 10  # noqa: E731
    engine = _engine(ctx, model, ZeroConfig(stage=3, param_persistence_threshold=0), init)
    register_external_parameter(model.user, model.scale.weight)
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # the trace must stay valid step to step
        for _ in range(2):
            engine.begin_step()
            engine.backward(model(torch.tensor([[1, 2, 3]])).sum())
            engine.step(lr=0.0)
    with GatheredParameters([model.emb.weight], modifier_rank=1):
        full = model.emb.weight.data.clone()
        if ctx.rank == 1:
            model.emb.weight.data.fill_(0.5)
    assert model.emb.weight.data.numel() == 0
    with GatheredParameters(model.emb.weight):
        after = model.emb.weight.data.clone()
    return full.sum().item(), after.unique().tolist()


def test_tied_weights_external_params_and_gathered_edit(dist_pool):
    results = dist_pool(2).run(tied_and_gathered)
    assert results[0] == results[1]
    assert results[0][1] == [0.5], "the modifier rank's edit reaches every rank"


def test_order_change_rerecords_trace_with_warning(dist_pool):
    dist_pool(2).run(order_change)


def order_change(ctx):
    if ctx.rank >= 2:
        ctx.groups(Topology(world_size=2))
        return None
    with torch.device("meta"):
        model = Stack(n=3)
    engine = _engine(
        ctx, model, ZeroConfig(stage=3, param_persistence_threshold=0), lambda name, p: torch.full(p.shape, 0.1)
    )
    order = [0, 1, 2]
    for step in range(3):
        if step == 1:
            order = [2, 0, 1]
        engine.begin_step()
        x = torch.ones(1, 8)
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            for i in order:
                x = model.layers[i](x)
            engine.backward(x.sum())
            engine.step(lr=0.0)
        changed = any("module order changed" in str(w.message) for w in caught)
        assert changed == (step == 1), f"step {step}: warning {changed}"
    assert engine.gather.trace_names()[:3] == ["layers.2", "layers.0", "layers.1"]
