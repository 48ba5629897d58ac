"""CPU decode attention over the compute region at full scale: the C++ kernel (each path this CPU
offers), torch's flash op, and a plain read of the same bytes as this run's achievable rate, side
by side; then the kernel again while a host-to-GPU copy of the same size runs (the split step's
contention), on CUDA machines; and with ``--busy N``, while N other processes spin on the cores
(a step's thread issuing GPU work, driver threads), the equal split of the keys over the threads
against the dynamic one (cpu_kernel.cpp, DYNAMIC_SPLIT), calls taking turns.

Shapes: DeepSeek-V2-Lite's MLA latent (1 x 576 per token, 16 query heads, V = the first 512
columns) and Qwen3-30B-A3B's GQA KV (4 KV heads x 8 query heads, 128 + 128), bf16, random values
(never zeros), one compute region per sequence laid out as the cache lays it out (per-head rows).
Per case: median ms of one whole-batch call over --repeats (after 2 warm-up calls), the spread
(min-max), GB/s of KV read (MLA: the latent once) and that rate as a fraction of the plain read of
the same bytes measured in the same run (``read_probe``: every byte loaded once by the same
threads). The fixed cost of one call is timed on 16 x 1 block.

Run (repository root):
    PYTHONPATH=. python3 benchmarks/cpu_attention.py --out benchmarks/results/cpu_attention_h200
    PYTHONPATH=. python3 benchmarks/cpu_attention.py --cases mla:4x4k --threads 2 --repeats 5 --out /tmp/cpu_attention
    PYTHONPATH=. python3 benchmarks/cpu_attention.py --cases mla:16x32k --busy 1 --tunings 12 --ablations= --also-threads 0 --no-flash
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import threading
import time
from pathlib import Path

import torch

from writescope.attention import cpu_kernel
from writescope.attention.partial import cpu_attend

from interference import Busy, timed_in_turns  # benchmarks/ (the script's folder)

SHAPES = {"mla": (1, 16, 576, 512), "gqa": (4, 8, 128, 128)}  # kv_heads, group, dk, dv


def parse_case(text: str) -> tuple[str, int, int]:
    """``mla:16x32k`` -> ("mla", 16, 32768)."""
    shape, _, rest = text.partition(":")
    b, _, n = rest.partition("x")
    if shape not in SHAPES or not b.isdigit() or not n:
        raise ValueError(f"case {text!r}: use SHAPE:BATCHxCONTEXT with SHAPE mla or gqa, e.g. mla:16x32k")
    n = n.lower()
    tokens = int(n[:-1]) * 1024 if n.endswith("k") else int(n)
    return shape, int(b), tokens


def build(shape: str, batch: int, n: int, gen: torch.Generator):
    """Per sequence its region (contiguous) and the (k, v) views the cache hands the kernel."""
    H, G, dk, dv = SHAPES[shape]
    regs, kv = [], []
    for _ in range(batch):
        if shape == "mla":
            r = torch.empty(H, n, dk, dtype=torch.bfloat16).normal_(generator=gen)
            kv.append((r, r[..., :dv]))
        else:
            r = torch.empty(2, H, n, dk, dtype=torch.bfloat16).normal_(generator=gen)
            kv.append((r[0], r[1]))
        regs.append(r)
    q = torch.randn(batch, H, G, dk, generator=gen).to(torch.bfloat16)
    return regs, kv, q


def timed(fn, repeats: int) -> tuple[float, float, float]:
    for _ in range(2):
        fn()
    ts = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        fn()
        ts.append(time.perf_counter() - t0)
    return statistics.median(ts), min(ts), max(ts)


class Copier:
    """Host-to-GPU copies of a pinned buffer of ``nbytes`` in 256 MiB pieces on a side stream,
    over and over, in a thread of its own, until stopped; ``gbs()`` the rate it reached."""

    def __init__(self, nbytes: int):
        self.src = torch.empty(nbytes, dtype=torch.uint8, pin_memory=True).random_(0, 255)
        self.dst = torch.empty(nbytes, dtype=torch.uint8, device="cuda")
        self.stop, self.moved, self.seconds = threading.Event(), 0, 0.0

    def _run(self):
        s, piece = torch.cuda.Stream(), 256 << 20
        t0 = time.perf_counter()
        with torch.cuda.stream(s):
            while not self.stop.is_set():
                for a in range(0, self.src.numel(), piece):
                    self.dst[a : a + piece].copy_(self.src[a : a + piece], non_blocking=True)
                s.synchronize()
                self.moved += self.src.numel()
        self.seconds = time.perf_counter() - t0

    def __enter__(self):
        self.thread = threading.Thread(target=self._run)
        self.thread.start()
        time.sleep(0.3)
        return self

    def __exit__(self, *exc):
        self.stop.set()
        self.thread.join()

    def gbs(self) -> float:
        return self.moved / self.seconds / 1e9 if self.seconds else float("nan")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--cases", default="mla:16x32k,mla:32x32k,gqa:16x32k", help="SHAPE:BATCHxCONTEXT, comma-separated")
    ap.add_argument("--threads", type=int, default=max(1, torch.get_num_threads() - 1), help="kernel threads (default: all but one)")
    ap.add_argument("--repeats", type=int, default=10)
    ap.add_argument("--chunks", default="128,256", help="CHUNK values tried with each tuning on the best path")
    ap.add_argument("--tunings", default="2,4,6,1,5", help="tuning flags tried on the best path (cpu_kernel.cpp, Tuning: 1 each chunk "
                    "read in address order first, 2 software prefetch in the AMX scores, 4 values product on V's rows in place, 8 paced "
                    "prefetch over the whole chunk, 16 paced into L1, 32 paced two chunks ahead)")
    ap.add_argument("--ablations", default="64,128,256,512", help="stages left out, one at a time, added to the default tuning and "
                    "PV_DIRECT's (64 scores, 128 softmax, 256 packing V, 512 values): their time differences place the time "
                    "(the outputs are then wrong)")
    ap.add_argument("--copy-tunings", default="", help="tuning flags also timed during the host-to-GPU copy (CUDA only; "
                    "default: the kernel's default tuning alone)")
    ap.add_argument("--also-threads", type=int, default=8, help="the default variant again with this many threads (0: not)")
    ap.add_argument("--no-flash", action="store_true", help="leave torch's flash op out (it is slow at full scale)")
    ap.add_argument("--busy", default="", help="comma-separated counts of spinning processes (e.g. 0,1,2): the best path's "
                    "default tuning with the equal and the dynamic split of keys over threads, calls taking turns, under each")
    ap.add_argument("--out", default=None, help="path prefix: writes PREFIX.json and PREFIX.md")
    a = ap.parse_args()
    cases = [parse_case(c) for c in a.cases.split(",")]
    if a.threads < 1 or a.repeats < 1:
        raise SystemExit(f"--threads and --repeats must be >= 1, got {a.threads}, {a.repeats}")
    if a.out:
        Path(a.out).parent.mkdir(parents=True, exist_ok=True)
    if not cpu_kernel.kernel_available():
        raise SystemExit("the CPU attention kernel did not build (see the warning)")
    ext = cpu_kernel._extension()
    torch.set_num_threads(a.threads)
    best = cpu_kernel.best_path()
    paths = [p for p in ("amx", "avx512bf16", "portable") if cpu_kernel.PATHS.index(p) <= cpu_kernel.PATHS.index(best)]
    print(f"CPU attention: {a.threads} threads, best path {best}; paths timed: {', '.join(paths)}; torch {torch.__version__}", flush=True)
    rows, gen = [], torch.Generator().manual_seed(0)

    def run_path(path, q, kv, scale):
        os.environ["WRITESCOPE_CPU_ATTENTION"] = "flash" if path == "flash" else "kernel"
        os.environ["WRITESCOPE_CPU_ISA"] = "auto" if path == "flash" else path
        return lambda: cpu_attend(q, kv, scale, kv[0][1].shape[-1])

    for ci, (shape, batch, n) in enumerate(cases):
        H, G, dk, dv = SHAPES[shape]
        regs, kv, q = build(shape, batch, n, gen)
        nbytes = sum(r.numel() * r.element_size() for r in regs)
        read = timed(lambda: ext.read_probe(regs, a.threads), a.repeats)
        read_gbs = nbytes / read[0] / 1e9
        name = f"{shape} {batch}x{n // 1024}K"
        print(f"{name}: {nbytes / 1e9:.2f} GB of KV; plain read {read_gbs:.1f} GB/s", flush=True)
        base = {"case": name, "shape": shape, "batch": batch, "context": n, "bytes": nbytes, "read_gbs": read_gbs, "threads": a.threads}
        default_tuning = ext.set_tuning(0)
        ext.set_tuning(default_tuning)
        for path in paths + ([] if a.no_flash else ["flash"]):
            sweep = path == best
            variants = [(c, t, a.threads) for t in (map(int, a.tunings.split(",")) if sweep else [default_tuning])
                        for c in ([int(c) for c in a.chunks.split(",")] if sweep else [cpu_kernel.CHUNK])]
            if sweep:
                variants += [(cpu_kernel.CHUNK, base | int(x), a.threads) for base in sorted({default_tuning, 4 | default_tuning})
                             for x in a.ablations.split(",") if x]
                if a.also_threads:
                    variants.append((cpu_kernel.CHUNK, default_tuning, a.also_threads))
            for chunk, tuning, threads in variants:
                old = cpu_kernel.CHUNK
                cpu_kernel.CHUNK = chunk
                ext.set_tuning(tuning)
                torch.set_num_threads(threads)
                med, lo, hi = timed(run_path(path, q, kv, dk**-0.5), a.repeats)
                cpu_kernel.CHUNK = old
                ext.set_tuning(default_tuning)
                torch.set_num_threads(a.threads)
                label = path if path == "flash" else f"{path} (chunk {chunk}, tuning {tuning}{'' if threads == a.threads else f', {threads} threads'})"
                if tuning >= 64:
                    label += " [ablation]"
                rows.append({**base, "backend": label, "ms": med * 1e3, "min_ms": lo * 1e3, "max_ms": hi * 1e3,
                             "gbs": nbytes / med / 1e9, "of_read": nbytes / med / 1e9 / read_gbs})
                print(f"  {label:50s} {med * 1e3:8.2f} ms [{lo * 1e3:.2f}-{hi * 1e3:.2f}]  {nbytes / med / 1e9:6.1f} GB/s  "
                      f"{nbytes / med / 1e9 / read_gbs:5.0%} of read", flush=True)
        if torch.cuda.is_available():  # the same call while the link carries a copy of the same size
            for tuning in [int(t) for t in a.copy_tunings.split(",") if t] or [default_tuning]:
                ext.set_tuning(tuning)
                with Copier(nbytes) as cp:
                    read_c = timed(lambda: ext.read_probe(regs, a.threads), a.repeats)
                    med, lo, hi = timed(run_path(best, q, kv, dk**-0.5), a.repeats)
                ext.set_tuning(default_tuning)
                label = f"{best} (tuning {tuning}), during a host-to-GPU copy"
                rows.append({**base, "backend": label, "ms": med * 1e3, "min_ms": lo * 1e3, "max_ms": hi * 1e3, "tuning": tuning,
                             "gbs": nbytes / med / 1e9, "of_read": nbytes / med / 1e9 / read_gbs,
                             "read_during_copy_gbs": nbytes / read_c[0] / 1e9, "copy_gbs": cp.gbs()})
                print(f"  {label:50s} {med * 1e3:8.2f} ms [{lo * 1e3:.2f}-{hi * 1e3:.2f}]  {nbytes / med / 1e9:6.1f} GB/s  "
                      f"(plain read during copy {nbytes / read_c[0] / 1e9:.1f} GB/s; copy {cp.gbs():.1f} GB/s)", flush=True)
        for n_busy in [int(x) for x in a.busy.split(",") if x]:
            splits = [default_tuning & ~cpu_kernel.DYNAMIC_SPLIT, default_tuning | cpu_kernel.DYNAMIC_SPLIT]

            def with_tuning(t):
                def call():
                    ext.set_tuning(t)
                    run_path(best, q, kv, dk**-0.5)()
                return call

            with Busy(n_busy):
                got = timed_in_turns([with_tuning(t) for t in splits], a.repeats)
            ext.set_tuning(default_tuning)
            for t, (med, lo, hi) in zip(splits, got):
                label = f"{best} (tuning {t}, {'dynamic' if t & cpu_kernel.DYNAMIC_SPLIT else 'equal'} split), {n_busy} busy"
                rows.append({**base, "backend": label, "ms": med * 1e3, "min_ms": lo * 1e3, "max_ms": hi * 1e3, "tuning": t,
                             "busy": n_busy, "gbs": nbytes / med / 1e9, "of_read": nbytes / med / 1e9 / read_gbs})
                print(f"  {label:50s} {med * 1e3:8.2f} ms [{lo * 1e3:.2f}-{hi * 1e3:.2f}]  {nbytes / med / 1e9:6.1f} GB/s", flush=True)
        del regs, kv
    # the fixed cost of one call: 16 sequences of one 256-token block
    regs, kv, q = build("mla", 16, 256, gen)
    for path in paths:
        med, lo, hi = timed(run_path(path, q, kv, 576**-0.5), max(a.repeats, 50))
        rows.append({"case": "mla 16x256 (fixed cost)", "backend": path, "ms": med * 1e3, "min_ms": lo * 1e3, "max_ms": hi * 1e3, "threads": a.threads})
    print("\n| case | backend | ms (min-max) | GB/s | of plain read |\n|---|---|---|---|---|")
    lines = [f"| {r['case']} | {r['backend']} | {r['ms']:.2f} ({r['min_ms']:.2f}-{r['max_ms']:.2f}) | "
             f"{r.get('gbs', float('nan')):.1f} | {r.get('of_read', float('nan')):.0%} |" for r in rows]
    print("\n".join(lines))
    if a.out:
        Path(a.out + ".json").write_text(json.dumps({"threads": a.threads, "best_path": best, "torch": torch.__version__, "rows": rows}, indent=1))
        Path(a.out + ".md").write_text("| case | backend | ms (min-max) | GB/s | of plain read |\n|---|---|---|---|---|\n" + "\n".join(lines) + "\n")


if __name__ == "__main__":
    main()
