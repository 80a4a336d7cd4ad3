"""Tests of tools/: generate, and convert_checkpoint's Hugging Face export and import."""
