"""``writescope calibrate``: measure the roofline inputs A, B, C for a model's KV shape here."""

from __future__ import annotations

import argparse
import time


def add_parser(sub) -> None:
    p = sub.add_parser("calibrate", help="measure the CPU and load-path costs of the model's KV shape on this machine")
    p.add_argument("--model", required=True, help="checkpoint directory or preset name (only its config is read)")
    p.add_argument("--device", default="auto", help="auto (cuda when present, the default), cpu or cuda")
    p.add_argument("--dtype", default="auto", help="auto (bf16 on cuda, fp32 on cpu), bf16, fp16, fp32")
    p.add_argument("--window", type=int, default=256, help="D, tokens per block (default 256)")
    p.add_argument("--batch", type=int, default=16, help="sequences in the measured batch (default 16)")
    p.add_argument("--cpu-threads", type=int, default=None, help="threads for CPU attention (default: all torch threads)")
    p.add_argument("--quiet", action="store_true", help="no progress bar")
    p.set_defaults(run=run)


def run(args: argparse.Namespace) -> int:
    from writescope.engine.model_loader import parse_dtype, resolve_config, resolve_device
    from writescope.scheduler import calibrate as cal
    from writescope.scheduler.limits import Limits
    from writescope.scheduler.roofline import WriteScopePolicy, roofline_share

    from writescope.engine.threads import check_cpu_threads

    for flag, value in (("--window", args.window), ("--batch", args.batch)):
        if value < 1:
            raise ValueError(f"{flag} must be >= 1, got {value}")
    check_cpu_threads(args.cpu_threads, "--cpu-threads")
    device = resolve_device(args.device)
    dtype = parse_dtype(args.dtype, device)
    cfg, _ = resolve_config(args.model)
    layout, q_heads = cfg.kv_layout, cfg.attention.q_heads
    shape = cal.shape_key(layout, q_heads, dtype, args.window)
    print(f"calibrating {shape} on {device} (batch {args.batch})", flush=True)
    t0 = time.perf_counter()
    r, detail = cal.calibrate(layout, q_heads, dtype, device, args.window, args.batch, cpu_threads=args.cpu_threads,
                              progress=not args.quiet)
    path = cal.save(device, shape, r, detail)
    tok_bytes = layout.bytes_per_token(dtype.itemsize)
    print(f"done in {time.perf_counter() - t0:.1f} s; stored in {path} (the terms: docs/DESIGN.md section 5)")
    if device.type == "cpu":
        print("note: on the CPU the 'GPU' side runs as CPU tensors: these figures do not describe a GPU machine")
    bad = detail["implausible"]

    def flag(fit: str) -> str:  # a fit clamped to the machine's limits is marked where it is printed
        return "  [CLAMPED: cannot be true as measured, see below]" if any(p.startswith(fit) for p in bad) else ""

    lims = detail["limits"]
    size = lims.get("read_bytes") or 0  # calibrations stored before it was kept lack it
    where = (f"; the host read of {size / 2**20:.0f} MiB, the largest KV calibrated here, from the CPU's caches where it fits "
             "them, as that KV is") if size else ""
    print(f"  limits here: host read {lims['host_read_gbs']:.1f} GB/s"
          + ("" if lims["load_path"] == "host read" else f", {lims['load_path']} {lims['load_gbs']:.1f} GB/s") + f" (measured{where})")
    if bad:  # what a clamped fit was held to: the limit times its margin, not the limit itself
        cpu_max = Limits(lims["host_read_gbs"], lims["load_gbs"], lims["load_path"]).max_gbs
        print(f"  a [CLAMPED] fit is held to: A at most {cpu_max('cpu')[1]} = {cpu_max('cpu')[0]:.1f} GB/s; "
              f"B at most {cpu_max('load')[1]} = {cpu_max('load')[0]:.1f} GB/s")
    print(f"  A (CPU, compute region)     {r.a * 1e9:10.3f} ns/token  = {tok_bytes / r.a / 1e9:6.1f} GB/s{flag('A and')}")
    print(f"  B (GPU, load region)        {r.b * 1e9:10.3f} ns/token  = {tok_bytes / r.b / 1e9:6.1f} GB/s{flag('B and')}")
    print(f"  C_cpu, C_gpu (fixed/step)   {r.c_cpu * 1e3:.3f} ms, {r.c_gpu * 1e3:.3f} ms")
    print(f"  B alone (no CPU part)       {r.b_alone * 1e9:10.3f} ns/token  = {tok_bytes / r.b_alone / 1e9:6.1f} GB/s, "
          f"C_gpu alone {r.c_gpu_alone * 1e3:.3f} ms{flag('B alone')}")
    print(f"  hand-over in this attention-only loop {detail.get('loop_handover_s', 0.0) * 1e3:.3f} ms per layer "
          "(not counted against a split: whole-model steps hide it behind each layer's other work)")
    policy = WriteScopePolicy(r)
    policy.expect_batch(args.batch)
    contexts = (2048, 8192, 32768, 131072)
    print("  r(L) for a batch of %d (paper eq. 2):" % args.batch, "  ".join(
        f"{L // 1024}K {roofline_share(L * args.batch, r.a, r.b, r.c_cpu, r.c_gpu):.3f}" for L in contexts))
    print("  deployed (0 where a split is predicted no faster than streaming alone):",
          "  ".join(f"{L // 1024}K {policy.cpu_share(L):.3f}" for L in contexts))
    acted = cal.actionable(bad, device)
    if len(acted) < len(bad):  # CPU tensors standing in for a GPU: nothing to act on
        print("note: the 'GPU' side's fits above are CPU tensors' and were clamped; without a GPU that is expected:\n"
              + "\n".join(f"  {p}" for p in bad if p not in acted))
        bad = acted
    if bad:
        print(f"WARNING: {len(bad)} fit(s) stayed outside this machine's physical limits after measuring them again; they are "
              "clamped to the limits, and the shares above rest on them (run calibrate again on a quieter machine, or with a "
              "larger --batch):\n" + "\n".join(f"  {p}" for p in bad))
    return 0

