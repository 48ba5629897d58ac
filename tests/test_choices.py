"""``SamplingParams.n`` (several choices per prompt), ``include_stop_str_in_output``,
``stop_reason`` and ``cumulative_logprob`` in offline ``LLM.generate`` (writescope/engine/choices.py,
outputs.py, stop_strings.py), over the tiny preset on the CPU.

References are the engine's own single-choice runs: choice i of a seeded request must generate
what a request of one choice seeded ``seed + i`` does, greedy choices what greedy decoding does.
Stop strings are cut out of the greedy reference text (tests/stop_helpers.py), so nothing
depends on what the synthetic model happens to say.
"""

from __future__ import annotations

import math

import pytest

from writescope import LLM, SamplingParams
from writescope.engine.choices import expand, expand_batch, group
from writescope.engine.outputs import CompletionOutput
from writescope.engine.request import Request
from writescope.engine.stop_strings import StopStrings
from writescope.errors import ArgError
from stop_helpers import inner_stop, spanning_stop

MODEL = "tiny-qwen3-moe"
PROMPT = "hello"
NEW = 24  # greedy reference length
NEVER = "\x00never\x00"  # a stop string the model does not produce


@pytest.fixture(scope="module")
def llm():
    return LLM(MODEL, device="cpu", progress=False, max_model_len=2048)


@pytest.fixture(scope="module")
def greedy(llm):
    out = llm.generate([PROMPT], SamplingParams(max_tokens=NEW))[0]
    assert out.finish_reason == "length"  # the references below need all NEW tokens
    return out


# ---------------------------------------------------------------- SamplingParams
def test_sampling_params_check_n_and_include_stop_str_in_output():
    assert SamplingParams(n=16).n == 16 and SamplingParams().n == 1
    for bad in (0, 17, -1, True, 2.0, None):
        with pytest.raises(ArgError, match=r"^n \(choices per prompt\) must be an integer in \[1, 16\], got ") as e:
            SamplingParams(n=bad)
        assert e.value.names == ("n",)
    assert SamplingParams(stop="x", include_stop_str_in_output=True).include_stop_str_in_output
    for bad in (1, "yes", None):
        with pytest.raises(ArgError, match="^include_stop_str_in_output must be True or False") as e:
            SamplingParams(include_stop_str_in_output=bad)
        assert e.value.names == ("include_stop_str_in_output",)


def test_expand_seeds_choice_i_with_seed_plus_i():
    sp = SamplingParams(temperature=1.0, seed=5, n=3, max_tokens=4)
    choices = expand(sp)
    assert [c.seed for c in choices] == [5, 6, 7] and all(c.n == 1 for c in choices)
    assert all(c == SamplingParams(temperature=1.0, seed=5 + i, max_tokens=4) for i, c in enumerate(choices))
    assert [c.seed for c in expand(SamplingParams(n=2))] == [None, None]
    one = SamplingParams(seed=3)
    assert expand(one) == [one]
    flat = expand_batch([SamplingParams(n=2), SamplingParams(), SamplingParams(n=3, seed=1)])
    assert [(i, c, p.seed) for i, c, p in flat] == [(0, 0, None), (0, 1, None), (1, 0, None), (2, 0, 1), (2, 1, 2), (2, 2, 3)]
    assert group(flat, "abcdef") == [["a", "b"], ["c"], ["d", "e", "f"]]


# ---------------------------------------------------------------- n in LLM.generate
def test_greedy_n_gives_equal_choices_one_output_per_prompt(llm, greedy):
    outs = llm.generate([PROMPT, [5, 6, 7]], [SamplingParams(max_tokens=8, n=3), SamplingParams(max_tokens=4, ignore_eos=True)])
    assert len(outs) == 2 and len({o.request_id for o in outs}) == 2
    first, second = outs
    assert [c.index for c in first.outputs] == [0, 1, 2]
    assert all(isinstance(c, CompletionOutput) for c in first.outputs)
    assert [c.token_ids for c in first.outputs] == [greedy.token_ids[:8]] * 3
    assert [c.text for c in first.outputs] == [llm.tokenizer.decode(greedy.token_ids[:8])] * 3
    c0 = first.outputs[0]  # the output's own fields are choice 0's
    assert (first.text, first.token_ids, first.finish_reason, first.stop_reason) == (c0.text, c0.token_ids, c0.finish_reason,
                                                                                   c0.stop_reason)
    assert first.metrics is c0.metrics and first.metrics.output_tokens == 8 and first.prompt == PROMPT
    assert [c.metrics.output_tokens for c in first.outputs] == [8, 8, 8]
    assert [c.index for c in second.outputs] == [0] and len(second.token_ids) == 4 and second.prompt_token_ids == [5, 6, 7]
    assert first.to_dict()["outputs"][2]["token_ids"] == greedy.token_ids[:8]


def test_sampled_choice_i_equals_a_single_choice_run_with_seed_plus_i(llm):
    many = llm.generate([PROMPT], SamplingParams(max_tokens=10, temperature=1.0, seed=7, n=3))[0].outputs
    singles = llm.generate([PROMPT] * 3, [SamplingParams(max_tokens=10, temperature=1.0, seed=7 + i) for i in range(3)])
    assert [c.token_ids for c in many] == [s.token_ids for s in singles]
    assert [c.text for c in many] == [s.text for s in singles]
    assert len({tuple(c.token_ids) for c in many}) > 1  # seeds 7, 8, 9: not all the same
    # without a seed: the engine's seed + the choice's index among the batch's choices
    unseeded = llm.generate([PROMPT, "x"], [SamplingParams(max_tokens=10, temperature=1.0, n=2), SamplingParams(max_tokens=3)])
    flat = llm.generate([PROMPT, PROMPT, "x"], [SamplingParams(max_tokens=10, temperature=1.0)] * 2 + [SamplingParams(max_tokens=3)])
    assert [c.token_ids for c in unseeded[0].outputs] == [flat[0].token_ids, flat[1].token_ids]
    assert unseeded[1].token_ids == flat[2].token_ids


def test_on_tokens_events_name_the_prompt_and_the_choice(llm):
    events = []
    outs = llm.generate([PROMPT, "x"], [SamplingParams(max_tokens=3, n=2, ignore_eos=True, temperature=1.0, seed=1),
                                        SamplingParams(max_tokens=2, ignore_eos=True)], on_tokens=events.extend)
    got: dict[tuple[int, int], list[int]] = {}
    for e in events:
        got.setdefault((e.index, e.choice), []).append(e.token_id)
    assert got == {(0, 0): outs[0].outputs[0].token_ids, (0, 1): outs[0].outputs[1].token_ids, (1, 0): outs[1].token_ids}
    assert sorted((e.index, e.choice) for e in events if e.finish_reason == "length") == [(0, 0), (0, 1), (1, 0)]


def test_n_choices_each_count_in_the_memory_check(llm, monkeypatch):
    seen, real = [], llm._check_memory
    monkeypatch.setattr(llm, "_check_memory", lambda caps: (seen.append(list(caps)), real(caps))[1])
    llm.generate([[5, 6, 7], [8]], [SamplingParams(max_tokens=4, n=3), SamplingParams(max_tokens=2)])
    assert seen == [[7, 7, 7, 3]]
    with pytest.raises(ValueError, match=r"prompts\[0\] has 3 tokens \+ max_tokens 2,046 = 2,049"):
        llm.generate([[5, 6, 7]], SamplingParams(max_tokens=2046, n=2))
    assert llm.cache.active_slots == []


# ---------------------------------------------------------------- include_stop_str_in_output and stop_reason
def test_stop_strings_kept_in_the_text_are_not_held_back(llm, greedy):
    tok = llm.tokenizer
    stop, n_tokens, before = spanning_stop(tok, greedy.token_ids)
    s = StopStrings(tok.decode, (NEVER, stop), include=True)
    out = ""
    for t in greedy.token_ids:
        if s.push(t):
            break
        out += s.take(final=False)
        assert out == s.detok.text  # nothing held back: text already seen can only be followed by a stop string
    out += s.take(final=True)
    assert (out, s.text, s.matched) == (before + stop, before + stop, stop)


def test_offline_stop_reason_and_include_stop_str_in_output(llm, greedy):
    tok = llm.tokenizer
    stop, n_tokens, before = spanning_stop(tok, greedy.token_ids)
    inner, n_inner, before_inner = inner_stop(tok, greedy.token_ids, 1)
    stop_tok = greedy.token_ids[5]
    k = greedy.token_ids.index(stop_tok)  # it ends at the first one
    outs = llm.generate([PROMPT] * 5, [SamplingParams(max_tokens=NEW, stop=stop),
                                       SamplingParams(max_tokens=NEW, stop=stop, include_stop_str_in_output=True),
                                       SamplingParams(max_tokens=NEW, stop=[NEVER, inner], include_stop_str_in_output=True),
                                       SamplingParams(max_tokens=NEW, stop_token_ids=[stop_tok]),
                                       SamplingParams(max_tokens=NEW, stop=NEVER, include_stop_str_in_output=True)])
    got = [(o.text, o.finish_reason, o.stop_reason, len(o.token_ids)) for o in outs]
    assert got[0] == (before, "stop", stop, n_tokens)
    assert got[1] == (before + stop, "stop", stop, n_tokens)
    assert got[2] == (before_inner + inner, "stop", inner, n_inner)  # the rest of the token's text is still cut
    assert got[3] == (tok.decode(greedy.token_ids[: k + 1]), "stop", stop_tok, k + 1)
    assert got[4] == (greedy.text, "length", None, NEW)
    assert [o.outputs[0].stop_reason for o in outs] == [stop, stop, inner, stop_tok, None]
    # with n: every choice names its stop
    many = llm.generate([PROMPT], SamplingParams(max_tokens=NEW, stop=stop, include_stop_str_in_output=True, n=2))[0]
    assert [(c.text, c.stop_reason) for c in many.outputs] == [(before + stop, stop)] * 2


def test_stop_reason_of_an_end_token_is_none_of_a_stop_token_its_id():
    """vLLM's stop_reason: an end-of-sequence token is no stop reason, a stop_token_ids token is
    (also when it is an end token too: it was asked for)."""
    eos = 2
    r = Request("r", [1], SamplingParams(stop_token_ids=(9,)), output_ids=[5, eos], finish_reason="stop")
    assert r.stop_reason is None
    r = Request("r", [1], SamplingParams(stop_token_ids=(9, eos)), output_ids=[5, eos], finish_reason="stop")
    assert r.stop_reason == eos
    r = Request("r", [1], SamplingParams(stop_token_ids=(5,)), output_ids=[5], finish_reason="length")
    assert r.stop_reason is None


# ---------------------------------------------------------------- cumulative_logprob
def test_cumulative_logprob_is_the_sum_of_the_sampled_tokens_logprobs(llm, greedy):
    """With logprobs: the sum of the logprobs each choice carries (every token's, the one completing
    a stop string included), whatever the top count; None without logprobs, in the same batch."""
    stop, n_tokens, _ = spanning_stop(llm.tokenizer, greedy.token_ids)
    outs = llm.generate([PROMPT] * 5, [SamplingParams(max_tokens=NEW, logprobs=0),
                                       SamplingParams(max_tokens=NEW, logprobs=5),
                                       SamplingParams(max_tokens=NEW, temperature=1.3, seed=4, n=2, logprobs=2),
                                       SamplingParams(max_tokens=NEW, stop=stop, logprobs=1),
                                       SamplingParams(max_tokens=NEW, temperature=1.0, seed=1, n=2)])
    with_lps = [c for o in outs[:4] for c in o.outputs]
    for c in with_lps:
        assert [lp.token_id for lp in c.logprobs] == c.token_ids
        assert c.cumulative_logprob == pytest.approx(math.fsum(lp.logprob for lp in c.logprobs), rel=1e-6, abs=1e-6)
        assert c.cumulative_logprob < 0
    assert len(outs[3].outputs[0].logprobs) == n_tokens  # ended by the stop string: its completing token counts
    assert outs[0].cumulative_logprob == pytest.approx(outs[1].cumulative_logprob, rel=1e-6)  # the sampled tokens' alone
    sampled = outs[2].outputs
    assert sampled[0].token_ids != sampled[1].token_ids and sampled[0].cumulative_logprob != sampled[1].cumulative_logprob
    assert [o.cumulative_logprob for o in outs] == [o.outputs[0].cumulative_logprob for o in outs]  # the output's: choice 0's
    assert outs[0].to_dict()["outputs"][0]["cumulative_logprob"] == outs[0].cumulative_logprob
    assert [(c.logprobs, c.cumulative_logprob) for c in outs[4].outputs] == [(None, None)] * 2 and outs[4].cumulative_logprob is None
