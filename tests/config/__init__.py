"""Tests of megazero/config/: flags and DeepSpeed JSON onto TrainConfig, and the memory estimate."""
