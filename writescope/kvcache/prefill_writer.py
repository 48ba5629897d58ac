"""Asynchronous prefill writes to the compute region (docs/DESIGN.md section 3: write-time routing).

A prompt block routed to the compute region must go from the device to per-KV-head rows in
pageable host memory. A device-to-host copy into pageable memory runs at a fraction of PCIe speed,
so the copy goes through pinned staging: device -> pinned staging (DMA on a copy stream) ->
compute rows (a CPU copy). The first version did both synchronously on the calling thread, which
stalled the prefill: in the one-layer benchmark routed prefill took +4% (32K) to +14.5% (8K) over
writing everything to one region (benchmarks/results/split_attention.md).

Here the calling thread only issues the DMA into one of ``buffers`` pinned staging buffers; a
writer thread waits for each copy and moves it into the compute rows, then frees the buffer. The
calling thread blocks only when every buffer is in flight. Readers of the compute region call
:meth:`PrefillWriter.flush` first. Without CUDA the same thread and ordering are used with plain
copies (so CI exercises the ordering).

Chunked prefill reads the compute rows of earlier chunks back to the device (the other way
through pinned staging). :meth:`PrefillWriter.read` does that on the calling thread;
:meth:`PrefillWriter.read_async` does it on a reader thread of its own, so the thread that issues
the prefill only takes the finished read (:meth:`PrefillWriter.take`: the current stream waits
for its copies). Its copy into staging cost the issuing thread 1.1 s of a 32.4 s prefill of 16 x
32K tokens (run 68, benchmarks/results/gpu_decode_h200.md), about a third of writescope's lead
over ``gpu`` there.
"""

from __future__ import annotations

import threading
import time
from concurrent.futures import Future, ThreadPoolExecutor, wait
from contextlib import nullcontext

import torch

from writescope.kvcache.pinned import host_empty, unpin

STAGING_BUFFERS = 4  # pinned staging buffers in flight
READ_BUFFERS = 2  # pinned staging buffers for chunked prefill's read-back of the compute rows


class PrefillWriter:
    """Writes device tensors into host (pageable, strided) destinations in the background.

    Args:
        buffer_bytes: bytes of one pinned staging buffer.
        dtype: element type of everything written.
        device: the device the sources live on (CUDA: DMA + events; CPU: plain copies).
        buffers: staging buffers in flight.
        threads: intra-op threads of the writer thread (a strided copy: a few are enough).
        read_threads: intra-op threads of the reader thread (:meth:`read_async`; default ``threads``).
    """

    def __init__(self, buffer_bytes: int, dtype: torch.dtype, device: torch.device, buffers: int = STAGING_BUFFERS, threads: int = 1,
                 read_threads: int | None = None):
        self.dtype, self.device = dtype, torch.device(device)
        self.cuda = self.device.type == "cuda"
        self.numel = max(1, buffer_bytes // dtype.itemsize)
        self.n_buffers = buffers
        self._bufs: list[torch.Tensor] = []  # made on first use (pinned on CUDA)
        self._busy: list[Future | None] = [None] * buffers
        self._next = 0
        self._pending: list[Future] = []
        self._read_bufs: list[torch.Tensor] = []  # READ_BUFFERS more, for reads (made with the others)
        self._read_done: list = [None] * READ_BUFFERS  # per read buffer: a CUDA event after its last DMA
        self.read_stream = torch.cuda.Stream(self.device) if self.cuda else None
        self.read_copy_s = 0.0  # seconds copying rows into the read buffers (the reading thread's)
        self.read_wait_s = 0.0  # ... and waiting for a read buffer's last DMA before refilling it
        self.read_after_s = 0.0  # the reader thread's seconds waiting for the writes a read_async names
        self.take_wait_s = 0.0  # the calling thread's seconds in take() waiting for the reader thread
        self._read_lock = threading.Lock()  # one user of the read buffers at a time (read and the reader thread)
        self._prepare_lock = threading.Lock()  # the buffers are made once, whichever thread comes first
        self._pool = ThreadPoolExecutor(1, "writescope-prefill-write", initializer=torch.set_num_threads, initargs=(threads,))
        self._reader = ThreadPoolExecutor(1, "writescope-prefill-read", initializer=torch.set_num_threads,
                                          initargs=(read_threads or threads,))
        self.copy_stream = torch.cuda.Stream(self.device) if self.cuda else None

    def prepare(self) -> None:
        """Make (and on CUDA pin) the staging buffers now, if not yet made. Pinning is the
        expensive part (HARDWARE.md: 0.25 s per GiB), so caches call this at allocate, where
        set-up cost is expected, rather than inside the first prefill."""
        with self._prepare_lock:  # the issuing thread (a write) and the reader thread (a read ahead) may both come first
            self._prepare()

    def _prepare(self) -> None:
        if not self._bufs:
            bufs: list[torch.Tensor] = []
            try:
                for _ in range(self.n_buffers + READ_BUFFERS):
                    bufs.append(host_empty((self.numel,), self.dtype, pin=self.cuda))
            except BaseException:
                for t in bufs if self.cuda else []:
                    unpin(t)
                raise
            self._bufs, self._read_bufs = bufs[: self.n_buffers], bufs[self.n_buffers :]

    def _buffer(self) -> int:
        """A free staging buffer's index (waits for the oldest one when all are busy)."""
        self.prepare()
        b = self._next
        self._next = (b + 1) % self.n_buffers
        fut, self._busy[b] = self._busy[b], None
        if fut is not None and fut.exception() is not None:  # waits; a failure is raised here, once
            self._pending = [f for f in self._pending if f is not fut]
            raise fut.exception()
        return b

    def write(self, dst: torch.Tensor, src: torch.Tensor) -> list[Future]:
        """Copy ``src`` ``[a, b, n, c]`` (device) into ``dst`` (host view of the same shape), in
        chunks along dim 2 that fit one staging buffer. Returns once the copies are issued: the
        futures of its chunks (each done once its rows have landed, or failed)."""
        futures: list[Future] = []
        per_token = src.shape[0] * src.shape[1] * src.shape[3]
        step = max(1, self.numel // per_token)
        cur = torch.cuda.current_stream(self.device) if self.cuda else None
        for a in range(0, src.shape[2], step):
            part = src[:, :, a : a + step]
            b = self._buffer()
            stage = self._bufs[b][: part.numel()].view(part.shape)
            event = None
            if self.cuda:
                self.copy_stream.wait_stream(cur)  # src was produced on the current stream
                with torch.cuda.stream(self.copy_stream):
                    stage.copy_(part, non_blocking=True)
                    event = torch.cuda.Event(blocking=True)  # the writer thread sleeps, not spins, on it
                    event.record(self.copy_stream)
                part.record_stream(self.copy_stream)  # the allocator keeps src until the copy is done
                fut = self._pool.submit(_finish, event, stage, dst[:, :, a : a + step])
            else:
                stage.copy_(part)
                fut = self._pool.submit(_finish, None, stage, dst[:, :, a : a + step])
            self._busy[b] = fut
            self._pending.append(fut)
            futures.append(fut)
        return futures

    def read(self, src: torch.Tensor) -> torch.Tensor:
        """Copy ``src`` ``[a, b, n, c]`` (host rows, pageable, possibly strided) to a new
        contiguous device tensor of its shape, through pinned staging, on the calling thread:
        it copies each piece along dim 2 into one of ``READ_BUFFERS`` read buffers (torch's
        intra-op threads), then issues its DMA on the read stream and goes on to the next piece
        while it runs; a buffer is refilled once its last DMA is done. The read stream waits for
        nothing else, so the copies overlap the device's work; the current stream waits for the
        read stream before this returns. A pageable host-to-device copy runs at 7.3 GB/s on the
        H200 host (../shared/HARDWARE.md) against about 50 for pinned, and chunked prefill reads
        every compute row placed before each chunk again (kvcache/inplace.py ``_gather``). The
        read buffers are not the write buffers: a read never waits for a write still in flight.
        Without CUDA the same pieces go through the same buffers with plain copies. The rows
        read must have landed (callers wait for their writes first, or name them to
        :meth:`read_async`)."""
        return self._hand_over(*self._stage_in(src))

    def read_async(self, src: torch.Tensor, after: list[Future] | tuple = ()) -> Future:
        """:meth:`read` on the reader thread, once the writes ``after`` (futures of :meth:`write`)
        have finished: returns at once with a future for :meth:`take`. ``src`` must stay
        allocated and unwritten until the read is taken (or the future is done). A write of
        ``after`` that failed fails the read with its error (its rows are not what was written)."""
        return self._reader.submit(self._read_job, src, list(after))

    def take(self, read: Future) -> torch.Tensor:
        """The device tensor of a :meth:`read_async`, the current stream ordered after its copies
        (the calling thread waits only while the reader thread has not issued them).

        Raises:
            The read's error (a failed write it waited for, a failed copy).
        """
        t0 = time.perf_counter()
        out, event = read.result()
        self.take_wait_s += time.perf_counter() - t0
        return self._hand_over(out, event)

    def _read_job(self, src: torch.Tensor, after: list[Future]):
        self.read_after_s += wait_writes(after)
        with torch.inference_mode():  # src may be an inference tensor
            return self._stage_in(src)

    def _hand_over(self, out: torch.Tensor, event) -> torch.Tensor:
        if self.cuda:
            cur = torch.cuda.current_stream(self.device)
            cur.wait_event(event)
            out.record_stream(cur)  # made on the read stream, used and freed on the current one
        return out

    def _stage_in(self, src: torch.Tensor):
        """(device copy of ``src``, a CUDA event after its last DMA on the read stream; None
        without CUDA). Any thread; one at a time."""
        with self._read_lock:
            self.prepare()
            per_token = src.shape[0] * src.shape[1] * src.shape[3]
            n = src.shape[2]
            step = max(1, self.numel // max(1, per_token))
            rs = self.read_stream
            with torch.cuda.stream(rs) if self.cuda else nullcontext():
                out = torch.empty(src.shape, dtype=src.dtype, device=self.device)  # on CUDA from the read stream's memory
                for i, a in enumerate(range(0, n, step)):
                    b = i % len(self._read_bufs)
                    t0 = time.perf_counter()
                    if self._read_done[b] is not None:
                        self._read_done[b].synchronize()  # its last DMA is done: the buffer may be refilled
                    t1 = time.perf_counter()
                    part = src[:, :, a : a + step]
                    stage = self._read_bufs[b][: part.numel()].view(part.shape)
                    stage.copy_(part)
                    self.read_wait_s += t1 - t0
                    self.read_copy_s += time.perf_counter() - t1
                    out[:, :, a : a + step].copy_(stage, non_blocking=self.cuda)
                    if self.cuda:
                        self._read_done[b] = torch.cuda.Event(blocking=True)  # a refill sleeps, not spins, on it
                        self._read_done[b].record(rs)
                event = rs.record_event() if self.cuda else None
            return out, event

    def flush(self) -> None:
        """Wait until every issued write is in its destination or failed; then re-raise the
        first failure (every write has finished either way)."""
        pending, self._pending = self._pending, []
        try:
            wait_writes(pending)
        finally:
            self._busy = [None] * self.n_buffers  # every buffer is free; failures are reported here, once

    @property
    def in_flight(self) -> int:
        return sum(1 for f in self._pending if not f.done())

    def close(self) -> None:
        """Finish the writes, stop the thread, unregister the staging buffers."""
        try:
            self.flush()
        finally:
            self._pool.shutdown(wait=True)
            self._reader.shutdown(wait=True)  # reads in flight finish (their buffers and DMAs below)
            for event in self._read_done:
                if event is not None:
                    event.synchronize()  # no DMA still reads a buffer about to be unregistered
            if self.cuda:
                for t in self._bufs + self._read_bufs:
                    unpin(t)
            self._bufs, self._read_bufs = [], []


def wait_writes(writes: list[Future]) -> float:
    """Wait for ``writes`` (futures of :meth:`PrefillWriter.write`); returns the seconds waited.

    Raises:
        The first failed write's error (its rows are not what was written).
    """
    if not writes:
        return 0.0
    t0 = time.perf_counter()
    wait(writes)
    waited = time.perf_counter() - t0
    for f in writes:
        if f.exception() is not None:
            raise f.exception()
    return waited


def _finish(event, stage: torch.Tensor, dst: torch.Tensor) -> None:
    if event is not None:
        event.synchronize()
    with torch.inference_mode():  # dst may be an inference tensor (a cache allocated under inference mode)
        dst.copy_(stage)
