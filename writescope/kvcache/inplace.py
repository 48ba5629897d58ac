"""InplaceKVCache: the four-region KV format with write-time routing (docs/DESIGN.md sections 2-4).

Writes (per layer, per sequence; D = window):
- tokens fill the D-window; whole blocks of a prefill go straight from the new KV to their home
  (compute or load region, chosen by the policy), without passing through the window;
- a full window is evicted whole once its step's attention has been issued: to the load region by
  an asynchronous device-to-host copy on a side stream, or to the compute region through a pinned
  staging block that is copied in before the compute region is next read (docs/DESIGN.md: the copy
  runs in the otherwise idle device-to-host direction). Without CUDA the same deferred path runs
  (the copies are plain), so CI exercises the ordering.
Reads: decode uses :class:`writescope.attention.split.SplitDecoder`; prefill attends on the
device (for a prompt prefilled in several chunks, earlier chunks' KV is read back to the device
for that attention; counted in ``prefill_readback_bytes``). Placed bytes never move.
"""

from __future__ import annotations

import contextlib
import math
import time
from concurrent.futures import wait

import torch

from writescope.attention.metadata import ForwardBatch
from writescope.attention.reference import attend_sequence
from writescope.attention.split import SplitDecoder
from writescope.engine.ranges import named
from writescope.kvcache.base import KVCache, AttendedNow
from writescope.engine.threads import default_attention_threads
from writescope.env import env_choice, env_int
from writescope.kvcache import pinned as pinned_memory
from writescope.kvcache.prefill_writer import PrefillWriter, wait_writes
from writescope.kvcache.sequence import SequenceKV, block_runs, load_blocks_reserved, pinned_staging_bytes
from writescope.kvcache.spec import PartitionSpec
from writescope.scheduler.placement import micro_batched
from writescope.scheduler.policies import COMPUTE, PlacementPolicy


class InplaceKVCache(KVCache):
    """KV cache in the InplaceKVCache format.

    Args:
        spec: layout and sizes (:class:`PartitionSpec`).
        policy: placement policy (``gpu``, ``cpu``, ``static:R``, ...).
        device: the GPU, or the CPU standing in for it (then nothing is pinned and no streams).
        cpu_threads: threads for CPU attention (default: torch's intra-op thread count).
        cpu_inline: see :class:`~writescope.attention.split.SplitDecoder`.

    Attributes:
        prefill_readback_bytes: bytes read back to the device for chunked prefills.
        evicted_blocks: D-windows evicted (all layers counted).
    """

    def __init__(
        self, spec: PartitionSpec, policy: PlacementPolicy, device: torch.device | str, cpu_threads: int | None = None, cpu_inline: bool = False
    ):
        self.spec, self.policy = spec, policy
        self.layout, self.num_layers = spec.layout, spec.num_layers
        self.device = torch.device(device)
        self.cuda = self.device.type == "cuda"
        self.decoder = SplitDecoder(spec, self.device, cpu_threads, cpu_inline)
        self.evict_stream = torch.cuda.Stream(self.device) if self.cuda else None
        self._load_on_evict = _prefill_load_on_evict_stream()  # a bad value fails here, not mid-prefill
        # layers of compute rows read ahead in chunked prefill (0: none; none without CUDA, where the rows are read in place)
        self.read_ahead = read_ahead_from_env() if self.cuda else 0
        self._ahead_bytes = 0  # bytes of those reads started and not yet taken
        # while prefill passes run layer by layer (keeping_prefill_kv): slot -> (layer, that layer's KV of the
        # sequence so far on the device), which the sequence's next pass at that layer takes instead of reading back
        self._kept: dict[int, tuple[int, torch.Tensor]] | None = None
        self._keep_slots: set[int] = set()  # the sequences with a later pass in the group (keep_for)
        self.prefill_kept_bytes = 0  # KV bytes a pass took from the kept KV instead of reading them back
        self._seqs: dict[int, SequenceKV] = {}
        self._next_slot = 0
        self.prefill_readback_bytes = 0
        self.prefill_readback_compute_bytes = 0  # of those, compute rows (through the prefill writer's pinned staging on CUDA)
        self.prefill_readback_host_s = 0.0  # the issuing thread's seconds in the read-back (host time: no device wait added)
        self.prefill_readback_write_wait_s = 0.0  # of those, waiting for the layer's compute-row writes to land
        # allocation's up-front host work, summed over sequences (kv_allocation)
        self._allocation = {"sequences": 0, "host_s": 0.0, "reserve_s": 0.0, "reserve_bytes": 0, "commit_s": 0.0, "commit_bytes": 0}
        self.evicted_blocks = 0
        self._writer: PrefillWriter | None = None  # prefill writes to the compute region (made on first use)
        self._load_read_stream = None  # chunked prefill's read-back of the load region (CUDA, made on first use)
        self.micro_batches = _micro_batches()
        # with micro_batches auto: the fewest tokens a decode step at which the CPU computes host experts
        # (the engine sets it, engine/llm.py _cpu_experts_from; None: no step does), which auto does not split
        self.cpu_experts_from: int | None = None
        self._step_batch = 0  # sequences of the decode pass under way (decode_groups), for the policy's feedback
        self._pending: list = []  # decode layers begun and not yet ended
        self.other_work = None  # scheduler/other_work.OtherWork, given by the engine: marks each decode layer's begin and end

    # ------------------------------------------------------------------ lifecycle
    def allocate(self, capacity: int, prompt_len: int = 0) -> int:
        if capacity < 1:
            raise ValueError(f"KV capacity must be at least 1 token, got {capacity}")
        t0 = time.perf_counter()
        try:
            seq = SequenceKV(self.spec, capacity, prompt_len, self.policy, self.device, pin=self.cuda)
        except torch.OutOfMemoryError:
            raise RuntimeError(
                f"cannot allocate the D-window ({self.spec.window_bytes(1) / 2**20:.1f} MiB) on {self.device}: free device memory"
            ) from None
        except RuntimeError as e:
            host = self.spec.host_bytes([capacity])
            raise RuntimeError(
                f"cannot allocate host memory for a {capacity}-token sequence (up to {host / 2**30:.2f} GiB of KV): {str(e)[:200]}; "
                "use fewer or shorter requests"
            ) from None
        if COMPUTE in seq.prompt_plan():
            try:  # the prefill writer's pinned staging is set up here, once, not during the first prefill
                self._prefill_writer().prepare()
            except BaseException:
                seq.release()
                raise
        slot = self._next_slot
        self._next_slot += 1
        self._seqs[slot] = seq
        a = self._allocation
        a["sequences"] += 1
        a["host_s"] += time.perf_counter() - t0
        for k in ("reserve_s", "reserve_bytes", "commit_s", "commit_bytes"):
            a[k] += getattr(seq, k)
        return slot

    def kv_allocation(self) -> dict:
        """Allocation's up-front host work so far, on the thread that allocated (the issuing one in
        the engine): ``sequences``; ``host_s`` in all; of it ``reserve_s`` making the prompt plans'
        load blocks (``reserve_bytes``; page-locked on CUDA) and ``commit_s`` faulting in their
        compute rows (``commit_bytes``; kvcache/sequence.py, so that a shortfall shows at
        allocate and not mid-prefill). Seconds are host time."""
        return dict(self._allocation)

    def warm_up(self, q_heads: int) -> None:
        """Compile the decode kernels for ``q_heads`` query heads now (the first decode step then
        has no compile in it)."""
        self.decoder.warm_up(q_heads)

    def expect_batch(self, batch: int) -> None:
        """``batch`` sequences (those already active included) will decode together: tell the
        policy before their prompts are placed (the roofline's fixed-cost term is per step)."""
        self.policy.expect_batch(batch)

    def free(self, slot: int) -> None:
        seq = self._seqs.pop(slot, None)
        if seq is None:
            return
        if self._kept is not None:
            self._kept.pop(slot, None)
        try:
            self._drop_read_ahead(seq)  # nothing still reading its compute rows
            self.flush_writes()  # nothing still writing into its compute rows
        finally:
            if self.cuda:  # every stream: copies into or out of its pinned memory must be done
                torch.cuda.synchronize(self.device)
            self.decoder.forget_early()  # no early fill of its blocks is used for a sequence made after it
            if self.decoder.gpu is not None:  # cached plans hold views of its slabs (the in-place read)
                self.decoder.gpu.forget()
            seq.release()

    def close(self) -> None:
        """Free every slot and stop the CPU worker."""
        for slot in list(self._seqs):
            self.free(slot)
        if self._writer is not None:
            self._writer.close()
            self._writer = None
        self.decoder.close()

    def __del__(self) -> None:  # a cache dropped without close(): stop its worker thread
        decoder = getattr(self, "decoder", None)
        if decoder is not None:
            decoder.pool.shutdown(wait=False)

    def seq_len(self, slot: int) -> int:
        return self._seqs[slot].seq_len(self.num_layers - 1)

    def sequence(self, slot: int) -> SequenceKV:
        """The regions of a slot (for inspection and tests)."""
        return self._seqs[slot]

    def placement(self, slot: int) -> dict[str, int]:
        """Tokens of ``slot`` per region (``window``, ``compute``, ``load``), in the last layer."""
        sq, D, last = self._seqs[slot], self.spec.window, self.num_layers - 1
        return {"window": sq.win_len[last], "compute": sq.n_comp[last] * D, "load": sq.n_load[last] * D}

    @property
    def prefetch_tokens(self) -> int:
        """Tokens of one layer that the ping-pong buffers hold (0 when the load region is read in
        place): how much of the next layer's load region the link can copy before its attention
        starts. The roofline caps the link's work during a layer's other work by it
        (scheduler/roofline.py, ``link_in_other``)."""
        return self.spec.pingpong_total_bytes() // self.spec.token_bytes

    @property
    def active_slots(self) -> list[int]:
        return list(self._seqs)

    # ------------------------------------------------------------------ attention
    @contextlib.contextmanager
    def keeping_prefill_kv(self):
        """While prefill passes run layer by layer (models/causal_lm.py ``forward_by_layer``,
        engine/prefill_order.py): each prefill pass leaves a sequence's KV of the layer it ran on
        the device (the tensor its attention used: earlier tokens and the pass's new ones, in
        position order), and the sequence's next pass at that layer takes it instead of reading
        its earlier KV back from host memory (``_gather``). One kept layer per sequence (the
        last one run; a pass at another layer reads back as before), and only for a sequence with
        a later pass in the group (:meth:`keep_for`); all dropped on leaving, and a sequence's
        when it is freed. Nothing is read ahead meanwhile (the next call is the same layer's next
        pass, not the next layer). The KV is written to its regions as always."""
        if self._kept is not None:
            raise RuntimeError("keeping_prefill_kv is already active")
        self._kept, self._keep_slots = {}, set()
        try:
            yield
        finally:
            self._kept, self._keep_slots = None, set()

    def keep_for(self, slots: set[int]) -> None:
        """Inside :meth:`keeping_prefill_kv`, before a pass: the sequences (slots) that have a later
        pass in the group, whose KV of the layer this pass runs is kept for it (no other's is:
        it would be dropped unused at the group's end, and held meanwhile)."""
        if self._kept is None:
            raise RuntimeError("keep_for outside keeping_prefill_kv")
        self._keep_slots = slots

    def attend(self, layer_id, q, k, v, batch: ForwardBatch, scale, sliding_window=None, prefill_attn=None):
        return self.attend_end(self.attend_begin(layer_id, q, k, v, batch, scale, sliding_window, prefill_attn))

    def attend_begin(self, layer_id, q, k, v, batch: ForwardBatch, scale, sliding_window=None, prefill_attn=None):
        if sliding_window is not None:
            raise ValueError(
                f"sliding_window={sliding_window} is not supported by the partitioned KV cache (policy {self.policy}): "
                "use policy 'resident'"
            )
        seqs = [self._seqs[s] for s in batch.slots]
        for i, sq in enumerate(seqs):
            assert sq.seq_len(layer_id) == batch.context_lens[i], (
                f"slot {batch.slots[i]} layer {layer_id}: cached {sq.seq_len(layer_id)} != context {batch.context_lens[i]}"
            )
            if sq.seq_len(layer_id) + batch.query_lens[i] > sq.capacity:
                raise RuntimeError(f"slot {batch.slots[i]} overflows its KV capacity {sq.capacity} tokens")
            if sq.prompt_len == 0 and sq.seq_len(layer_id) == 0:
                sq.prompt_len = batch.query_lens[i]  # no hint given: the first write is the prompt
        new = _pack(k, v)  # [parts, Hkv, T, dim]
        if all(n == 1 for n in batch.query_lens):
            if self.other_work is not None and not self._step_batch:  # micro-batched steps interleave: not measured
                self.other_work.begin(layer_id, len(seqs))
            with named("kv.append"):
                self._append(seqs, layer_id, new)
            cpu_blocks = None
            if getattr(self.policy, "monolithic", False):
                cpu_blocks = [min(n, math.floor(self.policy.read_share(sq.placed[layer_id]) * n + 0.5))
                              for sq, n in ((sq, sq.n_comp[layer_id]) for sq in seqs)]
            self.flush_writes()  # the prompt's compute rows are in place before the CPU reads them
            pending = self.decoder.decode_begin(layer_id, q, seqs, scale, self.evict_stream, cpu_blocks)
            self._pending.append(pending)
            return _Decoding(layer_id, seqs, pending)
        self.decoder.last_split = None  # a prefill: no decode split this layer (scheduler/expert_work.py)
        out = self._prefill_attend(layer_id, q, new, seqs, batch, scale, prefill_attn)
        self._evict_full(seqs, layer_id)
        return AttendedNow(out)

    def attend_end(self, handle) -> torch.Tensor:
        if isinstance(handle, AttendedNow):
            return handle.out
        self._pending.remove(handle.pending)
        out = self.decoder.decode_end(handle.pending)
        if self.other_work is not None and not self._step_batch:
            self.other_work.end(handle.layer)
        for secs, tokens, batch in self.decoder.take_cpu_parts():  # each finished CPU part once, with its step's batch
            if tokens:
                self.policy.observe(secs, tokens, max(batch, self._step_batch))
        self._evict_full(handle.seqs, handle.layer)
        return out

    def abandon(self) -> None:
        pending, self._pending = self._pending, []
        for p in pending:
            self.decoder.abandon(p)
        self.decoder.forget_early()  # also after an error between two layers' attention, with none pending

    def decode_groups(self, batch: ForwardBatch) -> list[tuple[int, int]] | None:
        """Two micro-batches when this decode pass has a CPU part and at least two sequences and
        ``micro_batches`` is 2 (``WRITESCOPE_MICRO_BATCHES``; the default 1: never), or ``auto`` and
        the pass has fewer tokens than :attr:`cpu_experts_from` (None: every pass; scheduler/placement.py
        :func:`micro_batched`) and the policy does not find whole steps paying where two halves
        do not (``WriteScopePolicy.splits_micro``, at the batch's mean placed tokens), else None.
        The split point balances the compute-region tokens the CPU attends in each half."""
        self._step_batch = 0
        self.decoder.grouped = False
        if not micro_batched(self.micro_batches, len(batch.slots), self.cpu_experts_from) or any(n != 1 for n in batch.query_lens):
            return None
        cpu = [self._seqs[s].n_comp[0] for s in batch.slots]  # every layer places block j in the same region
        total = sum(cpu)
        if total == 0:
            return None
        splits = getattr(self.policy, "splits_micro", None)
        if self.micro_batches == "auto" and splits is not None:
            placed = sum(self._seqs[s].placed[0] for s in batch.slots) // len(batch.slots)
            if not splits(len(batch.slots), placed):
                return None  # the policy finds whole steps paying here, the two-half split not
        best, acc, B = None, 0, len(cpu)
        for cut in range(1, B):
            acc += cpu[cut - 1]
            key = (abs(2 * acc - total), abs(2 * cut - B))
            if best is None or key < best[0]:
                best = (key, cut)
        self._step_batch = B
        self.decoder.grouped = True  # the halves' layers interleave: no early copies (each would find the other's runs)
        return [(0, best[1]), (best[1], B)]

    def _prefill_attend(self, layer_id, q, new, seqs, batch, scale, prefill_attn):
        """Write a prefill's (or mixed pass's) new KV and attend each sequence on the device."""
        out = q.new_empty(q.shape[0], q.shape[1], self.layout.v_dim) if prefill_attn is None else None
        for i, sq in enumerate(seqs):
            s, e = batch.query_start_loc[i], batch.query_start_loc[i + 1]
            if e == s:  # no new tokens: nothing to write or attend
                continue
            ctx, slot = batch.context_lens[i], batch.slots[i]
            kept = self._kept.pop(slot, None) if self._kept is not None else None
            if ctx > 0 and kept is not None and kept[0] == layer_id and kept[1].shape[2] == ctx:
                prev = kept[1]  # this layer's KV so far, made on the device by the sequence's previous pass
                self.prefill_kept_bytes += sq.placed[layer_id] // self.spec.window * self.spec.block_bytes  # what _gather would read
            else:
                kept = None  # another layer's: not held while this one is read back
                prev = self._gather(sq, layer_id) if ctx > 0 else None
            self._write(sq, layer_id, new[:, :, s:e])
            kv = new[:, :, s:e] if prev is None else torch.cat((prev, new[:, :, s:e]), dim=2)
            if self._kept is not None and slot in self._keep_slots:  # a later pass of the group takes it
                self._kept[slot] = (layer_id, kv if prev is not None else kv.clone())  # (a view of this pass's k, v: copied)
            keys = kv[0].transpose(0, 1)  # [ctx + n, Hkv, dk]
            vals = kv[1].transpose(0, 1) if self.spec.parts == 2 else keys[..., : self.layout.v_dim]
            if prefill_attn is None:
                out[s:e] = attend_sequence(q[s:e], keys, vals, ctx, scale)
            else:
                o = prefill_attn(q[s:e], keys, vals, ctx, scale)
                out = q.new_empty(q.shape[0], q.shape[1], o.shape[-1]) if out is None else out
                out[s:e] = o
        if self.read_ahead and self._kept is None:  # after this layer's own reads, which must not queue behind them
            self._read_ahead([sq for i, sq in enumerate(seqs) if batch.context_lens[i] > 0
                              and batch.query_start_loc[i + 1] > batch.query_start_loc[i]], layer_id)
        if out is None:  # no rows
            out = q.new_empty(q.shape[0], q.shape[1], self.layout.v_dim)
        return out

    def _evict_full(self, seqs: list[SequenceKV], layer_id: int) -> None:
        """Evict every full D-window of ``layer_id`` (after the layer's attention was issued)."""
        with named("kv.evict"):
            for sq in seqs:
                if sq.win_len[layer_id] == self.spec.window:
                    self._evict(sq, layer_id)

    # ------------------------------------------------------------------ writes
    def write(self, slot: int, layer_id: int, k: torch.Tensor, v: torch.Tensor | None) -> None:
        """Place the next tokens' KV of one sequence without attending, routed exactly as
        :meth:`attend` would (fills a cache for benchmarks and calibration).

        Args:
            k: ``[n, kv_heads, k_dim]``; v: ``[n, kv_heads, v_dim]`` or None (shared latent).

        Raises:
            RuntimeError: the sequence would pass its capacity.
        """
        sq = self._seqs[slot]
        n = k.shape[0]
        if sq.seq_len(layer_id) + n > sq.capacity:
            raise RuntimeError(f"slot {slot} overflows its KV capacity {sq.capacity} tokens")
        if sq.prompt_len == 0 and sq.seq_len(layer_id) == 0:
            sq.prompt_len = n
        self._write(sq, layer_id, _pack(k, v))
        if sq.win_len[layer_id] == self.spec.window:
            self._evict(sq, layer_id)

    def _write(self, sq: SequenceKV, layer: int, x: torch.Tensor) -> None:
        """Place ``x`` ``[parts, Hkv, n, dim]`` (the next n tokens of ``layer``)."""
        D, n, pos = self.spec.window, x.shape[2], 0
        while pos < n:
            w = sq.win_len[layer]
            if w == D:
                self._evict(sq, layer)
                w = 0
            if w == 0 and n - pos >= D:
                pos += self._place_blocks(sq, layer, x[:, :, pos : pos + (n - pos) // D * D])
                continue
            take = min(D - w, n - pos)
            if self.cuda and sq.evict_events[layer] is not None:
                torch.cuda.current_stream(self.device).wait_event(sq.evict_events[layer])
                sq.evict_events[layer] = None
            sq.window[layer, :, :, w : w + take].copy_(x[:, :, pos : pos + take])
            sq.win_len[layer] += take
            pos += take

    def _append(self, seqs: list[SequenceKV], layer: int, new: torch.Tensor) -> None:
        """Decode: token i of ``new`` ``[parts, Hkv, B, dim]`` to sequence i's D-window, in one
        multi-tensor copy (windows are never full here: they are evicted right after attention)."""
        dsts, srcs = [], []
        for i, sq in enumerate(seqs):
            w = sq.win_len[layer]
            assert w < self.spec.window, f"layer {layer}: D-window full at append"
            if self.cuda and sq.evict_events[layer] is not None:
                torch.cuda.current_stream(self.device).wait_event(sq.evict_events[layer])
                sq.evict_events[layer] = None
            dsts.append(sq.window[layer, :, :, w])
            srcs.append(new[:, :, i])
            sq.win_len[layer] = w + 1
        torch._foreach_copy_(dsts, srcs)

    def _place_blocks(self, sq: SequenceKV, layer: int, x: torch.Tensor) -> int:
        """Write whole blocks ``x`` ``[parts, Hkv, nb*D, dim]`` straight to their homes; returns tokens."""
        D = self.spec.window
        nb, j0 = x.shape[2] // D, sq.placed[layer] // D
        for region, idx, t, r in block_runs([sq.home(j0 + t) for t in range(nb)]):  # runs of consecutive blocks in one region
            src = x[:, :, t * D : (t + r) * D]
            if region == COMPUTE:
                sq.drain(layer)
                futures = self._write_compute(sq.compute[layer, :, :, idx * D : (idx + r) * D], src)
                sq.compute_writes[layer] = [f for f in sq.compute_writes[layer] if not f.done() or f.exception() is not None] + futures
                sq.n_comp[layer] += r
            else:
                blocks = src.unflatten(2, (r, D)).permute(2, 0, 1, 3, 4).contiguous()  # [r, parts, Hkv, D, dim]
                if self.cuda and not self._load_on_evict and sq.load_written[layer] is not None:
                    # compute-stream writes: behind the layer's last load write (an eviction on the evict stream), so
                    # the event this records covers it too
                    torch.cuda.current_stream(self.device).wait_event(sq.load_written[layer])
                sq.load_written[layer] = self._write_load(sq.load_runs(layer, idx, idx + r, r), blocks)
                sq.n_load[layer] += r
        sq.placed[layer] += nb * D
        return nb * D

    def _write_load(self, runs: list[torch.Tensor], blocks: torch.Tensor):
        """Prefill blocks ``blocks`` ``[r, parts, Hkv, D, dim]`` (device) into the load-region
        ``runs`` (pinned slabs) by device-to-host copies on the evict stream, behind the compute
        stream's work so far, so the prefill's next kernels do not wait for them (the streaming
        copies wait for the evict stream, ``note_evict``; ``blocks`` stays allocated until the
        copies are done). Returns a CUDA event recorded after the copies on the stream that ran
        them (chunked prefill's read-back waits on it), None without CUDA (plain copies)."""
        done = 0
        if not self.cuda or not self._load_on_evict:  # (WRITESCOPE_PREFILL_LOAD_STREAM=compute: the earlier behaviour)
            for run in runs:
                run.copy_(blocks[done : done + run.shape[0]], non_blocking=self.cuda)
                done += run.shape[0]
            self.decoder.note_load_write()
            return torch.cuda.current_stream(self.device).record_event() if self.cuda else None
        self.evict_stream.wait_stream(torch.cuda.current_stream(self.device))
        with torch.cuda.stream(self.evict_stream):
            for run in runs:
                run.copy_(blocks[done : done + run.shape[0]], non_blocking=True)
                done += run.shape[0]
        blocks.record_stream(self.evict_stream)
        self.decoder.note_evict()
        return self.evict_stream.record_event()

    def _write_compute(self, dst: torch.Tensor, src: torch.Tensor) -> list:
        """Device ``src`` ``[parts, Hkv, n, dim]`` -> compute-region rows ``dst`` (host, per-head
        strided), in the background (:class:`~writescope.kvcache.prefill_writer.PrefillWriter`):
        readers call :meth:`flush_writes` first, or wait for the futures returned."""
        return self._prefill_writer().write(dst, src)

    def _prefill_writer(self) -> PrefillWriter:
        """The prefill writer, made on first need (pinned staging: 4 write and 2 read buffers of one
        ping-pong buffer each; pinning them is about 0.1 s at HARDWARE.md's 0.25 s per GiB, once
        per cache; its writer thread copies on up to 4 threads, its reader thread on up to 8)."""
        if self._writer is None:
            s = self.spec
            cpus = default_attention_threads(self.device)
            self._writer = PrefillWriter(s.pingpong_blocks * s.block_bytes, s.dtype, self.device,
                                         threads=min(4, cpus), read_threads=min(8, cpus))
        return self._writer

    def _read_compute(self, rows: torch.Tensor) -> torch.Tensor:
        """Compute-region ``rows`` ``[parts, Hkv, n, dim]`` (host) on the device. On CUDA through
        the prefill writer's pinned staging (a pageable copy runs at 7.3 GB/s on the H200 host,
        against about 50 pinned); on the CPU the rows are already where the attention runs."""
        return self._prefill_writer().read(rows) if self.cuda else rows

    def flush_writes(self) -> None:
        """Wait until every prefill write to the compute region has landed (the CPU attention,
        chunked prefill's read-back and ``free`` call it; so may anyone reading the regions)."""
        if self._writer is not None:
            self._writer.flush()

    def _evict(self, sq: SequenceKV, layer: int) -> None:
        """Move the full D-window of ``layer`` to its block's home (asynchronously on CUDA)."""
        D = self.spec.window
        assert sq.win_len[layer] == D, f"evicting a window of {sq.win_len[layer]} tokens, expected {D}"
        region, idx = sq.home(sq.placed[layer] // D)
        src = sq.window[layer]
        if region == COMPUTE:
            sq.drain(layer)  # the staging block is free again
            dst = sq.staging_buffer()[layer]  # written home by drain() before the next read (also without CUDA)
        else:
            dst = sq.load_block(layer, idx)
            self.decoder.note_evict()  # the streaming copies wait for the evict stream once
        # the destination exists (staging or slab registered): only now count the block as placed
        event = None
        if self.cuda:
            self.evict_stream.wait_stream(torch.cuda.current_stream(self.device))
            with torch.cuda.stream(self.evict_stream):
                dst.copy_(src, non_blocking=True)
                event = torch.cuda.Event()
                event.record(self.evict_stream)
            sq.evict_events[layer] = event
            if region != COMPUTE:
                sq.load_written[layer] = event
        else:
            dst.copy_(src)
        if region == COMPUTE:
            sq.pending[layer] = (event, idx)
        if region == COMPUTE:
            sq.n_comp[layer] += 1
        else:
            sq.n_load[layer] += 1
        sq.placed[layer] += D
        sq.win_len[layer] = 0
        self.evicted_blocks += 1

    def _gather(self, sq: SequenceKV, layer: int) -> torch.Tensor:
        """All cached KV of ``layer`` in position order on the device: ``[parts, Hkv, ctx, dim]``.
        Only for chunked prefill (a read, not a move).

        Each region crosses in one piece: the placed compute rows in one read through the
        prefill writer's pinned staging (:meth:`_read_compute`), the load blocks in one copy per
        pinned slab, then the blocks are put in position order on the device. A copy per block
        (about 300 KB each for DeepSeek-V2-Lite), each a synchronous pageable copy for the compute
        region, was what every chunk of a long prompt paid for all the blocks before it (1M tokens
        on the H200: prefill 1.40x slower under ``writescope`` than under ``gpu``, runs 42 and 65).

        The read waits only for this layer's earlier writes (written by earlier chunks, so
        normally done long before): the host for the prefill writer's futures of its compute rows
        (:meth:`_wait_compute_writes`), the read stream for the event after its latest load-region
        write. It used to wait for every write in flight, this chunk's earlier layers' included,
        which held the issuing thread until the device had finished the layer before (a host
        wait every layer of every chunk). Both reads run on their own streams, so they overlap
        the device's work on the layers before; the compute stream waits for them."""
        t0 = time.perf_counter()
        D = self.spec.window
        ahead = self._take_read_ahead(sq, layer)
        if ahead is None:
            self._wait_compute_writes(sq, layer)
            sq.drain(layer)
        nb = sq.placed[layer] // D
        runs = sq.block_runs(nb)  # the same for every layer of a chunk: worked out once
        n_c = sum(n for region, _, _, n in runs if region == COMPUTE)  # compute and load indices are dense: 0 .. n - 1 each
        n_l = nb - n_c
        comp = ahead if ahead is not None else self._read_compute(sq.compute[layer, :, :, : n_c * D]) if n_c else None
        load = self._read_load(sq, layer, n_l) if n_l else None  # [n_l, parts, Hkv, D, dim]
        self.prefill_readback_bytes += nb * self.spec.block_bytes
        self.prefill_readback_compute_bytes += n_c * self.spec.block_bytes
        win = sq.window[layer, :, :, : sq.win_len[layer]]
        parts, hkv, _, dim = win.shape
        out = torch.empty(parts, hkv, nb * D + win.shape[2], dim, dtype=win.dtype, device=win.device)
        # one copy per run of blocks consecutive in both the sequence and their region (a prompt
        # plan has two runs; one copy per block cost the issuing thread a slice per block)
        for region, first, start, n in runs:
            dst = out[:, :, start * D : (start + n) * D]
            if region == COMPUTE:
                dst.copy_(comp[:, :, first * D : (first + n) * D])
            else:  # [n, parts, Hkv, D, dim] blocks into [parts, Hkv, n * D, dim] positions
                dst.view(parts, hkv, n, D, dim).copy_(load[first : first + n].permute(1, 2, 0, 3, 4))
        out[:, :, nb * D :].copy_(win)
        self.prefill_readback_host_s += time.perf_counter() - t0
        return out

    def _read_ahead(self, seqs: list[SequenceKV], layer: int) -> None:
        """Start the compute-row reads of the next :attr:`read_ahead` layers of ``seqs`` (this
        pass's sequences with earlier chunks), on the prefill writer's reader thread, in the order
        the pass will take them, while the reads started and not taken stay within
        ``READ_AHEAD_BYTES`` of device memory. A layer whose last eviction to the compute region
        is still pending (its staging block is written home on the issuing thread) is left to
        be read when it comes. The read takes over the layer's unfinished compute-row writes:
        it waits for them first and fails with a failed one's error (raised by the gather).
        Reads stop at the pass's last layer: past it, a read for the next pass would be left
        untaken where that pass is decode-shaped (no gather), and in serve it would copy
        during the running requests' decode step."""
        if self._writer is None:  # no compute rows were ever written
            return
        D = self.spec.window
        for lay in range(layer + 1, min(layer + 1 + self.read_ahead, self.num_layers)):
            for sq in seqs:
                if lay in sq.read_ahead or sq.pending[lay] is not None:
                    continue
                nb = sq.placed[lay] // D
                n_c = sum(n for region, _, _, n in sq.block_runs(nb) if region == COMPUTE)
                size = n_c * self.spec.block_bytes
                if not n_c:
                    continue
                if self._ahead_bytes + size > READ_AHEAD_BYTES:
                    return
                read = self._writer.read_async(sq.compute[lay, :, :, : n_c * D], sq.compute_writes[lay])
                sq.compute_writes[lay] = []  # the read waits for them and raises a failed one's error (only once it is submitted)
                sq.read_ahead[lay] = (nb, size, read)
                self._ahead_bytes += size

    def _take_read_ahead(self, sq: SequenceKV, layer: int) -> torch.Tensor | None:
        """The compute rows of ``layer`` read ahead for this gather (on the device), or None where
        none was started or the one started no longer covers the layer's placed blocks (it is
        taken and dropped: a failure of the writes it waited for is still raised)."""
        entry = sq.read_ahead.pop(layer, None)
        if entry is None:
            return None
        nb, size, read = entry
        self._ahead_bytes -= size
        rows = self._writer.take(read)
        return rows if nb == sq.placed[layer] // self.spec.window else None

    def _drop_read_ahead(self, sq: SequenceKV) -> None:
        """Wait for ``sq``'s reads started ahead and forget them (before its rows are freed)."""
        entries, sq.read_ahead = list(sq.read_ahead.values()), {}
        for _, size, read in entries:
            self._ahead_bytes -= size
        wait([read for _, _, read in entries])

    def prefill_readback(self) -> dict:
        """Chunked prefill's read-back so far: ``bytes`` (every earlier block read again, all
        layers), ``compute_bytes`` (of those, compute rows), ``kept_bytes`` (earlier KV a pass
        took from the device instead, passes run layer by layer: :meth:`keeping_prefill_kv`),
        ``host_s`` (the issuing thread's
        seconds in it, host time) and of those ``take_wait_s`` (waiting for reads started ahead
        on the prefill writer's reader thread); and the threads' that read compute rows, either
        of them (the issuing one where no read was started ahead): ``staging_copy_s`` (copying
        compute rows into pinned staging, CUDA only) and ``wait_s`` (waiting for the layer's
        compute-row writes to land and, CUDA only, for a read buffer's last DMA)."""
        w = self._writer
        return {"bytes": self.prefill_readback_bytes, "compute_bytes": self.prefill_readback_compute_bytes,
                "kept_bytes": self.prefill_kept_bytes,
                "host_s": self.prefill_readback_host_s,
                "take_wait_s": w.take_wait_s if w is not None else 0.0,
                "staging_copy_s": w.read_copy_s if w is not None else 0.0,
                "wait_s": self.prefill_readback_write_wait_s + (w.read_wait_s + w.read_after_s if w is not None else 0.0)}

    def _wait_compute_writes(self, sq: SequenceKV, layer: int) -> None:
        """Wait until the prefill writer's writes of ``layer``'s compute rows have landed.

        Raises:
            The first of those writes' failures (its rows are not what was written).
        """
        futures, sq.compute_writes[layer] = sq.compute_writes[layer], []
        self.prefill_readback_write_wait_s += wait_writes(futures)

    def _read_load(self, sq: SequenceKV, layer: int, n: int) -> torch.Tensor:
        """Load blocks ``0 .. n - 1`` of ``layer`` on the device ``[n, parts, Hkv, D, dim]``: one
        copy per pinned slab, on the read stream after the layer's latest load-region write
        (CUDA); the compute stream waits for the read stream."""
        if not self.cuda:
            runs = sq.load_runs(layer, 0, n, n)
            return runs[0] if len(runs) == 1 else torch.cat(runs)
        cur, rs = torch.cuda.current_stream(self.device), self._read_stream()
        written = sq.load_written[layer]
        with torch.cuda.stream(rs):
            if written is not None:
                rs.wait_event(written)
            runs = [run.to(self.device, non_blocking=True) for run in sq.load_runs(layer, 0, n, n)]
            load = runs[0] if len(runs) == 1 else torch.cat(runs)
        cur.wait_stream(rs)
        load.record_stream(cur)  # made on the read stream, used and freed on the compute stream
        return load

    def _read_stream(self) -> torch.cuda.Stream:
        if self._load_read_stream is None:
            self._load_read_stream = torch.cuda.Stream(self.device)
        return self._load_read_stream

    # ------------------------------------------------------------------ sizing
    def check_capacity(self, capacities: list[int], device_free: int | None, host_free: int | None, pinned_budget: int | None) -> None:
        """Refuse, before anything is allocated, a batch whose KV cannot fit.

        Args:
            capacities: tokens per sequence (prompt + max new tokens).
            device_free, host_free: free bytes (None = unknown, not checked).
            pinned_budget: bytes that may be page-locked (None = not checked); checked without
                CUDA too, so a plan that fits here fits a GPU machine with the same memory.

        Raises:
            ValueError: naming the region, bytes needed and available, and what to change.
        """
        s, p = self.spec, self.policy
        gib = 2**30
        dev = s.window_bytes(len(capacities)) + s.pingpong_total_bytes()
        if device_free is not None and dev > 0.9 * device_free:
            raise ValueError(
                f"the D-windows and ping-pong buffers need {dev / gib:.2f} GiB on {self.device} but {device_free / gib:.2f} GiB is free: "
                "use a smaller batch or window"
            )
        host = s.host_bytes(capacities)
        if host_free is not None and host > 0.9 * host_free:
            raise ValueError(
                f"the batch's spilled KV needs up to {host / gib:.2f} GiB of host memory but {host_free / gib:.2f} GiB is available: "
                "use fewer or shorter requests"
            )
        # load region (worst case for the policy) + eviction staging + the prefill staging buffer
        pinned = sum(load_blocks_reserved(p, c // s.window) for c in capacities) * s.num_layers * s.block_bytes
        pinned += pinned_staging_bytes(s, p, len(capacities), host)
        if pinned_budget is not None and pinned > pinned_budget:
            raise ValueError(
                f"the load region and staging buffers need up to {pinned / gib:.2f} GiB of pinned memory, above the pinned "
                f"budget of {pinned_budget / gib:.2f} GiB: raise pinned_budget, or use fewer or shorter requests"
            )
        # host_free counted the pool's wholly idle mappings: those the batch may need go back to the host now
        # (pageable KV is committed as it is written, so no later allocation would see the shortfall)
        pinned_memory.POOL.make_room(host)


def _micro_batches() -> int | str:
    """``WRITESCOPE_MICRO_BATCHES``: ``1`` (the default: whole batches), ``2`` (a decode step
    with a CPU part runs as two interleaved micro-batches, models/decode_step.py) or ``auto``
    (returned as the string: two where the step's CPU computes no host experts,
    scheduler/placement.py :func:`micro_batched`). Not the default: on the H200 in run 8 it was
    slower, since the main thread issued each micro-batch's attention work separately
    (DeepSeek-V2-Lite 16 x 32K: 261.9 against 237.7 ms per step); with CUDA graphs for the stages
    run 65 measured two micro-batches 1.14-1.20x faster there (benchmarks/results/gpu_decode_h200.md).

    Raises:
        ValueError: another value (names it).
    """
    value = env_choice("WRITESCOPE_MICRO_BATCHES", ("1", "2", "auto"))
    return value if value == "auto" else int(value)


class _Decoding:
    """The handle of a decode layer begun on the split decoder."""

    __slots__ = ("layer", "seqs", "pending")

    def __init__(self, layer: int, seqs: list[SequenceKV], pending):
        self.layer, self.seqs, self.pending = layer, seqs, pending


READ_AHEAD_ENV = "WRITESCOPE_PREFILL_READ_AHEAD"
# device memory held by compute-row reads started ahead (counted in the budget plan's activations, budget/plan.py):
# a layer's compute rows of a 32K-token prompt at r 0.5 are 19 MB for DeepSeek-V2-Lite, 34 MB for Qwen3-30B-A3B
READ_AHEAD_BYTES = 64 << 20


def read_ahead_from_env() -> int:
    """``WRITESCOPE_PREFILL_READ_AHEAD``: how many layers ahead chunked prefill starts reading a
    sequence's compute rows back, on the prefill writer's reader thread (default 2; 0: each
    layer's read on the issuing thread when the layer comes, the earlier behaviour, for
    comparing the two in one run).

    Raises:
        ValueError: not an integer from 0 to 64 (names the value).
    """
    n = env_int(READ_AHEAD_ENV, 0, 64, "use layers from 0 (none: read on the issuing thread) to 64, default 2")
    return 2 if n is None else n


def _prefill_load_on_evict_stream() -> bool:
    """``WRITESCOPE_PREFILL_LOAD_STREAM``: ``evict`` (the default: prefill's load-region copies on
    the evict stream) or ``compute`` (on the compute stream, the earlier behaviour; for comparing
    the two in one run).

    Raises:
        ValueError: another value (names it).
    """
    return env_choice("WRITESCOPE_PREFILL_LOAD_STREAM", ("evict", "compute")) == "evict"


def _pack(k: torch.Tensor, v: torch.Tensor | None) -> torch.Tensor:
    """New KV ``[T, Hkv, dk]`` (+ ``[T, Hkv, dv]``) -> ``[parts, Hkv, T, dim]`` (a view when shared)."""
    if v is None:
        return k.permute(1, 0, 2).unsqueeze(0)
    return torch.stack((k, v)).permute(0, 2, 1, 3)
