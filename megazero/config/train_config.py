"""The typed configuration tree of a training run. Flags map onto it once, at the edge
(megazero.config.train_flags); the runtime reads these records, never argv or globals."""

from __future__ import annotations

from typing import Literal, Optional

from pydantic import Field

from megazero.config.batch_ramp import BatchRamp
from megazero.core.records import Record
from megazero.models.config import GPTConfig
from megazero.ops.adam_config import AdamConfig
from megazero.ops.muon_config import MuonConfig
from megazero.zero.config import ZeroConfig
from megazero.zero.config import PrecisionConfig


class ParallelConfig(Record):
    tensor_parallel: int = 1
    pipeline_parallel: int = 1
    sequence_parallel: bool = False
    context_parallel: int = 1  # ranks splitting each sequence (--context-parallel-size)
    expert_parallel: int = 1  # ranks the experts split over, out of dp x cp
    expert_tensor_parallel: int = 0  # 0: tp (experts split as the dense MLP); 1: whole experts
    moe_dispatcher: Literal["alltoall", "allgather"] = "alltoall"
    cp_comm_type: Literal["p2p", "a2a", "allgather"] = "p2p"
    """How attention sees the whole sequence under context parallelism: ring attention (p2p),
    Ulysses all-to-all over heads (a2a) or all-gathered keys and values (allgather)."""
    virtual_stages: int = 1  # interleaved pipeline: model chunks per stage
    cpu_offloading_num_layers: int = 0
    """Activation offload (--cpu-offloading): the first N transformer layers of each model chunk keep
    their saved activations in host memory between forward and backward (parallel/activation_offload.py)."""
    layer_split: Optional[list[int]] = None  # uneven pipeline split: layers per chunk
    schedule: Literal["auto", "1f1b", "gpipe", "interleaved", "zb-h1", "zbv", "interleaved-zb", "dualpipev"] = "auto"
    overlap_p2p_comm: bool = False  # 1F1B/interleaved: p2p transfers move during compute
    ranks_per_node: int = 0  # 0: LOCAL_WORLD_SIZE
    distributed_backend: Literal["gloo", "nccl"] = "gloo"
    timeout_minutes: float = 10.0
    """How long any collective waits for a silent rank (Megatron's --distributed-timeout-minutes):
    init_process_group's and every group's timeout; under gloo it bounds each op."""
    heartbeat_minutes: float = 5.0
    """How long a rank may miss its heartbeats through the launch's store before the job ends naming
    it (megazero.run.heartbeat); below timeout_minutes so that the line comes before NCCL's watchdog
    aborts the process naming no one. 0: off."""


class OptimizerConfig(Record):
    lr: float = 6e-4
    min_lr: float = 0.0
    warmup_iters: int = 0
    decay_iters: Optional[int] = None  # None: train_iters
    decay_style: Literal["constant", "linear", "cosine", "inverse-square-root"] = "cosine"
    adam: AdamConfig = Field(default_factory=AdamConfig)
    muon: Optional[MuonConfig] = None
    """--optimizer muon: Muon steps the weight matrices (megazero.training.muon_matrices), Adam the rest;
    None: Adam steps every parameter."""
    clip_grad: float = 1.0
    decoupled_lr: Optional[float] = None
    """Megatron's --decoupled-lr: the input embedding and the output layer follow the same schedule
    from this peak instead of `lr` (None: every parameter takes `lr`)."""
    decoupled_min_lr: Optional[float] = None  # their min_lr (None: min_lr)
    from_train_iters: tuple[str, ...] = ()
    """The schedule fields (warmup_iters, decay_iters) no flag set: derived from --train-iters, so a
    resume with another --train-iters is refused naming that flag, not these."""
    in_samples: bool = False
    """warmup_iters and decay_iters count samples and the schedule is read at consumed samples
    (Megatron's sample-based schedule, which --rampup-batch-size needs)."""


class DataConfig(Record):
    data_path: Optional[list[str]] = None  # None: the embedded default corpus
    split: str = "949,50,1"
    tokenizer_model: Optional[str] = None
    tokenizer_type: str = "SentencePieceTokenizer"  # or GPT2BPETokenizer, HuggingFaceTokenizer, NullTokenizer
    vocab_file: Optional[str] = None  # GPT2BPETokenizer: vocab.json
    merge_file: Optional[str] = None  # GPT2BPETokenizer: merges.txt
    vocab_size: Optional[int] = None  # NullTokenizer
    cache_dir: Optional[str] = None
    mock_data: bool = False  # random tokens of the vocabulary, no files
    mmap_bin_files: bool = True  # False: .bin files read with plain reads
    tiktoken_pattern: Optional[str] = None  # TikTokenizer: "v1" or "v2"
    # Megatron-LM's document masking of packed samples, at the tokenizer's end-of-document id
    # (models/documents.py): positions restart after it, attention stays inside each document, no
    # loss where the input token is it.
    reset_position_ids: bool = False
    reset_attention_mask: bool = False
    eod_mask_loss: bool = False
    split_paths: Optional[list[Optional[list[str]]]] = None
    """[train, valid, test] of --train-data-path / --valid-data-path / --test-data-path, each split's
    own blend taken whole (data_path and split unused); None: data_path cut by split."""
    builder_threads: int = 1  # --num-dataset-builder-threads

    def reads_files(self) -> bool:
        """Whether the run reads the user's .bin/.idx files (else mock data or the embedded corpus)."""
        return not self.mock_data and (self.data_path is not None or self.split_paths is not None)


class CheckpointConfig(Record):
    """Megatron's checkpoint flags (see megazero.checkpoint.resume)."""

    save: Optional[str] = None  # folder to save into
    load: Optional[str] = None  # folder (its `latest`) or iter_* directory to load
    save_interval: int = 0  # save every N iterations (0: only at the end)
    load_optim: bool = True
    load_rng: bool = True
    finetune: bool = False  # weights only; iteration 0, fresh optimizer
    exit_interval: int = 0  # stop after an iteration that is a multiple of N
    exit_duration_mins: float = 0.0
    exit_signal_handler: bool = False  # exit_signal or SIGINT: finish the step, save, exit 0
    exit_signal: str = "SIGTERM"  # SIGTERM, SIGINT, SIGUSR1 or SIGUSR2
    keep_last: int = 0  # keep the newest K checkpoints (0: all), and the newest healthy one
    async_save: bool = False
    exit_on_save_failure: bool = False  # a failed save stops the run (else it trains on)
    extend_positions: bool = False  # a smaller learned position table grows on load
    scheduler_on_load: Literal["check", "flags", "checkpoint"] = "check"
    """What --load does with the checkpoint's lr schedule (Megatron): "check" refuses a schedule that
    differs from the flags', "flags" (--override-opt_param-scheduler) and "checkpoint"
    (--use-checkpoint-opt_param-scheduler) say which one wins."""


class MonitorConfig(Record):
    """Where the logging rank also sends its metrics records (see megazero.training.monitor)."""

    wandb_project: Optional[str] = None  # None: no wandb run
    wandb_exp_name: Optional[str] = None  # None: wandb picks a name
    wandb_save_dir: Optional[str] = None  # wandb writes <this>/wandb/<run>; the edge sets run_dir
    wandb_entity: Optional[str] = None  # None: the account's default entity
    tensorboard_dir: Optional[str] = None  # None: no event files


class RunOptions(Record):
    """Megatron's housekeeping, logging and profiling flags (none changes the math), and when a run
    that diverged stops (megazero.training.divergence)."""

    manual_gc: bool = False  # Python's automatic GC off, collected every interval
    manual_gc_interval: int = 0  # 0: only Megatron's collections around evaluation
    empty_unused_memory_level: int = 0  # 1: release the allocator cache after backward; 2: also after the step
    log_params_norm: bool = False
    log_num_zeros_in_grad: bool = False
    log_timers_to_tensorboard: bool = False
    profile: bool = False  # a torch.profiler trace of steps [profile_step_start, profile_step_end)
    profile_step_start: int = 10
    profile_step_end: int = 12
    profile_ranks: list[int] = Field(default_factory=lambda: [0])
    num_workers: int = 0  # >0: batches prepared by a background thread
    straggler_threshold: float = 0.2  # name a rank this fraction slower than the median; 0: off
    check_for_nan: bool = True  # a non-finite loss or unexplained gradient ends the run
    max_consecutive_skipped_steps: int = 50  # so many skipped steps in a row end the run; 0: never


class TrainConfig(Record):
    model: GPTConfig
    parallel: ParallelConfig = Field(default_factory=ParallelConfig)
    zero: ZeroConfig = Field(default_factory=ZeroConfig)
    optimizer: OptimizerConfig = Field(default_factory=OptimizerConfig)
    precision: PrecisionConfig = Field(default_factory=PrecisionConfig)
    data: DataConfig = Field(default_factory=DataConfig)
    checkpoint: CheckpointConfig = Field(default_factory=CheckpointConfig)
    monitor: MonitorConfig = Field(default_factory=MonitorConfig)
    micro_batch_size: int = 4
    global_batch_size: int = 8
    train_iters: int = 100
    eval_interval: int = 100
    eval_iters: int = 10
    log_interval: int = 10
    seed: int = 1234
    run_dir: str = "runs/latest"
    default_run_dir: bool = False
    """run_dir is this rank's draw of the default name (no --run-dir): rank 0's replaces it once the
    process groups exist (megazero.run.run_folder)."""
    metrics_file: Optional[str] = None  # None: <run_dir>/metrics.jsonl
    wall_clock_breakdown: bool = False
    """Time the phases of each step (forward, backward, reduction, optimizer) and log them with the
    iteration (DeepSpeed's wall_clock_breakdown)."""
    compile_backend: Optional[str] = None
    """torch.compile backend each transformer layer is compiled with (--compile); None: eager."""
    notes: list[str] = Field(default_factory=list)
    """Settings accepted without effect, one line each, for the driver to log once at start-up."""
    batch_from: Optional[str] = None
    """The DeepSpeed config (as the flag naming it) that set the batch sizes, for the start-up line."""
    rampup: Optional[BatchRamp] = None
    """--rampup-batch-size: the global batch of the first steps grows to global_batch_size."""
    run: RunOptions = Field(default_factory=RunOptions)

    def num_microbatches(self, data_parallel: int) -> int:
        return self.global_batch_size // (self.micro_batch_size * data_parallel)

    def batch_at(self, iteration: int) -> int:
        """The global batch of step `iteration` (counting from 0)."""
        if self.rampup is None:
            return self.global_batch_size
        return self.rampup.batch_at_consumed(self.rampup.consumed_before(iteration))

    def sample_counts(self) -> tuple[int, int, int]:
        """Samples the run draws from the train, valid and test splits."""
        return (self.consumed_before(self.train_iters), self.eval_iters * self.global_batch_size, 0)

    def consumed_before(self, iteration: int) -> int:
        """Samples the steps before step `iteration` (counting from 0) consumed."""
        if self.rampup is None:
            return iteration * self.global_batch_size
        return self.rampup.consumed_before(iteration)


def topology_of(cfg: TrainConfig, world: int):
    """The rank grid `cfg` lays `world` ranks out on (megazero.parallel.topology.Topology)."""
    from megazero.parallel.topology import Topology  # here: the flags are checked before torch loads

    par = cfg.parallel
    return Topology(
        world_size=world,
        tp=par.tensor_parallel,
        pp=par.pipeline_parallel,
        cp=par.context_parallel,
        ep=par.expert_parallel,
        etp=par.expert_tensor_parallel,
        mics_shard_size=cfg.zero.mics_shard_size,
        ranks_per_node=par.ranks_per_node,
        hpz_partition_size=cfg.zero.zero_hpz_partition_size if cfg.zero.stage == 3 else 1,
    )
