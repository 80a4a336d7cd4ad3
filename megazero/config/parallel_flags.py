"""The parallelism flags' parser entries: the rank grid (tensor, pipeline, context, sequence), the
pipeline schedule, the process-group backend and its timeouts, the ZeRO stage and the DeepSpeed config
(with zero_flags' offload and ZeRO++ flags). What they mean together is train_flags' and zero_flags';
this module only declares them. Part of the edge: touches no process group.
"""

from __future__ import annotations

from megazero.config.zero_flags import add_zero_flags


def add_parallel_flags(g, add) -> None:
    """The parallel layout, ZeRO and process-group flags (`add` is flags._add)."""
    add(g, "--tensor-model-parallel-size", type=int, default=1, help="tensor-parallel ranks")
    add(g, "--pipeline-model-parallel-size", type=int, default=1, help="pipeline stages")
    add(g, "--sequence-parallel", action="store_true", help="split norms and dropout along the sequence (tp > 1)")
    add(
        g,
        "--context-parallel-size",
        type=int,
        default=1,
        help="context-parallel ranks: each holds 2 of 2N load-balanced chunks of every sequence",
    )
    add(
        g,
        "--cp-comm-type",
        choices=["p2p", "a2a", "allgather"],
        default="p2p",
        help="how attention sees the whole sequence under context parallelism: p2p ring attention, "
        "a2a (Ulysses) all-to-all over heads, allgather of keys and values",
    )
    add(
        g,
        "--ds-sequence-parallel-size",
        type=int,
        default=None,
        help="Megatron-DeepSpeed's Ulysses: --context-parallel-size N --cp-comm-type a2a",
        shown="off",
    )
    add(
        g,
        "--num-layers-per-virtual-pipeline-stage",
        type=int,
        default=0,
        help="layers per model chunk of the interleaved schedule; 0: one chunk per stage",
    )
    add(
        g,
        "--pipeline-schedule",
        choices=["auto", "1f1b", "gpipe", "interleaved", "zb-h1", "zbv", "interleaved-zb", "dualpipev"],
        default="auto",
        help="pipeline schedule; zb-h1, zbv, interleaved-zb and dualpipev split each "
        "backward and defer the weight gradients into the bubble",
    )
    add(
        g,
        "--pipeline-layer-split",
        type=int,
        nargs="+",
        default=None,
        help="layers per pipeline chunk, for uneven splits",
        shown="even",
    )
    add(
        g,
        "--overlap-p2p-communication",
        action="store_true",
        help="1f1b/interleaved: pipeline sends and receives move while the stage computes",
    )
    add(g, "--ranks-per-node", type=int, default=0, help="ranks per node; 0: LOCAL_WORLD_SIZE")
    add(
        g,
        "--distributed-backend",
        choices=["gloo", "nccl"],
        default=None,
        help="process-group backend",
        shown="nccl when CUDA is available, else gloo",
    )
    add(
        g,
        "--distributed-timeout-minutes",
        type=float,
        default=10.0,
        help="how long a collective waits for a silent rank, and the ranks at start-up for each other, "
        "before the job ends naming it (fractions allowed)",
    )
    add(
        g,
        "--heartbeat-timeout-minutes",
        type=float,
        default=None,
        help="how long a rank may miss its heartbeats (stopped, killed, host lost) before the job ends "
        "naming it, whatever the backend; below --distributed-timeout-minutes (0: off)",
        shown="half of --distributed-timeout-minutes",
    )
    add(
        g,
        "--zero-stage",
        type=int,
        default=None,
        choices=[0, 1, 2, 3],
        help="ZeRO stage: 1 optimizer states, 2 + gradients, 3 + parameters partitioned",
        shown="0, or the config's zero_optimization.stage",
    )
    add(
        g,
        "--zero-config",
        default=None,
        metavar="JSON",
        help="DeepSpeed JSON (whole config or zero_optimization)",
        shown="none",
    )
    add(
        g,
        "--deepspeed_config",
        "--deepspeed-config",
        default=None,
        metavar="JSON",
        help="Megatron-DeepSpeed's name for --zero-config",
        shown="none",
    )
    add(
        g,
        "--use-distributed-optimizer",
        action="store_true",
        help="Megatron-LM's name for ZeRO-1; stage 1 unless a stage is given",
    )
    add(
        g,
        "--overlap-grad-reduce",
        action="store_true",
        help="overlap gradient reduction with backward (zero_optimization.overlap_comm)",
        shown="on at every stage; a DeepSpeed config's overlap_comm: false turns it off",
    )
    add(
        g,
        "--overlap-param-gather",
        action="store_true",
        help="overlap parameter gathers with compute (stage 3 prefetch)",
    )
    add(g, "--deepspeed", action="store_true", help="accepted for Megatron-DeepSpeed launch lines; no effect")
    add_zero_flags(g, add)
    add(
        g,
        "--local-rank",
        "--local_rank",
        type=int,
        default=None,
        help="set by the deepspeed and torch.distributed.launch launchers",
        shown="LOCAL_RANK",
    )
