"""writescope/native/build.py: ``is_cached`` agrees with what torch's build (ninja) will do, and
the build notices come with ``--quiet`` too. No real compile: torch's own machinery (load_inline,
its build.ninja, ninja) runs with a stand-in compiler that writes the dependency file and touches
its output, as g++ -MMD would."""

from __future__ import annotations

import os
import shutil
import subprocess
import textwrap
import time
from pathlib import Path

import pytest

from writescope.native import build

FAKE_CXX = textwrap.dedent("""\
    #!/bin/sh
    # a compiler stand-in: "-MMD -MF dep ... -c main.cpp -o main.o" or "main.o ... -o x.so"
    out=""; dep=""; prev=""
    for a in "$@"; do
      case "$prev" in -o) out="$a";; -MF) dep="$a";; esac
      prev="$a"
    done
    if [ -n "$dep" ]; then printf '%s: %s\\n' "$out" "$FAKE_DEPS" > "$dep"; fi
    : > "$out"
    echo "$out" >> "$FAKE_LOG"
    """)


@pytest.fixture
def fake_build(tmp_path, monkeypatch):
    """A source folder (x.cpp including x.h), a private torch extension cache and the stand-in
    compiler; yields (source folder, the compiler's log: one line per file it made)."""
    if shutil.which("ninja") is None:
        pytest.skip("no ninja here")
    src = tmp_path / "src"
    src.mkdir()
    (src / "x.cpp").write_text('#include "x.h"\n')
    (src / "x.h").write_text("// a header\n")
    cxx = tmp_path / "fake-cxx"
    cxx.write_text(FAKE_CXX)
    cxx.chmod(0o755)
    log = tmp_path / "cxx.log"
    log.write_text("")
    monkeypatch.setenv("TORCH_EXTENSIONS_DIR", str(tmp_path / "ext"))
    monkeypatch.setenv("CXX", str(cxx))
    monkeypatch.setenv("TORCH_DONT_CHECK_COMPILER_ABI", "1")
    monkeypatch.setenv("FAKE_LOG", str(log))
    monkeypatch.setenv("FAKE_DEPS", f"{src / 'x.h'} {build.NATIVE_DIR / 'cpu_features.h'}")
    yield src, log


def _name(src: Path) -> str:
    """A name of its own for each test's extension (torch bumps a name rebuilt with other sources
    in one process to name_v1)."""
    import hashlib

    return f"writescope_fake_{hashlib.sha1(str(src).encode()).hexdigest()[:8]}"


def _build_dir(src: Path) -> Path:
    from torch.utils.cpp_extension import _get_build_directory

    name, _ = build._named_source(_name(src), src, ("x.cpp", "x.h"))
    return Path(_get_build_directory(name, False))


def _ninja(d: Path) -> None:
    """Run the build as torch does (ninja in the build directory)."""
    subprocess.run(["ninja", "-C", str(d)], check=True, capture_output=True)


def _newer_than_the_build(path: Path, d: Path) -> None:
    """Give ``path`` an mtime after the build in ``d`` (as a fresh clone's files have): the build's
    files are dated 200 s back, ``path`` 100 s back (so a rebuild now dates its outputs after it)."""
    now = time.time()
    for f in d.iterdir():
        os.utime(f, (now - 200, now - 200))
    os.utime(path, (now - 100, now - 100))


def test_is_cached_follows_ninja_after_a_header_is_touched(fake_build):
    """The fresh-clone case: same text, newer header; ninja rebuilds, so it is no cached build."""
    src, log = fake_build
    ext = build.Extension(_name(src), src, ("x.cpp", "x.h"), "nothing")
    assert not ext.cached()  # nothing built yet
    with pytest.warns(UserWarning, match="could not be built"):  # built; the stand-in .so does not import
        assert build.load(*ext.args) is None
    d = _build_dir(src)
    assert len(log.read_text().split()) == 2 and (d / "build.ninja").exists()  # torch ran ninja: compiled, linked
    assert ext.cached()  # just built: ninja has nothing to do
    _newer_than_the_build(src / "x.h", _build_dir(src))
    assert not ext.cached()  # the header is newer than main.o: ninja will rebuild
    _ninja(d)
    assert len(log.read_text().split()) == 4  # ... and it did (compile and link)
    assert ext.cached()


def test_is_cached_follows_a_changed_header_and_changed_flags(fake_build, monkeypatch):
    src, log = fake_build
    ext = build.Extension(_name(src), src, ("x.cpp", "x.h"), "nothing")
    with pytest.warns(UserWarning, match="could not be built"):
        build.load(*ext.args)
    assert ext.cached()
    flags = build._flags
    monkeypatch.setattr(build, "_flags", lambda d: {**flags(d), "extra_cflags": flags(d)["extra_cflags"] + ["-DOTHER"]})
    assert not ext.cached()  # torch will write another build.ninja: another command line, a rebuild
    monkeypatch.setattr(build, "_flags", flags)
    assert ext.cached()
    (src / "x.h").write_text("// another header\n")
    assert not ext.cached()  # another text (the digest in main.cpp differs)


def test_a_cached_build_has_no_notice_and_a_stale_one_has(fake_build, capsys):
    """Extension.build announces a build exactly when ninja will run one."""
    src, log = fake_build
    name = _name(src)
    with pytest.warns(UserWarning, match="could not be built"):
        build.load(name, src, ("x.cpp", "x.h"), "nothing")
    capsys.readouterr()
    ext = build.Extension(name, src, ("x.cpp", "x.h"), "nothing")
    ext.get = lambda: object()  # loading is not what this checks
    ext.build(True, "CPU attention", "about a minute")
    assert "building" not in capsys.readouterr().err
    _newer_than_the_build(src / "x.h", _build_dir(src))
    ext.build(True, "CPU attention", "about a minute")
    assert "CPU attention: building the C++ kernel (once per machine and environment, about a minute)" in capsys.readouterr().err


def test_the_build_notices_come_with_quiet_too(monkeypatch, capsys):
    """``--quiet`` (progress=False) drops bars and streamed text, not the build notice and its time."""
    clock = iter(range(0, 10_000, 30))
    monkeypatch.setattr(time, "perf_counter", lambda: float(next(clock)))
    monkeypatch.setattr(build, "load", lambda *a: object())
    monkeypatch.setattr(build, "is_cached", lambda *a: False)
    ext = build.Extension("writescope_test_ext", Path("/nonexistent"), ("x.cpp",), "nothing")
    assert ext.build(False, "host experts", "about half a minute")
    err = capsys.readouterr().err
    assert "host experts: building the C++ kernel (once per machine and environment, about half a minute) ..." in err
    assert "host experts: C++ kernel ready in" in err
    monkeypatch.setattr(build, "is_cached", lambda *a: True)
    ext = build.Extension("writescope_test_ext", Path("/nonexistent"), ("x.cpp",), "nothing")
    monkeypatch.setattr(time, "perf_counter", lambda: 0.0)
    assert ext.build(False, "host experts", "about half a minute")
    assert capsys.readouterr().err == ""  # loaded from the cache at once: nothing to say


def test_the_build_name_differs_by_torch_installation(monkeypatch, tmp_path):
    """Two virtual environments on one checkout get builds of their own: torch rebuilds a name whose
    build.ninja (the torch installation's include and library paths) changed, so one name shared
    by two environments rebuilt on every switch between them (about 50 s each, a new user found)."""
    import torch

    src = tmp_path / "src"
    src.mkdir()
    (src / "x.cpp").write_text("int f() { return 1; }\n")
    (src / "x.h").write_text("\n")
    first, _ = build._named_source("writescope_fake", src, ("x.cpp", "x.h"))
    assert build._named_source("writescope_fake", src, ("x.cpp", "x.h"))[0] == first  # stable
    monkeypatch.setattr(torch, "__file__", str(tmp_path / "other-venv" / "torch" / "__init__.py"))
    assert build._named_source("writescope_fake", src, ("x.cpp", "x.h"))[0] != first
