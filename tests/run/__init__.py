"""End to end: pretrain_gpt.py and megazero/run/launch.py as users run them (in-process, one process, torchrun)."""
