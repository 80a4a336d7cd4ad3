"""Tests of parallel/ (megazero.parallel): topology, process groups, TP layers, parallelize, CP, tiling, RNG."""
