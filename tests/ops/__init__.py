"""Tests of megazero/ops/ (and csrc/): the Adam math and kernels, CPUAdam, block quantization."""
