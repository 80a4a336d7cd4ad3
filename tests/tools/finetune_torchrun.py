"""Run by tests/tools/test_finetune.py under torchrun on 2 ranks, in one launch: examples/deepspeed_loop.py
(its lines on stdout), then tools/finetune.py's job in the same processes with the arguments after
OUT, then the engine's logits on the test's probe tokens (OUT/probe.pt) into OUT/ours.pt (rank 0).

    torchrun --nproc-per-node 2 tests/tools/finetune_torchrun.py OUT <tools/finetune.py arguments>
"""

import runpy
import sys
from pathlib import Path

import torch

REPO = Path(__file__).resolve().parents[2]

out, argv = Path(sys.argv[1]), sys.argv[2:]
sys.argv = [
    str(REPO / "examples" / "deepspeed_loop.py"),
    "--deepspeed_config",
    str(REPO / "examples" / "ds_config.json"),
]
runpy.run_path(sys.argv[0], run_name="__main__")
finetune = runpy.run_path(str(REPO / "tools" / "finetune.py"))
engine = finetune["run"](finetune["parse_args"](argv)).engine
engine.eval()
with torch.no_grad():
    logits = engine(input_ids=torch.load(out / "probe.pt"), use_cache=False).logits
if engine.global_rank == 0:
    torch.save(logits, out / "ours.pt")
