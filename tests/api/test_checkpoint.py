"""engine.save_checkpoint / engine.load_checkpoint (megazero/api/checkpoint.py) on a user's model.

- In one process at ZeRO-3: 2 steps, a save (with client_state), 2 more steps; a fresh engine that
  loads the checkpoint trains those 2 steps to bitwise the same losses and weights, and gets the
  client_state and the global step back.
- One writer per folder, as pretrain_gpt.py's --save: while this process's engine has saved into a
  folder (and lives), a 2-rank job saving there is refused on both ranks with one line naming this
  process (its pid); once the first engine is gone, the same save succeeds.

Planted to see it fail: the lock taken and released within each save (the second job saves).
"""

import gc
import os

import torch
from torch import nn

import megazero
from megazero.core.errors import UsageError
from megazero.utils import safe_get_full_fp32_param


def model():
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(6, 8), nn.Tanh(), nn.Linear(8, 3))


CONFIG = {
    "train_micro_batch_size_per_gpu": 4,
    "gradient_accumulation_steps": 1,
    "optimizer": {"type": "AdamW", "params": {"lr": 1e-2, "weight_decay": 0.1}},
    "zero_optimization": {"stage": 3, "stage3_param_persistence_threshold": 0},
}


def train(engine, steps: range) -> list[float]:
    losses = []
    for i in steps:
        g = torch.Generator().manual_seed(i)
        x, y = torch.randn(4, 6, generator=g), torch.randn(4, 3, generator=g)
        loss = nn.functional.mse_loss(engine(x), y)
        engine.backward(loss)
        engine.step()
        losses.append(loss.item())
    return losses


def test_a_loaded_checkpoint_trains_on_as_the_run_that_saved_it(tmp_path):
    engine, *_ = megazero.initialize(model=model(), config=CONFIG)
    train(engine, range(2))
    engine.save_checkpoint(tmp_path / "ck", client_state={"epoch": 3})
    after = train(engine, range(2, 4))
    weights = [safe_get_full_fp32_param(p) for p in engine.module.parameters()]
    del engine
    fresh, *_ = megazero.initialize(model=model(), config=CONFIG)
    path, client_state = fresh.load_checkpoint(tmp_path / "ck")
    assert client_state == {"epoch": 3} and fresh.global_steps == 2 and path.endswith("global_step2")
    assert train(fresh, range(2, 4)) == after
    assert all(torch.equal(a, safe_get_full_fp32_param(b)) for a, b in zip(weights, fresh.module.parameters()))


def save_into(ctx, folder: str) -> str:
    """Pool entry: every rank trains a step and saves into `folder`; the refusal's line, or "saved"."""
    from megazero.parallel.topology import Topology

    groups = ctx.groups(Topology(world_size=ctx.world_size))
    engine, *_ = megazero.initialize(model=model(), config=CONFIG, process_groups=groups)
    train(engine, range(1))
    try:
        engine.save_checkpoint(folder)
    except UsageError as err:
        return str(err)
    return "saved"


def test_a_second_job_saving_into_the_folder_is_refused_naming_the_first(dist_pool, tmp_path):
    folder = tmp_path / "ck"
    first, *_ = megazero.initialize(model=model(), config=CONFIG)
    train(first, range(1))
    first.save_checkpoint(folder)
    assert (folder / ".lock").is_file()
    pool = dist_pool(2)
    lines = pool.run(save_into, str(folder))
    for line in lines:
        assert (
            line.startswith(f"engine.save_checkpoint({str(folder)!r}): another job writes there")
            and f"pid {os.getpid()} " in line
            and "\n" not in line
        ), lines
    del first
    gc.collect()
    assert not (folder / ".lock").exists()
    assert pool.run(save_into, str(folder)) == ["saved", "saved"]
