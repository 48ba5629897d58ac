"""Split decode attention over InplaceKVCache equals monolithic attention.

Every output of ``InplaceKVCache.attend`` is compared with plain float64
``softmax(q k^T * scale) v`` over all keys the test has written for that sequence
(:func:`reference_attention`, computed here from the test's own copy of the KV, not from the
cache). Decode attention is D-window part + load part (ping-pong) + CPU part (compute region,
worker thread) merged by lse (DESIGN.md section 4); prefill outputs are checked too.

Tolerances (rtol = atol), against the float64 reference on the same (cache-dtype) inputs:
- float64 cache: 1e-10 (observed ~1e-15; the split only adds exact lse rescalings);
- float32 cache: 1e-5 (float32 partials and merge; outputs are O(1)).

Besides the values, the tests check where bytes live: block counts per region after prefill,
``check_invariants()`` after every pass, every placed block's bytes equal to the KV written for
its token positions, and that placed blocks never move (same home, same data_ptr, same bytes).

Legend: P prompt tokens, D window (tokens per block), Hq/Hkv query/KV heads, G = Hq // Hkv,
dk/dv key/value widths (MLA: one shared latent head, V = K[..., :dv]).
"""

from __future__ import annotations

import math

import pytest
import torch

from writescope.attention.metadata import ForwardBatch
from writescope.config import KVLayout
from writescope.kvcache.inplace import InplaceKVCache
from writescope.kvcache.sequence import SequenceKV
from writescope.kvcache.spec import PartitionSpec
from writescope.scheduler.policies import COMPUTE, LOAD, PlacementPolicy, StaticPolicy, parse_policy

TOL = {
    torch.float64: dict(rtol=1e-10, atol=1e-10),
    torch.float32: dict(rtol=1e-5, atol=1e-5),
}

# (q_heads, layout)
GQA_8_2 = (8, KVLayout(kv_heads=2, k_dim=16, v_dim=16, shared_kv=False))
MLA_SMALL = (8, KVLayout(kv_heads=1, k_dim=24, v_dim=16, shared_kv=True))
# fewer query heads where an ~8K-token MLA prefill is needed: the library's prefill runs SDPA's
# math path when dk != dv, about 1 s per query head for 8193 tokens
MLA_FEW_HEADS = (2, MLA_SMALL[1])


# ---------------------------------------------------------------------------------- reference
def reference_attention(q: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, scale: float) -> torch.Tensor:
    """Monolithic attention of one query position, float64.

    Args:
        q: ``[Hq, dk]``.
        keys: ``[n, Hkv, dk]``, all keys the query sees.
        values: ``[n, Hkv, dv]``.
        scale: softmax scale.

    Returns:
        ``[Hq, dv]`` float64; query head h reads KV head ``h // (Hq // Hkv)``.
    """
    g = q.shape[0] // keys.shape[1]
    k = keys.double().repeat_interleave(g, dim=1)  # [n, Hq, dk]
    v = values.double().repeat_interleave(g, dim=1)  # [n, Hq, dv]
    s = torch.einsum("hd,nhd->hn", q.double(), k) * scale  # [Hq, n]
    return torch.einsum("hn,nhd->hd", torch.softmax(s, dim=-1), v)


def rows_to_check(n: int, window: int, gen: torch.Generator) -> list[int]:
    """Query rows of an n-token pass to compare (all of a short pass; a sample of a long one)."""
    if n <= 48:
        return list(range(n))
    rows = {0, 1, n // 2, n - 2, n - 1, window - 1, window, window + 1}
    rows |= set(torch.randint(0, n, (6,), generator=gen).tolist())
    return sorted(r for r in rows if 0 <= r < n)


def block_view(sq: SequenceKV, layer: int, j: int) -> torch.Tensor:
    """Block j (tokens j*D .. j*D+D-1) of ``layer`` where it lives: ``[parts, Hkv, D, dim]``."""
    region, idx = sq.homes[j]
    D = sq.spec.window
    return sq.compute[layer, :, :, idx * D : (idx + 1) * D] if region == COMPUTE else sq.load_block(layer, idx)


def counts(sq: SequenceKV, layer: int = 0) -> tuple[int, int, int]:
    """(compute blocks, load blocks, window tokens) of one layer."""
    return sq.n_comp[layer], sq.n_load[layer], sq.win_len[layer]


# ---------------------------------------------------------------------------------- driver
class Harness:
    """An InplaceKVCache on the CPU plus the test's own copy of every K/V written to it.

    ``forward`` runs one ``attend`` per layer over a ragged batch and checks every output row
    (or a sample of long prefills) against :func:`reference_attention`, then checks lengths and
    invariants of every sequence in the batch.
    """

    def __init__(
        self,
        q_heads: int,
        layout: KVLayout,
        *,
        window: int,
        policy: PlacementPolicy | str,
        dtype: torch.dtype = torch.float64,
        num_layers: int = 1,
        cpu_threads: int | None = None,
        pingpong_blocks: int | None = None,
        pingpong_buffers: int = 2,
        seed: int = 0,
    ):
        assert q_heads % layout.kv_heads == 0
        extra = {"pingpong_buffers": pingpong_buffers}
        if pingpong_blocks is not None:
            extra["pingpong_bytes"] = pingpong_blocks * PartitionSpec(layout, num_layers, dtype, window=window).block_bytes
        self.spec = PartitionSpec(layout, num_layers, dtype, window=window, **extra)
        if pingpong_blocks is not None:
            assert self.spec.pingpong_blocks == pingpong_blocks
        self.policy = parse_policy(policy) if isinstance(policy, str) else policy
        self.cache = InplaceKVCache(self.spec, self.policy, "cpu", cpu_threads=cpu_threads)
        self.q_heads, self.layout, self.dtype = q_heads, layout, dtype
        self.D, self.L = window, num_layers
        self.scale = layout.k_dim**-0.5
        self.gen = torch.Generator().manual_seed(seed)
        self.keys: dict[tuple[int, int], list[torch.Tensor]] = {}
        self.vals: dict[tuple[int, int], list[torch.Tensor]] = {}
        self.lens: dict[int, int] = {}

    # ---------------------------------------------------------------- data
    def randn(self, *shape: int, std: float = 1.0) -> torch.Tensor:
        return (std * torch.randn(shape, generator=self.gen, dtype=torch.float64)).to(self.dtype)

    def random_q(self, n: int) -> torch.Tensor:
        """``[n, Hq, dk]``; std 2 makes the softmax peaked enough that a misplaced key shows."""
        return self.randn(n, self.q_heads, self.layout.k_dim, std=2.0)

    def random_kv(self, n: int) -> tuple[torch.Tensor, torch.Tensor | None]:
        """``k [n, Hkv, dk]``, ``v [n, Hkv, dv]`` (None for MLA)."""
        lay = self.layout
        k = self.randn(n, lay.kv_heads, lay.k_dim)
        return k, None if lay.shared_kv else self.randn(n, lay.kv_heads, lay.v_dim)

    def history(self, slot: int, layer: int) -> tuple[torch.Tensor, torch.Tensor]:
        """All K ``[n, Hkv, dk]`` and V ``[n, Hkv, dv]`` written for ``slot``/``layer`` (cache dtype)."""
        k = torch.cat(self.keys[slot, layer])
        v = k[..., : self.layout.v_dim] if self.layout.shared_kv else torch.cat(self.vals[slot, layer])
        return k, v

    # ---------------------------------------------------------------- lifecycle
    def allocate(self, capacity: int, prompt_len: int = 0) -> int:
        slot = self.cache.allocate(capacity, prompt_len=prompt_len)
        self.lens[slot] = 0
        for layer in range(self.L):
            self.keys[slot, layer], self.vals[slot, layer] = [], []
        return slot

    def seq(self, slot: int) -> SequenceKV:
        return self.cache.sequence(slot)

    def close(self) -> None:
        self.cache.close()

    # ---------------------------------------------------------------- passes
    def forward(self, slots: list[int], query_lens: list[int], qkv=None) -> list[torch.Tensor]:
        """One pass (prefill chunk or decode step) of every layer; checks outputs; returns them.

        ``qkv``: optional fixed ``(q [T, Hq, dk], k [T, Hkv, dk], v or None)`` for every layer.
        """
        ctx = [self.lens[s] for s in slots]
        batch = ForwardBatch.build(slots, query_lens, ctx, "cpu")
        T, tol = batch.num_tokens, TOL[self.dtype]
        outs = []
        for layer in range(self.L):
            if qkv is None:
                q, (k, v) = self.random_q(T), self.random_kv(T)
            else:
                q, k, v = qkv
            out = self.cache.attend(layer, q, k, v, batch, self.scale)
            assert out.shape == (T, self.q_heads, self.layout.v_dim) and out.dtype == self.dtype
            got, want, where = [], [], []
            for i, slot in enumerate(slots):
                a, b = batch.query_start_loc[i], batch.query_start_loc[i + 1]
                self.keys[slot, layer].append(k[a:b])
                if v is not None:
                    self.vals[slot, layer].append(v[a:b])
                keys, vals = self.history(slot, layer)
                for r in rows_to_check(b - a, self.D, self.gen):
                    seen = ctx[i] + r + 1  # causal: keys 0 .. position of this query
                    got.append(out[a + r].double())
                    want.append(reference_attention(q[a + r], keys[:seen], vals[:seen], self.scale))
                    where.append(f"slot {slot} (context {ctx[i]}) row {r}")
            for g, w, msg in zip(got, want, where):
                torch.testing.assert_close(g, w, **tol, msg=lambda m, msg=msg, layer=layer: f"layer {layer} {msg}: {m}")
            outs.append(out)
        for i, slot in enumerate(slots):
            self.lens[slot] += query_lens[i]
            assert self.cache.seq_len(slot) == self.lens[slot]
            self.seq(slot).check_invariants()
        return outs

    def prefill(self, slots: list[int], lens: list[int]) -> list[torch.Tensor]:
        return self.forward(slots, lens)

    def decode(self, slots: list[int], qkv=None) -> list[torch.Tensor]:
        return self.forward(slots, [1] * len(slots), qkv)

    # ---------------------------------------------------------------- placement checks
    def assert_placement_exact(self, slot: int) -> None:
        """Every cached token's bytes sit at its position's home, equal to what was written
        (after any pending compute-region copy-in, which the next read would do)."""
        sq, D = self.seq(slot), self.D
        self.cache.flush_writes()  # prefill writes to the compute region land in the background
        for layer in range(self.L):
            sq.drain(layer)
            k, _ = self.history(slot, layer)
            if self.layout.shared_kv:
                packed = k.permute(1, 0, 2).unsqueeze(0)  # [1, Hkv, n, dk]
            else:
                packed = torch.stack((k, torch.cat(self.vals[slot, layer]))).permute(0, 2, 1, 3)  # [2, Hkv, n, dim]
            nb = sq.placed[layer] // D
            assert sq.placed[layer] + sq.win_len[layer] == packed.shape[2]
            for j in range(nb):
                assert torch.equal(block_view(sq, layer, j), packed[:, :, j * D : (j + 1) * D]), f"layer {layer} block {j} {sq.homes[j]}"
            assert torch.equal(sq.window[layer, :, :, : sq.win_len[layer]], packed[:, :, nb * D :]), f"layer {layer} window"

    def snapshot(self, slot: int) -> dict[tuple[int, int], tuple[tuple[int, int], int, torch.Tensor]]:
        """``{(layer, block): (home, data_ptr, bytes)}`` of every placed block. A block just
        evicted to the compute region waits in staging until the next read writes it home
        (once); drain first so the snapshot holds its final bytes."""
        sq = self.seq(slot)
        self.cache.flush_writes()
        snap = {}
        for layer in range(self.L):
            sq.drain(layer)
            for j in range(sq.placed[layer] // self.D):
                view = block_view(sq, layer, j)
                snap[layer, j] = (sq.homes[j], view.data_ptr(), view.clone())
        return snap

    def assert_unmoved(self, slot: int, snap) -> None:
        sq = self.seq(slot)
        for (layer, j), (home, ptr, data) in snap.items():
            assert sq.homes[j] == home, f"block {j} moved from {home} to {sq.homes[j]}"
            view = block_view(sq, layer, j)
            assert view.data_ptr() == ptr, f"layer {layer} block {j}: storage moved"
            assert torch.equal(view, data), f"layer {layer} block {j}: bytes changed"


@pytest.fixture
def make_harness():
    made: list[Harness] = []

    def make(shape=GQA_8_2, **kw) -> Harness:
        h = Harness(*shape, **kw)
        made.append(h)
        return h

    yield make
    for h in made:
        h.close()


def prefill_plan(policy: PlacementPolicy, P: int, D: int) -> tuple[int, int, int]:
    """Expected (compute blocks, load blocks, window tokens) right after a P-token prefill
    (policies.py: floor(r * P / D + 1/2) whole blocks to the compute region, by default the last)."""
    nb = P // D
    n_cpu = min(nb, math.floor(policy.cpu_share(P) * P / D + 0.5))
    if policy.max_cpu_share == 0:
        n_cpu = 0
    return n_cpu, nb - n_cpu, P % D


# ================================================================================= kv lengths
D256 = 256
KV_LENGTHS = [1, 2, 15, 16, 17, D256 - 1, D256, D256 + 1, 4097]


@pytest.mark.parametrize("policy", ["gpu", "cpu", "static:0.5"])
@pytest.mark.parametrize("kv_len", KV_LENGTHS, ids=[f"kv{n}" for n in KV_LENGTHS])
def test_decode_after_prefill_kv_lengths(make_harness, kv_len, policy):
    """Context of kv_len tokens (one prefill), then 3 decode steps (D-1 crosses an eviction)."""
    h = make_harness(window=D256, policy=policy, pingpong_blocks=2)
    slot = h.allocate(kv_len + 3, prompt_len=kv_len)
    h.prefill([slot], [kv_len])
    assert counts(h.seq(slot)) == prefill_plan(h.policy, kv_len, D256)
    h.assert_placement_exact(slot)
    for _ in range(3):
        h.decode([slot])
    h.assert_placement_exact(slot)


@pytest.mark.parametrize("kv_len", [17, 4097], ids=["kv17", "kv4097"])
def test_decode_float32_cache(make_harness, kv_len):
    """The same in a float32 cache (tolerance 1e-5), all three partials present for 4097."""
    h = make_harness(window=D256, policy="static:0.5", dtype=torch.float32, cpu_threads=4)
    slot = h.allocate(kv_len + 2, prompt_len=kv_len)
    h.prefill([slot], [kv_len])
    assert counts(h.seq(slot)) == prefill_plan(h.policy, kv_len, D256)
    h.decode([slot])
    h.decode([slot])


# ================================================================================= CPU shares
SHARE_P = 8 * D256 + 17  # 8 whole blocks + 17 window tokens
SHARES = {"none": 0, "one-block": 1, "half": 4, "all-but-one": 7, "all": 8}


@pytest.mark.parametrize("shape", [GQA_8_2, MLA_SMALL], ids=["gqa8/2", "mla"])
@pytest.mark.parametrize("share", list(SHARES), ids=list(SHARES))
def test_cpu_share_block_counts(make_harness, share, shape):
    """R chosen so the compute region gets exactly n blocks of 8; the counts are asserted so the
    test cannot silently exercise another split. CPU attention split over 4 threads; ping-pong
    of 3 blocks so the load region streams in several runs."""
    n = SHARES[share]
    r = n * D256 / SHARE_P  # floor(r * P / D + 1/2) = n
    h = make_harness(shape, window=D256, policy=StaticPolicy(r), cpu_threads=4, pingpong_blocks=3)
    slot = h.allocate(SHARE_P + 4, prompt_len=SHARE_P)
    h.prefill([slot], [SHARE_P])
    sq = h.seq(slot)
    assert counts(sq) == (n, 8 - n, 17)
    assert [reg for reg, _ in sq.homes] == [LOAD] * (8 - n) + [COMPUTE] * n  # the default plan: compute blocks last
    for _ in range(3):
        h.decode([slot])
    assert counts(sq) == (n, 8 - n, 20)
    h.assert_placement_exact(slot)


# ================================================================================= GQA / MLA
GROUPS = {
    "gqa32/4": (32, KVLayout(4, 32, 32, False)),
    "gqa32/8": (32, KVLayout(8, 32, 32, False)),
    "gqa16/16": (16, KVLayout(16, 32, 32, False)),
    "gqa16/1": (16, KVLayout(1, 32, 32, False)),
    "mla576/512": (16, KVLayout(1, 576, 512, True)),
    "mla24/16": MLA_SMALL,
}


@pytest.mark.parametrize("group", list(GROUPS), ids=list(GROUPS))
def test_head_groups(make_harness, group):
    """P = 3 blocks + 250: prefill plan [C, C, L] + 250 window tokens; 8 decode steps evict the
    window (block 3 -> load) and continue in a fresh window."""
    P = 3 * D256 + 250
    h = make_harness(GROUPS[group], window=D256, policy="static:0.5", cpu_threads=4)
    slot = h.allocate(P + 8, prompt_len=P)
    h.prefill([slot], [P])
    sq = h.seq(slot)
    assert counts(sq) == (2, 1, 250)
    for _ in range(8):
        h.decode([slot])
    assert counts(sq) == (2, 2, 2) and sq.homes[3] == (LOAD, 1)
    h.assert_placement_exact(slot)


# ================================================================================= ragged batches
RAGGED = [1, 8193, 17]


@pytest.mark.parametrize("shape", [GQA_8_2, MLA_FEW_HEADS], ids=["gqa8/2", "mla"])
def test_ragged_batch_window256(make_harness, shape):
    """[1, 8193, 17] prefilled in one ragged pass, then decoded together (float32: 8193 tokens)."""
    h = make_harness(shape, window=D256, policy="static:0.5", dtype=torch.float32, cpu_threads=4)
    slots = [h.allocate(n + 4, prompt_len=n) for n in RAGGED]
    h.prefill(slots, RAGGED)
    assert [counts(h.seq(s)) for s in slots] == [(0, 0, 1), (16, 16, 1), (0, 0, 17)]
    for _ in range(4):
        h.decode(slots)
    for s in slots:
        h.assert_placement_exact(s)


def test_ragged_small_window_many_steps_blocks_never_move(make_harness):
    """D = 16, 2 layers, [1, 8193, 17] decoded together for 2*D + 8 steps: windows are evicted
    mid-test to both regions; every step is checked against the reference and every sequence's
    invariants; blocks placed by the prefill (and by every eviction) keep their home, storage
    and bytes."""
    D, steps = 16, 2 * 16 + 8
    h = make_harness(window=D, policy="static:0.5", dtype=torch.float32, num_layers=2, pingpong_blocks=5)
    slots = [h.allocate(n + steps, prompt_len=n) for n in RAGGED]
    h.prefill(slots, RAGGED)
    assert [counts(h.seq(s), layer) for s in slots for layer in (0, 1)] == [(0, 0, 1)] * 2 + [(256, 256, 1)] * 2 + [(1, 0, 1)] * 2
    snaps = {s: h.snapshot(s) for s in slots}
    prompt_homes = {s: list(h.seq(s).homes) for s in slots}
    for _ in range(steps):
        h.decode(slots)
        for s in slots:
            # blocks placed by evictions are recorded as they appear
            snaps[s] = {**h.snapshot(s), **snaps[s]}
    for s in slots:
        sq = h.seq(s)
        assert sq.homes[: len(prompt_homes[s])] == prompt_homes[s]
        h.assert_unmoved(s, snaps[s])
        h.assert_placement_exact(s)
        assert sq.n_comp[0] == sq.n_comp[1] and sq.n_load[0] == sq.n_load[1] and sq.win_len[0] == sq.win_len[1]
    # the decode evictions went to both regions
    evicted = [reg for s in slots for reg, _ in h.seq(s).homes[len(prompt_homes[s]) :]]
    assert len(evicted) == sum((n + steps) // D - n // D for n in RAGGED) == 6
    assert COMPUTE in evicted and LOAD in evicted, evicted
    assert h.cache.evicted_blocks == 2 * len(evicted)  # both layers


def test_mla_compute_region_longer_than_fallback_chunk(make_harness):
    """MLA CPU attention over a long compute region: 8192, then 8208 tokens (whole chunks of the
    flash op and a tail; the plain-torch path's chunk of 8192 keys when the op cannot be used)."""
    D, P = 16, 8192 + 8
    h = make_harness(MLA_FEW_HEADS, window=D, policy="cpu", dtype=torch.float32)
    slot = h.allocate(P + 10, prompt_len=P)
    h.prefill([slot], [P])
    assert counts(h.seq(slot)) == (512, 0, 8)
    for _ in range(10):
        h.decode([slot])
    assert counts(h.seq(slot)) == (513, 0, 2)


# ================================================================================= CPU / load internals
@pytest.mark.parametrize("kv_heads", [1, 2], ids=["kv1", "kv2"])
@pytest.mark.parametrize("threads", [1, 2, 3, 16], ids=lambda t: f"threads{t}")
def test_cpu_attention_split_over_threads(make_harness, threads, kv_heads):
    """The CPU worker cuts each head's compute-region keys into whole chunks (strided views,
    batched through the flash op) plus a tail that does not fill a chunk, merged by lse, with any
    thread count. 97 blocks of 16 (1552 keys) and, after an eviction, 98 (1568 keys) leave tails."""
    D, P = 16, 97 * 16 + 5
    h = make_harness((4, KVLayout(kv_heads, 16, 16, False)), window=D, policy="cpu", cpu_threads=threads)
    slot = h.allocate(P + 12, prompt_len=P)
    h.prefill([slot], [P])
    assert counts(h.seq(slot)) == (97, 0, 5)
    for _ in range(12):
        h.decode([slot])
    assert counts(h.seq(slot)) == (98, 0, 1)


@pytest.mark.parametrize("buffers,blocks", [(1, 1), (2, 1), (2, 3), (3, 2)], ids=lambda x: str(x))
def test_load_region_streaming_runs(make_harness, buffers, blocks):
    """The load region (41 blocks, in several slabs) streams through ping-pong buffers of a few
    blocks; runs are split at slab edges and at buffer size; the partials are merged."""
    D, P = 16, 40 * 16 + 3
    h = make_harness(window=D, policy="gpu", pingpong_blocks=blocks, pingpong_buffers=buffers)
    slot = h.allocate(P + 16, prompt_len=P)
    h.prefill([slot], [P])
    assert counts(h.seq(slot)) == (0, 40, 3)
    for _ in range(16):
        h.decode([slot])
    sq = h.seq(slot)
    assert counts(sq) == (0, 41, 3) and len(sq.slabs) > 1
    assert len(h.cache.decoder.buffers()) == buffers
    h.assert_placement_exact(slot)


# ================================================================================= dominant token
@pytest.mark.parametrize("shape", [GQA_8_2, MLA_SMALL], ids=["gqa8/2", "mla"])
@pytest.mark.parametrize("where", ["window", "compute", "load"])
def test_dominant_newest_token(make_harness, where, shape):
    """A decode token whose key is the query direction scaled large takes all the attention:
    the output equals its value, while it sits in the D-window and after its window was evicted
    to the compute or the load region (all three partials present, D = 16, static:0.5)."""
    D = 16
    # P = 37: plan [C, L] + 5 window; decode block 2 -> compute.  P = 53: [C, C, L]; block 3 -> load.
    P = 53 if where == "load" else 37
    h = make_harness(shape, window=D, policy="static:0.5")
    q_heads, lay = shape
    G = q_heads // lay.kv_heads
    slot = h.allocate(P + 2 * D, prompt_len=P)
    h.prefill([slot], [P])
    sq = h.seq(slot)
    assert counts(sq) == ((2, 1, 5) if P == 53 else (1, 1, 5))

    qg = h.randn(lay.kv_heads, lay.k_dim, std=2.0)  # one direction per KV group
    q = qg.repeat_interleave(G, dim=0)[None]  # [1, Hq, dk]
    # score of the dominant key = 30 * |q| >= ~50 above the random keys' O(1) scores
    k_dom = (qg / qg.norm(dim=-1, keepdim=True) * 30 * math.sqrt(lay.k_dim))[None]  # [1, Hkv, dk]
    v_dom = None if lay.shared_kv else h.randn(1, lay.kv_heads, lay.v_dim, std=3.0)
    value = k_dom[..., : lay.v_dim] if lay.shared_kv else v_dom  # [1, Hkv, dv]
    expect = value[0].repeat_interleave(G, dim=0).double()  # [Hq, dv]
    pos, block = P, P // D

    def step(k, v):
        out = h.decode([slot], qkv=(q, k, v))[0]
        torch.testing.assert_close(out[0].double(), expect, **TOL[h.dtype])

    step(k_dom, v_dom)
    assert sq.placed[0] <= pos < sq.seq_len(0), "dominant token is in the D-window"
    if where == "window":
        for _ in range(5):  # new random tokens never compete with it
            step(*h.random_kv(1))
        assert sq.placed[0] <= pos, "dominant token is still in the D-window"
        return
    while sq.placed[0] <= pos:
        step(*h.random_kv(1))
    assert sq.homes[block][0] == (COMPUTE if where == "compute" else LOAD)
    for _ in range(3):
        step(*h.random_kv(1))
    assert sq.placed[0] > pos
    h.assert_placement_exact(slot)


# ================================================================================= empty partitions
# D = 16, R = 0.4: prompt -> (compute blocks, load blocks, window tokens)
EMPTY = {
    5: (0, 0, 5),  # window only
    24: (1, 0, 8),  # no load blocks
    16: (0, 1, 0),  # no compute blocks, empty window (context = D)
    32: (1, 1, 0),  # empty window (context = 2 D)
    15: (0, 0, 15),  # window fills and is evicted in the first decode step
    67: (2, 2, 3),  # all three
}


@pytest.mark.parametrize(
    "prompts",
    [[5, 24, 16, 32, 15, 67], [5, 16, 15], [5, 24], [16, 32]],
    ids=["every-kind", "no-compute-in-batch", "no-load-in-batch", "empty-windows"],
)
def test_empty_partitions(make_harness, prompts):
    D = 16
    h = make_harness(window=D, policy=StaticPolicy(0.4), cpu_threads=2)
    slots = [h.allocate(p + 20, prompt_len=p) for p in prompts]
    h.prefill(slots, prompts)
    assert [counts(h.seq(s)) for s in slots] == [EMPTY[p] for p in prompts]
    h.decode(slots)
    for s, p in zip(slots, prompts):
        if p == 15:  # evicted (block 0 -> load at R = 0.4) after the step's attention
            assert counts(h.seq(s)) == (0, 1, 0)
    for _ in range(19):
        h.decode(slots)
    for s in slots:
        h.assert_placement_exact(s)


def test_prefill_of_whole_blocks_then_decode_with_empty_window(make_harness):
    """A batch where every window is empty after prefill and one region is empty per policy."""
    for policy in ("gpu", "cpu"):
        h = make_harness(window=16, policy=policy)
        slots = [h.allocate(p + 17, prompt_len=p) for p in (16, 32)]
        h.prefill(slots, [16, 32])
        assert [counts(h.seq(s))[2] for s in slots] == [0, 0]
        for _ in range(17):
            h.decode(slots)


# ================================================================================= chunked prefill
CHUNKED = {
    # id: (D, prompts, chunks per call (one query length per sequence), counts after prefill)
    "D256-100+500": (256, [600], [[100], [500]], [(1, 1, 88)]),
    "D256-256+256+88": (256, [600], [[256], [256], [88]], [(1, 1, 88)]),
    "D256-17+239+344": (256, [600], [[17], [239], [344]], [(1, 1, 88)]),
    "D16-7+50+43": (16, [100], [[7], [50], [43]], [(3, 3, 4)]),
    "ragged-D256": (256, [600, 300], [[100, 200], [500, 100]], [(1, 1, 88), (1, 0, 44)]),
}


@pytest.mark.parametrize("plan", ["compute-last", "compute-first"])
@pytest.mark.parametrize("case", list(CHUNKED), ids=list(CHUNKED))
def test_chunked_prefill(make_harness, monkeypatch, case, plan):
    """A prompt prefilled in several calls (context_lens > 0): every chunk's outputs equal
    causal attention over all earlier keys; the placement equals the one-pass plan under either
    prompt plan (WRITESCOPE_PROMPT_PLAN); decode follows."""
    monkeypatch.setenv("WRITESCOPE_PROMPT_PLAN", plan)
    D, prompts, chunks, expected = CHUNKED[case]
    h = make_harness(window=D, policy="static:0.5")
    slots = [h.allocate(p + 4, prompt_len=p) for p in prompts]
    for lens in chunks:
        h.prefill(slots, lens)
    assert [counts(h.seq(s)) for s in slots] == expected
    for s, p in zip(slots, prompts):
        n_c, n_l, _ = prefill_plan(h.policy, p, D)
        order = [LOAD] * n_l + [COMPUTE] * n_c if plan == "compute-last" else [COMPUTE] * n_c + [LOAD] * n_l
        assert [reg for reg, _ in h.seq(s).homes] == order
        h.assert_placement_exact(s)
    for _ in range(2):
        h.decode(slots)


# ================================================================================= errors
def test_write_past_capacity_raises_and_leaves_cache_usable(make_harness):
    h = make_harness(window=16, policy="static:0.5")
    a, b = h.allocate(20, prompt_len=18), h.allocate(30, prompt_len=18)
    h.prefill([a, b], [18, 18])
    h.decode([a, b])
    h.decode([a, b])  # a is full (20 tokens)
    q, (k, v) = h.random_q(2), h.random_kv(2)
    batch = ForwardBatch.build([a, b], [1, 1], [20, 20], "cpu")
    with pytest.raises(RuntimeError, match="capacity 20"):
        h.cache.attend(0, q, k, v, batch, h.scale)
    # nothing of the batch was written
    assert (h.cache.seq_len(a), h.cache.seq_len(b)) == (20, 20)
    h.assert_placement_exact(a)
    h.assert_placement_exact(b)
    q, (k, v) = h.random_q(11), h.random_kv(11)
    with pytest.raises(RuntimeError, match="capacity 30"):
        h.cache.attend(0, q, k, v, ForwardBatch.build([b], [11], [20], "cpu"), h.scale)
    assert h.cache.seq_len(b) == 20
    h.decode([b])  # still usable


def test_sliding_window_raises(make_harness):
    h = make_harness(window=16, policy="static:0.5")
    slot = h.allocate(40, prompt_len=20)
    h.prefill([slot], [20])
    q, (k, v) = h.random_q(1), h.random_kv(1)
    with pytest.raises(ValueError, match="sliding_window=8"):
        h.cache.attend(0, q, k, v, ForwardBatch.build([slot], [1], [20], "cpu"), h.scale, sliding_window=8)
    assert h.cache.seq_len(slot) == 20
    h.decode([slot])


@pytest.mark.parametrize("window", [0, -16])
def test_partition_spec_window_must_be_positive(window):
    with pytest.raises(ValueError, match="window"):
        PartitionSpec(GQA_8_2[1], num_layers=1, dtype=torch.float32, window=window)


ACCEPTED = ("resident", "gpu", "cpu", "static:R")


@pytest.mark.parametrize("text", ["foo", "static:1.5", "static:-0.1", "static:nan", "static:abc"])
def test_parse_policy_error_names_accepted_policies(text):
    with pytest.raises(ValueError) as e:
        parse_policy(text)
    msg = str(e.value)
    assert repr(text) in msg and all(name in msg for name in ACCEPTED), msg
    if text.startswith("static:"):
        assert "[0, 1]" in msg, msg


def test_unknown_prompt_len_plans_from_first_write(make_harness):
    """allocate without prompt_len (0 = unknown): the first write is the prompt and follows the
    prefill plan ([L, L, C, C], compute blocks last by default; [C, C, L, L] compute-first), not
    the decode rule's interleaving [C, L, C, L]."""
    h = make_harness(window=16, policy="static:0.5")
    slot = h.allocate(80)  # prompt_len = 0: unknown
    h.prefill([slot], [64])
    assert [reg for reg, _ in h.seq(slot).homes] == [LOAD, LOAD, COMPUTE, COMPUTE]
    for _ in range(3):
        h.decode([slot])


def test_an_error_on_the_device_side_waits_for_the_worker_and_is_the_one_raised(monkeypatch):
    """The thread-pool path (WRITESCOPE_CPU_WORKER=python); the native worker's: test_cpu_worker.py."""
    import time

    monkeypatch.setenv("WRITESCOPE_CPU_WORKER", "python")
    layout, D = KVLayout(2, 8, 8, False), 8
    cache = InplaceKVCache(PartitionSpec(layout, 1, torch.float32, window=D), StaticPolicy(1.0), "cpu")
    g = torch.Generator().manual_seed(0)
    slot = cache.allocate(64, prompt_len=40)
    cache.write(slot, 0, torch.randn(40, 2, 8, generator=g), torch.randn(40, 2, 8, generator=g))
    dec, finished = cache.decoder, []
    real = dec._cpu_part_body

    def slow_cpu(*a):
        time.sleep(0.2)
        out = real(*a)
        finished.append(True)
        return out

    def broken(*a):
        raise RuntimeError("device side failed")

    monkeypatch.setattr(dec, "_cpu_part_body", slow_cpu)
    monkeypatch.setattr(dec, "_window_part", broken)
    fb = ForwardBatch.build([slot], [1], [cache.seq_len(slot)], "cpu")
    with pytest.raises(RuntimeError, match="device side failed"):
        cache.attend(0, torch.randn(1, 4, 8), torch.randn(1, 2, 8), torch.randn(1, 2, 8), fb, 0.1)
    assert finished == [True]  # the worker was done before the error left decode
    cache.close()


def test_pingpong_buffers_from_the_environment(monkeypatch):
    """WRITESCOPE_PINGPONG_BUFFERS sets the spec's default (so the budget, the cache and the
    calibration agree), enters the calibration's machine key, and a bad value is named."""
    from writescope.config import KVLayout
    from writescope.kvcache.spec import PartitionSpec
    from writescope.scheduler.calibrate import machine_key

    layout = KVLayout(kv_heads=2, k_dim=16, v_dim=16, shared_kv=False)
    base_key = machine_key(torch.device("cpu"))
    assert PartitionSpec(layout, 2, torch.float32).pingpong_buffers == 2
    monkeypatch.setenv("WRITESCOPE_PINGPONG_BUFFERS", "6")
    spec = PartitionSpec(layout, 2, torch.float32)
    assert spec.pingpong_buffers == 6 and spec.pingpong_total_bytes() == 6 * spec.pingpong_blocks * spec.block_bytes
    assert PartitionSpec(layout, 2, torch.float32, pingpong_buffers=3).pingpong_buffers == 3  # an explicit count wins
    assert "|6 ping-pong buffers" in machine_key(torch.device("cpu")) and "ping-pong" not in base_key
    for bad in ("0", "many", "65"):
        monkeypatch.setenv("WRITESCOPE_PINGPONG_BUFFERS", bad)
        with pytest.raises(ValueError, match=f"WRITESCOPE_PINGPONG_BUFFERS='{bad}': use an integer from 1 to 64"):
            PartitionSpec(layout, 2, torch.float32)


# ================================================================================= early copies
@pytest.mark.parametrize("shape", [GQA_8_2, MLA_SMALL], ids=["gqa8/2", "mla"])
@pytest.mark.parametrize("buffers,blocks", [(1, 1), (2, 3), (3, 2), (2, 64)], ids=lambda x: str(x))
@pytest.mark.parametrize("policy", ["gpu", "static:0.5"])
def test_early_copies_are_used_and_exact(make_harness, monkeypatch, shape, buffers, blocks, policy):
    """WRITESCOPE_LOAD_COPIES=early: each layer's first fills (one per buffer) are copied at the end
    of the previous layer's load part and used there; outputs stay exact through evictions into the
    load region (window 16, 20 steps from a 3-token tail), over ragged sequences in several slabs."""
    monkeypatch.setenv("WRITESCOPE_LOAD_COPIES", "early")
    D, L = 16, 3
    h = make_harness(shape, window=D, policy=policy, num_layers=L, pingpong_blocks=blocks, pingpong_buffers=buffers)
    assert h.cache.decoder.copies_early
    lens = [40 * D + 3, 17, 5 * D]
    slots = [h.allocate(n + 20, prompt_len=n) for n in lens]
    h.prefill(slots, lens)
    for _ in range(20):
        h.decode(slots)
    st = h.cache.decoder.stats
    # every decode step's layers 1 .. L-1 take their first fills early (at most one per buffer)
    assert st.early_fills >= 20 * (L - 1) and st.early_fills_wasted == 0
    for s in slots:
        h.assert_placement_exact(s)


@pytest.mark.parametrize("mode", ["early", "own-layer"])
def test_the_decoder_says_how_many_tokens_it_copied_early(make_harness, monkeypatch, mode):
    """``last_early_tokens``: the next layer's load-region tokens a decode call copied early (the
    expert split counts them as the link's work in the expert phase): the first fills, at most one
    per buffer, none in the last layer, none without early copies."""
    monkeypatch.setenv("WRITESCOPE_LOAD_COPIES", mode)
    D, L, buffers, blocks = 16, 3, 2, 3
    h = make_harness(window=D, policy="gpu", num_layers=L, pingpong_blocks=blocks, pingpong_buffers=buffers)
    a, b = h.allocate(10 * D + 4, prompt_len=10 * D), h.allocate(2 * D + 4, prompt_len=2 * D)
    h.prefill([a, b], [10 * D, 2 * D])
    dec = h.cache.decoder
    seen = []
    real = dec.decode_begin

    def begin(layer, *args, **kw):
        out = real(layer, *args, **kw)
        seen.append((layer, dec.last_early_tokens, dec.stats.last_load_tokens))
        return out

    monkeypatch.setattr(dec, "decode_begin", begin)
    h.decode([a, b])
    h.decode([a, b])
    assert [x[0] for x in seen] == list(range(L)) * 2
    for layer, early, load in seen:
        assert load > 0
        if mode == "early" and layer + 1 < L:
            assert early == min(load, buffers * blocks * D) and early % D == 0
        else:
            assert early == 0


def test_early_fills_whose_runs_differ_are_copied_again(make_harness, monkeypatch):
    """A fill copied early for other runs (another micro-batch's layer in between, a stale record)
    is copied again, never attended as it is."""
    monkeypatch.setenv("WRITESCOPE_LOAD_COPIES", "early")
    D = 16
    h = make_harness(window=D, policy="gpu", num_layers=2, pingpong_blocks=2, pingpong_buffers=2)
    a, b = h.allocate(10 * D + 20, prompt_len=10 * D), h.allocate(7 * D + 20, prompt_len=7 * D)
    h.prefill([a, b], [10 * D, 7 * D])
    dec = h.cache.decoder
    # one sequence decoded alone: layer 0's load part copies layer 1's first fills for it
    h.decode([a])
    used = dec.stats.early_fills
    assert used == 2 and dec.stats.early_fills_wasted == 0
    # a record for layer 1 of `a`, then layer 1 run over `b`: its ids differ, both fills are copied again
    real = dec._load_part

    def load_part_then_stale(*args, **kw):
        out = real(*args, **kw)
        if dec._early is not None:  # what layer 0 of [b] copied early: claim it was for [a]
            layer, _, keys = dec._early
            dec._early = (layer, (id(h.seq(a)),), keys)
        return out

    monkeypatch.setattr(dec, "_load_part", load_part_then_stale)
    h.decode([b])  # the harness checks every output against float64
    assert dec.stats.early_fills == used and dec.stats.early_fills_wasted == 2
    monkeypatch.setattr(dec, "_load_part", real)
    # keys that differ from the layer's runs (same layer, same sequences): that fill is copied again
    h.decode([a, b])
    fills_before, wasted_before = dec.stats.early_fills, dec.stats.early_fills_wasted

    def tamper(*args, **kw):
        out = real(*args, **kw)
        if dec._early is not None:
            layer, ids, keys = dec._early
            dec._early = (layer, ids, [((0, 0, 1),)] + list(keys[1:]))
        return out

    monkeypatch.setattr(dec, "_load_part", tamper)
    h.decode([a, b])
    assert dec.stats.early_fills_wasted == wasted_before + 1 and dec.stats.early_fills == fills_before + 1
    # the record of a layer that does not come next is dropped at the next call
    dec._early = (5, (), [()])
    monkeypatch.setattr(dec, "_load_part", real)
    h.decode([a, b])
    assert dec.stats.early_fills_wasted == wasted_before + 2


def test_load_copies_auto_by_default_and_bad_values_named(monkeypatch):
    from writescope.attention.split import load_copies_from_env

    monkeypatch.delenv("WRITESCOPE_LOAD_COPIES", raising=False)
    assert load_copies_from_env() == "auto"
    monkeypatch.setenv("WRITESCOPE_LOAD_COPIES", "Early ")
    assert load_copies_from_env() == "early"
    monkeypatch.setenv("WRITESCOPE_LOAD_COPIES", "own-layer")
    assert load_copies_from_env() == "own-layer"
    monkeypatch.setenv("WRITESCOPE_LOAD_COPIES", "soon")
    with pytest.raises(ValueError, match="WRITESCOPE_LOAD_COPIES='soon'"):
        load_copies_from_env()


def test_auto_copies_early_only_from_the_tokens_the_engine_gives(make_harness, monkeypatch):
    """WRITESCOPE_LOAD_COPIES=auto (the default): no early copies until the engine sets
    ``early_from`` (the fewest tokens a step at which the host computes experts mid-layer); then
    only decode calls of at least that many sequences copy early, and outputs stay exact."""
    monkeypatch.delenv("WRITESCOPE_LOAD_COPIES", raising=False)
    D, L = 16, 3
    h = make_harness(window=D, policy="static:0.5", num_layers=L, pingpong_blocks=2, pingpong_buffers=2)
    dec = h.cache.decoder
    assert dec.copies_mode == "auto" and dec.early_from is None and not dec.copies_early
    lens = [9 * D + 3, 6 * D, 4 * D + 1]
    slots = [h.allocate(n + 12, prompt_len=n) for n in lens]
    h.prefill(slots, lens)
    h.decode(slots)
    assert dec.stats.early_fills == 0
    dec.early_from = 3
    assert dec.copies_early
    h.decode(slots[:2])  # two sequences: below early_from
    assert dec.stats.early_fills == 0
    h.decode(slots)  # three: layers 1 .. L-1 take their first fills early
    assert dec.stats.early_fills >= L - 1 and dec.stats.early_fills_wasted == 0
    monkeypatch.setenv("WRITESCOPE_LOAD_COPIES", "own-layer")
    own = make_harness(window=D, policy="static:0.5", num_layers=L, pingpong_blocks=2, pingpong_buffers=2)
    own.cache.decoder.early_from = 1
    assert not own.cache.decoder.copies_early  # own-layer asked for: never early
    for s in slots:
        h.assert_placement_exact(s)


def test_abandon_drops_early_fills_with_nothing_pending(make_harness, monkeypatch):
    """An error between two layers' attention (routing, host experts) leaves no decode pending; the
    cache's abandon still drops the early fills, before the caller frees the sequences."""
    monkeypatch.setenv("WRITESCOPE_LOAD_COPIES", "early")
    D = 16
    h = make_harness(window=D, policy="gpu", num_layers=2, pingpong_blocks=2, pingpong_buffers=2)
    a = h.allocate(6 * D + 4, prompt_len=6 * D)
    h.prefill([a], [6 * D])
    dec = h.cache.decoder
    real = dec._load_part
    kept = []
    monkeypatch.setattr(dec, "_load_part", lambda *a, **k: (real(*a, **k), kept.append(dec._early))[0])
    h.cache.attend(0, h.random_q(1), *h.random_kv(1), ForwardBatch.build([a], [1], [6 * D], "cpu"), h.scale)
    assert kept[-1] is not None and dec._early is not None and not h.cache._pending  # layer 1's fills copied, none pending
    h.cache.abandon()
    assert dec._early is None
