"""``writescope`` entry point: subcommands ``generate``, ``bench``, ``calibrate``, ``plan``, ``profile``, ``expert-profile`` and ``make-checkpoint``."""

from __future__ import annotations

import argparse
import os
import sys

from writescope.cli import bench, calibrate, expert_profile, generate, make_checkpoint, plan, profile


def main(argv: list[str] | None = None) -> int:
    # before CUDA starts (set here, not at import, so importing the CLI changes nothing): freed
    # weights go back to the device page by page instead of pinning whole 20 MiB segments, so
    # what a --vram-budget run holds stays close to its plan
    os.environ.setdefault("PYTORCH_CUDA_ALLOC_CONF", "expandable_segments:True")
    parser = argparse.ArgumentParser(prog="writescope", description="Long-context MoE inference with a partitioned KV cache.")
    sub = parser.add_subparsers(dest="command", required=True)
    generate.add_parser(sub)
    calibrate.add_parser(sub)
    bench.add_parser(sub)
    plan.add_parser(sub)
    make_checkpoint.add_parser(sub)
    profile.add_parser(sub)
    expert_profile.add_parser(sub)
    args = parser.parse_args(argv)
    try:
        return args.run(args)
    except (ValueError, FileNotFoundError, FileExistsError) as e:
        print(f"writescope {args.command}: error: {e}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
