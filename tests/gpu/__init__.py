"""Checks that need CUDA devices and NCCL (skipped without them; conftest.py says how)."""
