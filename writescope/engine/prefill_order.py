"""The order of an offline chunked prefill's work: layer by layer over a group of passes.

Chunked prefill splits the prompts into passes of up to ``prefill_chunk_tokens`` tokens. Run pass
by pass (``chunk`` order), every pass goes through every layer, and a later pass of a sequence
needs the KV of its earlier passes again at each layer: the partitioned cache reads it back from
host memory (kvcache/inplace.py ``_gather``: the load region's pinned blocks, the compute region's
rows through pinned staging). At 16 x 32K of DeepSeek-V2-Lite in 2,048-token passes that is
122 GB over the link and 1.5-3.7 s of the issuing thread (run 68, benchmarks/results/gpu_decode_h200.md),
for `gpu` and `writescope` alike; it is most of why `writescope`'s prefill trails `gpu`'s.

Run layer by layer (``layer`` order, the default) over a group of passes, layer l of every pass of
the group runs before layer l + 1 of any: when a later pass of a sequence comes to layer l, its
earlier passes' KV of layer l was made on the device moments before, and the cache keeps it
there (``InplaceKVCache.keeping_prefill_kv``) instead of reading it back. The same operations run
on the same inputs in the same order per pass (layer l of pass k needs layer l - 1 of pass k and
layer l of passes before k: both done), so the logits are the same bits. What it costs: the group's
hidden states stay on the device between layers (``GROUP_TOKENS`` tokens x hidden size) with
their rotary tables and one layer's kept KV of those tokens (about 170 MiB for DeepSeek-V2-Lite),
counted in the budget plan's activations (budget/plan.py ``layer_order_bytes``). Under ``resident``
every KV is on the device already and nothing is read back: its passes run one at a time.

A group is a run of consecutive passes of at most ``GROUP_TOKENS`` tokens in all, cut before any
pass whose every sequence has one new token (the model runs those as decode steps: its own
group) and only worth layering where a sequence has two or more passes in it; others run as
before. ``WRITESCOPE_PREFILL_ORDER=chunk`` runs every pass through all layers in turn (the earlier
order, for comparing the two in one run). Only the offline prefill (``LLM.generate``, the CLI's
``generate``, ``bench`` with real prompts) is ordered by layer: ``writescope serve`` interleaves
prefill passes with decode steps, one pass at a time.
"""

from __future__ import annotations

from writescope.env import env_choice

ORDER_ENV = "WRITESCOPE_PREFILL_ORDER"
GROUP_TOKENS = 32768  # the most prompt tokens run layer by layer together (their hidden states stay on the device)


def prefill_order_from_env() -> str:
    """``WRITESCOPE_PREFILL_ORDER``: ``layer`` (the default) or ``chunk``.

    Raises:
        ValueError: another value (names it and the choices).
    """
    return env_choice(ORDER_ENV, ("layer", "chunk"))


def group_passes(passes: list[list[tuple[int, int]]], group_tokens: int = GROUP_TOKENS) -> list[list[int]]:
    """Indices of ``passes`` in groups run together, in order.

    Args:
        passes: per pass, its ``(request, new tokens)`` rows, in the order they run.
        group_tokens: the most tokens of one group (a pass larger than it is a group alone).

    Returns:
        Consecutive runs of pass indices covering every pass once: a group ends before the pass
        that would take it past ``group_tokens`` and around a pass whose rows all have one token
        (a decode-shaped pass, alone).
    """
    groups: list[list[int]] = []
    cur: list[int] = []
    tokens = 0
    for k, rows in enumerate(passes):
        n = sum(t for _, t in rows)
        decode_shaped = all(t == 1 for _, t in rows)
        if cur and (decode_shaped or tokens + n > group_tokens):
            groups.append(cur)
            cur, tokens = [], 0
        if decode_shaped:
            groups.append([k])
            continue
        cur.append(k)
        tokens += n
    if cur:
        groups.append(cur)
    return groups


def layered(group: list[int], passes: list[list[tuple[int, int]]]) -> bool:
    """Whether ``group`` gains from running layer by layer: some request has rows in two or more
    of its passes (otherwise no pass needs another's KV of the group)."""
    seen: set[int] = set()
    for k in group:
        for req, _ in passes[k]:
            if req in seen:
                return True
        seen.update(req for req, _ in passes[k])
    return False
