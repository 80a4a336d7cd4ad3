"""Tests of bench/: what a CPU can check of the GPU check and its benches."""
