"""Tests of megazero's runtime modules: training.py (the step), model_builder.py, flops.py, monitor.py."""
