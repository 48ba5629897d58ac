"""``stop`` strings, ``n`` choices and ``logprobs`` in ``writescope serve`` (writescope/serve/) and
in the engine under it (SamplingParams.stop / .logprobs), on a real loopback server over the tiny
preset.

References come from a second, independent ``LLM`` of the same preset (the same seeded synthetic
weights), so they can be computed at any time while the served model belongs to the engine thread:
offline ``generate`` for texts and tokens, and the model's own prefill logits (one prefill per
position, not the engine's decode step or sampler) for logprobs. Stop strings are cut out of the
greedy reference text (one spanning two tokens, one inside a token), so nothing depends on what
the synthetic model happens to say. No test depends on timing: waits poll a condition.
"""

from __future__ import annotations

import logging
import re
import threading

import pytest

pytest.importorskip("fastapi")
httpx = pytest.importorskip("httpx")

import torch  # noqa: E402

from writescope import LLM, SamplingParams  # noqa: E402
from writescope.engine.stop_strings import StopStrings  # noqa: E402
from writescope.errors import ArgError  # noqa: E402
from writescope.serve.app import ServerState, build_app  # noqa: E402
from writescope.serve.async_engine import AsyncEngine, RequestStream  # noqa: E402
from writescope.serve.chat_template import ChatTemplate  # noqa: E402
from writescope.serve.server import ServerThread  # noqa: E402
from serve_helpers import (MODEL, WAIT_S, complete, held_engine, metrics, per_choice, post, sse,  # noqa: E402
                           stream, wait_until)
from stop_helpers import inner_stop, spanning_stop, stop_at_a_token_start, token_texts  # noqa: E402

from serve_fixtures import CHAT, MAX_LEN, NEVER, NEW, PROMPT, greedy, llm, ref_llm, server  # noqa: E402,F401


# ---------------------------------------------------------------- helpers
def reference_logprobs(ref_llm, prompt_ids: list[int], out_ids: list[int]) -> torch.Tensor:
    """``[len(out_ids), vocab]``: log_softmax of the model's logits for each output position,
    each from a prefill of the prompt and the output before it (the model's forward alone: not
    the engine's decode step, nor its sampler or logprob code)."""
    rows, real = [], ref_llm._prefill

    def capture(ids, slots):
        logits = real(ids, slots)
        rows.append(logits[0].float().clone())
        return logits

    ref_llm._prefill = capture
    try:
        for j in range(len(out_ids)):
            ref_llm.generate(prompt_token_ids=[prompt_ids + out_ids[:j]], sampling_params=SamplingParams(max_tokens=1))
    finally:
        del ref_llm._prefill  # the class's method again
    return torch.log_softmax(torch.stack(rows), dim=-1)


# ---------------------------------------------------------------- the engine alone
def test_stop_strings_hold_back_what_a_stop_string_may_claim(ref_llm, greedy):
    """Token by token, take() never hands out text past where the stop string starts, and the
    pieces concatenate to the text before it."""
    tok = ref_llm.tokenizer
    stop, n_tokens, before = spanning_stop(tok, greedy.token_ids)
    s = StopStrings(tok.decode, (NEVER, stop))
    out, stopped_at = "", None
    for i, t in enumerate(greedy.token_ids):
        if s.push(t):
            stopped_at = i + 1
            break
        out += s.take(final=False)
        assert before.startswith(out), (out, before)
        assert len(out) <= len(s.detok.text) - (len(NEVER) - 1) or out == ""  # the longest stop's length - 1 held back
    out += s.take(final=True)
    assert (stopped_at, out, s.text, s.matched) == (n_tokens, before, before, stop)
    # never matched: everything comes out at the end
    s = StopStrings(tok.decode, (NEVER,))
    pieces = [s.take(final=False) for t in greedy.token_ids if not s.push(t)]
    assert "".join(pieces) + s.take(final=True) == greedy.text and not s.stopped


def test_sampling_params_check_stop_and_logprobs():
    assert SamplingParams(stop="x").stop == ("x",)
    assert SamplingParams(stop=["a", "b"]).stop == ("a", "b")
    assert SamplingParams(stop=None).stop == ()
    for bad in ("", ["a", ""], 5):
        with pytest.raises(ArgError, match="stop"):
            SamplingParams(stop=bad)
    for bad in (-1, 21, True, 2.0):
        with pytest.raises(ArgError, match="logprobs"):
            SamplingParams(logprobs=bad)


def test_offline_generate_with_stop_and_logprobs(ref_llm, greedy):
    tok = ref_llm.tokenizer
    stop, n_tokens, before = spanning_stop(tok, greedy.token_ids)
    inner, n_inner, before_inner = inner_stop(tok, greedy.token_ids, 1)
    outs = ref_llm.generate([PROMPT] * 3, [SamplingParams(max_tokens=NEW, stop=stop),
                                           SamplingParams(max_tokens=NEW, stop=[NEVER, inner]),
                                           SamplingParams(max_tokens=NEW, stop=NEVER, logprobs=2)])
    assert (outs[0].text, outs[0].finish_reason, outs[0].token_ids) == (before, "stop", greedy.token_ids[:n_tokens])
    assert (outs[1].text, outs[1].finish_reason, len(outs[1].token_ids)) == (before_inner, "stop", n_inner)
    assert (outs[2].text, outs[2].finish_reason, outs[2].token_ids) == (greedy.text, "length", greedy.token_ids)
    assert outs[0].logprobs is None
    lps = outs[2].logprobs
    assert [lp.token_id for lp in lps] == greedy.token_ids and all(len(lp.top) == 2 for lp in lps)
    assert all(lp.top[0] == (lp.token_id, lp.logprob) for lp in lps)  # greedy: the chosen token is the most likely


# ---------------------------------------------------------------- stop strings over HTTP
def test_stop_string_spanning_two_tokens(server, ref_llm, greedy):
    stop, n_tokens, before = spanning_stop(ref_llm.tokenizer, greedy.token_ids)
    offline = ref_llm.generate([PROMPT], SamplingParams(max_tokens=NEW, stop=stop))[0]
    assert offline.text == before and offline.finish_reason == "stop"
    for form in (stop, [stop], [NEVER, stop]):
        body = complete(server, prompt=PROMPT, max_tokens=NEW, temperature=0, stop=form, return_token_ids=True)
        c = body["choices"][0]
        assert (c["text"], c["finish_reason"], c["token_ids"]) == (offline.text, "stop", offline.token_ids)
        assert body["usage"]["completion_tokens"] == n_tokens == len(offline.token_ids)  # the completing token counts
        events = stream(server, prompt=PROMPT, max_tokens=NEW, temperature=0, stop=form, return_token_ids=True,
                        stream_options={"include_usage": True})
        got = per_choice(events)[0]
        assert got["text"] == before and got["finish"] == ["stop"] and got["ids"] == offline.token_ids
        assert all(before.startswith(t) for t in got["texts"])  # no chunk ever showed the stop string's start
        assert events[-1]["usage"]["completion_tokens"] == n_tokens


def test_stop_strings_in_a_list_and_inside_a_token(server, ref_llm, greedy):
    tok = ref_llm.tokenizer
    inner, n_inner, before_inner = inner_stop(tok, greedy.token_ids, 1)
    later = greedy.text[len(before_inner) + 3 :][:3]  # further on: the earlier one wins
    offline = ref_llm.generate([PROMPT], SamplingParams(max_tokens=NEW, stop=[later, NEVER, inner]))[0]
    assert offline.text == before_inner and len(offline.token_ids) == n_inner
    for streamed in (False, True):
        body = {"prompt": PROMPT, "max_tokens": NEW, "temperature": 0, "stop": [later, NEVER, inner]}
        if streamed:
            got = per_choice(stream(server, **body))[0]
            text, finish = got["text"], got["finish"]
            assert all(before_inner.startswith(t) for t in got["texts"])
        else:
            c = complete(server, **body)["choices"][0]
            text, finish = c["text"], [c["finish_reason"]]
        assert (text, finish) == (offline.text, ["stop"])


def test_stop_string_that_never_occurs(server, greedy):
    for streamed in (False, True):
        body = {"prompt": PROMPT, "max_tokens": NEW, "temperature": 0, "stop": [NEVER, "\x01\x02"]}
        if streamed:
            got = per_choice(stream(server, **body))[0]
            assert (got["text"], got["finish"]) == (greedy.text, ["length"])
        else:
            body = complete(server, **body)
            assert (body["choices"][0]["text"], body["choices"][0]["finish_reason"]) == (greedy.text, "length")
            assert body["usage"]["completion_tokens"] == NEW


def test_chat_stop_string(server, ref_llm):
    ids = ref_llm.tokenizer.encode(ChatTemplate().render(CHAT))
    ref = ref_llm.generate(prompt_token_ids=[ids], sampling_params=SamplingParams(max_tokens=12))[0]
    stop, n_tokens, before = spanning_stop(ref_llm.tokenizer, ref.token_ids)
    r = post(server, "/v1/chat/completions", messages=CHAT, max_tokens=12, temperature=0, stop=stop)
    assert r.status_code == 200, r.text
    c = r.json()["choices"][0]
    assert (c["message"]["content"], c["finish_reason"]) == (before, "stop")
    assert r.json()["usage"]["completion_tokens"] == n_tokens
    got = per_choice(stream(server, "/v1/chat/completions", messages=CHAT, max_tokens=12, temperature=0, stop=stop), chat=True)[0]
    assert (got["text"], got["finish"]) == (before, ["stop"])


@pytest.mark.parametrize("one_by_one", [True, False], ids=["one-output-per-read", "as-queued"])
def test_the_token_completing_a_stop_string_sends_no_empty_chunk(server, ref_llm, greedy, monkeypatch, one_by_one):
    """A stop string of 2 characters that ends on a token's first one: 1 character (its first) is
    held back before that token, so the token adds no text. Its output goes with the finishing
    chunk: every chunk before that one has text (completions and chat, the stop string cut or
    kept), and the streamed text is the whole response's. ``one_by_one``: the stream reads each
    engine output alone (as when the client reads faster than the engine steps), where the empty
    chunk came from; else as queued."""
    read: list = []  # the engine outputs, as read one by one
    if one_by_one:
        async def one_output(self):
            read.append(await self.queue.get())
            return [read[-1]]

        monkeypatch.setattr(RequestStream, "queued", one_output)
    tok = ref_llm.tokenizer
    chat_ids = tok.encode(ChatTemplate().render(CHAT))
    chat_ref = ref_llm.generate(prompt_token_ids=[chat_ids], sampling_params=SamplingParams(max_tokens=NEW))[0]
    for path, ref_ids, body in (("/v1/completions", greedy.token_ids, {"prompt": PROMPT}),
                                ("/v1/chat/completions", chat_ref.token_ids, {"messages": CHAT})):
        chat = path == "/v1/chat/completions"
        stop, n_tokens, before = stop_at_a_token_start(tok, ref_ids, 4)  # past the first output (the prefill's token and more)
        for include in (False, True):
            req = {**body, "max_tokens": NEW, "temperature": 0, "stop": stop, "include_stop_str_in_output": include}
            r = post(server, path, **req)
            assert r.status_code == 200, r.text
            whole = r.json()["choices"][0]
            text = whole["message"]["content"] if chat else whole["text"]
            assert (text, whole["finish_reason"]) == (before + (stop if include else ""), "stop")
            read.clear()
            chunks = [c for e in stream(server, path, **req) for c in e["choices"] if not chat or "role" not in c["delta"]]
            texts = [c["delta"].get("content", "") if chat else c["text"] for c in chunks]
            assert [c["finish_reason"] for c in chunks] == [None] * (len(chunks) - 1) + ["stop"]
            assert all(texts[:-1]), texts  # no chunk of empty text before the finish
            assert "".join(texts) == text
            if one_by_one:  # the case: the completing token's output came alone (its text: none, or the stop string's end)
                last = read[-1][1]
                assert (last.new_token_ids, last.text) == ((ref_ids[n_tokens - 1],), stop[1:] if include else "")
        # its token id comes with the finish
        chunks = [c for e in stream(server, path, **body, max_tokens=NEW, temperature=0, stop=stop, return_token_ids=True)
                  for c in e["choices"] if not chat or "role" not in c["delta"]]
        assert [t for c in chunks for t in c["token_ids"]] == ref_ids[:n_tokens]
        assert chunks[-1]["finish_reason"] == "stop" and chunks[-1]["token_ids"][-1] == ref_ids[n_tokens - 1]
        assert all(c["token_ids"] or c["finish_reason"] for c in chunks)


# ---------------------------------------------------------------- n choices
def test_n_greedy_gives_equal_choices(server, greedy):
    one = complete(server, prompt=PROMPT, max_tokens=8, temperature=0)
    body = complete(server, prompt=PROMPT, max_tokens=8, temperature=0, n=3)
    assert [c["index"] for c in body["choices"]] == [0, 1, 2]
    assert [c["text"] for c in body["choices"]] == [one["choices"][0]["text"]] * 3 == [greedy.text[: len(one["choices"][0]["text"])]] * 3
    u = body["usage"]
    assert u["prompt_tokens"] == one["usage"]["prompt_tokens"] and u["completion_tokens"] == 3 * 8
    assert u["total_tokens"] == u["prompt_tokens"] + u["completion_tokens"]


def test_n_sampled_with_a_seed_is_reproducible(server):
    body = {"prompt": PROMPT, "max_tokens": 10, "temperature": 1.0, "seed": 7, "n": 3, "return_token_ids": True}
    a, b = complete(server, **body), complete(server, **body)
    ids = [c["token_ids"] for c in a["choices"]]
    assert ids == [c["token_ids"] for c in b["choices"]]
    assert len({tuple(x) for x in ids}) > 1  # seeds 7, 8, 9: not all the same
    for i in range(3):  # choice i is the request with seed + i
        single = complete(server, **{**body, "n": 1, "seed": 7 + i})
        assert single["choices"][0]["token_ids"] == ids[i]
    assert a["usage"]["completion_tokens"] == sum(len(x) for x in ids)


def test_n_streamed_interleaves_complete_choices(server):
    body = {"prompt": PROMPT, "max_tokens": 10, "temperature": 1.0, "seed": 3, "n": 2, "return_token_ids": True}
    whole = complete(server, **body)
    events = stream(server, **body, stream_options={"include_usage": True})
    got = per_choice(events)
    assert sorted(got) == [0, 1]
    for c in whole["choices"]:
        g = got[c["index"]]
        assert (g["text"], g["ids"], g["finish"]) == (c["text"], c["token_ids"], [c["finish_reason"]])
    assert events[-1]["choices"] == [] and events[-1]["usage"] == whole["usage"]
    assert whole["usage"]["completion_tokens"] == 20
    chat = stream(server, "/v1/chat/completions", messages=CHAT, max_tokens=5, temperature=0, n=2)
    roles = [c["index"] for e in chat for c in e["choices"] if c["delta"].get("role") == "assistant"]
    got = per_choice(chat, chat=True)
    assert sorted(roles) == [0, 1] and got[0]["text"] == got[1]["text"] and got[0]["finish"] == got[1]["finish"] == ["length"]


def test_n_with_stop_and_logprobs(server, greedy, ref_llm):
    stop, n_tokens, before = spanning_stop(ref_llm.tokenizer, greedy.token_ids)
    body = complete(server, prompt=PROMPT, max_tokens=NEW, temperature=0, n=2, stop=stop, logprobs=1)
    for c in body["choices"]:
        assert (c["text"], c["finish_reason"], len(c["logprobs"]["tokens"])) == (before, "stop", n_tokens)
    assert body["usage"]["completion_tokens"] == 2 * n_tokens


# ---------------------------------------------------------------- logprobs
def test_completion_logprobs_equal_the_model_s_log_softmax(server, ref_llm, greedy):
    prompt_ids = ref_llm.tokenizer.encode(PROMPT)
    body = complete(server, prompt=PROMPT, max_tokens=8, temperature=0, logprobs=5, return_token_ids=True)
    c = body["choices"][0]
    ids, lp = c["token_ids"], c["logprobs"]
    assert ids == greedy.token_ids[:8]
    ref = reference_logprobs(ref_llm, prompt_ids, ids)
    assert len(lp["tokens"]) == len(lp["token_logprobs"]) == len(lp["top_logprobs"]) == len(lp["text_offset"]) == len(ids)
    assert lp["tokens"] == token_texts(ref_llm.tokenizer, ids)
    for i, t in enumerate(ids):
        assert lp["token_logprobs"][i] == pytest.approx(ref[i, t].item(), abs=1e-4)
        top = list(lp["top_logprobs"][i].items())
        assert [v for _, v in top] == sorted((v for _, v in top), reverse=True)
        assert top[0] == (lp["tokens"][i], lp["token_logprobs"][i])  # greedy: the chosen token is the argmax
        assert [v for _, v in top] == pytest.approx(ref[i].topk(len(top)).values.tolist(), abs=1e-4)
    assert lp["text_offset"] == [sum(map(len, lp["tokens"][:i])) for i in range(len(ids))]
    # streamed: the chunks' logprobs concatenate to the same
    events = stream(server, prompt=PROMPT, max_tokens=8, temperature=0, logprobs=5, return_token_ids=True)
    chunks = per_choice(events)[0]["logprobs"]
    for key in ("tokens", "token_logprobs", "top_logprobs", "text_offset"):
        assert [x for ch in chunks for x in ch[key]] == lp[key], key
    for e in events:  # each chunk carries its own tokens' logprobs
        ch = e["choices"][0]
        assert len(ch["token_ids"]) == (len(ch["logprobs"]["tokens"]) if ch["logprobs"] else 0)


def test_logprobs_are_of_the_raw_logits_under_sampling(server, ref_llm):
    """Temperature 1.7: the logprobs are still log_softmax of the raw logits (vLLM's default), and
    a sampled token outside the top k is added to its top_logprobs (up to k + 1 entries)."""
    prompt_ids = ref_llm.tokenizer.encode(PROMPT)
    body = complete(server, prompt=PROMPT, max_tokens=8, temperature=1.7, seed=5, logprobs=2, return_token_ids=True)
    c = body["choices"][0]
    ref = reference_logprobs(ref_llm, prompt_ids, c["token_ids"])
    for i, t in enumerate(c["token_ids"]):
        assert c["logprobs"]["token_logprobs"][i] == pytest.approx(ref[i, t].item(), abs=1e-4)
        top = c["logprobs"]["top_logprobs"][i]
        assert c["logprobs"]["tokens"][i] in top and 2 <= len(top) <= 3
        assert list(top.values()) == sorted(top.values(), reverse=True)
    zero = complete(server, prompt=PROMPT, max_tokens=4, temperature=0, logprobs=0)["choices"][0]["logprobs"]
    assert [list(t) for t in zero["top_logprobs"]] == [[tok] for tok in zero["tokens"]]  # k = 0: the chosen token alone


def test_chat_logprobs(server, ref_llm):
    tok = ref_llm.tokenizer
    ids = tok.encode(ChatTemplate().render(CHAT))
    r = post(server, "/v1/chat/completions", messages=CHAT, max_tokens=6, temperature=0, logprobs=True, top_logprobs=3,
             return_token_ids=True)
    assert r.status_code == 200, r.text
    c = r.json()["choices"][0]
    content = c["logprobs"]["content"]
    assert len(content) == len(c["token_ids"]) == r.json()["usage"]["completion_tokens"]
    ref = reference_logprobs(ref_llm, ids, c["token_ids"])
    for i, (t, e) in enumerate(zip(c["token_ids"], content)):
        assert e["token"] == tok.decode([t]) and e["bytes"] == list(e["token"].encode("utf-8"))
        assert e["logprob"] == pytest.approx(ref[i, t].item(), abs=1e-4)
        top = e["top_logprobs"]
        assert len(top) == 3 and [x["logprob"] for x in top] == sorted((x["logprob"] for x in top), reverse=True)
        assert (top[0]["token"], top[0]["logprob"]) == (e["token"], e["logprob"])
        assert all(x["bytes"] == list(x["token"].encode("utf-8")) for x in top)
    plain = post(server, "/v1/chat/completions", messages=CHAT, max_tokens=3, temperature=0, logprobs=True).json()
    assert all(e["top_logprobs"] == [] for e in plain["choices"][0]["logprobs"]["content"])
    assert post(server, "/v1/chat/completions", messages=CHAT, max_tokens=3).json()["choices"][0]["logprobs"] is None
    events = stream(server, "/v1/chat/completions", messages=CHAT, max_tokens=6, temperature=0, logprobs=True, top_logprobs=3)
    streamed = [x for ch in per_choice(events, chat=True)[0]["logprobs"] for x in ch["content"]]
    assert streamed == content


# ---------------------------------------------------------------- the official client
def test_openai_client_parses_stop_n_and_logprobs(server, ref_llm, greedy):
    openai = pytest.importorskip("openai")
    client = openai.OpenAI(base_url=server.url + "/v1", api_key="unused", timeout=WAIT_S, max_retries=0)
    stop, n_tokens, before = spanning_stop(ref_llm.tokenizer, greedy.token_ids)
    c = client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=NEW, temperature=0, stop=[stop], n=2, logprobs=3)
    assert [ch.index for ch in c.choices] == [0, 1] and all(ch.text == before and ch.finish_reason == "stop" for ch in c.choices)
    lp = c.choices[0].logprobs
    assert len(lp.tokens) == len(lp.token_logprobs) == len(lp.text_offset) == n_tokens and len(lp.top_logprobs[0]) == 3
    assert c.usage.completion_tokens == 2 * n_tokens
    texts = {0: "", 1: ""}
    for ch in client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=NEW, temperature=0, stop=stop, n=2, stream=True):
        for x in ch.choices:
            texts[x.index] += x.text
    assert texts == {0: before, 1: before}
    chat = client.chat.completions.create(model=MODEL, messages=CHAT, max_tokens=4, temperature=0, n=2, logprobs=True,
                                          top_logprobs=2, stop=[NEVER])
    assert len(chat.choices) == 2 and chat.choices[0].message.content == chat.choices[1].message.content
    entry = chat.choices[0].logprobs.content[0]
    assert isinstance(entry.logprob, float) and len(entry.top_logprobs) == 2 and entry.top_logprobs[0].token == entry.token


# ---------------------------------------------------------------- bad values
BAD = [
    ("five stop strings", "/v1/completions", {"stop": ["a", "b", "c", "d", "e"]}, "stop"),
    ("an empty stop string", "/v1/completions", {"stop": ""}, "stop"),
    ("an empty stop string in a list", "/v1/chat/completions", {"stop": ["x", ""]}, "stop"),
    ("a stop that is not a string", "/v1/completions", {"stop": [3]}, "stop"),
    ("n = 0", "/v1/completions", {"n": 0}, "n"),
    ("n = 17", "/v1/chat/completions", {"n": 17}, "n"),
    ("logprobs = 6", "/v1/completions", {"logprobs": 6}, "logprobs"),
    ("logprobs = -1", "/v1/completions", {"logprobs": -1}, "logprobs"),
    ("logprobs as a bool in completions", "/v1/completions", {"logprobs": True}, "logprobs"),
    ("top_logprobs = 6", "/v1/chat/completions", {"logprobs": True, "top_logprobs": 6}, "top_logprobs"),
    ("top_logprobs without logprobs", "/v1/chat/completions", {"top_logprobs": 2}, "top_logprobs"),
    ("logprobs as a number in chat", "/v1/chat/completions", {"logprobs": 3}, "logprobs"),
]


@pytest.mark.parametrize("case", BAD, ids=[c[0] for c in BAD])
def test_bad_values_get_400_naming_the_field(server, case):
    _, path, change, field = case
    body = {"prompt": "hi"} if path == "/v1/completions" else {"messages": CHAT}
    r = post(server, path, max_tokens=2, **body, **change)
    assert r.status_code == 400, r.text
    msg = r.json()["error"]["message"]
    assert msg.split(":")[0].split(".")[0] == field or f" {field} " in f" {msg} ", msg


WORDED = [  # (what, path, body beside model, the 400's message, param)
    ("a prompt id below 0", "/v1/completions", {"prompt": [-1]}, "prompt.0: Input should be greater than or equal to 0 (got -1)",
     "prompt"),
    ("a number as the prompt", "/v1/completions", {"prompt": 5},
     "prompt: must be a string or a list of token ids (integers >= 0), got 5", "prompt"),
    ("a null prompt", "/v1/completions", {"prompt": None},
     "prompt: must be a string or a list of token ids (integers >= 0), got null", "prompt"),
    ("a number as stop", "/v1/completions", {"prompt": "hi", "stop": 5}, "stop: must be a string or a list of up to 4 strings, got 5",
     "stop"),
    ("a word as the temperature", "/v1/completions", {"prompt": "hi", "temperature": "hot"},
     'temperature: must be a number from 0 to 2, got "hot"', "temperature"),
    ("an image part", "/v1/chat/completions", {"messages": [{"role": "user", "content": [{"type": "image_url", "image_url": {}}]}]},
     'messages.0.content.0: a content part of type "image_url" is not supported: this server reads text only, as a string or '
     'parts {"type": "text", "text": ...} (got {"type": "image_url", "image_url": {}})', "messages"),
    ("stream_options without stream", "/v1/completions", {"prompt": "hi", "stream_options": {"include_usage": True}},
     "stream_options: stream_options is only allowed with stream: true (as OpenAI's API says): send stream: true or leave "
     "stream_options out", "stream_options"),
    ("a stop token id past the vocabulary", "/v1/completions", {"prompt": "hi", "stop_token_ids": [99999]},
     "stop_token_ids has token id 99999, outside the model's vocabulary of 4,096 ids [0, 4096): use ids below 4096 (it could "
     "never be generated)", "stop_token_ids"),
    ("a prompt id past the vocabulary", "/v1/completions", {"prompt": [5, 99999]},
     "prompt has token id 99999 at position 1, outside the model's vocabulary of 4,096 ids [0, 4096): use ids below 4096",
     "prompt"),
]


@pytest.mark.parametrize("case", WORDED, ids=[c[0] for c in WORDED])
def test_bad_values_are_worded_plainly(server, case):
    """A field of several types says what it takes, once (not each type's own error); a content
    part other than text, stream_options without stream and an id past the vocabulary name the
    value and what to send."""
    _, path, body, message, param = case
    r = post(server, path, **body)
    assert r.status_code == 400, r.text
    assert (r.json()["error"]["message"], r.json()["error"]["param"]) == (message, param)


def test_null_sampling_fields_take_their_defaults(server):
    """null for temperature, top_p and n is the default, as OpenAI reads it (its client sends
    null for an argument passed as None): the greedy-free defaults temperature 1, top_p 1, n 1."""
    r = post(server, "/v1/completions", prompt="hi", max_tokens=2, temperature=None, top_p=None, n=None, seed=3)
    assert r.status_code == 200, r.text
    again = post(server, "/v1/completions", prompt="hi", max_tokens=2, seed=3)
    assert [c["text"] for c in r.json()["choices"]] == [c["text"] for c in again.json()["choices"]]


def test_a_prompt_past_the_limit_is_worded_by_what_was_sent(server):
    """A prompt that leaves no room is refused for its length, naming no max_tokens the body did
    not send; completions' max_tokens, when left out, is said to be the default."""
    long_ids = [5] * MAX_LEN
    r = post(server, "/v1/completions", prompt=long_ids)
    assert r.status_code == 400 and r.json()["error"]["param"] == "prompt", r.text
    assert r.json()["error"]["message"] == (f"the prompt has {MAX_LEN:,} tokens, and this server's max_model_len is {MAX_LEN:,} "
                                            f"tokens: nothing is left to generate; shorten the prompt to at most {MAX_LEN - 1:,} tokens")
    r = post(server, "/v1/completions", prompt=long_ids[:MAX_LEN - 10])
    assert r.status_code == 400 and r.json()["error"]["param"] == "max_tokens", r.text
    assert r.json()["error"]["message"].startswith(f"the prompt has {MAX_LEN - 10:,} tokens + max_tokens 16 (the default, "
                                                   f"max_tokens not sent) = {MAX_LEN + 6:,}, beyond this server's max_model_len")
    r = post(server, "/v1/chat/completions", messages=[{"role": "user", "content": "word " * MAX_LEN}])
    assert r.status_code == 400 and r.json()["error"]["param"] == "messages", r.text
    assert "with the chat template, and this server's max_model_len is" in r.json()["error"]["message"]
    assert "max_tokens" not in r.json()["error"]["message"]
    r = post(server, "/v1/chat/completions", messages=CHAT, max_completion_tokens=MAX_LEN)
    assert r.status_code == 400 and r.json()["error"]["param"] == "max_completion_tokens", r.text
    assert re.fullmatch(rf"the messages come to [\d,]+ tokens with the chat template \+ max_completion_tokens {MAX_LEN:,} = [\d,]+, "
                        rf"beyond this server's max_model_len of {MAX_LEN:,} tokens: shorten the prompt or lower "
                        rf"max_completion_tokens to at most [\d,]+", r.json()["error"]["message"]), r.text
    r = post(server, "/v1/completions", prompt=[5] * (MAX_LEN + 1), max_tokens=0, echo=True)  # the prompt back: it may fill the context
    assert r.status_code == 400 and r.json()["error"]["param"] == "prompt", r.text
    assert r.json()["error"]["message"] == (f"the prompt has {MAX_LEN + 1:,} tokens, beyond this server's max_model_len of "
                                            f"{MAX_LEN:,} tokens: shorten the prompt to at most {MAX_LEN:,} tokens")
    assert post(server, "/v1/completions", prompt=[5] * MAX_LEN, max_tokens=0, echo=True).status_code == 200


def test_n_above_the_places_of_the_server_is_refused(llm, server):
    """A request's n choices may take up to --max-num-seqs + --max-queue places (2 + 3 here): n=5
    is served (above --max-queue alone), n=6 could never be taken: 400 naming n, the limit and the
    flags that set it."""
    state = ServerState(MODEL)
    engine = AsyncEngine(llm, max_num_seqs=2, max_queue=3)
    state.ready(engine, llm.tokenizer)
    try:
        wait_until(lambda: server.engine.snapshot()["running"] == 0, "the module server to be idle")  # they share the model
        with ServerThread(build_app(state)) as srv:
            r = post(srv, "/v1/completions", prompt="hi", max_tokens=2, n=6)
            assert r.status_code == 400, r.text
            assert r.json()["error"]["message"] == ("n must be in [1, 5], got 6: each choice takes one of the 5 places of this "
                                                    "server (--max-num-seqs 2 + --max-queue 3)"), r.text
            assert r.json()["error"]["param"] == "n"
            assert len(complete(srv, prompt="hi", max_tokens=2, n=5)["choices"]) == 5
    finally:
        engine.shutdown()


# ---------------------------------------------------------------- admission and cancellation with n
def test_n_takes_n_places_in_the_queue(llm, server):
    """An engine whose steps are held: a request of n=2 takes 2 of the 3 places of --max-num-seqs
    1 and --max-queue 2, so another n=2 is refused whole (503) while n=1 still fits."""
    state, engine, release = held_engine(llm, 1, 2, idle=server)
    with ServerThread(build_app(state)) as srv:
        results: list = []

        def send(n):
            results.append(post(srv, "/v1/completions", prompt="queued", max_tokens=3, n=n))

        first = threading.Thread(target=send, args=(2,))
        first.start()
        wait_until(lambda: engine.snapshot()["waiting"] == 2, "the two choices to wait")
        r = post(srv, "/v1/completions", prompt="queued", max_tokens=3, n=2)
        assert r.status_code == 503 and "no room for n=2" in r.json()["error"]["message"], r.text
        assert engine.snapshot()["waiting"] == 2  # none of the refused request's choices was queued
        second = threading.Thread(target=send, args=(1,))
        second.start()
        wait_until(lambda: engine.snapshot()["waiting"] == 3, "the third place to be taken")
        release.set()
        first.join(WAIT_S)
        second.join(WAIT_S)
        assert sorted((x.status_code, len(x.json()["choices"])) for x in results) == [(200, 1), (200, 2)]
    assert llm.cache.active_slots == []


@pytest.mark.parametrize("streamed", [False, True], ids=["whole", "streamed"])
def test_a_failing_choice_cancels_the_others(server, monkeypatch, streamed):
    """One of three choices fails in its prefill: the request gets 500 (streamed: an error event,
    then [DONE]), the other two are cancelled (counted as aborted; they could not have finished:
    ~2,000 tokens each), their KV freed."""
    core, tok = server.engine.core, server.state.tokenizer
    real, seen = core._prefill_chunk, []
    boom = tok.encode("boom boom")

    def prefill(req):
        if req.prompt_ids == boom and req.num_prefilled == 0:
            seen.append(req.request_id)
            if len(seen) == 2:
                raise RuntimeError("injected failure")
        return real(req)

    monkeypatch.setattr(core, "_prefill_chunk", prefill)
    key = ("writescope:request_success_total", (("finished_reason", "abort"),))
    refused = ("writescope:request_refused_total", (("status", "500"),))  # the engine took it: a failure, not a refusal
    wait_until(lambda: server.engine.snapshot()["running"] == 0, "the server to be idle")
    before, refused_before = metrics(server.url).get(key, 0), metrics(server.url).get(refused, 0)
    r = post(server, "/v1/completions", prompt="boom boom", max_tokens=MAX_LEN - 10, ignore_eos=True, n=3, stream=streamed)
    if streamed:
        assert r.status_code == 200
        errors = [e["error"] for e in sse(r.text) if "error" in e]
        assert len(errors) == 1 and errors[0]["code"] == 500 and "injected failure" in errors[0]["message"]
    else:
        assert r.status_code == 500 and "injected failure" in r.json()["error"]["message"]
    wait_until(lambda: metrics(server.url).get(key, 0) == before + 2, "the two other choices to be aborted")
    wait_until(lambda: server.engine.snapshot()["kv_slots"] == 0, "their KV to be freed")
    assert complete(server, prompt="fine", max_tokens=3, n=2)["usage"]["completion_tokens"] == 6
    assert metrics(server.url).get(refused, 0) == refused_before


def test_disconnect_cancels_every_choice(server, caplog, monkeypatch):
    """A client that hangs up mid-stream cancels both choices, their KV is freed, and the
    request's log line says status 499 and, in words, that the client disconnected."""
    top = logging.getLogger("uvicorn")  # as in test_one_info_line_per_finished_request
    if caplog.handler not in top.handlers:
        monkeypatch.setattr(top, "handlers", [*top.handlers, caplog.handler])
    caplog.set_level(logging.INFO, logger="uvicorn.error")
    key = ("writescope:request_success_total", (("finished_reason", "abort"),))
    wait_until(lambda: server.engine.snapshot()["running"] == 0, "the server to be idle")
    before = metrics(server.url).get(key, 0)
    body = {"model": MODEL, "prompt": "a long one", "max_tokens": MAX_LEN - 100, "ignore_eos": True, "stream": True, "n": 2}
    with httpx.Client(timeout=WAIT_S) as client:
        with client.stream("POST", server.url + "/v1/completions", json=body) as r:
            for line in r.iter_lines():
                if line.startswith("data: "):
                    break  # a token in: the loop's iterator, dropped here, closes the connection (hangs up)
    wait_until(lambda: metrics(server.url).get(key, 0) == before + 2, "both choices to be aborted")
    wait_until(lambda: server.engine.snapshot()["kv_slots"] == 0, "their KV to be freed")
    wait_until(lambda: any(" status=499 " in r.getMessage() for r in caplog.records), "the request's log line")
    line = next(r.getMessage() for r in caplog.records if " status=499 " in r.getMessage())
    assert line.endswith(" (the client disconnected: cancelled)"), line


# ---------------------------------------------------------------- work off the event loop
def test_prompts_are_tokenized_and_checked_off_the_event_loop(server, ref_llm, monkeypatch):
    """A request's prompt is tokenized, and its ids checked, in a worker thread, not on the event
    loop's (the server's thread): a prompt of millions of characters takes seconds there, and
    /health must answer meanwhile. Completions (with echo alone too) and chat; a refusal found
    there is the same answer."""
    tok, check = server.state.tokenizer, server.engine.core.check
    loop_threads, where = [], []

    class Spy:  # the served tokenizer, recording where it encodes
        def __getattr__(self, name):
            return getattr(tok, name)

        def encode(self, text):
            where.append(("encode", threading.current_thread()))
            return tok.encode(text)

    def spy_check(ids, max_tokens):
        where.append(("check", threading.current_thread()))
        return check(ids, max_tokens)

    real_render = server.state.metrics.render

    def render():  # /metrics' route runs on the loop: its thread is the loop's
        loop_threads.append(threading.current_thread())
        return real_render()

    monkeypatch.setattr(server.state, "tokenizer", Spy())
    monkeypatch.setattr(server.engine.core, "check", spy_check)
    monkeypatch.setattr(server.state.metrics, "render", render)
    assert httpx.get(server.url + "/metrics").status_code == 200
    assert loop_threads == [server.thread]
    assert complete(server, prompt=PROMPT, max_tokens=2)["choices"][0]["finish_reason"] == "length"
    assert complete(server, prompt=PROMPT, max_tokens=0, echo=True)["choices"][0]["text"] == PROMPT
    r = post(server, "/v1/chat/completions", messages=CHAT, max_tokens=2)
    assert r.status_code == 200, r.text
    r = post(server, "/v1/completions", prompt=PROMPT, max_tokens=MAX_LEN)  # beyond max_model_len: the route's own check
    assert r.status_code == 400 and "beyond this server's max_model_len" in r.json()["error"]["message"], r.text
    assert r.json()["error"]["param"] == "max_tokens"
    assert [w for w, _ in where] == ["encode", "check"] * 3 + ["encode"]  # (the length refused before the engine's check)
    assert all(t is not server.thread for _, t in where), where


# ---------------------------------------------------------------- the log
LOG_LINE = re.compile(r"(?P<id>\S+) status=(?P<status>\d+) prompt_tokens=(?P<prompt>\d+) completion_tokens=(?P<completion>\d+) "
                      r"finish_reason=(?P<finish>\S+) ttft_ms=(?P<ttft>[\d.]+) total_ms=(?P<total>[\d.]+)$")


def test_one_info_line_per_finished_request(server, caplog, monkeypatch):
    """Each request, as it ends, logs one line through the server's logger (uvicorn's, whose level
    is --log-level) at INFO: its id, status, prompt and completion tokens, finish reason (one per
    choice), TTFT and total ms. Whole, streamed with n=2, and chat."""
    top = logging.getLogger("uvicorn")  # it does not propagate to the root: recent pytest attaches caplog to it, else it is here
    if caplog.handler not in top.handlers:
        monkeypatch.setattr(top, "handlers", [*top.handlers, caplog.handler])
    caplog.set_level(logging.INFO, logger="uvicorn.error")
    whole = complete(server, prompt=PROMPT, max_tokens=3, ignore_eos=True)
    events = stream(server, prompt=PROMPT, max_tokens=2, ignore_eos=True, n=2, stream_options={"include_usage": True})
    r = post(server, "/v1/chat/completions", messages=CHAT, max_tokens=4, ignore_eos=True)
    assert r.status_code == 200, r.text
    chat = r.json()
    assert post(server, "/v1/completions", prompt=PROMPT, temperature="hot").status_code == 400  # refused: a line too
    refused = [rec.getMessage() for rec in caplog.records if " refused" in rec.getMessage()]
    assert refused == ['POST /v1/completions status=400 refused param=temperature: temperature: must be a number from 0 to 2, '
                       'got "hot"'], refused
    lines = {}
    for rec in caplog.records:
        m = LOG_LINE.match(rec.getMessage())
        if m:
            assert rec.levelno == logging.INFO and rec.name == "uvicorn.error"
            assert m["id"] not in lines, "two lines for one request"
            lines[m["id"]] = m
    assert set(lines) == {whole["id"], events[0]["id"], chat["id"]}, [r.getMessage() for r in caplog.records]
    for resp, finish in ((whole, "length"), (events[-1], "length,length"), (chat, "length")):
        m = lines[resp["id"]]
        assert m["status"] == "200" and m["finish"] == finish
        assert (int(m["prompt"]), int(m["completion"])) == (resp["usage"]["prompt_tokens"], resp["usage"]["completion_tokens"])
        assert 0 <= float(m["ttft"]) <= float(m["total"])
