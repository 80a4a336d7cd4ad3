"""End to end: pretrain_gpt.py and megazero/launch.py as users run them (in-process, one process, torchrun)."""
