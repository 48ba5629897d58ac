"""Two concurrent request streams against `writescope serve` (issue 18, item 5; the paper's Table 3):
ms per decode step of each stream alone, together under fixed CPU shares, and together under the
adaptive `writescope` policy, in one run.

    PYTHONPATH=. python benchmarks/multi_user.py --model qwen3-30b-a3b --synthetic --device cuda \\
        --vram-budget 32GiB --streams 8x8k,4x8k --new-tokens 32 --policies gpu,static:0.25,writescope \\
        --out benchmarks/results/multi_user_h200

Each stream is ``B x L``: B requests of L prompt tokens (random ids, seeded), all sent at once over
loopback with streaming on, ``--new-tokens`` tokens each (ignore_eos). A request's ms per step is
the time from its first streamed chunk to its last over the tokens those later chunks carried (the
inter-token latency a user sees; the server merges the tokens a slow reader has not taken into one
chunk, so chunks are counted by their ``token_ids``, not one a token);
a stream's figure is the median over its requests, with the spread (min-max). The server runs in
this process on the loaded model (the model loads once; each configuration gets a fresh engine and
cache; the placed CPU share is read from each request as its slot is freed, over all requests of a
configuration; on CUDA the peak of device memory allocated in each configuration, and where it
went when a request failed: a failed configuration is a row with its error, and the run goes on). Writes OUT.json and OUT.md (one row per configuration and stream) and prints the table.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import statistics
import sys
import time

import torch


def parse_streams(text: str) -> list[tuple[int, int]]:
    """``"8x8k,4x8k"`` -> ``[(8, 8192), (4, 8192)]``.

    Raises:
        ValueError: not of that form, or a count below 1.
    """
    from writescope.cli.bench import parse_tokens

    out = []
    for part in text.split(","):
        try:
            b, ctx = part.strip().lower().split("x")
            (length,) = parse_tokens(ctx, "--streams")
            out.append((int(b), length))
        except ValueError as e:
            raise ValueError(f"--streams {text!r}: each stream is BxL, e.g. 8x8k ({e})") from None
    if not out or any(b < 1 for b, _ in out):
        raise ValueError(f"--streams {text!r}: at least one stream, each with at least one request")
    return out


async def _one(client, url: str, model: str, prompt: list[int], new_tokens: int) -> list[tuple[float, int]]:
    """Streams one completion; returns each chunk's arrival time (seconds) and how many tokens it carried."""
    times = []
    body = {"model": model, "prompt": prompt, "max_tokens": new_tokens, "temperature": 0, "stream": True, "ignore_eos": True,
            "return_token_ids": True}
    async with client.stream("POST", url + "/v1/completions", json=body, timeout=3600) as r:
        if r.status_code != 200:
            raise RuntimeError(f"request refused: {r.status_code} {(await r.aread())[:300]!r}")
        async for line in r.aiter_lines():
            if line.startswith("data: ") and line != "data: [DONE]":
                chunk = json.loads(line[6:])
                if "error" in chunk:  # the server's in-stream failure (serve/app.py): no step time without the tokens
                    err = chunk["error"]
                    raise RuntimeError(f"request failed in the server: {err.get('message', err) if isinstance(err, dict) else err}")
                if chunk.get("choices"):
                    times.append((time.perf_counter(), len(chunk["choices"][0].get("token_ids") or ())))
    return times


def ms_per_step(chunks: list[tuple[float, int]]) -> float | None:
    """Mean ms per token after the first chunk: (last arrival - first) / the tokens after the first
    chunk; None when no token came after the first chunk."""
    later = sum(n for _, n in chunks[1:])
    return (chunks[-1][0] - chunks[0][0]) / later * 1e3 if later else None


def _row(policy: str, streams: list[tuple[int, int]], active: list[int], i: int, **measured) -> dict:
    """One table row: stream ``i`` of a configuration, what was measured (None where not) and the error."""
    b, ctx = streams[i]
    row = {"policy": policy, "together": len(active) > 1, "stream": f"{b}x{ctx}", "requests": b, "ms_per_step": None,
           "min_ms": None, "max_ms": None, "deployed_r": None, "peak_device_gib": None, "error": None}
    row.update(measured)
    return row


def run_config(llm, model: str, policy: str, streams: list[tuple[int, int]], active: list[int], new_tokens: int, seed: int) -> list[dict]:
    """Serve the ``active`` streams together under ``policy``; one row per active stream.

    Raises:
        RuntimeError: a request was refused or failed in the server (its message).
    """
    import httpx

    from writescope.serve.app import ServerState, build_app
    from writescope.serve.async_engine import AsyncEngine
    from writescope.serve.server import ServerThread

    llm.set_policy(policy)
    total = sum(streams[i][0] for i in active)
    llm.cache.expect_batch(total)
    state = ServerState(model)
    engine = AsyncEngine(llm, max_num_seqs=total, max_queue=total)
    state.ready(engine, llm.tokenizer)
    g = torch.Generator().manual_seed(seed)
    prompts = {i: torch.randint(3, llm.config.vocab_size, (streams[i][0], streams[i][1]), generator=g).tolist() for i in active}
    placed = {"compute": 0, "load": 0}  # every request's KV placement, read as the engine frees its slot
    free = llm.cache.free

    def recording_free(slot):
        if hasattr(llm.cache, "placement"):
            p = llm.cache.placement(slot)
            placed["compute"] += p["compute"]
            placed["load"] += p["load"]
        free(slot)

    llm.cache.free = recording_free
    cuda = llm.device.type == "cuda"
    if cuda:
        torch.cuda.reset_peak_memory_stats(llm.device)
    with ServerThread(build_app(state)) as srv:
        async def main():
            async with httpx.AsyncClient() as client:
                jobs = {i: [_one(client, srv.url, model, p, new_tokens) for p in prompts[i]] for i in active}
                flat = [(i, j) for i in active for j in jobs[i]]
                done = await asyncio.gather(*(j for _, j in flat))
            return [(i, t) for (i, _), t in zip(flat, done)]

        try:
            results = asyncio.run(main())
        except RuntimeError:
            if cuda:  # where the device memory went, for the plan's next look (budget/plan.py)
                print(f"{policy}, streams {active}: device memory when the run failed:\n"
                      f"{torch.cuda.memory_summary(llm.device, abbreviated=True)}", file=sys.stderr)
            raise
        finally:
            llm.cache.free = free
    peak = torch.cuda.max_memory_allocated(llm.device) / 2**30 if cuda else None
    rows = []
    for i in active:
        per_req = [ms for s, t in results if s == i and (ms := ms_per_step(t)) is not None]
        rows.append(_row(policy, streams, active, i, ms_per_step=statistics.median(per_req) if per_req else None,
                         min_ms=min(per_req) if per_req else None, max_ms=max(per_req) if per_req else None,
                         deployed_r=placed["compute"] / (placed["compute"] + placed["load"]) if placed["compute"] + placed["load"] else None,
                         peak_device_gib=peak))
    return rows


def main(argv: list[str] | None = None) -> list[dict]:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--model", default="tiny-qwen3-moe")
    ap.add_argument("--synthetic", action="store_true")
    ap.add_argument("--device", default="auto")
    ap.add_argument("--dtype", default="auto")
    ap.add_argument("--vram-budget", default=None)
    ap.add_argument("--streams", default="8x8k,4x8k", help="two (or more) streams BxL (default 8x8k,4x8k)")
    ap.add_argument("--new-tokens", type=int, default=32)
    ap.add_argument("--policies", default="gpu,static:0.25,writescope", help="policies for the streams together (the solo runs use writescope)")
    ap.add_argument("--solo-policy", default="writescope")
    ap.add_argument("--window", type=int, default=256)
    ap.add_argument("--prefill-chunk-tokens", type=int, default=4096,
                    help="prompt tokens per prefill forward pass (default 4096: the prefill's activations fit beside a 32 GiB plan)")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--out", default=None, help="write OUT.json and OUT.md")
    args = ap.parse_args(argv)
    os.environ.setdefault("PYTORCH_CUDA_ALLOC_CONF", "expandable_segments:True")  # as the CLI (cli/main.py), before CUDA starts
    streams = parse_streams(args.streams)
    if args.new_tokens < 2:
        raise ValueError(f"--new-tokens must be >= 2 (a step time needs two tokens), got {args.new_tokens}")
    from writescope import LLM

    total = sum(b for b, _ in streams)
    longest = max(ctx for _, ctx in streams) + args.new_tokens + 1
    llm = LLM(args.model, synthetic=args.synthetic, device=args.device, dtype=args.dtype, progress=False, policy=args.solo_policy,
              window=args.window, vram_budget=args.vram_budget, max_batch=total, max_model_len=longest,
              prefill_chunk_tokens=args.prefill_chunk_tokens)
    rows = []
    configs = [(args.solo_policy, [i]) for i in range(len(streams))]  # each stream alone
    configs += [(pol.strip(), list(range(len(streams)))) for pol in args.policies.split(",")]  # all together
    for policy, active in configs:
        try:
            rows += run_config(llm, args.model, policy, streams, active, args.new_tokens, args.seed)
        except (RuntimeError, ValueError) as e:  # a failed configuration is a row that says why; the others still run
            print(f"{policy}, streams {active}: {e}", file=sys.stderr)
            rows += [_row(policy, streams, active, i, error=str(e).split("\n")[0][:300]) for i in active]
    lines = ["| policy | streams | stream | ms per step (median) | min-max | placed r (all requests) | peak device GiB |",
             "|---|---|---|---|---|---|---|"]
    for r in rows:
        f = (lambda x: "-" if x is None else f"{x:.2f}")
        lines.append(f"| {r['policy']} | {'together' if r['together'] else 'alone'} | {r['stream']} | {f(r['ms_per_step'])} | "
                     f"{f(r['min_ms'])}-{f(r['max_ms'])} | {f(r['deployed_r'])} | {f(r['peak_device_gib'])} |")
    lines += [f"\n{r['policy']} {r['stream']}: failed: {r['error']}" for r in rows if r.get("error")]
    print("\n".join(lines))
    if args.out:
        with open(args.out + ".json", "w") as fh:
            json.dump({"args": vars(args), "rows": rows}, fh, indent=1)
        with open(args.out + ".md", "w") as fh:
            fh.write("\n".join(lines) + "\n")
    return rows


if __name__ == "__main__":
    main()
