"""Building a native CPU kernel (torch.utils.cpp_extension.load_inline, cached by torch per source
digest; ninja rebuilds where a source or header is newer than the build, whatever its text), telling
ahead whether a build will run (is_cached: the digest, the build.ninja torch writes and a ninja dry
run), and reading which of its paths an environment variable asks for."""

from __future__ import annotations

import contextlib
import hashlib
import os
import warnings
from pathlib import Path

NATIVE_DIR = Path(__file__).parent
SHARED = ("cpu_features.h", "avx512_math.h", "amx.h", "scratch.h", "read_probe.h", "flag_worker.h")
PATHS = ("portable", "avx512bf16", "amx", "amx-emulated")  # index = the extensions' path number; the last is for tests


def load(name: str, directory: Path, sources: tuple[str, ...], failure: str):
    """Build (or load from torch's cache) the extension ``name`` from ``directory/sources[0]``,
    which includes the other sources and this folder's shared headers through the include path.
    The source text carries a digest of all of them, so a change to any header rebuilds.
    Compiled with -O3 -march=native -fopenmp, under a name that carries a digest of this CPU's
    flags (a torch extension cache shared by different CPUs keeps one build for each), of this
    checkout's path and of the torch installation (one build per checkout and environment). Returns the module, or None with a warning naming
    ``failure`` (what is used instead) where it does not build (no compiler, say)."""
    # -march=native: one build per kind of CPU, also where torch's cache is shared; and one per
    # checkout and torch installation: torch rebuilds a name whose include paths changed, so two
    # checkouts on one machine (git worktrees), or two virtual environments, under one name rebuilt
    # each other's extension, and a build killed midway left its lock for every later process to wait on
    name, source = _named_source(name, directory, sources)
    try:
        from torch.utils.cpp_extension import load_inline

        with _build_lock(name) as build:
            return load_inline(name, cpp_sources=[source], **_flags(directory), verbose=False,
                               build_directory=None if build is None else str(build))
    except Exception as e:  # noqa: BLE001 - no compiler, or the build failed
        warnings.warn(f"{name} could not be built ({str(e)[:300]}); {failure}", stacklevel=3)
        return None


@contextlib.contextmanager
def _build_lock(name: str):
    """Hold an advisory lock (``fcntl.flock``) on ``<build directory>.flock`` around a build,
    yielding the build directory (None where the lock cannot be had: the build then goes on
    under torch's own lock alone, with a warning). The kernel releases the flock when its process
    dies, which torch's own ``lock`` file (created inside the build directory, deleted at the end
    of a build) is not: a build killed midway (a timeout on a test run) left that file, and every
    later process waited on it forever. Under this lock no other writescope build of ``name`` on
    this machine runs, so a ``lock`` file found there is stale and is removed, with a warning.
    (An extension cache shared by several machines over a file system whose flocks are local
    would defeat this; keep ``TORCH_EXTENSIONS_DIR`` per machine.)"""
    try:
        import fcntl

        from torch.utils.cpp_extension import _get_build_directory

        build = Path(_get_build_directory(name, False))
        build.mkdir(parents=True, exist_ok=True)
        f = open(build.parent / f"{build.name}.flock", "w")
        try:
            fcntl.flock(f, fcntl.LOCK_EX)  # another process building it: wait for that one (it finishes or dies)
        except OSError:
            f.close()
            raise
    except (ImportError, OSError, AttributeError) as e:  # no flock on this file system, or torch moved its helper
        warnings.warn(f"{name}: building without writescope's build lock ({e})", stacklevel=4)
        yield None
        return
    try:
        stale = build / "lock"
        if stale.exists():
            stale.unlink(missing_ok=True)
            warnings.warn(f"{stale}: a build of {name} stopped midway left this lock; removed it", stacklevel=4)
        yield build
    finally:
        fcntl.flock(f, fcntl.LOCK_UN)
        f.close()


def _flags(directory: Path) -> dict:
    """The include paths and compiler flags of every build (load_inline's keywords)."""
    return {"extra_include_paths": [str(directory), str(NATIVE_DIR)], "extra_cflags": ["-O3", "-march=native", "-fopenmp"],
            "extra_ldflags": ["-fopenmp"]}


def _named_source(name: str, directory: Path, sources: tuple[str, ...]) -> tuple[str, str]:
    """The build's name (with the CPU tag and the tag of the checkout and torch installation) and its source text (with the digest)."""
    name = f"{name}_{_cpu_tag()}_{_install_tag()}"
    files = [directory / s for s in sources] + [NATIVE_DIR / s for s in SHARED]
    digest = hashlib.sha256(b"".join(f.read_bytes() for f in files)).hexdigest()
    return name, (directory / sources[0]).read_text() + f"\n// sources digest {digest}\n"


def _install_tag() -> str:
    """Six hex digits of this checkout's path and of the torch installation the build links
    against: torch rebuilds a name whose build.ninja changed (its include and library paths are
    the torch installation's), so two virtual environments on one checkout under one name rebuilt
    each other's extension (about 50 s each time a user switched between them)."""
    try:
        import torch

        torch_dir = str(Path(torch.__file__).resolve().parent)
    except ImportError:  # the build fails later, with torch's own error
        torch_dir = ""
    return hashlib.sha1(f"{NATIVE_DIR.resolve()}|{torch_dir}".encode()).hexdigest()[:6]


def is_cached(name: str, directory: Path, sources: tuple[str, ...]) -> bool:
    """Whether :func:`load` will only load the build in torch's extension cache (no compile):
    its library is there, built from the very source text (which carries the digest of every
    source and header), the ``build.ninja`` torch is about to write is the one there (the same
    flags, include paths and compiler), and ninja finds nothing to do (``ninja -n``: it compares
    the mtimes of main.cpp and of every header the compiler reported against main.o's, so a
    header newer than the build, as in a fresh clone, rebuilds although its text is unchanged).
    False where any of these cannot be told (no ninja, an unknown cache layout): a build then
    is announced that may not come, rather than the other way round."""
    try:
        from torch.utils.cpp_extension import _get_build_directory

        name, source = _named_source(name, directory, sources)
        build = Path(_get_build_directory(name, False))
        if not ((build / f"{name}.so").exists() and (build / "main.cpp").read_text().endswith(source)):  # (load_inline prepends its include)
            return False
        return _same_ninja_file(build, name, directory) and _ninja_has_nothing_to_do(build)
    except Exception:  # noqa: BLE001 - an unknown cache layout: say it builds
        return False


def _same_ninja_file(build: Path, name: str, directory: Path) -> bool:
    """Whether ``build/build.ninja`` is the file torch would write for this build now (written by
    torch's own writer into a temporary folder and compared; a changed command line rebuilds).
    True where torch's private writer is not there or takes other arguments (another torch
    version): the ninja dry run alone then decides."""
    import inspect
    import tempfile

    try:
        from torch.utils.cpp_extension import _prepare_ldflags as ldflags
        from torch.utils.cpp_extension import _write_ninja_file_to_build_library as write
    except ImportError:
        return True
    flags = _flags(directory)
    every = {"name": name, "sources": [str(build / "main.cpp")], "extra_cflags": flags["extra_cflags"], "extra_cuda_cflags": [],
             "extra_sycl_cflags": [], "extra_ldflags": flags["extra_ldflags"], "extra_include_paths": flags["extra_include_paths"],
             "with_cuda": False, "with_sycl": False, "is_standalone": False, "verbose": False}

    def call(f, **given):
        args = {**every, **given}
        return f(**{k: v for k, v in args.items() if k in inspect.signature(f).parameters})

    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp) / "build.ninja"
        try:  # as torch's _write_ninja_file_and_build_library does, less the build
            call(write, path=str(path), extra_ldflags=call(ldflags, extra_ldflags=list(flags["extra_ldflags"])))
            expected = path.read_text()
        except Exception:  # noqa: BLE001 - another torch's helpers: leave it to the dry run
            return True
    return (build / "build.ninja").read_text() == expected


def _ninja_has_nothing_to_do(build: Path) -> bool:
    """``ninja -n`` (a dry run: nothing is built or written) in ``build``, as torch runs ninja."""
    import shutil
    import subprocess

    ninja = shutil.which("ninja")
    if ninja is None:
        return False
    run = subprocess.run([ninja, "-n", "-C", str(build)], capture_output=True, text=True, timeout=60, check=False)
    return run.returncode == 0 and "no work to do" in run.stdout


class Extension:
    """One native extension, built (or loaded from torch's cache) by :func:`load` on the first
    :meth:`get`; a failed build is not tried again in this process."""

    def __init__(self, name: str, directory: Path, sources: tuple[str, ...], failure: str):
        self.args = (name, directory, sources, failure)
        self.tried = False  # whether get() has run (a caller may announce the first, slow, build)
        self._module = None

    def get(self):
        """The module, or None where it does not build."""
        if not self.tried:
            self._module = load(*self.args)
            self.tried = True
        return self._module

    def cached(self) -> bool:
        """Whether the first :meth:`get` will only load a cached build (no compile)."""
        return is_cached(*self.args[:3])

    def build(self, progress: bool, what: str, takes: str) -> bool:
        """Build now (the first time on a machine takes ``takes``), saying so in one line on
        stderr, and how long it took after (``what``: the kernel's role, e.g. "CPU attention");
        whether it built. The notices come whatever ``progress`` says: ``--quiet`` drops progress
        bars and streamed text, not a wait of up to a minute with nothing said."""
        import sys
        import time

        del progress  # the notices are printed with or without progress output
        t0 = time.perf_counter()
        if not self.tried and not self.cached():
            print(f"{what}: building the C++ kernel (once per machine and environment, {takes}) ...", file=sys.stderr, flush=True)
        ok = self.get() is not None
        if ok and time.perf_counter() - t0 > 1.0:
            print(f"{what}: C++ kernel ready in {time.perf_counter() - t0:.1f} s", file=sys.stderr, flush=True)
        return ok


def _cpu_tag() -> str:
    """8 hex digits of the CPU's flags (/proc/cpuinfo), or of the machine name where unreadable."""
    import platform

    text = platform.machine()
    try:
        with open("/proc/cpuinfo") as f:
            text = next((ln for ln in f if ln.startswith("flags")), text)
    except OSError:
        pass
    return hashlib.sha1(text.encode()).hexdigest()[:8]


def requested_path(env: str) -> int:
    """The path the variable ``env`` asks for, as the extensions' path number (-1: ``auto``, the
    best the CPU offers; ``amx-emulated`` is a test path).

    Raises:
        ValueError: an unknown value (names it and the choices).
    """
    value = os.environ.get(env, "auto").strip().lower()
    if value == "auto":
        return -1
    if value not in PATHS:
        raise ValueError(f"{env}={value!r}: use auto (the default), amx, avx512bf16 or portable")
    return PATHS.index(value)
