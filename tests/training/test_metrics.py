"""The training log's interval line: over --log-interval > 1 iterations the rates (tokens/s, TFLOP/s,
MFU, HFU) are the interval's total tokens and FLOPs over its total time, as ms/iter is its mean time.
Planted: the mean of the iterations' rates (what the log printed before) fails it."""

import io

import pytest

from megazero.training.metrics import MetricsLogger


class Keep:
    def __init__(self):
        self.records = []

    def log(self, record):
        self.records.append(record)

    def close(self):
        pass


def _iteration(it, ms, tokens, tflop):
    seconds = ms / 1000
    return {
        "iteration": it,
        "loss": 2.0,
        "lr": 1e-3,
        "grad_norm": 1.0,
        "skipped": False,
        "loss_scale": 1.0,
        "ms_per_iter": ms,
        "tokens_per_s": tokens / seconds,
        "tflops_per_device": tflop / seconds,
        "mfu": tflop / seconds / 10.0,
        "hfu": 2 * tflop / seconds / 10.0,
        "memory_mib": 1.0,
    }


def test_interval_rates_are_totals_over_total_time():
    keep = Keep()
    logger = MetricsLogger(None, stream=io.StringIO(), total_iters=3)
    logger.add_monitors([keep])
    # three iterations of 100 tokens and 0.1 TFLOP each, taking 100, 300 and 600 ms
    logger.log_train([_iteration(i + 1, ms, 100, 0.1) for i, ms in enumerate((100, 300, 600))])
    (record,) = keep.records
    assert record["ms_per_iter"] == pytest.approx(1000 / 3)
    assert record["tokens_per_s"] == pytest.approx(300 / 1.0)  # 300 tokens in 1 s
    assert record["tflops_per_device"] == pytest.approx(0.3 / 1.0)  # 0.3 TFLOP in 1 s
    assert record["mfu"] == pytest.approx(0.03) and record["hfu"] == pytest.approx(0.06)
    # tokens/s x ms/iter is the tokens of one iteration, as a rate over the interval must give
    assert record["tokens_per_s"] * record["ms_per_iter"] / 1000 == pytest.approx(100)
