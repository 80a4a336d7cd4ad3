"""megazero.initialize's bad input: one UsageError line each, naming the problem and the fix, raised
before any process group exists (in one process, torch.distributed never initialised), and the
engine's misuse refused at the call.

A parameter on another device is a CUDA one made by torch's FakeTensorMode (this machine has no
GPU); a model wrapped in DistributedDataParallel is wrapped on 2 pool ranks, which then each refuse
it. zero.Init with a stage below 3 is refused in tests/zero/test_init.py.

Planted to see it fail: the check that the model's parameters are those the engine was built with
removed from engine.forward (a parameter added after initialize trains outside ZeRO, silently); the
device check accepting every device (the fake CUDA parameter reaches the engine).
"""

import pytest
import torch
import torch.distributed as dist
from torch import nn

import megazero
from megazero.core.errors import UsageError
from tests.api.hf_runs import ds_config

CONFIG = ds_config(2)


def model():
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(4, 4), nn.ReLU(), nn.Linear(4, 1))


@pytest.mark.parametrize(
    "kwargs, match",
    [
        (dict(config={**CONFIG, "zero_optimisation": {"stage": 1}}), "zero_optimisation"),
        (dict(config=CONFIG, optimizer="sgd"), "optimizer"),
        (dict(config={k: v for k, v in CONFIG.items() if k != "optimizer"}), "no optimizer block"),
        (
            dict(
                config={k: v for k, v in CONFIG.items() if k != "optimizer"},
                optimizer=lambda m: torch.optim.SGD(m, 0.1),
            ),
            "callable",
        ),
        (dict(config={**CONFIG, "train_batch_size": 3}), "train_batch_size 3"),
        (dict(config=CONFIG, mesh_param=(2, 1)), "mesh_param"),
    ],
)
def test_bad_arguments_fail_before_any_process_group(kwargs, match):
    with pytest.raises(UsageError, match=match):
        megazero.initialize(model=model(), **kwargs)
    assert not dist.is_initialized()


def test_refused_optimizers_and_models():
    m = model()
    with pytest.raises(UsageError, match="optimizer SGD is not supported"):
        megazero.initialize(
            model=m,
            optimizer=torch.optim.SGD(m.parameters(), lr=0.1),
            config={k: v for k, v in CONFIG.items() if k != "optimizer"},
        )
    with pytest.raises(UsageError, match="amsgrad"):
        megazero.initialize(
            model=m,
            optimizer=torch.optim.AdamW(m.parameters(), amsgrad=True),
            config={k: v for k, v in CONFIG.items() if k != "optimizer"},
        )
    with pytest.raises(UsageError, match="optimizer block and optimizer= is given too"):
        megazero.initialize(model=m, optimizer=torch.optim.AdamW(m.parameters()), config=CONFIG)
    meta = nn.Linear(4, 4, device="meta")
    with pytest.raises(UsageError, match="meta device"):
        megazero.initialize(model=meta, config=CONFIG)
    assert not dist.is_initialized()


def test_engine_misuse_is_refused_at_the_call():
    engine, optimizer, *_ = megazero.initialize(model=model(), config={**CONFIG, "gradient_accumulation_steps": 1})
    x = torch.ones(2, 4)
    loss = engine(x).sum()
    with pytest.raises(UsageError, match="before engine.backward"):
        engine.step()
    with pytest.raises(UsageError, match="scalar loss tensor"):
        engine.backward(loss.item())
    engine.backward(loss)
    with pytest.raises(UsageError, match="engine.step"):
        optimizer.step()
    engine.step()
    assert engine.global_steps == 1
    engine.module.extra = nn.Linear(1, 1)  # a parameter added after initialize
    with pytest.raises(UsageError, match="parameters changed after megazero.initialize"):
        engine(x)
    with pytest.raises(UsageError, match="already belongs to a megazero engine"):
        del engine.module.extra
        megazero.initialize(model=engine.module, config=CONFIG)


def test_a_parameter_on_another_device_is_refused():
    from torch._subclasses.fake_tensor import FakeTensorMode

    m = model()
    with FakeTensorMode(allow_non_fake_inputs=True):
        m[2].weight = nn.Parameter(torch.empty(1, 4, device="cuda"))
    with pytest.raises(UsageError, match=r"model parameter '2.weight' is on cuda:0: keep the model on the CPU"):
        megazero.initialize(model=m, config=CONFIG)
    assert not dist.is_initialized()


def wrap_in_ddp(ctx) -> str:
    """Pool entry: a model wrapped in DDP over the pool's ranks, given to initialize: the refusal."""
    from torch.nn.parallel import DistributedDataParallel

    try:
        megazero.initialize(model=DistributedDataParallel(model()), config=CONFIG)
    except UsageError as err:
        return str(err)
    return "accepted"


def test_a_model_wrapped_in_ddp_is_refused(dist_pool):
    lines = dist_pool(2).run(wrap_in_ddp)
    assert all(
        line.startswith("model is wrapped in DistributedDataParallel: pass the model itself") for line in lines
    ), lines
