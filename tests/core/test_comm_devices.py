"""Devices in the comm layer, without processes: every op rejects a tensor that is not on its group's
device (groups of one included) with a one-line message naming op, group and both devices; tensors
the layer creates itself live on the group's device; ProcessGroups hands its device to every group.
The `meta` device stands in for "a device other than the CPU", so all of this runs on a CPU build."""

import dataclasses

import pytest
import torch

from megazero.core import comm
from megazero.core.comm import CommLog, Group
from megazero.parallel.process_groups import ProcessGroups, collective_device

# op -> (its tensor arguments, a call taking the group and those tensors; sizes fit a group of `n`)
OPS = {
    "all_reduce": (("tensor",), lambda g, n, t: comm.all_reduce(t["tensor"], g)),
    "reduce_scatter": (("output", "input"), lambda g, n, t: comm.reduce_scatter(t["output"], t["input"], g)),
    "all_gather": (("output", "input"), lambda g, n, t: comm.all_gather(t["output"], t["input"], g)),
    "all_to_all": (("output", "input"), lambda g, n, t: comm.all_to_all(t["output"], t["input"], g)),
    "broadcast": (("tensor",), lambda g, n, t: comm.broadcast(t["tensor"], 0, g)),
    "send": (("send tensor",), lambda g, n, t: comm.send_recv([(t["send tensor"], n - 1)], [], g)),
    "recv": (("recv tensor",), lambda g, n, t: comm.send_recv([], [(t["recv tensor"], n - 1)], g)),
}


def _group(size: int, device: str) -> Group:
    # pg None: the device check must fire before any backend is touched, whatever the group size.
    return Group("mics_shard", tuple(range(10, 10 + size)), 0, None, True, CommLog(), torch.device(device))


def _tensors(op: str, n: int, device: str, wrong: str | None = None, wrong_device: str = "") -> dict:
    sizes = {"input": 4 * n if op == "reduce_scatter" else 4, "output": 4 * n if op == "all_gather" else 4}
    return {
        name: torch.zeros(sizes.get(name, 4), device=wrong_device if name == wrong else device) for name in OPS[op][0]
    }


@pytest.mark.parametrize("size", [1, 2])
@pytest.mark.parametrize("group_device,tensor_device", [("meta", "cpu"), ("cpu", "meta")])
@pytest.mark.parametrize("op", list(OPS))
def test_every_op_rejects_a_tensor_on_another_device(op, group_device, tensor_device, size):
    for wrong in OPS[op][0]:
        group = _group(size, group_device)
        tensors = _tensors(op, size, group_device, wrong, tensor_device)
        with pytest.raises(ValueError) as err:
            OPS[op][1](group, size, tensors)
        message = str(err.value)
        assert "\n" not in message
        assert message.startswith("send_recv" if op in ("send", "recv") else op), message
        assert wrong in message, message
        assert "mics_shard" in message and str(list(group.ranks)) in message, message
        assert f"is on {tensor_device}" in message and f"on {group_device}" in message, message
        assert not group.log.step_bytes, "nothing may be counted for an op that failed its check"


@pytest.mark.parametrize("op", ["all_reduce", "reduce_scatter", "all_gather", "all_to_all", "broadcast"])
def test_tensors_on_the_group_device_pass_for_a_group_of_one(op):
    group = _group(1, "meta")
    OPS[op][1](group, 1, _tensors(op, 1, "meta"))
    assert not group.log.step_bytes


def test_object_max_creates_its_scalar_on_the_group_device(monkeypatch):
    seen = []

    class Stop(Exception):
        pass

    def fake_all_reduce(tensor, op=None, group=None, async_op=False):
        seen.append(tensor.device)
        raise Stop

    monkeypatch.setattr(comm.dist, "all_reduce", fake_all_reduce)
    with pytest.raises(Stop):  # a CPU scalar would have failed the device check instead
        comm.all_reduce_object_max(1.0, _group(2, "meta"))
    assert seen == [torch.device("meta")]


def test_process_groups_give_their_device_to_every_group():
    def devices(groups):
        return {
            f.name: getattr(groups, f.name).device
            for f in dataclasses.fields(groups)
            if isinstance(getattr(groups, f.name), Group)
        }

    cpu, meta = devices(ProcessGroups.single()), devices(ProcessGroups.single(device="meta"))
    assert {
        "mics_shard_gather",
        "shard_node_local",
        "shard_cross_node",
        "hpz",
        "cp",
        "ep",
        "edp",
        "edp_gather",
        "expert_shard",
        "expert_replica",
    } <= set(cpu) and len(cpu) == 17
    assert set(cpu.values()) == {torch.device("cpu")}
    assert set(meta.values()) == {torch.device("meta")}


def test_collective_device_without_torch_distributed():
    assert collective_device() == torch.device("cpu")
    assert collective_device("meta") == torch.device("meta")
