"""The offline prefill's passes run layer by layer over a group (engine/prefill_order.py,
``CausalLM.forward_by_layer``, ``InplaceKVCache.keeping_prefill_kv``): the same logits, the same
placement and the same tokens as pass after pass, with the earlier KV of a group's sequences
taken from the device instead of read back from host memory."""

from __future__ import annotations

import pytest
import torch

import writescope.engine.prefill_order as prefill_order
from writescope import LLM, SamplingParams
from writescope.engine.prefill_order import group_passes, layered, prefill_order_from_env
from writescope.engine.runner import pack_passes
from writescope.kvcache.inplace import InplaceKVCache

D = 16
PROMPTS = (1, 15, 16, 17, 97, 33)  # ragged; 33 in passes of 16 ends with a one-token pass


def _prompts(lengths=PROMPTS):
    return [[(7 * i + 3 * j) % 500 + 5 for i in range(n)] for j, n in enumerate(lengths)]


def test_passes_pack_the_prompts_in_order():
    """Up to ``chunk`` tokens a pass, across the prompts in order; each row's start is the tokens
    of its prompt before the pass."""
    passes, starts = pack_passes([20, 5, 40], 16)
    assert passes == [[(0, 16)], [(0, 4), (1, 5), (2, 7)], [(2, 16)], [(2, 16)], [(2, 1)]]
    assert starts == [[0], [16, 0, 0], [7], [23], [39]]


def test_groups_stop_at_the_token_cap_and_keep_decode_shaped_passes_alone():
    passes = [[(0, 16)], [(0, 4), (1, 12)], [(1, 16)], [(1, 1)], [(2, 16)], [(2, 16)], [(2, 40)], [(2, 2)]]
    assert group_passes(passes, group_tokens=32) == [[0, 1], [2], [3], [4, 5], [6], [7]]
    assert group_passes(passes, group_tokens=10**6) == [[0, 1, 2], [3], [4, 5, 6, 7]]
    assert group_passes([[(0, 1), (1, 1)]], group_tokens=32) == [[0]]
    assert layered([0, 1], passes) and not layered([4], passes) and layered([4, 5], passes)
    assert not layered([0, 4], passes)  # no request in both passes: nothing to keep


@pytest.mark.parametrize("policy", ["resident", "gpu", "cpu", "static:0.5", "writescope"])
@pytest.mark.parametrize("preset", ["tiny-deepseek-v2", "tiny-qwen3-moe"])
def test_layer_by_layer_gives_the_same_logits_placement_and_tokens(policy, preset, monkeypatch):
    """Both orders on the same weights and prompts: the prefill's last-token logits are the same
    bits, every sequence's blocks sit in the same regions, and greedy decoding gives the same
    tokens; layer by layer, the partitioned cache reads no earlier KV back within a group."""
    results = {}
    for order in ("chunk", "layer"):
        monkeypatch.setenv("WRITESCOPE_PREFILL_ORDER", order)
        llm = LLM(preset, progress=False, policy=policy, window=D, prefill_chunk_tokens=16)
        outs = llm.generate(prompt_token_ids=_prompts(), sampling_params=SamplingParams(max_tokens=6, ignore_eos=True))
        cache = llm.cache
        slots = [cache.allocate(n + 2, prompt_len=n) for n in PROMPTS]
        logits = llm._prefill(_prompts(), slots)
        placed = [cache.placement(s) for s in slots] if isinstance(cache, InplaceKVCache) else None
        read = cache.prefill_readback() if isinstance(cache, InplaceKVCache) else None
        results[order] = ([o.token_ids for o in outs], logits, placed, read, [c.get("passes") for c in llm.prefill_chunks])
        for s in slots:
            cache.free(s)
    (tok_c, log_c, pl_c, rb_c, _), (tok_l, log_l, pl_l, rb_l, groups) = results["chunk"], results["layer"]
    assert tok_l == tok_c
    torch.testing.assert_close(log_l, log_c, rtol=0, atol=0)
    assert pl_l == pl_c
    assert max(groups) > 1 if policy != "resident" else max(groups) == 1  # resident: nothing to keep, one pass at a time
    if rb_c is not None:
        assert rb_c["bytes"] > 0 and rb_c["kept_bytes"] == 0
        # one group (all prompts fit GROUP_TOKENS): every earlier KV came from the device
        assert rb_l["bytes"] == 0 and rb_l["kept_bytes"] > 0
        assert rb_l["kept_bytes"] == rb_c["bytes"]  # exactly what chunk order read back


@pytest.mark.parametrize("policy", ["static:0.5", "gpu"])
def test_groups_smaller_than_a_prompt_read_back_across_groups(policy, monkeypatch):
    """A prompt split across groups: its first pass in a later group reads its earlier KV back
    (nothing kept crosses a group), later passes in the group take it from the device, and the
    logits still equal pass-after-pass's."""
    import writescope.engine.runner as runner

    monkeypatch.setattr(runner, "group_passes", lambda passes: prefill_order.group_passes(passes, 40))
    prompts = _prompts((97, 50))
    want = None
    for order in ("chunk", "layer"):
        monkeypatch.setenv("WRITESCOPE_PREFILL_ORDER", order)
        llm = LLM("tiny-deepseek-v2", progress=False, policy=policy, window=D, prefill_chunk_tokens=16)
        slots = [llm.cache.allocate(len(p) + 2, prompt_len=len(p)) for p in prompts]
        logits = llm._prefill(prompts, slots)
        rb = llm.cache.prefill_readback()
        assert llm.cache._kept is None  # nothing kept after the prefill
        if want is None:
            want, chunk_rb = logits, rb
        else:
            torch.testing.assert_close(logits, want, rtol=0, atol=0)
            assert 0 < rb["bytes"] < chunk_rb["bytes"] and rb["kept_bytes"] > 0
            assert rb["bytes"] + rb["kept_bytes"] == chunk_rb["bytes"]
            assert [c["passes"] for c in llm.prefill_chunks][:3] == [2, 2, 2]  # 16 + 16 tokens a group


def test_only_a_sequence_with_a_later_pass_in_the_group_is_kept(monkeypatch):
    """Passes [A 16] [A 16] | [A 8 + B 8] [B 16] | [B 16] in groups of 32 tokens: A goes on past
    the first group, but nothing of A's is kept after its last pass there (no later pass of the
    group would take it: it would be held unused until the group ends), so what is kept at any
    time is the KV of sequences with a pass still to come in the group, one layer each."""
    import writescope.engine.runner as runner

    monkeypatch.setenv("WRITESCOPE_PREFILL_ORDER", "layer")
    monkeypatch.setattr(runner, "group_passes", lambda passes: prefill_order.group_passes(passes, 32))
    llm = LLM("tiny-qwen3-moe", progress=False, policy="static:0.5", window=D, prefill_chunk_tokens=16)
    cache = llm.cache
    seen, real = [], cache.keep_for

    def spy(slots):
        seen.append((dict(cache._kept), set(cache._keep_slots)))  # what the pass before left, and who it kept for
        real(slots)

    monkeypatch.setattr(cache, "keep_for", spy)
    prompts = _prompts((40, 40))
    slots = [cache.allocate(42, prompt_len=40) for _ in prompts]
    llm._prefill(prompts, slots)
    assert [c["passes"] for c in llm.prefill_chunks] == [2, 2, 1]
    assert len(seen) == 4 * llm.config.num_layers  # two layered groups of two passes
    for kept, keep_slots in seen:
        assert set(kept) <= keep_slots and len(kept) <= 1, (kept, keep_slots)
    assert any(kept for kept, _ in seen)  # something was kept


def test_a_freed_sequence_drops_what_was_kept():
    llm = LLM("tiny-qwen3-moe", progress=False, policy="static:0.5", window=D)
    cache = llm.cache
    slot = cache.allocate(40, prompt_len=32)
    with cache.keeping_prefill_kv():
        cache._kept[slot] = (0, torch.zeros(1))
        cache.free(slot)
        assert slot not in cache._kept
        with pytest.raises(RuntimeError, match="already active"):
            with cache.keeping_prefill_kv():
                pass
    assert cache._kept is None


def test_forward_by_layer_refuses_a_decode_shaped_pass():
    from writescope.attention.metadata import ForwardBatch

    llm = LLM("tiny-qwen3-moe", progress=False, policy="gpu", window=D)
    slot = llm.cache.allocate(8, prompt_len=4)
    batch = ForwardBatch.build([slot], [1], [0], llm.device)
    with pytest.raises(ValueError, match="decode step"):
        llm.model.forward_by_layer([(torch.tensor([5]), batch)], llm.cache)


@pytest.mark.parametrize("value", ["layers", "1", ""])
def test_a_bad_order_names_the_value(value, monkeypatch):
    monkeypatch.setenv("WRITESCOPE_PREFILL_ORDER", value)
    if value == "":
        with pytest.raises(ValueError, match="WRITESCOPE_PREFILL_ORDER=''"):
            prefill_order_from_env()
        return
    with pytest.raises(ValueError, match=f"WRITESCOPE_PREFILL_ORDER='{value}'.*'layer'.*'chunk'"):
        prefill_order_from_env()
    with pytest.raises(ValueError, match="WRITESCOPE_PREFILL_ORDER"):  # before any weight loads
        LLM("tiny-qwen3-moe", progress=False, policy="gpu", window=D)


def test_the_default_is_layer_order(monkeypatch):
    monkeypatch.delenv("WRITESCOPE_PREFILL_ORDER", raising=False)
    assert prefill_order_from_env() == "layer"


@pytest.mark.gpu
@pytest.mark.parametrize("policy", ["static:0.5", "gpu"])
def test_layer_by_layer_on_cuda_gives_the_same_logits(policy, monkeypatch):
    """On CUDA (bf16, the prefill writer's staging and streams): both orders give the same
    last-token logits, and layer by layer reads nothing back within the group."""
    prompts = _prompts((97, 50, 33))
    got = {}
    for order in ("chunk", "layer"):
        monkeypatch.setenv("WRITESCOPE_PREFILL_ORDER", order)
        llm = LLM("tiny-deepseek-v2", device="cuda", dtype="bfloat16", progress=False, policy=policy, window=D, prefill_chunk_tokens=16)
        slots = [llm.cache.allocate(len(p) + 2, prompt_len=len(p)) for p in prompts]
        got[order] = (llm._prefill(prompts, slots).cpu(), llm.cache.prefill_readback())
    # the experts' float32 sums are atomic adds on CUDA, in no fixed order: equal within their rounding
    torch.testing.assert_close(got["layer"][0], got["chunk"][0], rtol=1e-2, atol=1e-2)
    assert got["layer"][1]["bytes"] == 0 and got["layer"][1]["kept_bytes"] == got["chunk"][1]["bytes"] > 0


def test_the_plan_counts_the_group_s_hidden_states_and_kept_kv(monkeypatch):
    """budget/plan.py: layer by layer, the activations grow by the group's hidden states, rotary
    tables and one layer's KV (DeepSeek-V2-Lite, 16 x 32K in passes of 2,048: a group of 32,768
    tokens); nothing where the prefill is one pass or runs pass after pass."""
    from writescope.budget.plan import make_plan
    from writescope.kvcache.spec import PartitionSpec
    from writescope.presets import preset_config
    from writescope.scheduler.policies import StaticPolicy

    cfg = preset_config("deepseek-v2-lite")
    plans = {}
    for order in ("layer", "chunk"):
        monkeypatch.setenv("WRITESCOPE_PREFILL_ORDER", order)
        plans[order] = [make_plan(cfg, torch.bfloat16, 32 * 2**30, b, c, 256, StaticPolicy(0.5), prefill_chunk_tokens=2048)
                        for b, c in ((16, 32768), (1, 2000))]
    token_bytes = PartitionSpec(cfg.kv_layout, cfg.num_layers, torch.bfloat16).token_bytes
    extra = plans["layer"][0].activations - plans["chunk"][0].activations
    assert extra == 32768 * (cfg.hidden_size * 2 + cfg.rope.dim * 4 + token_bytes) > 128 * 2**20
    assert plans["layer"][1].activations == plans["chunk"][1].activations  # 2,000 tokens: one pass
    # a prompt longer than a group keeps up to its whole context of one layer; resident keeps nothing
    monkeypatch.setenv("WRITESCOPE_PREFILL_ORDER", "layer")
    long = [make_plan(cfg, torch.bfloat16, 32 * 2**30, 1, 131072, 256, pol, prefill_chunk_tokens=2048) for pol in (StaticPolicy(0.5), None)]
    monkeypatch.setenv("WRITESCOPE_PREFILL_ORDER", "chunk")
    long_chunk = [make_plan(cfg, torch.bfloat16, 32 * 2**30, 1, 131072, 256, pol, prefill_chunk_tokens=2048) for pol in (StaticPolicy(0.5), None)]
    assert long[0].activations - long_chunk[0].activations == 32768 * (cfg.hidden_size * 2 + cfg.rope.dim * 4) + 131072 * token_bytes
    assert long[1].activations == long_chunk[1].activations


def test_the_order_is_read_once_at_load_and_a_server_plans_without_it(monkeypatch):
    """``LLM(prefill_order=...)`` overrides the environment and is what its prefill and its budget
    plan use (a later change of the environment changes neither); ``writescope serve`` passes
    ``chunk`` (its passes run one at a time), so its plan counts no group; a bad value is named."""
    import writescope.cli.serve as serve_cli
    from writescope.errors import ArgError

    monkeypatch.setenv("WRITESCOPE_PREFILL_ORDER", "layer")
    args = dict(progress=False, policy="static:0.5", window=D, prefill_chunk_tokens=16, vram_budget="4GiB", max_batch=4, max_model_len=512)
    layer = LLM("tiny-qwen3-moe", **args)
    chunk = LLM("tiny-qwen3-moe", prefill_order="chunk", **args)
    assert (layer.prefill_order, chunk.prefill_order) == ("layer", "chunk")
    assert chunk.vram_plan.activations < layer.vram_plan.activations
    monkeypatch.setenv("WRITESCOPE_PREFILL_ORDER", "chunk")
    prompts = _prompts((40,))
    layer._prefill(prompts, [layer.cache.allocate(42, prompt_len=40)])
    assert [c["passes"] for c in layer.prefill_chunks] == [3]  # still by layer: the order it was loaded with
    from types import SimpleNamespace

    import writescope

    given = {}

    def fake_llm(*a, **kw):  # what serve's loader asks for; refused, so nothing loads
        given.update(kw)
        raise RuntimeError("not loaded in this test")

    monkeypatch.setattr(writescope, "LLM", fake_llm)
    names = ("synthetic", "device", "dtype", "weight_seed", "max_model_len", "prefill_chunk_tokens", "policy", "window",
             "cpu_threads", "vram_budget", "max_num_seqs", "expert_threads", "expert_stream_share")
    state, server = SimpleNamespace(load_error=None, closing=False), SimpleNamespace(should_exit=False)
    serve_cli._load(SimpleNamespace(model="tiny-qwen3-moe", **dict.fromkeys(names)), state, server)
    assert given["prefill_order"] == "chunk" and "not loaded" in state.load_error and server.should_exit
    with pytest.raises(ArgError, match="prefill_order must be 'layer' or 'chunk'.*'rows'"):
        LLM("tiny-qwen3-moe", prefill_order="rows", progress=False)
