"""The recipe of a pretraining run, top to bottom in the order it runs on every rank:

    flags -> config -> checks       configure(): the machine, its files, the checkpoint to resume
    process groups                  launch.process_groups(): the rank grid's groups, on the device
    data                            megazero.data.run_data: datasets, sampler, read-ahead, tokenizer
    model chunks and ZeRO engine    megazero.training.setup
    checkpoint                      megazero.checkpoint.resume.start: load, or start a new run
    the loop                        megazero.training.train

megazero.launch runs it, with what lies around it: the rendezvous, the error line every rank agrees
on, heartbeats and signals.
"""
from __future__ import annotations

from megazero.checkpoint.resume import check_resume, start as start_checkpoint
from megazero.config.machine_checks import check_machine
from megazero.config.train_flags import config_from_args, parse_args
from megazero.core.comm import CommLog
from megazero.data.run_data import run_data
from megazero.lr_schedule import step_learning_rate
from megazero.metrics import MetricsLogger
from megazero.monitor import open_monitors
from megazero.training import setup, train


def configure(argv, launch):
    """Flags -> config -> checks against this machine and the checkpoint: (config, device, resume);
    every error a UsageError."""
    args = parse_args(argv)
    launch.adopt_local_rank(args.local_rank)
    cfg = config_from_args(args, launch.world, launch.local_world)
    if cfg.zero.cpu_optimizer_threads is None:
        cfg = cfg.replace(zero=cfg.zero.model_copy(update={"cpu_optimizer_threads": launch.cpu_optimizer_threads()}))
    device = launch.device(cfg)
    check_machine(cfg, launch.world, launch.local_world, device)
    resume = check_resume(cfg.checkpoint, cfg.model, cfg.global_batch_size, cfg.optimizer, cfg.train_iters)
    return cfg.replace(optimizer=resume.optimizer), device, resume   # the schedule may be the checkpoint's


def pretrain(cfg, launch, device, resume, progress, groups=None) -> None:
    """Trains `cfg` on this rank; `groups`: process groups already built (else the launch builds them)."""
    progress.comm_log = CommLog()
    groups = groups or launch.process_groups(cfg, device, progress.comm_log)
    metrics = _open_metrics(cfg, groups, device, launch.threads)
    data = run_data(cfg, groups.coords.dp, groups.topology.dp, metrics.say, first=launch.first("data"),
                    keep_tokenizer=launch.rank == 0 and cfg.checkpoint.save is not None)
    state = progress.state = setup(cfg, groups, device, eod=data.eod)
    _say_setup(state, resume, metrics.say)
    start_iteration, policy = start_checkpoint(state, cfg.checkpoint, resume.reader if resume else None,
                                               metrics.say, data.tokenizer)
    if start_iteration >= cfg.train_iters:
        metrics.say(f" the checkpoint is at iteration {start_iteration}: --train-iters {cfg.train_iters} "
                    f"is done; raise --train-iters to train on")
    metrics.say(" model states per rank (MiB): " + ", ".join(
        f"{k}={v / 2**20:.1f}" for k, v in state.engine.memory.report().items()))
    try:
        train(state, data.train, data.valid,
              lambda step, done: step_learning_rate(cfg.optimizer, step, cfg.train_iters, done),
              metrics, start_iteration=start_iteration, policy=policy)
    finally:
        data.close()
    metrics.close()
    saved = cfg.checkpoint.save
    metrics.say(f" done: metrics appended to {cfg.metrics_file}"
                + (f"; checkpoints in {saved} (go on with --load {saved})" if saved else ""))


def _open_metrics(cfg, groups, device, threads: str = "") -> MetricsLogger:
    """The log lines and metrics.jsonl (one rank: the first of the last stage), wandb / TensorBoard."""
    topology = groups.topology
    logging_rank = groups.rank == topology.rank_of(0, 0, topology.pp - 1)
    metrics = MetricsLogger(cfg.metrics_file, enabled=logging_rank, total_iters=cfg.train_iters)
    metrics.say(f" megazero: {topology.describe()} zero_stage={cfg.zero.stage} device={device.type} "
                f"precision={'bf16' if cfg.precision.bf16 else 'fp16' if cfg.precision.fp16 else 'fp32'}"
                + (f" {threads}" if threads else ""))
    metrics.say(f" {batch_line(cfg, topology.dp)}")
    saves = f"into {cfg.checkpoint.save}" if cfg.checkpoint.save else "none (no --save)"
    metrics.say(f" run folder: {cfg.run_dir} (metrics.jsonl); checkpoints: {saves}")
    for note in cfg.notes:          # config keys accepted without an effect of their own
        metrics.say(f" note: {note}")
    if logging_rank:     # wandb/TensorBoard; a run that raises is ended by their own exit hooks
        metrics.add_monitors(open_monitors(cfg, metrics.say))
    return metrics


def _say_setup(state, resume, say) -> None:
    say(f" {state.streams.describe()}")
    for notice in resume.notices if resume is not None else ():
        say(f" {notice}")


def batch_line(cfg, dp: int) -> str:
    """The global batch as it resolved (from flags or a DeepSpeed config's train_batch_size,
    micro batch and accumulation steps), and the run's length."""
    micro, glob = cfg.micro_batch_size, cfg.global_batch_size
    ramp = f", growing from {cfg.rampup.start}" if cfg.rampup is not None else ""
    source = f" (set by {cfg.batch_from})" if cfg.batch_from else ""
    return (f"batch: global {glob} samples{ramp} = micro batch {micro} x data-parallel {dp} x "
            f"{glob // (micro * dp)} accumulation steps{source}; {cfg.train_iters} iteration"
            f"{'s' if cfg.train_iters != 1 else ''}, {cfg.model.seq_length} tokens a sample")
