"""Tests of megazero/data/: indexed datasets, GPT samples, blends, tokenizers, the default corpus."""
