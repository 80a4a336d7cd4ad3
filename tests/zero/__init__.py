"""Tests of megazero/zero/: the engine, storage, flat layout, precision, loss scaling, offload, ZeRO++, ZenFlow."""
