"""megazero/dry_run/report.py's schedule_text: what tools/dry_run.py prints under a zero-bubble
--pipeline-schedule (each stage's list of actions, the ideal idle fraction, the per-stage peaks), for
the job's own microbatch count; nothing under the other schedules.
Planted, failing here: the microbatches counted without the data-parallel split (16 instead of 8)."""

from megazero.dry_run.job import job_config
from megazero.dry_run.report import schedule_text
from megazero.parallel.pipeline.zero_bubble import zero_bubble_schedule

FLAGS = [
    "--num-layers",
    "8",
    "--hidden-size",
    "64",
    "--num-attention-heads",
    "4",
    "--seq-length",
    "32",
    "--micro-batch-size",
    "1",
    "--global-batch-size",
    "16",
    "--pipeline-model-parallel-size",
    "4",
]


def test_dry_run_prints_the_zero_bubble_lists_of_the_jobs_step():
    cfg = job_config(FLAGS + ["--pipeline-schedule", "zbv", "--num-layers-per-virtual-pipeline-stage", "1"], 8)
    text = schedule_text(cfg, 8)  # dp 2: 8 microbatches a step
    assert zero_bubble_schedule("zbv", 4, 2, 8).format() in text
    assert "4 stages x 2 chunks (V), 8 microbatches" in text
    assert "ideal idle fraction 0.059" in text and "peak held per stage" in text
    assert schedule_text(job_config(FLAGS, 8), 8) is None
