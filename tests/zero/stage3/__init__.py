"""Tests of megazero/zero/stage3/: the coordinator, leaf modules, gathers (MiCS two hops, hpZ), param offload."""
