"""The pool of registered host buffers (kvcache/pinned_pool.py), with a fake registration so it
runs without CUDA: reuse by size, the idle cap, room made under memory pressure, a failed
registration retried once, host_empty / unpin / garbage collection, and a sequence's slabs lent
to the next sequence."""

from __future__ import annotations

import gc

import pytest
import torch

from writescope.config import KVLayout
from writescope.kvcache import pinned
from writescope.kvcache.pinned_pool import PAGE, SLACK, PinnedPool, idle_cap_from_env, whole_pages
from writescope.kvcache.sequence import SequenceKV
from writescope.kvcache.spec import PartitionSpec
from writescope.scheduler.policies import StaticPolicy

MiB = 2**20


class FakeCuda:
    """Records registrations; ``fail`` registrations fail before the rest succeed."""

    def __init__(self, fail: int = 0):
        self.live: dict[int, int] = {}
        self.registered = 0
        self.fail = fail
        self.errors = 0

    def register(self, ptr: int, nbytes: int) -> int:
        if self.fail:
            self.fail -= 1
            return 2  # cudaErrorMemoryAllocation
        assert ptr not in self.live, "registered twice"
        self.live[ptr] = nbytes
        self.registered += 1
        return 0

    def unregister(self, ptr: int) -> int:
        assert ptr in self.live, "unregistered a pointer that is not registered"
        del self.live[ptr]
        return 0


def _pool(cap=64 * MiB, free=lambda: None, fail=0):
    cuda = FakeCuda(fail)
    pool = PinnedPool(cuda.register, cuda.unregister, cap, free, {}, on_error=lambda: setattr(cuda, "errors", cuda.errors + 1))
    return pool, cuda


def test_a_buffer_given_back_is_lent_again_for_its_size_or_a_little_less():
    pool, cuda = _pool()
    a = pool.take(4 * MiB)
    assert a.size == 4 * MiB and cuda.registered == 1
    pool.give(a)
    assert pool.idle_bytes == 4 * MiB and len(cuda.live) == 1  # still registered
    b = pool.take(4 * MiB - 5)  # rounds up to the same pages
    assert b is a and cuda.registered == 1 and pool.stats["reused"] == 1 and pool.stats["reused_bytes"] == 4 * MiB
    pool.give(b)
    c = pool.take(int(4 * MiB / (1 + SLACK)) + PAGE)  # within the slack
    assert c is a
    pool.give(c)
    d = pool.take(2 * MiB)  # half its size: beyond the slack, a new mapping
    assert d is not a and cuda.registered == 2
    e = pool.take(5 * MiB)  # larger than every idle buffer
    assert e is not a and cuda.registered == 3
    assert pool.idle_bytes == 4 * MiB


def test_the_smallest_fitting_idle_buffer_is_lent():
    pool, _ = _pool()
    big, small = pool.take(whole_pages(int(1.1 * MiB))), pool.take(MiB)
    pool.give(big)
    pool.give(small)
    assert pool.take(MiB) is small
    assert pool.take(MiB) is big  # 1.1x: still within the slack


@pytest.mark.parametrize("sizes", [[1, 15, 16, 17], [4097]])
def test_odd_sizes_round_up_to_whole_pages(sizes):
    pool, cuda = _pool()
    for n in sizes:
        buf = pool.take(n)
        assert buf.size == whole_pages(n) and buf.size % PAGE == 0 and buf.size >= n
        assert cuda.live[buf.ptr] == buf.size
        pool.give(buf)


def test_idle_bytes_stay_under_the_cap_longest_idle_first():
    pool, cuda = _pool(cap=10 * MiB)
    bufs = [pool.take(n * MiB) for n in (4, 3, 5)]
    for b in bufs:
        pool.give(b)
    assert pool.idle_bytes == 8 * MiB  # the 4 MiB one, idle longest, went when the 5 MiB one came
    assert bufs[0].ptr not in cuda.live and bufs[1].ptr in cuda.live and bufs[2].ptr in cuda.live
    huge = pool.take(11 * MiB)
    pool.give(huge)  # larger than the cap alone: unregistered at once
    assert huge.ptr not in cuda.live and pool.idle_bytes == 8 * MiB
    assert pool.stats["unregister_bytes"] == 15 * MiB
    assert pool.release_idle() == 8 * MiB and not cuda.live and pool.idle_count == 0


def test_cap_zero_is_no_pool():
    pool, cuda = _pool(cap=0)
    a = pool.take(MiB)
    pool.give(a)
    assert not cuda.live and pool.idle_bytes == 0
    assert pool.take(MiB) is not a and cuda.registered == 2


def test_a_cap_read_at_each_give_back_follows_its_source():
    cap = [8 * MiB]
    cuda = FakeCuda()
    pool = PinnedPool(cuda.register, cuda.unregister, lambda: cap[0], lambda: None, {})
    pool.give(pool.take(MiB))
    assert pool.idle_bytes == MiB
    cap[0] = 0
    pool.give(pool.take(2 * MiB))
    assert pool.idle_bytes == 0 and not cuda.live  # the new cap applied to both


def test_idle_buffers_make_room_when_the_host_is_short():
    free = [100 * MiB]
    pool, cuda = _pool(cap=64 * MiB, free=lambda: free[0])
    a, b = pool.take(8 * MiB), pool.take(8 * MiB)
    pool.give(a)
    pool.give(b)
    lent = [pool.take(20 * MiB)]  # enough free memory: the idle ones stay
    assert pool.idle_bytes == 16 * MiB
    free[0] = 21 * MiB  # a 20 MiB mapping needs 20 / 0.9 = 22.2 MiB free
    lent.append(pool.take(20 * MiB))
    assert pool.idle_count == 0 and a.ptr not in cuda.live and b.ptr not in cuda.live


def test_a_failed_registration_gives_the_idle_buffers_back_and_tries_once_more():
    pool, cuda = _pool(fail=0)
    a = pool.take(MiB)
    pool.give(a)
    cuda.fail = 1
    b = pool.take(4 * MiB)
    assert b.size == 4 * MiB and a.ptr not in cuda.live and cuda.errors == 1  # retried after releasing a
    cuda.fail = 2
    with pytest.raises(RuntimeError, match=r"cudaHostRegister of 0\.008 GiB failed \(CUDA error 2\).*pinned budget"):
        pool.take(8 * MiB)
    assert cuda.errors == 3 and set(cuda.live) == {b.ptr}


def test_idle_cap_from_the_environment(monkeypatch):
    monkeypatch.delenv("WRITESCOPE_PINNED_POOL", raising=False)
    assert idle_cap_from_env(64 * 2**30) == 16 * 2**30
    assert idle_cap_from_env(None) == 0
    monkeypatch.setenv("WRITESCOPE_PINNED_POOL", "auto")
    assert idle_cap_from_env(8 * 2**30) == 2 * 2**30
    monkeypatch.setenv("WRITESCOPE_PINNED_POOL", "0")
    assert idle_cap_from_env(64 * 2**30) == 0
    monkeypatch.setenv("WRITESCOPE_PINNED_POOL", "512MiB")
    assert idle_cap_from_env(64 * 2**30) == 512 * MiB
    for bad in ("lots", "-1GiB", "nan"):
        monkeypatch.setenv("WRITESCOPE_PINNED_POOL", bad)
        with pytest.raises(ValueError, match="WRITESCOPE_PINNED_POOL=.*8GiB.*auto"):
            idle_cap_from_env(64 * 2**30)


@pytest.fixture
def fake_pool(monkeypatch):
    """pinned.POOL replaced by a pool over FakeCuda (host_empty with pin=True then runs without CUDA)."""
    cuda = FakeCuda()
    pool = PinnedPool(cuda.register, cuda.unregister, 256 * MiB, lambda: None, pinned.STATS)
    monkeypatch.setattr(pinned, "POOL", pool)
    return pool, cuda


def test_host_empty_unpin_and_garbage_collection(fake_pool):
    pool, cuda = fake_pool
    t = pinned.host_empty((3, 1000, 7), torch.bfloat16, pin=True)
    assert t.shape == (3, 1000, 7) and t.dtype == torch.bfloat16 and cuda.live[t.data_ptr()] == whole_pages(3 * 1000 * 7 * 2)
    t.fill_(1.5)
    ptr = t.data_ptr()
    pinned.unpin(t)
    pinned.unpin(t)  # idempotent: given back once
    assert pool.idle_count == 1
    u = pinned.host_empty((3, 1000, 7), torch.bfloat16, pin=True)
    assert u.data_ptr() == ptr and cuda.registered == 1  # the same registered pages
    del t, u
    gc.collect()  # u was never given back: unregistered, not kept
    assert ptr not in cuda.live and pool.idle_count == 0
    assert pinned.host_empty((0, 4), torch.float32, pin=True).numel() == 0  # nothing to register
    assert cuda.registered == 1


def test_available_host_memory_counts_idle_buffers(fake_pool, monkeypatch):
    from writescope.budget import memory

    pool, _ = fake_pool
    monkeypatch.setattr(memory, "host_free_now", lambda: 10 * 2**30)  # MemAvailable held still: other processes move it
    assert memory.available_memory(torch.device("cpu")) == 10 * 2**30
    pinned.unpin(pinned.host_empty((64 * MiB,), torch.uint8, pin=True))
    assert pool.idle_bytes == 64 * MiB
    assert memory.available_memory(torch.device("cpu")) == 10 * 2**30 + 64 * MiB
    monkeypatch.setattr(memory, "host_free_now", lambda: None)
    assert memory.available_memory(torch.device("cpu")) is None


def _spec() -> PartitionSpec:
    return PartitionSpec(KVLayout(2, 16, 16, False), 3, torch.float32, window=16, pingpong_bytes=1 << 16)


def _sequence() -> SequenceKV:
    """A sequence of 640 tokens' capacity with a 480-token prompt, half its blocks for the CPU
    (load slabs and committed compute rows), pinned through the pool."""
    return SequenceKV(_spec(), 16 * 40, 16 * 30, StaticPolicy(0.5), torch.device("cpu"), pin=True)


def test_a_freed_sequence_lends_its_slabs_to_the_next(fake_pool):
    pool, cuda = fake_pool
    a = _sequence()
    slabs = {s.tensor.data_ptr() for s in a.slabs}
    assert slabs and slabs <= set(cuda.live)
    registered = cuda.registered
    a.release()
    b = _sequence()
    assert {s.tensor.data_ptr() for s in b.slabs} == slabs and cuda.registered == registered
    b.release()


def test_a_thousand_requests_of_similar_sizes_register_a_few_buffers():
    """Memory stays flat: after the first requests every one is served by an idle buffer."""
    pool, cuda = _pool(cap=64 * MiB)
    gen = torch.Generator().manual_seed(0)
    for i in range(1000):
        n = int(MiB * (1 + 0.1 * torch.rand((), generator=gen).item()))  # 1.0-1.1 MiB
        pool.give(pool.take(n))
        if i == 99:
            early = cuda.registered
    assert early <= 8 and cuda.registered == early  # none in the last 900
    assert pool.idle_bytes <= 64 * MiB and len(cuda.live) == pool.idle_count


def test_a_sequence_takes_its_slabs_before_making_room_for_its_compute_rows(fake_pool, monkeypatch):
    """Pageable KV does not pass through the pool. A new sequence first takes its load slabs
    (lent again: nothing registered), then, when the host is short of the prompt's compute rows
    it commits, gives the other idle buffers back."""
    pool, cuda = fake_pool
    a = _sequence()
    a.release()
    pinned.unpin(pinned.host_empty((8 * MiB,), torch.uint8, pin=True))  # another idle buffer, of no use to the sequence
    registered = cuda.registered
    monkeypatch.setattr(pool, "_free", lambda: 100_000)  # the host: 100 kB free, the prompt's rows need 92 kB x 1.11
    b = _sequence()
    assert cuda.registered == registered  # its slabs were lent again
    assert pool.idle_count == 0 and set(cuda.live) == {s.tensor.data_ptr() for s in b.slabs}
    b.release()


def test_admitting_a_batch_gives_idle_buffers_back_when_the_host_is_short(fake_pool, monkeypatch):
    """check_capacity counted the idle buffers as available: once the batch passes, those it may
    need go back to the host (pageable KV commits as it is written, later, past every check)."""
    from writescope.kvcache.inplace import InplaceKVCache

    pool, cuda = fake_pool
    cache = InplaceKVCache(_spec(), StaticPolicy(0.5), "cpu")
    pinned.unpin(pinned.host_empty((8 * MiB,), torch.uint8, pin=True))
    monkeypatch.setattr(pool, "_free", lambda: 10 * 2**30)
    cache.check_capacity([16 * 40] * 4, None, 10 * 2**30, None)
    assert pool.idle_count == 1  # plenty free: kept
    monkeypatch.setattr(pool, "_free", lambda: 1000)
    cache.check_capacity([16 * 40] * 4, None, 10 * 2**30, None)
    assert pool.idle_count == 0 and not cuda.live
    cache.close()


def test_a_bad_cap_set_later_never_fails_a_give_back():
    """The cap is read at every give-back; a value that turns bad after start (a variable set
    later) counts as the last good cap, so a clean-up path never raises for it and nothing leaks."""
    cuda = FakeCuda()
    caps = iter([8 * MiB, 8 * MiB])

    def cap():
        try:
            return next(caps)
        except StopIteration:
            raise ValueError("WRITESCOPE_PINNED_POOL='lots'") from None

    pool = PinnedPool(cuda.register, cuda.unregister, cap, lambda: None, {})
    a = pool.take(MiB)  # reads 8 MiB
    pool.give(a)  # reads 8 MiB
    b = pool.take(2 * MiB)  # the cap now fails: 8 MiB still
    pool.give(b)
    assert pool.idle_bytes == 3 * MiB and len(cuda.live) == 2


def test_no_pool_set_later_lends_nothing_kept_before(monkeypatch):
    cap = [8 * MiB]
    cuda = FakeCuda()
    pool = PinnedPool(cuda.register, cuda.unregister, lambda: cap[0], lambda: None, {})
    a = pool.take(MiB)
    pool.give(a)
    cap[0] = 0
    b = pool.take(MiB)
    assert b is not a and a.ptr not in cuda.live and cuda.registered == 2


def test_a_failed_mapping_gives_the_idle_buffers_back_and_tries_once_more(monkeypatch):
    from writescope.kvcache import pinned_pool

    pool, cuda = _pool()
    a = pool.take(MiB)
    pool.give(a)
    real, fails = pinned_pool.mmap.mmap, [1]

    def flaky(*args, **kw):
        if fails[0]:
            fails[0] -= 1
            raise OSError(12, "Cannot allocate memory")
        return real(*args, **kw)

    monkeypatch.setattr(pinned_pool.mmap, "mmap", flaky)
    b = pool.take(4 * MiB)
    assert b.size == 4 * MiB and a.ptr not in cuda.live
    fails[0] = 2
    with pytest.raises(RuntimeError, match=r"cannot map 0\.004 GiB of host memory for pinned KV.*Cannot allocate memory"):
        pool.take(4 * MiB)
