"""DeepSpeed's command-line arguments for a user's script: `add_config_arguments(parser)` adds
--deepspeed (a switch), --deepspeed_config FILE and --local_rank (which the launchers pass), so a
script written for DeepSpeed parses its own flags unchanged and hands `args` to megazero.initialize.
"""

from __future__ import annotations

import argparse


def add_config_arguments(parser: argparse.ArgumentParser) -> argparse.ArgumentParser:
    group = parser.add_argument_group("DeepSpeed", "DeepSpeed configurations (megazero)")
    group.add_argument(
        "--deepspeed",
        default=False,
        action="store_true",
        help="Enable DeepSpeed (megazero: always on; kept for scripts that pass it)",
    )
    group.add_argument("--deepspeed_config", default=None, type=str, help="DeepSpeed JSON configuration file")
    if not any(a.dest == "local_rank" for a in parser._actions):
        group.add_argument(
            "--local_rank",
            "--local-rank",
            type=int,
            default=-1,
            help="local rank passed by the launcher (torchrun sets LOCAL_RANK instead)",
        )
    return parser
