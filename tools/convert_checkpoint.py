"""Convert megazero checkpoints.

    python tools/convert_checkpoint.py consolidate --load runs/ckpt --output out/model [--with-optimizer]

`consolidate` writes the full fp32 model of a sharded checkpoint (any layout) as
OUT/model.safetensors + OUT/config.json, loadable by megazero.models.GPT with strict=True, reading
one parameter at a time (see megazero/checkpoint/consolidate.py). It prints the peak memory it used.
"""
from __future__ import annotations

import argparse
import resource
import sys
import time

from megazero.checkpoint.consolidate import consolidate
from megazero.errors import UsageError


def parse_args(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    sub = parser.add_subparsers(dest="command", required=True)
    c = sub.add_parser("consolidate", help="one full fp32 state dict from a sharded checkpoint")
    c.add_argument("--load", required=True, help="a --save directory (its `latest`) or an iter_* directory")
    c.add_argument("--output", required=True, help="directory for model.safetensors and config.json")
    c.add_argument("--with-optimizer", action="store_true", help="also write the full Adam states")
    return parser.parse_args(argv)


def main(argv=None) -> int:
    args = parse_args(argv)
    before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    started = time.perf_counter()
    try:
        written = consolidate(args.load, args.output, args.with_optimizer)
    except (UsageError, ValueError) as err:
        print(f"error: {err}", file=sys.stderr)
        return 2
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    files = ", ".join(f"{name} ({count} tensors)" for name, count in written.items())
    print(f"wrote {files} to {args.output} in {time.perf_counter() - started:.1f}s; "
          f"peak RSS {peak / 1024:.0f} MiB ({(peak - before) / 1024:.0f} MiB above start-up)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
