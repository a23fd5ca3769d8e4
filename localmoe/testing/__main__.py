"""`python -m localmoe.testing FAMILY PATH [--size tiny|small|large] [--seed N]`: write a
random test checkpoint (or, with --plan, print what it would hold)."""

from __future__ import annotations

import argparse
import sys

from localmoe.errors import LocalMoEError
from localmoe.testing.families import FAMILIES
from localmoe.testing.write import SIZES, plan_checkpoint, write_checkpoint


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m localmoe.testing", description=__doc__.split("\n\n")[0])
    parser.add_argument("family", choices=sorted(FAMILIES))
    parser.add_argument("path", nargs="?", help="output directory (not needed with --plan)")
    parser.add_argument("--size", choices=SIZES, default="tiny")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--shard-gb", type=float, default=None, help="shard size limit in GB (default: per size)")
    parser.add_argument("--plan", action="store_true", help="print sizes and shards, write nothing")
    args = parser.parse_args(argv)
    shard_bytes = "default" if args.shard_gb is None else int(args.shard_gb * 10**9)
    try:
        if args.plan:
            plan = plan_checkpoint(args.family, args.size, shard_bytes=shard_bytes)
            print(f"{args.family} {args.size}: {plan.params / 1e6:.1f}M parameters, {len(plan.tensors)} tensors, "
                  f"{plan.total_bytes / 1e9:.3f} GB in {len(plan.shards)} shard(s), "
                  f"{plan.expert_bytes / 1e9:.3f} GB of routed experts")
            return 0
        if args.path is None:
            parser.error("PATH is required unless --plan is given")
        path = write_checkpoint(args.family, args.path, args.size, args.seed, shard_bytes=shard_bytes,
                                progress=args.size != "tiny")
    except LocalMoEError as e:
        print(f"error: {e}", file=sys.stderr)
        return 1
    print(path)
    return 0


if __name__ == "__main__":
    sys.exit(main())
