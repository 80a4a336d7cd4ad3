"""Model parallelism applied from outside the pure model (installed as megazero.parallel): the rank
grid and process groups, tensor-parallel layers and mappings, parallelize, finalize, tiling, and
pipeline/ (split, p2p, schedules). Never imports megazero.zero.
"""
