"""Two one-CTA Triton kernels for the hand-offs between a CUDA stream and the native CPU worker
(cpu_worker.py), on int32 flags in pinned host memory read and written through their device
address (unified addressing; a zero-copy access, not a copy):

- :func:`store_flag`: the stream sets ``flags[index] = value`` after the work issued before it.
- :func:`wait_flag`: the stream waits until ``flags[index]`` reaches ``value`` (modulo 2^32),
  re-reading it with volatile loads; after ``MAX_POLLS`` polls (tens of seconds) it sets the
  timeout flag and lets the stream go on. The host never waits.
- :func:`store_flag_from`, :func:`wait_flag_for`: the same with the value read, when the store
  runs, from a pinned slot the host wrote (a CUDA graph's kernels have fixed arguments), and kept
  on the device for the wait.

Measured on the H200 machine (docs/HARDWARE.md, tools/streamwait_probe.py): a spinning kernel of
this kind sees a host write; from the write to the host seeing the kernel's completion event took a
median 157 us (20 tries; the host's own polling of the event included).
"""

from __future__ import annotations

from contextlib import nullcontext

import torch
import triton
import triton.language as tl

MAX_POLLS = 50_000_000  # each volatile load of host memory crosses PCIe (about 1 us): tens of seconds


# index, value and max_polls vary call to call: not specialised (Triton would compile a variant for
# 1, for multiples of 16 and for the rest; seen on the H200: a recompile inside a timed hand-off)
# FROM_SLOT: the store reads the value, when it runs, from ``slot_ptr`` (pinned host memory the host
# writes before a CUDA graph's replay: a captured kernel's arguments are fixed) and keeps it in
# ``latch_ptr`` (device memory) for the wait, which reads the latch: by the time the wait starts the
# host may have named the next job in the slot already (its guard waits only for the done flag,
# which the worker may set before this wait runs). One kernel each either way, so the timeline
# finds them by name (bench/timeline.py); the pointers are 4-byte slots: not specialised on
# 16-byte alignment (a variant compiled inside a capture otherwise)
@triton.jit(do_not_specialize=["index", "value"], do_not_specialize_on_alignment=["slot_ptr", "latch_ptr"])
def _store(flag_ptr, index, value, slot_ptr, latch_ptr, FROM_SLOT: tl.constexpr):
    if FROM_SLOT:
        value = tl.load(slot_ptr, volatile=True)
        tl.store(latch_ptr, value)
    tl.store(flag_ptr + index, value)


@triton.jit(do_not_specialize=["index", "value", "timeout_index", "max_polls"], do_not_specialize_on_alignment=["latch_ptr"])
def _wait(flag_ptr, index, value, timeout_index, max_polls, latch_ptr, FROM_SLOT: tl.constexpr):
    if FROM_SLOT:
        value = tl.load(latch_ptr, volatile=True)
    v = tl.load(flag_ptr + index, volatile=True)
    i = 0
    while ((v - value) < 0) & (i < max_polls):  # int32 difference: modulo 2^32
        v = tl.load(flag_ptr + index, volatile=True)
        i += 1
    if i >= max_polls:
        tl.store(flag_ptr + timeout_index, 1)


class _Cai:
    def __init__(self, t: torch.Tensor):
        self.__cuda_array_interface__ = {"data": (t.data_ptr(), False), "shape": tuple(t.shape), "typestr": "<i4", "version": 3}


def device_view(flags: torch.Tensor, device: torch.device) -> torch.Tensor:
    """A tensor on ``device`` over the pinned int32 ``flags`` (the same memory; keep ``flags`` alive).

    Raises:
        ValueError: ``flags`` is not a pinned contiguous int32 tensor.
    """
    if flags.dtype != torch.int32 or not flags.is_pinned() or not flags.is_contiguous():
        raise ValueError(f"flags must be pinned contiguous int32, got {flags.dtype}, pinned={flags.is_pinned()}")
    return torch.as_tensor(_Cai(flags), device=device)


def warm(flags_dev: torch.Tensor, timeout_index: int) -> None:
    """Compile both kernels now (first use compiles them: seconds), not inside a decode step:
    a store of 0 into ``flags_dev[0]`` and a wait for a value it already has. Call it before
    any job uses the flags."""
    store_flag(flags_dev, 0, 0)
    wait_flag(flags_dev, 0, 0, timeout_index)
    latch = torch.zeros(4, dtype=torch.int32, device=flags_dev.device)
    store_flag_from(flags_dev, 0, flags_dev[0:1], latch[1:2])  # flags[0] = flags[0]; unaligned pointers, as slots are
    wait_flag_for(flags_dev, 0, latch[1:2], timeout_index)
    torch.cuda.synchronize(flags_dev.device)


def _on(device: torch.device):
    """Launch on ``device``: a device switch only when it is not the current one (entering
    ``torch.cuda.device`` costs tens of microseconds of the thread that issues the step)."""
    return _SAME if torch.cuda.current_device() == device.index else torch.cuda.device(device)


_SAME = nullcontext()


def store_flag(flags_dev: torch.Tensor, index: int, value: int) -> None:
    """The current stream sets ``flags[index] = value`` (a plain store to host memory through its
    device address, after the stream's earlier work: q's copy has landed, in stream order, before
    this kernel runs; the H200 runs relied on that, tests/test_gpu_inplace.py)."""
    with _on(flags_dev.device):
        _store[(1,)](flags_dev, index, value, flags_dev, flags_dev, False)


def wait_flag(flags_dev: torch.Tensor, index: int, value: int, timeout_index: int) -> None:
    """The current stream waits until ``flags[index]`` reaches ``value``; on giving up it sets
    ``flags[timeout_index] = 1``."""
    with _on(flags_dev.device):
        _wait[(1,)](flags_dev, index, value, timeout_index, MAX_POLLS, flags_dev, False)


def store_flag_from(flags_dev: torch.Tensor, index: int, slot_dev: torch.Tensor, latch: torch.Tensor) -> None:
    """:func:`store_flag` of the value ``slot_dev`` (a device view of one pinned int32) holds when
    the kernel runs, also written into ``latch`` (one int32 in device memory) for
    :func:`wait_flag_for`: what a CUDA graph captures where the value changes from replay to
    replay (the host writes the slot before each replay, native/flag_worker.py ``JobSlot``)."""
    with _on(flags_dev.device):
        _store[(1,)](flags_dev, index, 0, slot_dev, latch, True)


def wait_flag_for(flags_dev: torch.Tensor, index: int, latch: torch.Tensor, timeout_index: int) -> None:
    """:func:`wait_flag` for the value the last :func:`store_flag_from` on this stream put in
    ``latch``."""
    with _on(flags_dev.device):
        _wait[(1,)](flags_dev, index, 0, timeout_index, MAX_POLLS, latch, True)
