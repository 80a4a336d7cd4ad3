"""megazero.initialize against DeepSpeed's own engine, and the DeepSpeed-style example script.

- The same tiny transformers Llama, config (ZeRO-2 and ZeRO-3, gradient clipping, 2 accumulation
  steps, DeepSpeed's bucket keys), client torch AdamW optimizer, data and loop (engine(batch),
  engine.backward(loss), engine.step()) on 2 gloo ranks, through megazero.initialize and through
  deepspeed.initialize (DeepSpeed 0.19 on its CPU accelerator): loss curves, gradient norms
  (get_global_grad_norm) and final parameters agree to 1e-6 (measured over 10 steps: losses equal, parameters 7.5e-8 / 5.9e-7 relative L2 at
  stages 2 / 3). Skipped, with a line, when deepspeed is not installed.
- examples/deepspeed_loop.py (DeepSpeed's tutorial loop with `import megazero as deepspeed`) runs on
  the same 2 ranks as torchrun would start it, with examples/ds_config.json, and its loss falls.

The pool is this file's own: DeepSpeed's import and engine leave state in the processes they ran in.

Planted to see them fail: the user's AdamW read as L2-decay Adam (decoupled_weight_decay False for
torch.optim.AdamW): both stages fail; the backward without the 1 / data-parallel-ranks factor:
the gradient norms differ.
"""

import contextlib
import importlib.util
import io
import runpy
import sys
from pathlib import Path

import pytest

from megazero.testing import DistributedPool
from tests.api.hf_runs import assert_matches, client_config, train_with_deepspeed, train_with_megazero

STEPS = 6
EXAMPLES = Path(__file__).resolve().parents[2] / "examples"


@pytest.fixture(scope="module")
def pool():
    pool = DistributedPool(2)
    yield pool
    pool.close(force=True)


def run_example(ctx) -> str:
    """examples/deepspeed_loop.py as torchrun runs it on this rank (its stdout)."""
    out, argv = io.StringIO(), sys.argv
    sys.argv = [str(EXAMPLES / "deepspeed_loop.py"), "--deepspeed_config", str(EXAMPLES / "ds_config.json")]
    try:
        with contextlib.redirect_stdout(out):
            runpy.run_path(sys.argv[0], run_name="__main__")
    finally:
        sys.argv = argv
    return out.getvalue()


def test_the_example_script_trains_on_2_ranks(pool):
    printed = pool.run(run_example)
    losses = [float(line.split()[3]) for line in printed[0].splitlines() if line.startswith("step ")]
    assert printed[1] == "" and len(losses) == 4, printed
    assert losses[-1] < 0.9 * losses[0], losses  # 5.57 -> 4.67, measured


@pytest.mark.skipif(
    importlib.util.find_spec("deepspeed") is None,
    reason="deepspeed is not installed (pip install deepspeed; DS_ACCELERATOR=cpu)",
)
def test_megazero_initialize_matches_deepspeeds_engine(pool):
    # ours first: DeepSpeed's import patches torch in the process it runs in
    ours = {
        stage: pool.run(train_with_megazero, "llama", 2, client_config(stage), steps=STEPS, client=True)[0]
        for stage in (2, 3)
    }
    for stage in (2, 3):
        theirs = pool.run(train_with_deepspeed, "llama", client_config(stage), steps=STEPS)[0]
        assert ours[stage]["steps"] == theirs["steps"] == STEPS
        assert_matches(ours[stage], theirs, f"stage {stage} against DeepSpeed", rtol=1e-6)
