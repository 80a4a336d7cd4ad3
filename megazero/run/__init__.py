"""A run as a user starts it: `pretrain_gpt.py` -> `launch.main()`.

    launch.py         the driver: the launcher's environment, flags checked before torch loads, the
                      rendezvous, the one error line every rank agrees on, signals and the exit code
    pretrain.py       the recipe on every rank, in the order it runs: flags -> config -> checks,
                      process groups, data, model chunks and engine, checkpoint, the loop
    failures.py       how a run cut short ends: the lost or silent rank named, Ctrl-C, exit codes
    heartbeat.py      beats through the launch's store; the watch that names a silent rank
    threads.py        the CPU threads a rank takes of its node
    addresses.py      the address a rank's process group offers, refused where other hosts cannot reach it

The runtime it drives is megazero.training; the dry run (megazero.dry_run) runs the same recipe
with a simulated launch.
"""
