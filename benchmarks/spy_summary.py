"""Where the thread that issues a decode step spends it, from py-spy's sampled stacks.

``py-spy record --native -f raw -o FILE -- python3 -m writescope.cli.main bench ...`` writes one
line per distinct stack, ``frame;frame;...;frame COUNT`` (outermost first; a Python frame is
``function (path.py:line)``, a native one ``symbol (library or source)``). This keeps the stacks
that pass through ``--marker`` (default: the decode step, ``models/decode_step.py``), so the
load and the prefill drop out, and prints, as shares of those samples:

- inclusive: each Python function (lines merged) on the stack;
- self: each innermost frame (native included: a CUDA launch, a lock, a copy);
- under: each innermost WriteScope frame with the innermost frame below it (what it waits in).

Unlike cProfile, sampling adds no cost per call, so a C call that blocks (a full launch queue, a
lock) is charged to where it happens. Usage:
``python benchmarks/spy_summary.py FILE.raw [--marker REGEX] [--top 30] [--step-ms MS]``
(``--step-ms``: the step's measured time, to print ms per step next to the shares).
"""

from __future__ import annotations

import argparse
import re
import sys
from collections import Counter

_FRAME = re.compile(r"^(?P<name>.*?) \((?P<where>[^()]*)\)$")


def parse(lines) -> list[tuple[list[str], int]]:
    """``(frames outermost first, samples)`` of each raw line (blank or malformed lines skipped)."""
    out = []
    for line in lines:
        line = line.rstrip("\n")
        head, _, count = line.rpartition(" ")
        if not head or not count.isdigit():
            continue
        out.append((head.split(";"), int(count)))
    return out


def split_frame(frame: str) -> tuple[str, str, bool]:
    """``(name, file or library without the line, is_python)`` of one frame."""
    m = _FRAME.match(frame)
    if not m:
        return frame, "", False
    where = m.group("where")
    path = where.rsplit(":", 1)[0] if re.search(r":\d+$", where) else where
    return m.group("name"), path, path.endswith(".py")


def _ours(path: str) -> bool:
    return "writescope/" in path and "site-packages" not in path


def summarize(stacks: list[tuple[list[str], int]], marker: str) -> dict:
    """The counts :func:`main` prints (see the module's docstring)."""
    pat = re.compile(marker)
    total = 0
    inclusive: Counter = Counter()
    self_: Counter = Counter()
    under: Counter = Counter()
    for frames, n in stacks:
        if not any(pat.search(f) for f in frames):
            continue
        total += n
        seen = set()
        for f in frames:
            name, path, py = split_frame(f)
            if py and (name, path) not in seen:
                seen.add((name, path))
                inclusive[f"{name} ({path})"] += n
        leaf_name, leaf_path, _ = split_frame(frames[-1])
        self_[f"{leaf_name} ({leaf_path})"] += n
        ours = [i for i, f in enumerate(frames) if split_frame(f)[2] and _ours(split_frame(f)[1])]
        if ours:
            i = ours[-1]
            name, path, _ = split_frame(frames[i])
            leaf = f"{leaf_name} ({leaf_path})" if i + 1 < len(frames) else "(itself)"
            under[f"{name} ({path}) > {leaf}"] += n
    return {"total": total, "inclusive": inclusive, "self": self_, "under": under}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("raw", help="py-spy record -f raw output")
    ap.add_argument("--marker", default=r"models/decode_step\.py", help="keep stacks with a frame matching this regex")
    ap.add_argument("--top", type=int, default=30, help="rows per table (default 30)")
    ap.add_argument("--step-ms", type=float, default=None, help="the measured step, to print ms per step")
    args = ap.parse_args(argv)
    with open(args.raw) as fh:
        s = summarize(parse(fh), args.marker)
    total = s["total"]
    if not total:
        print(f"no sampled stack passes through {args.marker!r}: nothing to summarize", file=sys.stderr)
        return 1
    print(f"{total} samples through {args.marker!r}" + (f"; ms per step from the measured {args.step_ms:.1f} ms" if args.step_ms else ""))
    for title, key in (("inclusive (Python functions)", "inclusive"), ("self (innermost frame)", "self"),
                       ("innermost WriteScope frame > innermost frame", "under")):
        print(f"\n{title}:")
        for what, n in s[key].most_common(args.top):
            ms = f"{n / total * args.step_ms:8.2f} ms" if args.step_ms else ""
            print(f"  {100 * n / total:5.1f}% {ms}  {what}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
