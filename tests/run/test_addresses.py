"""The process-group address a rank offers, checked before it connects (megazero.run.addresses), and the
line for a connection gloo could not make (megazero.run.failures): a loopback address in a job spanning
hosts is refused naming the address, the host and the variable to set; a refused connection is named
as such, with the rank and address, not as the timeout gloo's words suggest."""

import json
import os
import socket

from megazero.run import addresses, failures

GLOO_REFUSED = (
    "Gloo connectFullMesh failed with [/__w/pytorch/pytorch/third_party/gloo/gloo/transport/tcp/"
    "pair.cc:152] timed out connecting: SO_ERROR: Connection refused, remote=[127.0.1.1]:16285$0"
)


def test_a_job_spans_hosts_only_with_ranks_elsewhere_and_a_reachable_master():
    assert addresses.spans_hosts(4, 2, "10.1.2.3")
    assert not addresses.spans_hosts(4, 2, "127.0.0.1")  # a loopback master: every rank is here
    assert not addresses.spans_hosts(4, 2, "localhost")
    assert not addresses.spans_hosts(4, 4, "10.1.2.3")  # every rank on this host


def test_a_loopback_interface_is_refused_only_across_hosts():
    line, address = addresses.address_error("gloo", {"GLOO_SOCKET_IFNAME": "lo"}, spanning=True)
    assert address == "127.0.0.1"
    assert line.startswith(
        f"this job spans hosts but host {socket.gethostname()}'s process-group address is "
        f"127.0.0.1, a loopback address (GLOO_SOCKET_IFNAME=lo), which the other hosts cannot "
        f"reach; set GLOO_SOCKET_IFNAME to this host's network interface (here: "
    ), line
    assert addresses.address_error("gloo", {"GLOO_SOCKET_IFNAME": "lo"}, spanning=False) == (None, "127.0.0.1")
    line, _ = addresses.address_error("nccl", {"NCCL_SOCKET_IFNAME": "lo"}, spanning=True)
    assert "NCCL_SOCKET_IFNAME=lo" in line and "loopback interface (127.0.0.1)" in line, line
    assert addresses.address_error("nccl", {"NCCL_SOCKET_IFNAME": "^lo"}, spanning=True)[0] is None


def test_an_interface_that_does_not_exist_is_named():
    line, address = addresses.address_error("gloo", {"GLOO_SOCKET_IFNAME": "nosuch9"}, spanning=False)
    assert address == "" and line.startswith(
        "GLOO_SOCKET_IFNAME=nosuch9 names no interface with an address on host "
    ), line


def test_the_host_name_address_is_the_one_gloo_binds():
    address, why = addresses.gloo_address(None)
    with socket.socket(socket.AF_INET6 if ":" in address else socket.AF_INET) as s:
        s.bind((address, 0))  # gloo's rule: an address of the host name that binds
    assert socket.gethostname() in why


def _raised_in_init_process_group(message: str) -> RuntimeError:
    """The error as it reaches the launch: raised inside torch.distributed's init_process_group."""
    scope = {"__name__": "torch.distributed.distributed_c10d"}  # failures reads a frame's module
    source = "def init_process_group(message):\n    raise RuntimeError(message)\n"
    exec(compile(source, os.path.join("site-packages", "torch", "distributed", "distributed_c10d.py"), "exec"), scope)
    try:
        scope["init_process_group"](message)
    except RuntimeError as err:
        return err


def test_a_refused_connection_names_the_rank_and_address_not_a_timeout():
    peers = {
        1: json.dumps({"host": "node1", "ns": "x", "pid": 5, "address": "127.0.1.1"}),
        2: json.dumps({"host": "node2", "ns": "y", "pid": 6, "address": "10.0.0.2"}),
    }
    line = failures.peer_failure_line(_raised_in_init_process_group(GLOO_REFUSED), 0, peers, 10)
    assert line == "rank 0: cannot connect to rank 1 at 127.0.1.1:16285 (connection refused) during init_process_group"
    peers[3] = peers[1]
    line = failures.peer_failure_line(_raised_in_init_process_group(GLOO_REFUSED), 0, peers, 10)
    assert line.startswith("rank 0: cannot connect to a rank of host node1 (ranks 1, 3) at 127.0.1.1:16285"), line
