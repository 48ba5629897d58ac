"""``echo``, ``include_stop_str_in_output`` and ``stop_reason`` in ``writescope serve``
(writescope/serve/echo.py, choices.py, protocol.py), on a real loopback server over the tiny
preset.

References come from a second, independent ``LLM`` of the same preset (the same seeded synthetic
weights): offline ``generate`` with the same parameters. Stop strings are cut out of the greedy
reference text (tests/stop_helpers.py). No test depends on timing: waits poll a condition.
"""

from __future__ import annotations

import pytest

pytest.importorskip("fastapi")
httpx = pytest.importorskip("httpx")

from writescope import LLM, SamplingParams  # noqa: E402
from writescope.serve.chat_template import ChatTemplate  # noqa: E402
from serve_helpers import MODEL, WAIT_S, complete, per_choice, post, stream, wait_until  # noqa: E402
from stop_helpers import inner_stop, spanning_stop  # noqa: E402

from serve_fixtures import CHAT, MAX_LEN, NEVER, NEW, PROMPT, greedy, llm, ref_llm, server  # noqa: E402,F401


def whole_and_streamed(server, **body) -> tuple[dict, dict]:
    """(the non-streamed response, per_choice of the streamed one) of one body."""
    return complete(server, **body), per_choice(stream(server, **body))


# ---------------------------------------------------------------- echo
def test_echo_puts_the_prompt_before_each_completion(server, greedy):
    body, got = whole_and_streamed(server, prompt=PROMPT, max_tokens=NEW, temperature=0, echo=True, n=2, return_token_ids=True)
    for c in body["choices"]:
        assert (c["text"], c["token_ids"], c["finish_reason"]) == (PROMPT + greedy.text, greedy.token_ids, "length")
    assert body["usage"] == {"prompt_tokens": len(greedy.prompt_token_ids), "completion_tokens": 2 * NEW,
                             "total_tokens": len(greedy.prompt_token_ids) + 2 * NEW}  # the completions' tokens only
    for i in (0, 1):
        assert got[i]["text"] == PROMPT + greedy.text and got[i]["ids"] == greedy.token_ids


def test_echo_streams_the_prompt_first_as_each_choice_s_own_chunk(server, greedy):
    events = stream(server, prompt=PROMPT, max_tokens=4, temperature=0, echo=True, n=2, return_token_ids=True)
    first = [e["choices"][0] for e in events[:2]]
    assert sorted(c["index"] for c in first) == [0, 1]
    assert all((c["text"], c["token_ids"], c["finish_reason"]) == (PROMPT, [], None) for c in first)
    rest = per_choice(events[2:])  # then the completion alone
    want = server.state.tokenizer.decode(greedy.token_ids[:4])
    assert [(rest[i]["text"], rest[i]["ids"], rest[i]["finish"]) for i in (0, 1)] == [(want, greedy.token_ids[:4], ["length"])] * 2


def test_echo_of_a_token_id_prompt_is_its_decoded_text(server, ref_llm):
    ids = ref_llm.tokenizer.encode("def main():")
    ref = ref_llm.generate(prompt_token_ids=[ids], sampling_params=SamplingParams(max_tokens=5))[0]
    body = complete(server, prompt=ids, max_tokens=5, temperature=0, echo=True)
    assert body["choices"][0]["text"] == "def main():" + ref.text


def test_echo_with_a_stop_string_kept_or_cut(server, ref_llm, greedy):
    stop, n_tokens, before = spanning_stop(ref_llm.tokenizer, greedy.token_ids)
    for include in (False, True):
        body, got = whole_and_streamed(server, prompt=PROMPT, max_tokens=NEW, temperature=0, echo=True, stop=stop,
                                       include_stop_str_in_output=include)
        want = PROMPT + before + (stop if include else "")
        c = body["choices"][0]
        assert (c["text"], c["finish_reason"], c["stop_reason"]) == (want, "stop", stop)
        assert (got[0]["text"], got[0]["finish"], got[0]["stop_reason"]) == (want, ["stop"], [stop])
        assert body["usage"]["completion_tokens"] == n_tokens


def test_echo_with_max_tokens_0_returns_the_prompt_alone(server):
    wait_until(lambda: server.engine.snapshot()["running"] == 0, "the server to be idle")
    steps = server.engine.snapshot()["steps"]
    ids = server.state.tokenizer.encode(PROMPT)
    body = complete(server, prompt=PROMPT, max_tokens=0, echo=True, n=2, return_token_ids=True)
    assert [(c["index"], c["text"], c["token_ids"], c["finish_reason"], c["stop_reason"]) for c in body["choices"]] == \
        [(0, PROMPT, [], "length", None), (1, PROMPT, [], "length", None)]
    assert body["usage"] == {"prompt_tokens": len(ids), "completion_tokens": 0, "total_tokens": len(ids)}
    events = stream(server, prompt=PROMPT, max_tokens=0, echo=True, stream_options={"include_usage": True})
    assert [(c["text"], c["finish_reason"]) for e in events[:-1] for c in e["choices"]] == [(PROMPT, None), ("", "length")]
    assert events[-1]["choices"] == [] and events[-1]["usage"] == {"prompt_tokens": len(ids), "completion_tokens": 0,
                                                                   "total_tokens": len(ids)}
    assert server.engine.snapshot()["steps"] == steps  # nothing went through the engine
    # the prompt is still checked as any request's
    r = post(server, "/v1/completions", prompt=list(range(5, 5 + MAX_LEN + 1)), max_tokens=0, echo=True)
    assert r.status_code == 400 and "max_model_len" in r.json()["error"]["message"], r.text
    r = post(server, "/v1/completions", prompt=[1, 99999], max_tokens=0, echo=True)
    assert r.status_code == 400 and "vocabulary" in r.json()["error"]["message"], r.text


@pytest.mark.parametrize("change, words, param", [
    ({"echo": True, "logprobs": 1}, ["echo", "logprobs"], "logprobs"),
    ({"echo": True, "logprobs": 0, "stream": True}, ["echo", "logprobs"], "logprobs"),
    ({"max_tokens": 0}, ["max_tokens: 0 generates nothing", "echo"], "max_tokens"),
], ids=["echo-with-logprobs", "echo-with-logprobs-0-streamed", "max-tokens-0-without-echo"])
def test_what_echo_cannot_do_gets_400_naming_the_fields(server, change, words, param):
    r = post(server, "/v1/completions", **{"prompt": PROMPT, "max_tokens": 3, **change})
    assert r.status_code == 400, r.text
    err = r.json()["error"]
    assert all(w in err["message"] for w in words) and err["param"] == param, err


def test_openai_client_reads_echo(server, greedy):
    openai = pytest.importorskip("openai")
    client = openai.OpenAI(base_url=server.url + "/v1", api_key="unused", timeout=WAIT_S, max_retries=0)
    c = client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=NEW, temperature=0, echo=True)
    assert c.choices[0].text == PROMPT + greedy.text
    texts = [x.text for ch in client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=NEW, temperature=0, echo=True,
                                                         stream=True) for x in ch.choices]
    assert texts[0] == PROMPT and "".join(texts) == PROMPT + greedy.text


# ---------------------------------------------------------------- include_stop_str_in_output and stop_reason
def test_include_stop_str_in_output_keeps_the_stop_string(server, ref_llm, greedy):
    tok = ref_llm.tokenizer
    stop, n_tokens, before = spanning_stop(tok, greedy.token_ids)
    inner, n_inner, before_inner = inner_stop(tok, greedy.token_ids, 1)
    for form, want, n in ((stop, before + stop, n_tokens), ([NEVER, inner], before_inner + inner, n_inner)):
        offline = ref_llm.generate([PROMPT], SamplingParams(max_tokens=NEW, stop=form, include_stop_str_in_output=True))[0]
        assert (offline.text, len(offline.token_ids)) == (want, n)
        body, got = whole_and_streamed(server, prompt=PROMPT, max_tokens=NEW, temperature=0, stop=form,
                                       include_stop_str_in_output=True, return_token_ids=True)
        c = body["choices"][0]
        matched = form if isinstance(form, str) else inner
        assert (c["text"], c["token_ids"], c["finish_reason"], c["stop_reason"]) == (want, offline.token_ids, "stop", matched)
        assert (got[0]["text"], got[0]["ids"], got[0]["stop_reason"]) == (want, offline.token_ids, [matched])
        assert all(want.startswith(t) for t in got[0]["texts"])  # never more than the final text
    chat = post(server, "/v1/chat/completions", messages=CHAT, max_tokens=NEW, temperature=0, stop=NEVER,
                include_stop_str_in_output=True)
    assert chat.status_code == 200 and chat.json()["choices"][0]["stop_reason"] is None, chat.text


def test_stop_reason_names_the_stop_string_or_token_else_null(server, ref_llm, greedy):
    stop, _, _ = spanning_stop(ref_llm.tokenizer, greedy.token_ids)
    stop_tok = greedy.token_ids[5]
    k = greedy.token_ids.index(stop_tok)  # it ends at the first one
    cases = [({"stop": [NEVER, stop]}, "stop", stop), ({"stop_token_ids": [stop_tok]}, "stop", stop_tok),
             ({"stop": NEVER}, "length", None)]
    for change, finish, reason in cases:
        body, got = whole_and_streamed(server, prompt=PROMPT, max_tokens=NEW, temperature=0, n=2, **change)
        assert [(c["finish_reason"], c["stop_reason"]) for c in body["choices"]] == [(finish, reason)] * 2
        assert [(g["finish"], g["stop_reason"]) for g in (got[0], got[1])] == [([finish], [] if reason is None else [reason])] * 2
    body = complete(server, prompt=PROMPT, max_tokens=NEW, temperature=0, stop_token_ids=[stop_tok], return_token_ids=True)
    assert body["choices"][0]["token_ids"] == greedy.token_ids[: k + 1]
    # chat: the same field
    ids = ref_llm.tokenizer.encode(ChatTemplate().render(CHAT))
    ref = ref_llm.generate(prompt_token_ids=[ids], sampling_params=SamplingParams(max_tokens=4))[0]
    chat_tok = ref.token_ids[1]
    r = post(server, "/v1/chat/completions", messages=CHAT, max_tokens=4, temperature=0, stop_token_ids=[chat_tok])
    assert r.status_code == 200, r.text
    assert [(c["finish_reason"], c["stop_reason"]) for c in r.json()["choices"]] == [("stop", chat_tok)]
    events = stream(server, "/v1/chat/completions", messages=CHAT, max_tokens=4, temperature=0, stop_token_ids=[chat_tok])
    assert [c["stop_reason"] for e in events for c in e["choices"]][-1] == chat_tok
    assert all(c["stop_reason"] is None for e in events for c in e["choices"] if c["finish_reason"] is None)
