"""Tests of models/ (installed as megazero.models): the pure GPT, its attention and loss, fp32 weight gradients."""
