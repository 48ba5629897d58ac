"""Command-line options shared by the one-layer benchmarks (split_attention.py, prefill_routing.py):
the batch, the contexts and one attention layer's shape; and ``token_counts`` (experts.py, cpu_experts.py). Defaults: Qwen3-30B-A3B's layer
(32 query heads, 4 kv_heads, head_dim 128; ../shared/models), a 256-token D-window and 15 CPU
threads (16 cores, one left to the thread that launches GPU work)."""

from __future__ import annotations

import argparse


def layer_parser(doc: str) -> argparse.ArgumentParser:
    """A parser described by ``doc``'s first line, with --batch, --contexts, --q-heads, --kv-heads,
    --head-dim, --window and --cpu-threads."""
    p = argparse.ArgumentParser(description=doc.split("\n")[0])
    p.add_argument("--batch", type=int, default=16)
    p.add_argument("--contexts", default="8192,16384,32768", help="comma-separated context lengths (tokens)")
    p.add_argument("--q-heads", type=int, default=32)
    p.add_argument("--kv-heads", type=int, default=4)
    p.add_argument("--head-dim", type=int, default=128)
    p.add_argument("--window", type=int, default=256, help="D-window tokens")
    p.add_argument("--cpu-threads", type=int, default=15)
    return p


def token_counts(ap: argparse.ArgumentParser, text: str, flag: str = "--tokens") -> list[int]:
    """``text`` as comma-separated positive integers, or the parser's error naming ``flag``."""
    try:
        values = [int(t) for t in text.split(",")]
    except ValueError:
        ap.error(f"{flag} must be comma-separated integers, got {text!r}")
    if min(values) < 1:
        ap.error(f"{flag} must be >= 1, got {text}")
    return values
