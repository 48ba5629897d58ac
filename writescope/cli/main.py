"""``writescope`` entry point: subcommands ``generate``, ``bench``, ``calibrate``, ``plan``, ``profile``, ``expert-profile``, ``make-checkpoint`` and ``serve``."""

from __future__ import annotations

import argparse
import os
import sys
import time
import warnings
from pathlib import Path

from writescope.cli import bench, calibrate, expert_profile, generate, make_checkpoint, plan, profile, serve
from writescope.cli.outputs import attach_negative_values
from writescope.cli.wording import worded


def package_version() -> str:
    """The installed distribution's version (its metadata), else the source tree's ``__version__``."""
    from importlib.metadata import PackageNotFoundError, version

    try:
        return version("writescope")
    except PackageNotFoundError:
        from writescope import __version__

        return f"{__version__} (not installed)"


def main(argv: list[str] | None = None) -> int:
    # before CUDA starts (set here, not at import, so importing the CLI changes nothing): freed
    # weights go back to the device page by page instead of pinning whole 20 MiB segments, so
    # what a --vram-budget run holds stays close to its plan
    os.environ.setdefault("PYTORCH_CUDA_ALLOC_CONF", "expandable_segments:True")
    parser = argparse.ArgumentParser(prog="writescope", description="Long-context MoE inference with a partitioned KV cache.")
    parser.add_argument("--version", action="version", version=f"%(prog)s {package_version()}",
                        help="print the installed package's version and exit")
    sub = parser.add_subparsers(dest="command", required=True)
    generate.add_parser(sub)
    calibrate.add_parser(sub)
    bench.add_parser(sub)
    plan.add_parser(sub)
    make_checkpoint.add_parser(sub)
    profile.add_parser(sub)
    expert_profile.add_parser(sub)
    serve.add_parser(sub)
    # "--vram-budget -1GiB" reaches the budget's own check instead of argparse's "expected one argument"
    args, extra = parser.parse_known_args(attach_negative_values(sys.argv[1:] if argv is None else list(argv)))
    if extra:  # said by the subcommand's parser: its usage and name ("writescope plan: error: ..."), not the top level's
        sub.choices[args.command].error(f"unrecognized arguments: {' '.join(extra)} (see writescope {args.command} --help)")
    shown, started = warnings.formatwarning, time.time()
    warnings.formatwarning = _warning_format(shown, args.command)
    try:
        return args.run(args)
    except (ValueError, FileNotFoundError, FileExistsError) as e:
        # an API error names API arguments: reworded with this command's flags (args.flags, set by the
        # subcommand: API argument name -> flag; others become --name-with-dashes)
        print(f"writescope {args.command}: error: {worded(e, args.command, getattr(args, 'flags', {}))}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:  # Ctrl-C: no traceback; say what was kept
        out, kept = Path(getattr(args, "output_json", None) or ""), ""
        # a bench's rows: those this run wrote (coarse file clocks allowed for), or the ones it resumes
        if args.command == "bench" and out.name and out.is_file() and (getattr(args, "resume", False) or out.stat().st_mtime >= started - 2):
            kept = f"; the rows finished so far are in {out} (run the same command with --resume to go on)"
        print(f"\nwritescope {args.command}: interrupted{kept}", file=sys.stderr)
        return 130
    finally:
        warnings.formatwarning = shown


def _warning_format(shown, command: str):
    """``warnings.formatwarning`` for a command: WriteScope's own warnings as ``writescope CMD:
    warning: ...`` (no source path and line, which mean nothing to a user); others as before."""
    ours = Path(__file__).resolve().parent.parent  # the package's own files (not a library's in a clone's .venv)

    def fmt(message, category, filename, lineno, line=None):
        if issubclass(category, UserWarning) and Path(str(filename)).resolve().is_relative_to(ours):
            return f"writescope {command}: warning: {message}\n"
        return shown(message, category, filename, lineno, line)

    return fmt


if __name__ == "__main__":
    sys.exit(main())
