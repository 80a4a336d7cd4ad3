"""Our ZB-V against torch's: the same tiny model trained on 2 gloo ranks with
torch.distributed.pipelining's ScheduleZBVZeroBubble and with ours (the zbv list, run by
parallel/pipeline/action_runner.py with the split backward of models/split_backward.py) gives the
same losses, fp32, rtol 1e-5, over 5 steps of 8 microbatches.

The model: 4 virtual stages of Linear(16, 16) + tanh in a V (rank 0 holds stages 0 and 3, rank 1
stages 1 and 2), mean squared error against fixed targets, plain SGD after each step. torch's side
runs torch's own nn.Linear under its own B/W split; ours models/weight_grad.Linear (same weights),
whose W is deferred by the runner. Both scale each microbatch's gradient by 1/m.
Planted, failing here: the deferred Linear's W computing its gradients from twice the output's
gradient: 32 of the 40 losses part (all after the first step's update).
"""

import torch
from torch import nn

from megazero.models.weight_grad import Linear
from megazero.parallel.pipeline.p2p import PipelineP2P, backward_from_freed
from megazero.parallel.pipeline.schedules import PipelineJob, get_schedule
from megazero.parallel.topology import Topology

STEPS, MICROBATCHES, ROWS, WIDTH, LR = 5, 8, 2, 16, 0.1
MINE = {0: (0, 3), 1: (1, 2)}  # rank -> its virtual stages, in chunk order (the V)


def stage_module(virtual: int, linear=nn.Linear) -> nn.Module:
    torch.manual_seed(100 + virtual)
    layer = linear(WIDTH, WIDTH)
    return nn.Sequential(layer, nn.Tanh())


def data():
    gen = torch.Generator().manual_seed(5)
    x = torch.randn(STEPS, MICROBATCHES * ROWS, WIDTH, generator=gen)
    return x, torch.randn(STEPS, MICROBATCHES * ROWS, WIDTH, generator=gen)


def mse(output, target):
    return ((output - target) ** 2).mean()


def sgd(modules) -> None:
    with torch.no_grad():
        for p in (p for m in modules for p in m.parameters()):
            p -= LR * p.grad
            p.grad = None


def torch_losses(pg, rank: int) -> list[float]:
    from torch.distributed.pipelining import PipelineStage, ScheduleZBVZeroBubble

    modules = [stage_module(v) for v in MINE[rank]]
    stages = [PipelineStage(m, v, 4, torch.device("cpu"), group=pg) for m, v in zip(modules, MINE[rank])]
    schedule = ScheduleZBVZeroBubble(stages, MICROBATCHES, loss_fn=mse)
    x, y = data()
    out = []
    for step in range(STEPS):
        losses = []
        if rank == 0:  # first and last stage both here
            schedule.step(x[step], target=y[step], losses=losses)
        else:
            schedule.step()
        sgd(modules)
        out += [float(loss) for loss in losses]
    return out


def our_losses(groups, rank: int) -> list[float]:
    modules = [stage_module(v, Linear) for v in MINE[rank]]
    p2p = PipelineP2P(groups.pp, (ROWS, WIDTH), torch.float32, torch.device("cpu"))
    run = get_schedule("zbv", 2, 2, MICROBATCHES)
    x, y = data()
    out = []
    for step in range(STEPS):
        inputs, targets = x[step].split(ROWS), y[step].split(ROWS)
        losses = {}

        def forward(chunk, input_tensor, mb):
            if rank == 0 and chunk == 0:
                return modules[0](inputs[mb])
            output = modules[chunk](input_tensor)
            if rank == 0 and chunk == 1:
                loss = mse(output, targets[mb])
                losses[mb] = float(loss)
                return loss / MICROBATCHES
            return output

        def backward_input(output, output_grad, ticket):
            output.backward() if output_grad is None else backward_from_freed([output], [output_grad])

        def backward_weight(run_w, ticket, last):
            run_w()

        job = PipelineJob(
            num_microbatches=MICROBATCHES,
            num_chunks=2,
            stage=rank,
            num_stages=2,
            forward=forward,
            backward=None,
            p2p=p2p,
            backward_input=backward_input,
            backward_weight=backward_weight,
        )
        run(job)
        sgd(modules)
        out += [losses[mb] for mb in sorted(losses)]
    return out


def train_both(ctx):
    groups = ctx.groups(Topology(world_size=2, pp=2))
    if groups is None:
        return None
    rank = groups.coords.pp
    return torch_losses(groups.pp.pg, rank), our_losses(groups, rank)


def test_zbv_trains_as_torchs_schedule_zbv_zero_bubble(dist_pool):
    theirs, ours = dist_pool(2).run(train_both)[0]
    assert len(theirs) == len(ours) == STEPS * MICROBATCHES
    torch.testing.assert_close(torch.tensor(ours), torch.tensor(theirs), rtol=1e-5, atol=0)
    assert ours[-1] < ours[0], "the tiny model learns"
