"""Tests of tools/: generate, and convert_checkpoint's Hugging Face and Megatron-LM export and import."""
