"""zero.Init (megazero/zero/init.py, init_replay.py): a model built inside it holds the weights the
same model built outside holds, seed for seed, and trains as it does.

- In one process, against the model built eagerly by torch / transformers (what we do not own):
  every parameter equal bitwise, and the random generator left where the eager build leaves it, for
  Llama, GPT-2 and Mixtral (their `_init_weights` re-initialise after construction) and for a module
  of our own whose construction mixes parameters made by `torch.randn`, reset_parameters, an
  embedding padding row zeroed after `normal_`, a `trunc_normal_` chain, a tied weight and a buffer
  computed from torch's generator between two parameters. No parameter's full value exists longer
  than its own initialisation: the live full values are counted during the replay.
- On 2 ranks: built under zero.Init, trained by megazero.initialize at stage 3 (each rank holding a
  slice until the engine adopts it), the loss curve and final weights equal the plain torch loop's
  (tests/api/hf_runs.py); GatheredParameters(modifier_rank=0) on a zero.Init-built parameter
  before initialize carries the edit into the engine.

Planted to see them fail: random ops not advancing the generator while recording (all four builds
differ), torch.nn.init's meta no-ops left unrecorded (SKIPS_META empty: the trunc_normal_ parameter
of `Mixed` keeps garbage and the generator lags), the dead-value elimination treating a partial
overwrite (the padding row) as a complete one (`Mixed` differs).
"""

import pytest
import torch
from torch import nn

from megazero.core.errors import UsageError
from megazero.zero import init_replay
from megazero.zero.init import Init
from megazero.models.param_info import param_info
from tests.api.hf_runs import ds_config, tiny_model, torch_reference, train_with_megazero, assert_matches


class Mixed(nn.Module):
    """Construction with every pattern the replay must order right."""

    def __init__(self):
        super().__init__()
        self.scale = nn.Parameter(torch.randn(5))
        self.lin = nn.Linear(6, 5)
        self.register_buffer("noise", torch.rand(3))  # real draw between two parameters
        self.emb = nn.Embedding(7, 6, padding_idx=2)
        with torch.no_grad():
            self.emb.weight.normal_(0, 0.5)
            self.emb.weight[self.emb.padding_idx].zero_()
        self.deep = nn.Parameter(torch.empty(4, 6))
        nn.init.trunc_normal_(self.deep, std=0.02)
        self.head = nn.Linear(6, 7, bias=False)
        self.head.weight = self.emb.weight  # tied


def full_values(model) -> dict[str, torch.Tensor]:
    return {
        n: param_info(p).init_shard.full() if param_info(p).init_shard is not None else p.detach()
        for n, p in model.named_parameters()
    }


@pytest.mark.parametrize(
    "build",
    [lambda: tiny_model("llama"), lambda: tiny_model("gpt2"), lambda: tiny_model("mixtral"), Mixed],
    ids=["llama", "gpt2", "mixtral", "mixed"],
)
def test_init_builds_the_weights_the_eager_build_does(build):
    torch.manual_seed(5)
    eager = build()
    after_eager = torch.rand(4)
    torch.manual_seed(5)
    with Init():
        lazy = build()
    after_lazy = torch.rand(4)
    assert torch.equal(after_eager, after_lazy), "zero.Init moved the generator"
    assert all(p.is_meta for p in lazy.parameters())
    want, got = dict(eager.named_parameters()), full_values(lazy)
    assert want.keys() == got.keys()
    for name, value in want.items():
        assert torch.equal(got[name], value.detach()), f"{name} differs from the eager build"
    for (name, b), (_, lb) in zip(eager.named_buffers(), lazy.named_buffers()):
        assert torch.equal(b, lb), f"buffer {name}"


def test_replay_holds_one_parameter_at_a_time(monkeypatch):
    """The replay's live full values never exceed the largest few parameters (not the model)."""
    live, peak = [0], [0]
    real_keep = Init._keep

    def counting_keep(self, param, value):
        live[0] -= value.numel()
        real_keep(self, param, value)

    real_storage = torch.UntypedStorage

    def storage(nbytes, *args, **kwargs):
        live[0] += nbytes // 4
        peak[0] = max(peak[0], live[0])
        return real_storage(nbytes, *args, **kwargs)

    monkeypatch.setattr(Init, "_keep", counting_keep)
    monkeypatch.setattr(init_replay.torch, "UntypedStorage", storage)
    torch.manual_seed(5)
    with Init():
        model = tiny_model("llama")
    total = sum(p.numel() for p in model.parameters())
    largest = max(p.numel() for p in model.parameters())
    assert peak[0] <= 3 * largest < total / 2, (peak[0], largest, total)


def test_init_refuses_a_stage_below_3_as_deepspeed_fails_on_it():
    with pytest.raises(UsageError, match="stage 2: only stage 3 keeps parameters partitioned"):
        Init(config_dict_or_path={"zero_optimization": {"stage": 2}})
    with pytest.raises(UsageError, match="reads a value of a parameter"):
        with Init():
            lin = nn.Linear(3, 3)
            if lin.weight.sum() > 0:
                pass


def build_under_init():
    with Init():
        return tiny_model("llama")


def edit_before_initialize(ctx):
    """GatheredParameters(modifier_rank=0) on a zero.Init parameter: rank 0's edit reaches every
    rank's slice, then the engine (stage 3)."""
    import megazero
    from megazero.parallel.topology import Topology
    from megazero.zero import GatheredParameters
    from megazero.utils import safe_get_full_fp32_param

    groups = ctx.groups(Topology(world_size=2))
    if groups is None:
        return None
    with Init():
        model = tiny_model("llama")
    norm = model.model.norm.weight
    with GatheredParameters([norm], modifier_rank=0):
        if groups.rank == 0:
            norm.data.fill_(3.0)
    assert norm.is_meta
    engine, *_ = megazero.initialize(model=model, config=ds_config(3), process_groups=groups)
    return safe_get_full_fp32_param(engine.module.model.norm.weight)


def test_init_built_model_trains_as_the_plain_loop_on_2_ranks(dist_pool):
    pool = dist_pool(2)  # zero.Init slices over every rank: the pool is the model's ranks
    result = pool.run(train_with_megazero, "llama", 2, ds_config(3), build=build_under_init)[0]
    assert_matches(result, torch_reference("llama", 2), "zero.Init llama dp 2 stage 3")
    edited = pool.run(edit_before_initialize)
    assert torch.equal(edited[0], torch.full_like(edited[0], 3.0)) and torch.equal(edited[1], edited[0])
