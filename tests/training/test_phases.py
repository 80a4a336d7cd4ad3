"""The run's phases as a listener hears them (megazero.training.phases): the seam the timers, the
straggler watch, the out-of-memory mark and the dry run's device stand-in share."""

import pytest
import torch

from megazero.parallel.process_groups import ProcessGroups
from megazero.training import phases
from megazero.training.out_of_memory import mark_phase
from tests.layouts import run_training, small_config


class Heard:
    def __init__(self):
        self.events = []

    def phase_started(self, name):
        self.events.append(("start", name))

    def phase_ended(self, name, error):
        self.events.append(("end", name, type(error).__name__ if error else None))


def test_a_listener_hears_every_phase_in_order_and_pipelined_microbatches_one_by_one():
    cfg = small_config(steps=2, micro=2, global_batch=4, layers=2)  # 2 microbatches a step
    with phases.listening(Heard()) as heard:
        out = run_training(cfg, ProcessGroups.single())
    names = [e[1] for e in heard.events if e[0] == "start"]
    assert names[0] == "build" and heard.events[1] == ("end", "build", None)
    values = [n for n in names if n == "initial value"]
    assert len(values) == len(out["params"]), "one 'initial value' phase per parameter"
    step = ["train step", "forward", "backward", "forward", "backward", "reduce", "step"]
    assert names[names.index("train step") :] == step * 2
    # each phase ends before the next starts, the step's own phases inside "train step"
    depth = 0
    for event in heard.events:
        depth += 1 if event[0] == "start" else -1
        assert 0 <= depth <= 2
    assert depth == 0


def test_the_phase_an_error_leaves_is_told_and_an_out_of_memory_error_is_marked_with_it():
    heard = Heard()
    run = phases.Phases(heard)
    err = torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 2.00 GiB")
    with pytest.raises(torch.OutOfMemoryError):
        with run("step"):
            raise err
    assert heard.events == [("start", "step"), ("end", "step", "OutOfMemoryError")]
    assert err.megazero_phase == "optimizer step"
    mark_phase(err, "forward")  # the innermost phase's mark stays
    assert err.megazero_phase == "optimizer step"


def test_listening_ends_with_its_block():
    heard = Heard()
    with phases.listening(heard):
        inside = phases.Phases()
    outside = phases.Phases()
    with inside("reduce"), outside("step"):
        pass
    assert heard.events == [("start", "reduce"), ("end", "reduce", None)]
