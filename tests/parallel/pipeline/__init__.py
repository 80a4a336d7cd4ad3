"""Tests of parallel/pipeline/: the schedules (with every ZeRO stage) and point-to-point ordering and overlap."""
