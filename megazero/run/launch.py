"""The driver behind pretrain_gpt.py: it runs the recipe (megazero.run.pretrain: flags -> config ->
checks -> process groups -> data -> model chunks -> ZeRO engine -> loop) on every rank, with what
surrounds it: the rendezvous, the error line the ranks agree on, heartbeats, signals and the exit code.

The flags are checked first, before torch loads (megazero.config.train_flags.flag_error): a mistake
in them is the same on every rank, so rank 0 prints it and every rank exits 2 within a second or two,
not after torch's and the runtime's imports. The runtime is imported only after that.

Errors end a launch with one line. Those found before the process group starts (flags, paths, data,
memory) are found on every rank and agreed through the launch's rendezvous store, and rank 0 prints
the verdict for all. Once the ranks run, the first rank to end (a bug, a lost or silent peer, Ctrl-C)
says so in the store: it prints its line (megazero.run.failures words it) and the others, cut off
mid-collective, leave quietly with the same line in torchrun's error file.

Ranks find each other in megazero.run.rendezvous: the launcher's variables checked against each other
before anything else, the store, and every rank registered within --distributed-timeout-minutes;
each restarted attempt (torchrun --max-restarts) under its own prefix of the store.

It is the one module that reads the launcher's environment (WORLD_SIZE, RANK, LOCAL_RANK,
LOCAL_WORLD_SIZE, MASTER_ADDR, MASTER_PORT, TORCHELASTIC_USE_AGENT_STORE, TORCHELASTIC_ERROR_FILE,
OMP_NUM_THREADS, CUDA_VISIBLE_DEVICES; the rendezvous reads what it hands in); what the runtime needs
of it travels on in `Launch` and `TrainConfig`.
"""

from __future__ import annotations

import datetime
import json
import os
import signal
import sys
import threading
import time
from typing import TYPE_CHECKING

from megazero.run import failures, rendezvous
from megazero.core.errors import AgreedStop, UsageError
from megazero.run.heartbeat import Heartbeat, describe_activity
from megazero.run.threads import default_threads, usable_cores

if TYPE_CHECKING:  # the runtime is imported only once the flags are checked
    from megazero.run.pretrain import Pretraining


class Launch:
    """This process's place in a launch (torchrun, the deepspeed launcher, or none) and the
    rendezvous store its ranks share before and after the process group exists."""

    def __init__(self, argv=None):
        env = os.environ
        # Older launchers (the deepspeed launcher, torch.distributed.launch) pass --local_rank instead.
        # A --local_rank that is no number reads as unset here and is left to the flag parser, which
        # names it in one line.
        place = rendezvous.place_of(env, _local_rank_flag(argv or []))
        self.world, self.rank, self.local_rank, self.local_world = place.numbers
        self.environment_problem = place.problem  # said first thing (_main), before any flag is read
        self.error_file = env.get("TORCHELASTIC_ERROR_FILE")
        self.timeout_minutes = 10.0  # the rendezvous's: --distributed-timeout-minutes, once read
        self.rendezvous_store = self.store = None  # the launch's store; this attempt's keys under a prefix
        self.address = None  # the address this rank's process group offers its peers
        self.spanning = False  # whether ranks of this job run on other hosts
        self.cuda_available = None  # the flags are read as torch.cuda finds this machine

    def connect(self) -> None:
        """Joins the rendezvous (no process group yet) when there is a launch to coordinate: the store,
        then every rank registered in it, within --distributed-timeout-minutes (megazero.run.rendezvous:
        a waiting rank says whom it waits for every 30 s; rendezvous.NeverJoined at the deadline)."""
        if self.world > 1 and self.store is None and "MASTER_ADDR" in os.environ:
            self.rendezvous_store, self.store = rendezvous.join(
                os.environ,
                self.rank,
                self.world,
                self.timeout_minutes,
                failures.process_identity(self.address),
                say=_say_waiting if self.local_rank == 0 else None,
            )

    def address_problem(self, backend: str) -> str | None:
        """The line refusing this rank's process-group address where other hosts cannot reach it
        (megazero.run.addresses), checked before anything connects; None when it is fine."""
        if self.world <= 1:
            return None
        from megazero.run import addresses

        env = os.environ
        spanning = self.spanning = addresses.spans_hosts(self.world, self.local_world, env.get("MASTER_ADDR"))
        problem, self.address = addresses.address_error(
            backend, {name: env.get(name) for name in ("GLOO_SOCKET_IFNAME", "NCCL_SOCKET_IFNAME")}, spanning
        )
        return problem

    def reach_problem(self, backend: str) -> str | None:
        """The agreed line naming a peer host whose process-group address does not answer (gloo, in a
        job spanning hosts; megazero.run.addresses.check_reach), None when every host answers."""
        if self.store is None or not self.spanning or backend == "nccl":
            return None
        from megazero.run import addresses

        listener, error = addresses.check_reach(
            self.store, self.rank, self.world, self.local_rank, self.address, os.environ.get("GLOO_SOCKET_IFNAME")
        )
        try:
            return self.agree("reach", error)
        finally:
            if listener is not None:
                listener.close()

    def cpu_optimizer_threads(self) -> int:
        """The offloaded optimizer's CPU Adam threads where --cpu-optimizer-threads is not given:
        MEGAZERO_CPU_OPTIMIZER_THREADS, else the node's cores per local rank. Not OMP_NUM_THREADS:
        torchrun sets it to 1 for the training's threads, which would leave the CPU Adam one core."""
        given = os.environ.get("MEGAZERO_CPU_OPTIMIZER_THREADS")
        if given:
            if not given.strip().isdigit() or int(given) < 1:
                raise UsageError(
                    f"MEGAZERO_CPU_OPTIMIZER_THREADS={given} must be a whole number >= 1 (the "
                    f"offloaded optimizer's CPU Adam threads); unset it for the cores per local rank"
                )
            return int(given)
        return max(1, usable_cores() // max(1, self.local_world))

    def process_group_store(self):
        """The store init_process_group builds the groups in: this attempt's, never the last one's."""
        import torch.distributed as dist

        return dist.PrefixStore("process_group", self.store)

    @property
    def speaks(self) -> bool:
        """Whether this rank prints agreed errors: rank 0, or every rank where nothing is shared."""
        return self.rank == 0 or self.store is None

    def agree(self, step: str, error: str | None) -> str | None:
        """Every rank reports how `step` went; rank 0 reads the reports and posts the verdict (its
        own error, else the first other rank's), which every rank returns. Doubles as a barrier."""
        self.connect()
        if self.store is None:
            return error
        self.store.set(f"{step}/{self.rank}", error or "")
        if self.rank == 0:
            self.store.set(f"{step}/verdict", error or self._first_other_report(step))
        return self.store.get(f"{step}/verdict").decode() or None

    def _first_other_report(self, step: str) -> str:
        for other in range(1, self.world):
            report = self.store.get(f"{step}/{other}").decode()  # waits for that rank's report
            if report:
                return f"rank {other}: {report}"
        return ""

    def end_first(self, line: str, code: int) -> tuple[bool, str, int]:
        """Whether this rank is the first of the attempt to end (then it prints `line`); the others
        get the first one's line and code, for torchrun's error file and their exit status."""
        if self.store is None:
            return True, line, code
        try:
            if self.store.add("ending", 1) == 1:
                self.store.set("ending/line", json.dumps([line, code]))
                return True, line, code
            self.store.wait(["ending/line"], datetime.timedelta(seconds=5))
            first, first_code = json.loads(self.store.get("ending/line"))
            return False, first, first_code
        except (RuntimeError, ValueError):  # the store went down with its host rank
            return False, line, code

    def peers(self) -> dict[int, str | None]:
        """Every other rank's registered identity (see megazero.run.failures.process_identity)."""
        found = {}
        for rank in range(self.world):
            if rank == self.rank:
                continue
            try:
                key = f"process/{rank}"
                found[rank] = self.store.get(key).decode() if self.store.check([key]) else None
            except (RuntimeError, ValueError, AttributeError):
                found[rank] = None
        return found

    def first(self, step: str):
        """For files one rank writes and all read (the data's caches): `first(build)` runs
        build(True) on rank 0, agrees on how it went, then build(False) on the others; a UsageError
        of rank 0's stops every rank with its line."""

        def run(build):
            error = built = None
            if self.rank == 0:
                try:
                    built = build(True)  # builds and caches what is missing, once
                except UsageError as err:
                    error = str(err)
            verdict = self.agree(step, error)
            if verdict:
                raise AgreedStop(verdict)
            return built if self.rank == 0 else build(False)

        return run

    def device(self, cfg):
        """This rank's device (its GPU under NCCL, set as torch's current one, else the CPU) and the
        start-up line's words on its thread count (`default_threads` unless OMP_NUM_THREADS says)."""
        import torch

        if os.environ.get("OMP_NUM_THREADS"):  # torch already took the user's (or torchrun's) count
            threads = f"threads={torch.get_num_threads()} (OMP_NUM_THREADS)"
        else:
            cores, load = usable_cores(), os.getloadavg()[0]
            torch.set_num_threads(default_threads(cores, self.local_world, load))
            threads = (
                f"threads={torch.get_num_threads()} (of {cores} cores, load {load:.1f}, "
                f"{self.local_world} rank{'s' if self.local_world > 1 else ''} here; "
                f"OMP_NUM_THREADS sets it)"
            )
        if cfg.parallel.distributed_backend != "nccl":
            return torch.device("cpu"), threads
        if not torch.cuda.is_available():
            raise UsageError("--distributed-backend nccl needs CUDA GPUs; use gloo on CPU")
        index = cuda_index(self.local_rank, self.local_world, torch.cuda.device_count())
        torch.cuda.set_device(index)
        return torch.device("cuda", index), threads

    def check_machine(self, cfg, device) -> None:
        """Paths, memory and data against this machine (megazero.config.machine_checks)."""
        from megazero.config.machine_checks import check_machine

        check_machine(cfg, self.world, self.local_world, device)

    def process_groups(self, cfg, device, log):
        """The process groups of the rank grid, on `device`, counting their bytes in `log`. Every
        collective, of the default group and of every group made from it, waits
        --distributed-timeout-minutes for a silent rank (gloo: each op's timeout); then it raises,
        and the rank names whom it waited for."""
        import torch.distributed as dist
        from megazero.config.train_config import topology_of
        from megazero.parallel.process_groups import GroupFactory, ProcessGroups

        par = cfg.parallel
        timeout = datetime.timedelta(minutes=par.timeout_minutes)
        if self.world > 1:
            # Binding NCCL to this rank's GPU makes it create its communicators now (not at the first
            # collective) and lets barriers and new groups know the device without guessing.
            bind = dict(device_id=device) if par.distributed_backend == "nccl" else {}
            store = dict(store=self.process_group_store()) if self.store is not None else {}
            dist.init_process_group(
                par.distributed_backend, rank=self.rank, world_size=self.world, timeout=timeout, **store, **bind
            )
        return ProcessGroups.build(
            topology_of(cfg, self.world), self.rank, GroupFactory(self.rank, timeout=timeout), device=device, log=log
        )

    def close_process_group(self) -> None:
        import torch.distributed as dist

        if dist.is_initialized():
            dist.destroy_process_group()


def _say_waiting(line: str) -> None:
    print(line, file=sys.stderr, flush=True)


def _local_rank_flag(argv) -> str | None:
    """The value of --local_rank / --local-rank in `argv`, as older launchers pass it."""
    for i, arg in enumerate(argv):
        name, eq, value = arg.partition("=")
        if name in ("--local_rank", "--local-rank"):
            return value if eq else (argv[i + 1] if i + 1 < len(argv) else None)
    return None


def cuda_index(local_rank: int, local_world: int, visible: int) -> int:
    """The GPU of this rank among the `visible` ones: its local rank when the node's GPUs are all
    visible, 0 when one is (CUDA_VISIBLE_DEVICES set per task, as some Slurm set-ups do)."""
    if visible == 1:
        return 0
    if local_world > visible or local_rank >= visible:
        raise UsageError(
            f"{local_world} ranks on this node but {visible} GPUs visible "
            f"(CUDA_VISIBLE_DEVICES={os.environ.get('CUDA_VISIBLE_DEVICES', 'unset')}): launch "
            f"--nproc-per-node {visible}, or make one GPU per rank visible"
        )
    return local_rank


def _heartbeat(run: "Pretraining", launch: Launch) -> Heartbeat | None:
    """This rank's heartbeat and watch (megazero.run.heartbeat) where ranks share a store."""
    minutes = run.cfg.parallel.heartbeat_minutes
    if launch.store is None or minutes <= 0:
        return None
    flag = f" (--heartbeat-timeout-minutes {minutes:g})"
    return Heartbeat(
        launch.store,
        launch.rank,
        launch.world,
        60 * minutes,
        lambda: describe_activity(run.comm_log),
        launch.end_first,
        launch.peers,
        launch.error_file,
        timeout_flag=flag,
        host_speaker=launch.local_rank == 0,
    ).start()


def _end_agreed(launch: Launch, line: str, code: int) -> int:
    """Every rank ends with the same line: rank 0 prints it, every rank hands it to torchrun. The
    others leave only once rank 0 has printed: torchrun stops every worker as soon as one ends, and
    would otherwise stop rank 0 before its line is out."""
    if launch.speaks:
        print(f"error: {line}", file=sys.stderr, flush=True)
        if launch.store is not None:
            launch.store.set("agreed/said", "1")
    elif launch.store is not None:
        try:
            launch.store.wait(["agreed/said"], datetime.timedelta(seconds=30))
        except (RuntimeError, ValueError):  # rank 0 went away: nothing left to wait for
            pass
    failures.write_error_file(launch.error_file, line)
    return code


def _end_on(err: BaseException, launch: Launch, run: "Pretraining | None", interrupts: failures.Interrupts) -> int:
    """The end of a run cut short on this rank: its line (printed by the first rank to end), exit code
    and torchrun's error file. An error that is none of ours (a bug) keeps its traceback."""
    if isinstance(err, KeyboardInterrupt) or interrupts.received:
        line = run.interrupted_line() if run is not None else "interrupted before training started"
        code = failures.EXIT_INTERRUPTED
    elif isinstance(err, UsageError):
        line, code = str(err) if launch.world == 1 else f"rank {launch.rank}: {err}", failures.EXIT_USAGE
    elif _out_of_memory(err):  # said by every rank it happens on
        from megazero.training import out_of_memory

        device = run.device if run is not None else None
        line = out_of_memory.out_of_memory_line(
            err, launch.rank if launch.world > 1 else None, run.cfg if run is not None else None, device
        )
        launch.end_first(line, failures.EXIT_FAILURE)
        print(f"error: {line}", file=sys.stderr, flush=True)
        failures.write_error_file(launch.error_file, line)
        return failures.EXIT_FAILURE
    else:
        timeout = run.cfg.parallel.timeout_minutes if run is not None else 0
        peers = launch.peers() if launch.store is not None else {}
        line, code = failures.peer_failure_line(err, launch.rank, peers, timeout), failures.EXIT_FAILURE
    bug = line is None
    first, shown, shown_code = launch.end_first(line or f"rank {launch.rank}: {type(err).__name__}: {err}", code)
    if bug and first:
        failures.write_traceback_error_file(launch.error_file, err)
        raise err
    if first:
        print(line if code == failures.EXIT_INTERRUPTED else f"error: {line}", file=sys.stderr)
    failures.write_error_file(launch.error_file, shown)
    return shown_code


def _out_of_memory(err: BaseException) -> bool:
    from megazero.training.out_of_memory import is_out_of_memory  # torch: loaded by now

    return is_out_of_memory(err)


def _with_signals_restored(body):
    """Runs body(interrupts) with Ctrl-C handled by `failures.Interrupts` (in the main thread), and
    gives the process its signal handlers back afterwards (tests run many launches in one process)."""
    interrupts = failures.Interrupts()
    if threading.current_thread() is not threading.main_thread():
        return body(interrupts)
    names = ("SIGINT", "SIGTERM", "SIGUSR1", "SIGUSR2")
    saved = {name: signal.getsignal(getattr(signal, name)) for name in names}
    signal.signal(signal.SIGINT, interrupts)
    try:
        return body(interrupts)
    finally:
        for name, handler in saved.items():
            signal.signal(getattr(signal, name), handler if handler is not None else signal.SIG_DFL)


def main(argv=None) -> int:
    return _with_signals_restored(lambda interrupts: _main(argv, Launch(argv), interrupts))


def _main(argv, launch: Launch, interrupts: failures.Interrupts) -> int:
    run = None
    try:
        if launch.environment_problem is not None:  # this process's own: every such rank says it
            print(f"error: {launch.environment_problem}", file=sys.stderr, flush=True)
            failures.write_error_file(launch.error_file, launch.environment_problem)
            return failures.EXIT_USAGE
        from megazero.config.train_flags import flag_error, parse_args  # imported once the environment passed

        mistake = flag_error(argv, launch.world, launch.local_world)
        if mistake is not None:  # the same flags on every rank, so the same mistake: said once
            if launch.rank == 0:
                print(f"error: {mistake}", file=sys.stderr, flush=True)
            else:  # no store yet: give rank 0 the moment to print before torchrun stops it
                time.sleep(1.0)
            failures.write_error_file(launch.error_file, mistake)
            return failures.EXIT_USAGE
        launch.timeout_minutes = parse_args(argv).distributed_timeout_minutes  # checked: the rendezvous's
        from megazero.run import pretrain  # the runtime: torch and everything on it
        from megazero.core import stream_check_report

        error = None
        try:
            run = pretrain.Pretraining(pretrain.configure(argv, launch), launch)
        except UsageError as err:
            error = str(err)
        if error is None:
            error = launch.address_problem(run.cfg.parallel.distributed_backend)
        try:
            verdict = launch.agree("preflight", error)
        except rendezvous.NeverJoined as never:  # this rank's own line: no one to agree with
            print(f"error: {never}", file=sys.stderr, flush=True)
            failures.write_error_file(launch.error_file, str(never))
            return failures.EXIT_FAILURE
        except (RuntimeError, ValueError) as err:  # no rendezvous: nothing to agree with
            print(
                f"error: cannot join the launch's rendezvous ({str(err).splitlines()[0]}); start the "
                f"ranks with torchrun",
                file=sys.stderr,
            )
            return failures.EXIT_USAGE
        if verdict:
            return _end_agreed(launch, verdict, failures.EXIT_USAGE)
        unreachable = launch.reach_problem(run.cfg.parallel.distributed_backend)
        if unreachable:
            return _end_agreed(launch, unreachable, failures.EXIT_USAGE)
        beat = _heartbeat(run, launch)
        try:
            checked = os.environ.get("MEGAZERO_STREAM_CHECK", "0") != "0"
            with stream_check_report.for_launch(checked, run.device, launch.store, launch.rank, launch.world):
                run.run()
        finally:
            if beat is not None:
                beat.stop()
        launch.close_process_group()
        return 0
    except AgreedStop as stop:  # every rank is here: nothing is left in flight
        launch.close_process_group()
        return _end_agreed(launch, str(stop), stop.code)
    except SystemExit:
        raise
    except BaseException as err:
        interrupts.ending = True
        return _end_on(err, launch, run, interrupts)
