"""The ``--expert-stream-share`` and ``--expert-profile`` flags that ``generate``, ``bench``, ``profile``
(and, for the profile, ``plan``) share."""

from __future__ import annotations

import argparse


def add_stream_share_flag(p: argparse.ArgumentParser) -> None:
    p.add_argument("--expert-stream-share", default=None, metavar="F",
                   help="of the routed experts in host memory with few tokens (decode), the fraction streamed to the GPU each "
                        "step while the CPU computes the rest, 0-1 (0: CPU only; 1: stream all), or auto (the default: "
                        "1 on CUDA, 0 without, and --policy writescope chooses each step)")


def check_stream_share(args: argparse.Namespace) -> None:
    """Parse ``--expert-stream-share`` in place: a number in [0, 1] or ``auto`` (None).

    Raises:
        ValueError: anything else (NaN included), naming the flag and the value.
    """
    from writescope.engine.arguments import parse_share

    if isinstance(args.expert_stream_share, str):
        args.expert_stream_share = parse_share(args.expert_stream_share, "--expert-stream-share")


def add_expert_profile_flag(p: argparse.ArgumentParser) -> None:
    p.add_argument("--expert-profile", default=None, metavar="PATH",
                   help="with --vram-budget: keep each layer's most chosen routed experts on the GPU, from a routing profile "
                        "(JSON; `writescope expert-profile` writes one) instead of the lowest expert ids")


def stream_share_note(given: float | None, llm) -> str | None:
    """The note a run prints where ``--expert-stream-share`` was given (``given``, parsed) but no
    routed expert lives in host memory, so the share changes nothing; None otherwise."""
    if given is None or llm.expert_stream_share is not None:
        return None
    why = ("without --vram-budget every routed expert is on the device" if llm.vram_plan is None
           else "the budget holds every routed expert on the device")
    return f"note: --expert-stream-share {given:g} changes nothing here: {why}"
