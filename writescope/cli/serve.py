"""``writescope serve``: the OpenAI-compatible server (:mod:`writescope.serve`)."""

from __future__ import annotations

import argparse
import os
import signal
import sys
import threading
import time

from writescope.cli.experts import add_stream_share_flag, check_stream_share
from writescope.errors import plural

FLAGS = {"max_batch": "--max-num-seqs", "max_num_seqs": "--max-num-seqs", "seed": "--weight-seed",
         "num_layers": "writescope generate --num-layers"}  # serve loads whole models


def add_parser(sub) -> None:
    p = sub.add_parser("serve", help="serve the model over an OpenAI-compatible HTTP API (continuous batching)")
    p.add_argument("--model", required=True, help="checkpoint directory or preset name (presets use synthetic weights)")
    p.add_argument("--synthetic", action="store_true", help="seeded synthetic weights instead of the checkpoint's")
    p.add_argument("--served-model-name", default=None, help="the model id clients send (default: --model)")
    p.add_argument("--host", default="127.0.0.1", help="address to bind (default 127.0.0.1: this machine only)")
    p.add_argument("--port", type=int, default=8000, help="TCP port (default 8000)")
    p.add_argument("--api-key", default=os.environ.get("WRITESCOPE_API_KEY"),
                   help="require 'Authorization: Bearer KEY' on /v1/* (default: $WRITESCOPE_API_KEY, else none)")
    p.add_argument("--max-num-seqs", type=int, default=32, help="requests decoding at once (default 32; the budget plan's batch)")
    p.add_argument("--max-model-len", type=int, default=None,
                   help="cap on prompt + max_tokens per request (default: the model's limit)")
    p.add_argument("--max-queue", type=int, default=256,
                   help="requests that may wait for a place in the batch; more get 503 with Retry-After (default 256; "
                        "0: none wait: a request is taken while one of the --max-num-seqs places is free, else 503)")
    p.add_argument("--shutdown-grace", type=float, default=None, metavar="SECONDS",
                   help="after Ctrl-C or SIGTERM, the requests in flight may finish for this long; those still running "
                        "then get 503 (default 25; the process exits a second or two after it)")
    p.add_argument("--prefill-chunk-tokens", type=int, default=2048,
                   help="prompt tokens per engine step (default 2048: running requests decode between chunks)")
    p.add_argument("--device", default="auto", help="auto (cuda when present, the default), cpu or cuda")
    p.add_argument("--dtype", default="auto", help="auto (bf16 on cuda, fp32 on cpu), bf16, fp16, fp32")
    p.add_argument("--weight-seed", type=int, default=0, help="seed of the synthetic weights and default sampling seed (default 0)")
    p.add_argument("--policy", default="resident",
                   help="KV placement: resident, gpu, cpu, static:R, writescope, monolithic[:R] (default resident: all KV on the device; see writescope generate)")
    p.add_argument("--window", type=int, default=256, help="D: tokens of the D-window and of one KV block (default 256)")
    p.add_argument("--cpu-threads", type=int, default=None, help="threads for CPU attention (default: WRITESCOPE_CPU_THREADS when set, else all torch threads, less one with CUDA)")
    p.add_argument("--expert-threads", type=int, default=None, help="threads for routed experts in host memory, 1 to the CPUs this process may use")
    p.add_argument("--vram-budget", default=None,
                   help="device memory the server may use, e.g. 32GiB (planned for --max-num-seqs sequences of --max-model-len)")
    add_stream_share_flag(p)
    p.add_argument("--log-level", default="info", choices=["critical", "error", "warning", "info", "debug"],
                   help="uvicorn's log level (default info)")
    p.set_defaults(run=run, flags=FLAGS)


def run(args: argparse.Namespace) -> int:
    try:
        import uvicorn  # noqa: F401 - the serve extra (its absence is said below)

        from writescope.serve.app import ServerState, build_app
        from writescope.serve.server import GRACEFUL_SHUTDOWN_S, Server, uvicorn_config
    except ImportError as e:
        print(f"writescope serve: error: {e.name} is not installed: in the project's clone, pip install -e '.[serve]' "
              "(the README's way; from a package index: pip install 'writescope[serve]')", file=sys.stderr)
        return 2
    if not 0 <= args.port <= 65535:
        raise ValueError(f"--port must be in [0, 65535], got {args.port}")
    for flag, value in (("--max-num-seqs", args.max_num_seqs), ("--window", args.window), ("--prefill-chunk-tokens", args.prefill_chunk_tokens)):
        if value < 1:
            raise ValueError(f"{flag} must be >= 1, got {value}")
    if args.max_queue < 0:
        raise ValueError(f"--max-queue must be >= 0, got {args.max_queue}")
    grace = GRACEFUL_SHUTDOWN_S if args.shutdown_grace is None else args.shutdown_grace
    if not 0 <= grace <= 86400:  # NaN fails too
        raise ValueError(f"--shutdown-grace must be seconds from 0 to 86400, got {args.shutdown_grace}")
    from writescope.engine.threads import check_cpu_threads

    check_cpu_threads(args.cpu_threads, "--cpu-threads")  # before the server listens, as the other flags
    check_cpu_threads(args.expert_threads, "--expert-threads")
    if args.api_key is not None and not args.api_key.strip():
        raise ValueError("--api-key is empty: give a key, or leave the flag out")
    check_stream_share(args)
    check_before_listening(args)
    check_port_free(args.host, args.port)  # before the model loads, not uvicorn's raw "[Errno 98]" after
    if args.host not in ("127.0.0.1", "localhost", "::1") and args.api_key is None:
        print(f"writescope serve: WARNING: binding {args.host} without --api-key: anyone who reaches this port can use the model",
              file=sys.stderr)

    state = ServerState(args.served_model_name or args.model, api_key=args.api_key)
    # a stop lets the requests in flight finish for the grace, then fails those still running (503)
    server = Server(uvicorn_config(build_app(state), args.host, args.port, args.log_level, grace), state, grace)
    threading.Thread(target=_load, args=(args, state, server), name="writescope-load", daemon=True).start()
    stopped = []

    def stop(signum, frame):  # uvicorn hands the Ctrl-C it stopped on back once it is done: the stop asked for, not an error
        stopped.append(signum)
        server.should_exit = True

    main_thread = threading.current_thread() is threading.main_thread()
    previous = {sig: signal.signal(sig, stop) for sig in (signal.SIGINT, signal.SIGTERM)} if main_thread else {}
    try:
        server.run()  # /health answers 503 while the model loads; SIGINT / SIGTERM stop it gracefully
    except SystemExit as e:  # uvicorn could not start (it logged why): taken since the check above, say, by another process
        if server.started:
            raise
        print(f"writescope serve: error: the server did not start on {_where(args.host, args.port)} (uvicorn's message above "
              "says why): for an address already in use, pass another --port (--port 0 picks a free one), or stop the "
              f"process using it{f' (uvicorn exit {e.code})' if e.code not in (None, 0) else ''}", file=sys.stderr)
        return 2
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, handler)
    if state.load_error is not None:
        print(f"writescope serve: error: {state.load_error}", file=sys.stderr)
        return 2
    if stopped:
        how = "Ctrl-C" if stopped[-1] == signal.SIGINT else "SIGTERM"  # uvicorn hands them back newest first
        failed = (f": {plural(state.failed_at_stop, 'request')} still running after the {grace:g} s grace "
                  "got 503" if state.failed_at_stop else "")
        print(f"writescope serve: stopped ({how}){failed}", file=sys.stderr)
    return 0


def check_before_listening(args: argparse.Namespace) -> None:
    """Refuse before the server listens what ``LLM`` would refuse after it (the model loads once the
    server answers): ``LLM``'s own checks of its arguments, before anything is built
    (:func:`writescope.engine.arguments.check_arguments`: the device and dtype, the policy, the
    ``WRITESCOPE_*`` switches, the model name or directory, ``--max-model-len``, the threads, the
    expert share, and with ``--vram-budget`` the memory plan), as ``writescope generate`` refuses
    them before doing anything. What this CPU's attention kernel offers (``WRITESCOPE_CPU_ISA``
    beyond it) is known once the kernel builds, while the model loads.

    Raises:
        ValueError: the first bad one (an :class:`ArgError` names API arguments: main() words them as flags).
    """
    import warnings

    from writescope.attention import cpu_kernel
    from writescope.engine.arguments import check_arguments

    with warnings.catch_warnings():  # a misspelt switch's name is warned of once, by LLM, as the model loads
        warnings.simplefilter("ignore")
        check_arguments(args.model, synthetic=args.synthetic, device=args.device, dtype=args.dtype, max_model_len=args.max_model_len,
                        prefill_chunk_tokens=args.prefill_chunk_tokens, policy=args.policy, window=args.window,
                        cpu_threads=args.cpu_threads, vram_budget=args.vram_budget, max_batch=args.max_num_seqs,
                        expert_threads=args.expert_threads, expert_stream_share=args.expert_stream_share)
    # cpu_kernel.prepare() reads these as LLM starts, but builds the kernel too (a minute on a new machine)
    if cpu_kernel.attention_choice() == "kernel":
        cpu_kernel.requested_path()  # WRITESCOPE_CPU_ISA


def _where(host: str, port: int) -> str:
    """``host:port`` as a URL writes it (an IPv6 address in brackets)."""
    return f"[{host}]:{port}" if ":" in host else f"{host}:{port}"


def check_port_free(host: str, port: int) -> None:
    """That the server can listen on ``host``:``port``: each address the host resolves to is bound
    as uvicorn (asyncio's ``create_server``) binds it, then closed again (``port`` 0: any free one,
    nothing to check).

    Raises:
        ValueError: the address is in use (another process listens on the port), not this
            machine's, the port needs privileges, or the host does not resolve: said with what to do.
    """
    import errno
    import socket

    if port == 0:
        return
    where = _where(host, port)
    try:
        infos = socket.getaddrinfo(host or None, port, type=socket.SOCK_STREAM, flags=socket.AI_PASSIVE)
    except socket.gaierror as e:
        raise ValueError(f"--host {host!r} does not resolve to an address ({e.strerror}): give an address of this machine, "
                         "e.g. 127.0.0.1 (this machine only) or 0.0.0.0 (all its interfaces)") from None
    for family, kind, proto, _, address in dict.fromkeys(infos):
        sock = socket.socket(family, kind, proto)
        try:
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)  # as asyncio: a port left in TIME_WAIT is free
            if family == socket.AF_INET6 and hasattr(socket, "IPV6_V6ONLY"):
                sock.setsockopt(socket.IPPROTO_IPV6, socket.IPV6_V6ONLY, 1)
            sock.bind(address)
        except OSError as e:
            if e.errno == errno.EADDRINUSE:
                raise ValueError(f"{where} is already in use: another process listens on port {port}; pass another --port "
                                 f"(--port 0 picks a free one), or stop the process using it (`ss -ltnp 'sport = :{port}'` "
                                 "names it)") from None
            if e.errno == errno.EACCES and port < 1024:
                raise ValueError(f"--port {port} needs privileges to listen on (ports below 1024): pass --port 1024 or "
                                 "above, e.g. the default 8000") from None
            if e.errno == errno.EADDRNOTAVAIL:
                raise ValueError(f"--host {host} is not an address of this machine: give one of its own, e.g. 127.0.0.1 "
                                 "(this machine only) or 0.0.0.0 (all its interfaces)") from None
            raise ValueError(f"cannot listen on {where}: {e.strerror or e}") from None
        finally:
            sock.close()


def load_error_message(e: Exception) -> str:
    """What ``writescope serve: error:`` says of a load that failed, worded as main() words a
    command's errors (API arguments as this command's flags); the exception's class is named only
    for one main() does not expect (a bug, or the machine: ``RuntimeError: CUDA out of memory``)."""
    from writescope.cli.wording import worded

    if isinstance(e, (ValueError, FileNotFoundError, FileExistsError)):
        return worded(e, "serve", FLAGS)
    return f"{type(e).__name__}: {e}"


def _bound_port(server, asked: int) -> int:
    """The port uvicorn listens on (the one it picked for ``--port 0``), else ``asked`` (not yet bound)."""
    for srv in getattr(server, "servers", None) or ():
        for sock in getattr(srv, "sockets", None) or ():
            return sock.getsockname()[1]
    return asked


def _load(args, state, server) -> None:
    """Load the model and start the engine (in the background: the server already answers)."""
    from writescope import LLM
    from writescope.serve.async_engine import AsyncEngine
    from writescope.serve.chat_template import ChatTemplate

    try:
        llm = LLM(args.model, synthetic=args.synthetic, device=args.device, dtype=args.dtype, seed=args.weight_seed,
                  max_model_len=args.max_model_len, prefill_chunk_tokens=args.prefill_chunk_tokens, progress=True,
                  policy=args.policy, window=args.window, cpu_threads=args.cpu_threads, vram_budget=args.vram_budget,
                  max_batch=args.max_num_seqs, expert_threads=args.expert_threads, expert_stream_share=args.expert_stream_share,
                  prefill_order="chunk")  # its passes interleave with decode steps: nothing to plan for layer order
        engine = AsyncEngine(llm, max_num_seqs=args.max_num_seqs, max_queue=args.max_queue)
        template = ChatTemplate.for_model(args.model)
    except Exception as e:  # noqa: BLE001 - reported by run() after the server stops
        state.load_error = load_error_message(e)
        server.should_exit = True
        return
    if state.closing or server.should_exit:  # stopped while the model loaded: serve nothing
        engine.shutdown(timeout=0)
        return
    for _ in range(100):  # the port uvicorn picked is known once it listens (a model loads in far longer, as a rule)
        if server.started or server.should_exit:
            break
        time.sleep(0.05)
    if state.closing or server.should_exit:
        return
    state.ready(engine, llm.tokenizer, template)  # shuts the engine down again if a stop came meanwhile (closing)
    if state.closing:
        return
    if llm.vram_plan is not None:  # --vram-budget: the plan, as generate says it (on the CPU: only where they would live)
        from writescope.cli.generate import budget_line

        print(f"writescope serve: {budget_line(llm)}", flush=True)
    print(f"writescope serve: {state.model_name} ready on http://{args.host}:{_bound_port(server, args.port)} (policy {llm.policy_name}, "
          f"max_model_len {llm.max_model_len}, max_num_seqs {engine.max_num_seqs}, chat template: {template.name})", flush=True)
