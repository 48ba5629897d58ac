"""The ``--expert-stream-share`` and ``--expert-profile`` flags that ``generate``, ``bench``, ``profile``
(and, for the profile, ``plan``) share."""

from __future__ import annotations

import argparse


def add_stream_share_flag(p: argparse.ArgumentParser) -> None:
    p.add_argument("--expert-stream-share", type=float, default=None, metavar="F",
                   help="of the routed experts in host memory with few tokens (decode), the fraction streamed to the GPU each "
                        "step while the CPU computes the rest, 0-1 (0: CPU only; 1: stream all; default 1 on CUDA, 0 without)")


def check_stream_share(args: argparse.Namespace) -> None:
    """Raises ValueError, naming the value, when ``--expert-stream-share`` is outside [0, 1] (NaN included)."""
    share = args.expert_stream_share
    if share is not None and not 0.0 <= share <= 1.0:
        raise ValueError(f"--expert-stream-share must be in [0, 1], got {share}")


def add_expert_profile_flag(p: argparse.ArgumentParser) -> None:
    p.add_argument("--expert-profile", default=None, metavar="PATH",
                   help="with --vram-budget: keep each layer's most chosen routed experts on the GPU, from a routing profile "
                        "(JSON; `writescope expert-profile` writes one) instead of the lowest expert ids")
