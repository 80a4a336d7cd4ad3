"""Training logs for people (one line per logged iteration) and for tools (JSON lines).

Only the logging rank (last pipeline stage, TP rank 0, DP rank 0: the one that holds the loss) writes.
Every object carries the run's `run_id` (the same across resumes: the checkpoint's), so that records
of several runs in one file stay apart. Each logged iteration appends one object with at least
iteration, loss, lr, grad_norm and tokens_per_s (on a GPU with a known peak also mfu, from model
FLOPs, and hfu, counting recomputation); evaluations append objects with "split": "valid". The same records go to the monitors
(megazero.training.monitor: wandb, TensorBoard) the driver attaches with `add_monitors`; `close` ends them.
A step's record is built here (`train_record`, from the numbers the loop hands it), so that what a
record holds is read in one file.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

from megazero.training.stragglers import describe


# Fields a record carries when a flag asks for them (--decoupled-lr, --rampup-batch-size,
# --log-params-norm, --log-num-zeros-in-grad).
OPTIONAL_FIELDS = (
    "decoupled_lr",
    "global_batch_size",
    "consumed_samples",
    "params_norm",
    "num_zeros_in_grad",
    "moe_aux_loss",
    "moe_z_loss",
    "moe_dropped",
)


def train_record(
    iteration: int,
    step,
    lr: float,
    elapsed: float,
    *,
    tokens: int,
    flops: float,
    hardware_flops: float,
    world: int,
    peak: float | None,
    memory_mib: float,
    skipped_total: int,
    flagged: dict,
    time_ms: dict | None,
) -> dict:
    """The record of one training step (megazero.training.loop's StepResult `step`, which took
    `elapsed` seconds on `world` devices and computed `tokens` tokens and `flops` model FLOPs,
    `hardware_flops` with recomputation): what `train` returns and `log_train` averages. MFU and HFU
    when the device's `peak` TFLOP/s is known; `flagged`: the fields flags ask for (OPTIONAL_FIELDS);
    `time_ms`: the phase timers' (wall_clock_breakdown)."""
    record = {
        "iteration": iteration,
        "loss": step.loss,
        "lr": lr,
        "grad_norm": step.grad_norm,
        "skipped": step.skipped,
        "loss_scale": step.loss_scale,
        "tokens_per_s": tokens / elapsed,
        "ms_per_iter": 1000 * elapsed,
        "tflops_per_device": flops / elapsed / world / 1e12,
        "memory_mib": memory_mib,
        "skipped_total": skipped_total,
    }
    record.update(flagged)
    if step.moe is not None:
        record.update(
            moe_aux_loss=step.moe["aux"],
            moe_z_loss=step.moe["z"],
            moe_dropped=step.moe["dropped"],
            moe_load={str(i): list(v) for i, v in step.moe["load"].items()},
        )
    if peak is not None:  # model FLOPs (MFU) and with recomputation (hardware FLOPs, HFU)
        record["mfu"] = record["tflops_per_device"] / peak
        record["hfu"] = hardware_flops / elapsed / world / 1e12 / peak
    if time_ms is not None:
        record["time_ms"] = time_ms
    return record


class MetricsLogger:
    def __init__(
        self, path: str | None, enabled: bool = True, stream=None, total_iters: int = 0, run_id: str | None = None
    ):
        self.enabled, self._stream, self.total_iters, self.run_id = enabled, stream, total_iters, run_id
        self.path = Path(path) if path else None
        if self.enabled and self.path is not None:
            self.path.parent.mkdir(parents=True, exist_ok=True)
        self.monitors: list = []

    def add_monitors(self, monitors: list) -> None:
        """Writers with log(record) and close(), fed every record written here."""
        if self.enabled:
            self.monitors.extend(monitors)

    def close(self) -> None:
        for monitor in self.monitors:
            monitor.close()
        self.monitors = []

    def _append(self, record: dict) -> None:
        if self.run_id is not None:
            record = {**record, "run_id": self.run_id}
        if self.enabled and self.path is not None:
            with self.path.open("a") as f:
                f.write(json.dumps(record) + "\n")
        if self.enabled:
            for monitor in self.monitors:
                monitor.log(record)

    def say(self, text: str) -> None:
        if self.enabled:
            # sys.stdout as it is now (a caller may have redirected it since this logger was made)
            print(text, file=self._stream or sys.stdout, flush=True)

    def log_train(self, window: list[dict], comm_log=None) -> None:
        """Averages loss and time over the iterations since the last log line; the rates (tokens/s,
        TFLOP/s, MFU, HFU) are the interval's totals over its total time, as ms/iter is its mean time
        (a mean of per-iteration rates would weigh a fast iteration as much as a slow one)."""
        if not window:
            return
        last = window[-1]
        seconds = [r["ms_per_iter"] for r in window]

        def rate(key):  # sum of (rate x time) = the interval's total, over the total time
            if not sum(seconds):
                return sum(r.get(key, 0.0) for r in window) / len(window)
            return sum(r.get(key, 0.0) * t for r, t in zip(window, seconds)) / sum(seconds)

        record = {
            "iteration": last["iteration"],
            "split": "train",
            "loss": sum(r["loss"] for r in window) / len(window),
            "lr": last["lr"],
            "grad_norm": last["grad_norm"],
            "tokens_per_s": rate("tokens_per_s"),
            "ms_per_iter": sum(r["ms_per_iter"] for r in window) / len(window),
            "tflops_per_device": rate("tflops_per_device"),
            "memory_mib": last["memory_mib"],
            "skipped": sum(bool(r["skipped"]) for r in window),
            "loss_scale": last["loss_scale"],
            "skipped_total": last.get("skipped_total", 0),
        }
        for key in ("mfu", "hfu"):  # model-FLOP and hardware-FLOP (with recomputation) utilisation
            if key in last:
                record[key] = rate(key)
        for key in OPTIONAL_FIELDS:  # flags' fields: the last iteration's
            if key in last:
                record[key] = last[key]
        if "time_ms" in last:  # wall_clock_breakdown: mean ms per phase per iteration
            phases = {k for r in window for k in r.get("time_ms", {})}
            record["time_ms"] = {
                k: sum(r.get("time_ms", {}).get(k, 0.0) for r in window) / len(window) for k in sorted(phases)
            }
        if "straggler" in last:  # --straggler-threshold: the slowest rank over it, this interval
            record["straggler"] = last["straggler"]
        if "moe_load" in last:
            record["moe_load"] = last["moe_load"]
        self._append(record)
        self.say(
            f" iteration {record['iteration']:>6}/{self.total_iters} | loss {record['loss']:.4f} | "
            f"lr {record['lr']:.3e} | grad norm {record['grad_norm']:.3f} | "
            f"tokens/s {record['tokens_per_s']:,.0f} | ms/iter {record['ms_per_iter']:.1f} | "
            f"TFLOP/s/device {record['tflops_per_device']:.3g} | "
            + (f"MFU {record['mfu']:.1%} | " if "mfu" in record else "")
            + (f"HFU {record['hfu']:.1%} | " if "hfu" in record else "")
            + f"mem {record['memory_mib']:.0f} MiB"
            + (f" | skipped {record['skipped']}" if record["skipped"] else "")
        )
        extra = [f"{key.replace('_', ' ')} {record[key]:.4g}" for key in OPTIONAL_FIELDS if key in record]
        if extra:
            self.say("   " + " | ".join(extra))
        if "moe_load" in record:  # tokens per expert of each MoE layer: max / mean
            self.say(
                "   expert load (max/mean tokens): "
                + " ".join(f"layer {i} {mx:.0f}/{mean:.0f}" for i, (mx, mean) in record["moe_load"].items())
            )
        if "time_ms" in record:
            self.say("   time/iter (ms): " + " ".join(f"{k}={v:.1f}" for k, v in record["time_ms"].items()))
        if comm_log is not None and comm_log.last_step:
            self.say("   " + comm_log.summary())
        if "straggler" in record:
            self.say(describe(record["straggler"]))

    def log_eval(self, record: dict) -> None:
        self._append(record)
        self.say(f" validation at iteration {record['iteration']} | loss {record['loss']:.4f}")
