"""A pool of gloo worker processes that runs functions on every rank: the multi-process test harness.

Starting a process group costs seconds (start a process, import torch, rendezvous) and layout
changes cost only a few `new_group` calls, so one pool serves many checks: `pool.run(fn, *args)` calls
`fn(ctx, *args)` on every rank and returns the per-rank results. `ctx.groups(topology)` builds that
layout's groups (reusing communicators across calls); ranks outside a smaller layout get None and
simply return.

`fn` must be importable by name (a module-level function), since it is pickled to the workers.
A failure on any rank fails the call with every rank's traceback, and the pool is torn down (the
surviving ranks may be stuck in a collective), so the next call starts a fresh one.

Ranks are forked from a multiprocessing forkserver that has imported torch and megazero's training
stack once (PRELOAD): a spawned rank spent 3-6 CPU seconds importing them, i.e. most of a minute
for a pool of 8 on 2 cores, and a pool torn down by a failure paid it again. The forkserver is a
clean process (no process group, no OpenMP threads), started on the first pool.
"""

from __future__ import annotations

import dataclasses
import os
import queue
import socket
import sys
import time
import traceback

import torch
import torch.multiprocessing as mp


@dataclasses.dataclass
class WorkerContext:
    rank: int
    world_size: int
    factory: object

    def groups(self, topology):
        from megazero.parallel.process_groups import ProcessGroups

        return ProcessGroups.build(topology, self.rank, self.factory, device=torch.device("cpu"))


def _ephemeral_start() -> int:
    try:
        return int(open("/proc/sys/net/ipv4/ip_local_port_range").read().split()[0])
    except (OSError, ValueError, IndexError):
        return 32768


def free_port() -> int:
    """A free port below the ephemeral range: a port the kernel handed out (bind to 0) can be taken
    by another process's outgoing connection before the rendezvous binds it, which happens when
    several test processes (pytest-xdist workers, their pools) connect at the same time."""
    import random

    pick = random.Random(os.getpid() ^ time.monotonic_ns())
    top = max(_ephemeral_start(), 12000)
    for _ in range(200):
        port = pick.randrange(10000, top)
        with socket.socket() as s:
            try:
                s.bind(("127.0.0.1", port))
            except OSError:
                continue
            return port
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _worker(rank, world_size, port, sys_path, requests, results):
    sys.path[:] = sys_path
    os.environ.update(
        MASTER_ADDR="127.0.0.1",
        MASTER_PORT=str(port),
        RANK=str(rank),
        WORLD_SIZE=str(world_size),
        LOCAL_WORLD_SIZE=str(world_size),
    )
    torch.set_num_threads(1)
    import torch.distributed as dist
    from megazero.parallel.process_groups import GroupFactory

    dist.init_process_group("gloo", rank=rank, world_size=world_size)
    ctx = WorkerContext(rank, world_size, GroupFactory(rank))
    while True:
        job = requests.get()
        if job is None:
            break
        fn, args, kwargs = job
        try:
            results.put((rank, True, fn(ctx, *args, **kwargs)))
        except BaseException:
            results.put((rank, False, traceback.format_exc()))
    dist.destroy_process_group()


PRELOAD = ["torch.distributed", "megazero.parallel.process_groups", "megazero.training"]


def process_context():
    """The multiprocessing context pool ranks start from (also for a test's own one-off process)."""
    if "forkserver" not in mp.get_all_start_methods():
        return mp.get_context("spawn")
    ctx = mp.get_context("forkserver")
    ctx.set_forkserver_preload(PRELOAD)  # takes effect when the forkserver starts
    return ctx


class DistributedPool:
    def __init__(self, world_size: int):
        self.world_size = world_size
        self._procs = []
        self._start()

    def _start(self):
        ctx = process_context()
        self._results = ctx.Queue()
        self._requests = [ctx.Queue() for _ in range(self.world_size)]
        port = free_port()
        self._procs = [
            ctx.Process(
                target=_worker,
                daemon=True,
                args=(r, self.world_size, port, list(sys.path), self._requests[r], self._results),
            )
            for r in range(self.world_size)
        ]
        for p in self._procs:
            p.start()

    def run(self, fn, *args, timeout: float = 600, **kwargs) -> list:
        if not self._procs:
            self._start()
        for q in self._requests:
            q.put((fn, args, kwargs))
        out, errors = [None] * self.world_size, []
        for _ in range(self.world_size):
            try:
                rank, ok, value = self._next_result(timeout)
            except queue.Empty:
                errors.append(f"timed out after {timeout}s waiting for a rank")
                break
            except ChildProcessError as err:
                errors.append(str(err))
                break
            if ok:
                out[rank] = value
            else:
                errors.append(f"--- rank {rank} ---\n{value}")
                timeout = min(timeout, 30)  # the others are likely stuck; don't wait long
        if errors:
            self.close(force=True)
            raise AssertionError(f"{fn.__name__} failed:\n" + "\n".join(errors))
        return out

    def _next_result(self, timeout: float):
        """The next rank's result; ChildProcessError as soon as a rank's process has ended (it died
        starting up or in the job: nothing more will come from it), queue.Empty after `timeout`."""
        deadline = time.monotonic() + timeout
        while True:
            try:
                return self._results.get(timeout=max(0.0, min(5.0, deadline - time.monotonic())))
            except queue.Empty:
                dead = [(r, p.exitcode) for r, p in enumerate(self._procs) if p.exitcode is not None]
                if dead:
                    raise ChildProcessError(
                        ", ".join(f"rank {r}'s process ended (exit code {code})" for r, code in dead)
                    ) from None
                if time.monotonic() >= deadline:
                    raise

    def close(self, force: bool = False):
        for p, q in zip(self._procs, self._requests):
            if force:
                p.kill()
            else:
                q.put(None)
        for p in self._procs:
            p.join(timeout=10)
            if p.is_alive():
                p.kill()
        self._procs = []
