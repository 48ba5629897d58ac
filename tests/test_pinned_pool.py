"""The pool of registered host buffers (kvcache/pinned_pool.py), with a fake registration so it
runs without CUDA: reuse by size, larger idle buffers split for smaller requests and merged when
given back, the idle cap, room made under memory pressure, a failed registration retried once,
host_empty / unpin / garbage collection, and a sequence's slabs lent to the next sequence."""

from __future__ import annotations

import gc

import pytest
import torch

from writescope.config import KVLayout
from writescope.kvcache import pinned
from writescope.kvcache.pinned_pool import PAGE, PinnedPool, idle_cap_from_env, whole_pages
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


def _check(pool: PinnedPool, cuda: FakeCuda) -> None:
    """The pool's invariants: every idle piece lies in a registered mapping, on whole pages, apart
    from the other idle pieces and never beside one of its own mapping (those are merged)."""
    idle = [p for p in pool._idle if not p.mapping.lost]
    for p in idle:
        m = p.mapping
        assert not p.lent and m.registered and cuda.live[m.ptr] == m.size
        assert p.offset % PAGE == 0 and p.size % PAGE == 0 and p.size > 0 and p.offset + p.size <= m.size
    for i, p in enumerate(idle):
        for q in idle[i + 1 :]:
            if p.mapping is q.mapping:
                assert p.offset + p.size < q.offset or q.offset + q.size < p.offset, "idle pieces overlap or touch"


def test_a_buffer_given_back_is_lent_again_for_its_size_or_less():
    pool, cuda = _pool()
    a = pool.take(4 * MiB)
    assert a.size == 4 * MiB and a.offset == 0 and cuda.registered == 1
    pool.give(a)
    assert pool.idle_bytes == 4 * MiB and len(cuda.live) == 1  # still registered
    b = pool.take(4 * MiB - 5)  # rounds up to the same pages
    assert b.ptr == a.ptr and b.size == 4 * MiB and cuda.registered == 1
    assert pool.stats["reused"] == 1 and pool.stats["reused_bytes"] == 4 * MiB
    pool.give(b)
    d = pool.take(2 * MiB)  # half its size: its first half, the rest stays idle
    assert d.ptr == a.ptr and d.size == 2 * MiB and cuda.registered == 1 and pool.idle_bytes == 2 * MiB
    e = pool.take(5 * MiB)  # larger than every idle piece
    assert e.ptr not in (a.ptr, a.ptr + 2 * MiB) and cuda.registered == 2
    assert pool.idle_bytes == 2 * MiB
    _check(pool, cuda)


def test_the_smallest_fitting_idle_buffer_is_lent():
    pool, cuda = _pool()
    big, small = pool.take(whole_pages(int(1.1 * MiB))), pool.take(MiB)
    pool.give(big)
    pool.give(small)
    assert pool.take(MiB).ptr == small.ptr
    assert pool.take(MiB).ptr == big.ptr  # the first MiB of the larger one
    assert pool.idle_bytes == big.size - MiB and cuda.registered == 2


def test_odd_sizes_split_a_larger_idle_buffer_and_the_rest_serves_a_later_request():
    """A 10-page buffer given back serves 3 pages, then its remainder 5 pages (no registration);
    4 more pages do not fit the last 2 idle pages and get a mapping of their own. Stats count
    the pages lent again and the pages registered."""
    pool, cuda = _pool()
    a = pool.take(10 * PAGE - 1)
    pool.give(a)
    x = pool.take(2 * PAGE + 1)  # 3 pages
    assert (x.ptr, x.size) == (a.ptr, 3 * PAGE) and pool.idle_bytes == 7 * PAGE and pool.idle_count == 1
    y = pool.take(5 * PAGE - 100)  # 5 pages, from the remainder
    assert (y.ptr, y.size) == (a.ptr + 3 * PAGE, 5 * PAGE) and pool.idle_bytes == 2 * PAGE
    z = pool.take(3 * PAGE + 7)  # 4 pages: more than the 2 idle ones
    assert z.mapping is not a.mapping and z.size == 4 * PAGE and pool.idle_bytes == 2 * PAGE
    assert cuda.registered == 2 and pool.stats["register_bytes"] == 14 * PAGE
    assert pool.stats["reused"] == 2 and pool.stats["reused_bytes"] == 8 * PAGE
    assert pool.stats["unregister_bytes"] == 0
    _check(pool, cuda)


def test_pieces_merge_back_and_their_mapping_goes_once_only_when_all_are_idle():
    cap = [64 * MiB]
    cuda = FakeCuda()
    pool = PinnedPool(cuda.register, cuda.unregister, lambda: cap[0], lambda: None, {})
    a = pool.take(10 * PAGE)
    pool.give(a)
    p1, p2, p3 = pool.take(3 * PAGE), pool.take(4 * PAGE), pool.take(3 * PAGE)
    assert [p.ptr - a.ptr for p in (p1, p2, p3)] == [0, 3 * PAGE, 7 * PAGE] and pool.idle_count == 0
    pool.give(p1)
    pool.give(p3)  # two idle pieces, not beside each other: 6 pages, none holding 5
    assert pool.idle_bytes == 6 * PAGE and pool.idle_count == 2 and pool.releasable_bytes == 0
    assert pool.take(5 * PAGE).mapping is not a.mapping and cuda.registered == 2
    assert pool.release_idle() == 0 and a.ptr in cuda.live  # partly lent: nothing of it can go
    pool.give(p2)  # all three merge: the whole mapping is one idle piece again
    assert pool.idle_count == 1 and pool.idle_bytes == pool.releasable_bytes == 10 * PAGE
    whole = pool.take(10 * PAGE)  # more than any piece given back
    assert (whole.ptr, whole.size) == (a.ptr, 10 * PAGE) and cuda.registered == 2
    pool.give(whole)
    p1, p2 = pool.take(6 * PAGE), pool.take(4 * PAGE)
    assert p1.mapping is a.mapping and p2.mapping is a.mapping
    cap[0] = 0  # no pool from now on: the mapping goes when its last piece is back, not before
    pool.give(p2)
    assert a.ptr in cuda.live and pool.idle_bytes == 4 * PAGE  # over the cap, but partly lent: kept
    assert pool.take(PAGE).mapping is not a.mapping  # and lent no more
    unregistered = pool.stats["unregister_bytes"]
    pool.give(p1)  # FakeCuda fails a second unregistration of the same pointer
    assert a.ptr not in cuda.live and pool.stats["unregister_bytes"] - unregistered == 10 * PAGE
    assert pool.idle_count == 0
    _check(pool, cuda)


def test_the_idle_cap_counts_pieces():
    """Idle pieces of a partly lent mapping count towards the cap; only wholly idle mappings go,
    idle longest first."""
    pool, cuda = _pool(cap=8 * PAGE)
    a = pool.take(8 * PAGE)
    pool.give(a)
    x = pool.take(6 * PAGE)  # 2 pages of a stay idle
    c = pool.take(7 * PAGE)  # no idle piece holds it: new
    pool.give(c)  # 2 + 7 pages idle > 8: c, the only wholly idle mapping, goes
    assert c.ptr not in cuda.live and a.ptr in cuda.live and pool.idle_bytes == 2 * PAGE
    d = pool.take(5 * PAGE)
    e = pool.take(PAGE)  # from a's 2 idle pages, not a new mapping
    assert e.mapping is a.mapping and pool.idle_bytes == PAGE
    pool.give(d)  # 1 + 5 pages: under the cap, kept
    assert d.ptr in cuda.live and pool.idle_bytes == 6 * PAGE
    pool.give(x)  # a: 1 + 6 pages idle, e lent; d (5) + 7 = 12 > 8: d goes, a cannot
    assert d.ptr not in cuda.live and a.ptr in cuda.live and pool.idle_bytes == 7 * PAGE
    pool.give(e)  # a whole again: 8 pages, at the cap
    assert pool.idle_bytes == pool.releasable_bytes == 8 * PAGE and pool.idle_count == 1
    _check(pool, cuda)


def test_a_piece_of_equal_size_in_a_partly_lent_mapping_goes_first():
    """Of two idle pieces of one size, the one in a mapping already partly lent is lent: the
    wholly idle mapping stays releasable."""
    pool, cuda = _pool()
    whole, big = pool.take(4 * PAGE), pool.take(8 * PAGE)
    pool.give(big)
    x = pool.take(4 * PAGE)  # big's first half; its second half stays idle
    pool.give(whole)
    y = pool.take(4 * PAGE)
    assert x.mapping is big.mapping and (y.mapping, y.ptr) == (big.mapping, big.ptr + 4 * PAGE)
    assert pool.releasable_bytes == 4 * PAGE and cuda.registered == 2


def test_zero_bytes_take_one_page():
    pool, cuda = _pool()
    assert pool.take(0).size == PAGE and cuda.registered == 1
    a = pool.take(3 * PAGE)
    pool.give(a)
    z = pool.take(0)  # one page of an idle piece
    assert (z.ptr, z.size) == (a.ptr, PAGE) and cuda.registered == 2 and pool.idle_bytes == 2 * PAGE
    pool.give(z)
    assert pool.idle_count == 1 and pool.releasable_bytes == 3 * PAGE
    _check(pool, cuda)


def test_a_piece_is_given_back_once():
    pool, _ = _pool()
    a = pool.take(PAGE)
    pool.give(a)
    with pytest.raises(ValueError, match="given back but not lent"):
        pool.give(a)
    assert pool.idle_count == 1


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
    t = pinned.host_empty((16 * MiB,), torch.uint8, pin=True)  # its first quarter lent: the rest cannot go to the host now
    assert pool.idle_bytes == 48 * MiB and memory.available_memory(torch.device("cpu")) == 10 * 2**30
    pinned.unpin(t)
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


def test_a_collected_piece_keeps_its_mapping_from_lending_and_it_goes_when_the_rest_is_back(fake_pool):
    pool, cuda = fake_pool
    big = pinned.host_empty((8 * PAGE,), torch.uint8, pin=True)
    ptr = big.data_ptr()
    pinned.unpin(big)
    del big
    a = pinned.host_empty((3 * PAGE,), torch.uint8, pin=True)
    b = pinned.host_empty((PAGE, 2), torch.uint8, pin=True)  # from the 5 pages left
    assert (a.data_ptr(), b.data_ptr()) == (ptr, ptr + 3 * PAGE) and cuda.registered == 1
    a.fill_(1)
    b.fill_(2)
    assert int(a.sum()) == 3 * PAGE and int(b.sum()) == 4 * PAGE  # apart: writes to one never reach the other
    del a
    gc.collect()  # a was never given back: its mapping lends nothing more, and stays registered while b is lent
    assert ptr in cuda.live and pool.idle_count == 0 and pool.idle_bytes == 0
    c = pinned.host_empty((PAGE,), torch.uint8, pin=True)
    assert not ptr <= c.data_ptr() < ptr + 8 * PAGE and cuda.registered == 2
    pinned.unpin(b)
    assert ptr not in cuda.live and pool.idle_count == 0
    pinned.unpin(c)


def test_a_piece_lost_while_a_take_looks_is_not_lent(monkeypatch):
    """A collection may run a finalizer (drop) in the middle of take, on the same thread; a
    mapping lost then, and unregistered, is not lent from (drop is called where it may run)."""
    pool, cuda = _pool()
    x = pool.take(4 * PAGE)
    pool.give(x)
    x = pool.take(2 * PAGE)  # the 2 pages left stay idle
    prune, pending = pool._prune, [x]

    def prune_then_collect():
        prune()
        while pending:
            pool.drop(pending.pop())

    monkeypatch.setattr(pool, "_prune", prune_then_collect)
    y = pool.take(2 * PAGE)
    assert y.mapping is not x.mapping and x.ptr not in cuda.live and y.ptr in cuda.live


def test_rows_of_smaller_load_regions_after_a_larger_one_register_nothing(fake_pool):
    """A benchmark's rows one after another in one process: the first row (``gpu``: every block in
    the load region) registers its sequences' slabs; rows with CPU shares 0.57, 0.30 and 0.40 need
    smaller load regions and are lent the first pages of those slabs."""
    pool, cuda = fake_pool
    before = dict(pool.stats)
    reused = 0
    for i, share in enumerate((0.0, 0.57, 0.30, 0.40)):
        seqs = [SequenceKV(_spec(), 16 * 40, 16 * 30, StaticPolicy(share), torch.device("cpu"), pin=True) for _ in range(4)]
        if i == 0:
            registered = pool.stats["register_bytes"] - before["register_bytes"]
            assert registered > 0 and len(cuda.live) == 4
        else:
            reused += sum(s.tensor.numel() * s.tensor.element_size() for q in seqs for s in q.slabs)
        for q in seqs:
            q.release()
    assert pool.stats["register_bytes"] - before["register_bytes"] == registered and len(cuda.live) == 4
    assert pool.stats["reused_bytes"] - before["reused_bytes"] == reused > 0
    assert pool.idle_bytes == pool.releasable_bytes == registered
    _check(pool, cuda)


def test_threads_taking_and_giving_never_share_a_byte():
    """Four threads take pieces of 1-16 pages, fill them with their own byte and check it before
    giving them back: no two lent pieces overlap whatever the interleaving; once all are back,
    every mapping is one idle piece again."""
    import random
    import threading

    pool, cuda = _pool(cap=64 * MiB)
    errors: list[str] = []

    def work(tid: int) -> None:
        rng, held = random.Random(tid), []
        for _ in range(300):
            if len(held) < 3 and (not held or rng.random() < 0.6):
                p = pool.take(rng.randint(1, 16) * PAGE - rng.randint(0, PAGE - 1))
                p.mem[p.offset : p.offset + p.size] = bytes([tid]) * p.size
                held.append(p)
            else:
                p = held.pop(rng.randrange(len(held)))
                if p.mem[p.offset : p.offset + p.size] != bytes([tid]) * p.size:
                    errors.append(f"thread {tid}: piece at {p.ptr:#x} written by another")
                pool.give(p)
        for p in held:
            pool.give(p)

    threads = [threading.Thread(target=work, args=(t + 1,)) for t in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not errors
    _check(pool, cuda)
    assert pool.idle_count == len(cuda.live) and pool.idle_bytes == pool.releasable_bytes == sum(cuda.live.values())
    assert pool.stats["reused"] > 0


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


def test_a_small_request_does_not_split_a_wholly_idle_mapping(fake_pool):
    """A piece lent from a wholly idle mapping keeps all of it registered until it comes back: a
    request under a quarter of the mapping registers its own pages instead, and the idle mapping
    can still go back to the host; a request of a quarter or more is lent from it."""
    from writescope.kvcache.pinned_pool import MIN_SPLIT, PAGE

    pool, cuda = fake_pool
    pinned.unpin(pinned.host_empty((32 * MiB,), torch.uint8, pin=True))
    before = cuda.registered
    small = pinned.host_empty((PAGE,), torch.uint8, pin=True)
    assert cuda.registered == before + 1 and pool.idle_bytes == 32 * MiB and pool.releasable_bytes == 32 * MiB
    just_under = pinned.host_empty((int(32 * MiB * MIN_SPLIT) - PAGE,), torch.uint8, pin=True)
    assert cuda.registered == before + 2 and pool.releasable_bytes == 32 * MiB
    pool.release_idle()
    assert pool.idle_bytes == 0  # the 32 MiB went back to the host
    pinned.unpin(pinned.host_empty((32 * MiB,), torch.uint8, pin=True))
    quarter = pinned.host_empty((int(32 * MiB * MIN_SPLIT),), torch.uint8, pin=True)
    assert cuda.registered == before + 3 and pool.idle_bytes == 24 * MiB and pool.releasable_bytes == 0
    # a piece of a mapping already partly lent serves any request that fits
    tiny = pinned.host_empty((PAGE,), torch.uint8, pin=True)
    assert cuda.registered == before + 3 and pool.idle_bytes == 24 * MiB - PAGE
    for t in (small, just_under, quarter, tiny):
        pinned.unpin(t)
