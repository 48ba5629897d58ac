"""Request fields in ``writescope serve`` (writescope/serve/protocol.py): OpenAI's fields that the
server does not implement are refused (400 naming the field and its value) unless sent at a value
that changes nothing, and a field OpenAI's API does not have is refused as unknown, as OpenAI's own
API does; on a real loopback server over the tiny preset.

The accepted values are checked by their effect: the response equals the one of the same request
without them (greedy). The field lists are checked against the official ``openai`` client's
request types, so that no field it can send is called unknown.
"""

from __future__ import annotations

import pytest

pytest.importorskip("fastapi")
httpx = pytest.importorskip("httpx")

from writescope.serve.protocol import ChatCompletionRequest, CompletionRequest  # noqa: E402
from serve_helpers import MODEL, WAIT_S, complete, per_choice, post, stream  # noqa: E402

from serve_fixtures import CHAT, PROMPT, llm, server  # noqa: E402,F401

COMPLETIONS, CHAT_PATH = "/v1/completions", "/v1/chat/completions"
TOOL = {"type": "function", "function": {"name": "f", "parameters": {"type": "object", "properties": {}}}}


def route(path: str) -> str:
    return "chat" if path == CHAT_PATH else "completions"


def body_of(path: str) -> dict:
    return {"prompt": PROMPT} if path == COMPLETIONS else {"messages": CHAT}


def answer(response: dict, chat: bool) -> list[tuple]:
    """Each choice's (text, finish_reason)."""
    return [(c["message"]["content"] if chat else c["text"], c["finish_reason"]) for c in response["choices"]]


# ---------------------------------------------------------------- not implemented, at a value that changes the result
UNSUPPORTED = [  # (route, the fields sent, the field refused, its value as the message shows it)
    (COMPLETIONS, {"best_of": 2}, "best_of", "2"),
    (COMPLETIONS, {"best_of": 3, "n": 2}, "best_of", "3"),
    (COMPLETIONS, {"best_of": 2, "stream": True}, "best_of", "2"),
    (COMPLETIONS, {"logit_bias": {"50": 100}}, "logit_bias", '{"50": 100}'),
    (COMPLETIONS, {"suffix": "\n}"}, "suffix", '"\\n}"'),
    (COMPLETIONS, {"frequency_penalty": 0.5}, "frequency_penalty", "0.5"),
    (COMPLETIONS, {"presence_penalty": -1}, "presence_penalty", "-1"),
    (CHAT_PATH, {"frequency_penalty": 1}, "frequency_penalty", "1"),
    (CHAT_PATH, {"logit_bias": {"7": -100}}, "logit_bias", '{"7": -100}'),
    (CHAT_PATH, {"tools": [TOOL]}, "tools", '[{"type": "function", "function": {"name": "f", "paramete...'),  # shortened
    (CHAT_PATH, {"tool_choice": "required"}, "tool_choice", '"required"'),
    (CHAT_PATH, {"functions": [TOOL["function"]]}, "functions", '[{"name": "f", "parameters": {"type": "object", "properti...'),
    (CHAT_PATH, {"response_format": {"type": "json_object"}}, "response_format", '{"type": "json_object"}'),
    (CHAT_PATH, {"response_format": {"type": "json_object"}, "stream": True}, "response_format", '{"type": "json_object"}'),
    (CHAT_PATH, {"store": True}, "store", "true"),
]


def refused(server, path: str, change: dict, param: str) -> dict:
    """The error of a request to ``path`` with ``change``, checked to be a 400 naming ``param``."""
    r = post(server, path, max_tokens=4, **body_of(path), **change)
    assert r.status_code == 400, r.text
    err = r.json()["error"]
    assert (err["type"], err["param"], err["code"]) == ("invalid_request_error", param, 400)
    return err


@pytest.mark.parametrize("case", UNSUPPORTED, ids=[f"{route(p)}-{'-'.join(c)}" for p, c, _, _ in UNSUPPORTED])
def test_an_unimplemented_field_that_would_change_the_result_gets_400(server, case):
    path, change, field, shown = case
    err = refused(server, path, change, field)
    assert err["message"].startswith(f"{field}: {shown} is not supported by this server ("), err["message"]
    assert "leave it out or send " in err["message"]


def test_several_refused_fields_are_all_named(server):
    r = post(server, COMPLETIONS, prompt=PROMPT, max_tokens=4, logit_bias={"1": 5}, top_k=3)
    assert r.status_code == 400, r.text
    msg = r.json()["error"]["message"]
    assert msg.startswith("logit_bias: {\"1\": 5} is not supported") and "; top_k: unknown field" in msg, msg


# ---------------------------------------------------------------- not implemented, at a value that changes nothing
HARMLESS = [
    (COMPLETIONS, {"user": "user-1", "best_of": 1, "frequency_penalty": 0, "presence_penalty": 0.0, "logit_bias": {},
                   "suffix": ""}),
    (COMPLETIONS, {"logit_bias": None, "suffix": None, "best_of": None, "frequency_penalty": None}),
    (COMPLETIONS, {"n": 2, "best_of": 2}),  # best_of = n: every candidate is returned
    (COMPLETIONS, {"n": 2, "best_of": 1}),
    (CHAT_PATH, {"user": "u", "frequency_penalty": 0, "presence_penalty": 0, "logit_bias": {}, "tools": [],
                 "tool_choice": "none", "functions": [], "function_call": "auto", "parallel_tool_calls": False,
                 "response_format": {"type": "text"}, "modalities": ["text"], "store": False, "metadata": {"k": "v"},
                 "service_tier": "auto", "safety_identifier": "s", "prompt_cache_key": "p", "verbosity": "medium",
                 "reasoning_effort": None, "audio": None}),
]


@pytest.mark.parametrize("case", HARMLESS, ids=[f"{route(p)}-{i}" for i, (p, _) in enumerate(HARMLESS)])
def test_an_unimplemented_field_at_a_value_that_changes_nothing_is_accepted(server, case):
    path, change = case
    chat = path == CHAT_PATH
    plain = {**body_of(path), "max_tokens": 6, "temperature": 0, "n": change.get("n", 1)}
    want = post(server, path, **plain)
    assert want.status_code == 200, want.text
    r = post(server, path, **{**plain, **change})
    assert r.status_code == 200, r.text
    assert answer(r.json(), chat) == answer(want.json(), chat)
    options = {"include_usage": True, "include_obfuscation": False}  # OpenAI's stream_options, both
    got = per_choice(stream(server, path, **{**plain, **change}, stream_options=options), chat=chat)
    assert [(got[i]["text"], got[i]["finish"][0]) for i in sorted(got)] == answer(want.json(), chat)


# ---------------------------------------------------------------- unknown fields
UNKNOWN = [  # (route, the fields sent, the field named, where the message puts it)
    (COMPLETIONS, {"top_k": 5}, "top_k", "top_k"),  # a vLLM extension this server does not read
    (COMPLETIONS, {"min_p": 0.1, "stream": True}, "min_p", "min_p"),
    (COMPLETIONS, {"messages": CHAT}, "messages", "messages"),  # chat's field
    (COMPLETIONS, {"max_completion_tokens": 3}, "max_completion_tokens", "max_completion_tokens"),
    (CHAT_PATH, {"echo": True}, "echo", "echo"),  # completions' field
    (CHAT_PATH, {"temprature": 0}, "temprature", "temprature"),  # a misspelt field
    (CHAT_PATH, {"stream": True, "stream_options": {"include_usage": True, "usage": True}}, "stream_options",
     "stream_options.usage"),
]


@pytest.mark.parametrize("case", UNKNOWN, ids=[f"{route(p)}-{w}" for p, _, _, w in UNKNOWN])
def test_a_field_of_no_api_gets_400_unknown_field(server, case):
    path, change, param, where = case
    err = refused(server, path, change, param)
    assert err["message"].startswith(f"{where}: unknown field ("), err["message"]
    assert err["message"].endswith("): remove it")
    if where != "stream_options.usage":  # the body's own fields: the vLLM extensions read here are named
        assert "ignore_eos, stop_token_ids, return_token_ids, include_stop_str_in_output" in err["message"]


def test_the_vllm_extensions_read_here_are_not_unknown(server):
    body = complete(server, prompt=PROMPT, max_tokens=3, temperature=0, ignore_eos=True, stop_token_ids=[],
                    return_token_ids=True, include_stop_str_in_output=False)
    assert len(body["choices"][0]["token_ids"]) == 3


# ---------------------------------------------------------------- the official client
def _openai_fields(params_module) -> set[str]:
    return set(params_module.CompletionCreateParamsBase.__annotations__) | {"stream"}


def test_every_field_of_the_openai_client_is_read_or_known_as_unimplemented():
    """No field the official client can send is unknown here, and every field named unimplemented
    is one of OpenAI's (no misspelt entry accepts a field silently)."""
    pytest.importorskip("openai")
    from openai.types import completion_create_params
    from openai.types.chat import completion_create_params as chat_create_params

    for model, params in ((CompletionRequest, completion_create_params), (ChatCompletionRequest, chat_create_params)):
        openai_fields = _openai_fields(params)
        ours = set(model.model_fields) - set(model.EXTENSIONS)
        assert ours <= openai_fields, ours - openai_fields
        assert set(model.UNIMPLEMENTED) <= openai_fields, set(model.UNIMPLEMENTED) - openai_fields
        assert openai_fields <= ours | set(model.UNIMPLEMENTED), openai_fields - ours - set(model.UNIMPLEMENTED)


def test_openai_client_sends_accepted_fields_and_reads_the_refusal(server):
    openai = pytest.importorskip("openai")
    client = openai.OpenAI(base_url=server.url + "/v1", api_key="unused", timeout=WAIT_S, max_retries=0)
    plain = client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=5, temperature=0)
    c = client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=5, temperature=0, user="me", best_of=1,
                                  frequency_penalty=0, presence_penalty=0, logit_bias={})
    assert c.choices[0].text == plain.choices[0].text
    with pytest.raises(openai.BadRequestError) as e:
        client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=5, best_of=4)
    assert e.value.status_code == 400 and "best_of: 4 is not supported" in str(e.value)
    with pytest.raises(openai.BadRequestError) as e:
        client.chat.completions.create(model=MODEL, messages=CHAT, max_tokens=5, tools=[TOOL])
    assert "tools: " in str(e.value) and "is not supported" in str(e.value)
    with pytest.raises(openai.BadRequestError) as e:
        client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=5, extra_body={"top_k": 2})
    assert "top_k: unknown field" in str(e.value)


def test_message_fields_are_checked_as_the_body_s_are(server):
    """In ``messages``: name, tool_call_id and refusal change nothing (the same greedy answer);
    tool_calls (non-empty), function_call and audio get a 400 naming the message's field; a field
    OpenAI's messages do not have is unknown."""
    plain = post(server, CHAT_PATH, max_tokens=4, temperature=0, messages=CHAT)
    assert plain.status_code == 200, plain.text
    named = [dict(m, name="alice", refusal=None, tool_call_id="c0") for m in CHAT]
    named[-1]["tool_calls"] = []
    same = post(server, CHAT_PATH, max_tokens=4, temperature=0, messages=named)
    assert same.status_code == 200, same.text
    assert answer(same.json(), True) == answer(plain.json(), True)
    call = {"id": "c1", "type": "function", "function": {"name": "f", "arguments": "{}"}}
    for field, value, shown in (("tool_calls", [call], "tool_calls"), ("function_call", {"name": "f", "arguments": "{}"}, "function_call"),
                                ("audio", {"id": "a1"}, "audio")):
        bad = [dict(m) for m in CHAT]
        bad[0][field] = value
        r = post(server, CHAT_PATH, max_tokens=4, messages=bad)
        assert r.status_code == 400, r.text
        err = r.json()["error"]
        assert err["param"] == "messages" and err["message"].startswith(f"messages.0.{shown}: "), err
        assert "is not supported by this server" in err["message"]
    for content in ({"content": None}, {}):  # OpenAI's assistant message with tool calls: null or no content
        bad = [dict(m) for m in CHAT] + [{"role": "assistant", **content, "tool_calls": [call]}]
        r = post(server, CHAT_PATH, max_tokens=4, messages=bad)
        assert r.status_code == 400, r.text
        assert r.json()["error"]["message"].startswith(f"messages.{len(CHAT)}.tool_calls: "), r.json()
    r = post(server, CHAT_PATH, max_tokens=4, messages=[{"role": "user", "content": None}])
    assert r.status_code == 400 and r.json()["error"]["message"].startswith("messages.0.content: a message needs its text"), r.text
    odd = [dict(m) for m in CHAT]
    odd[0]["colour"] = "blue"
    r = post(server, CHAT_PATH, max_tokens=4, messages=odd)
    assert r.status_code == 400 and r.json()["error"]["param"] == "messages"
    assert r.json()["error"]["message"].startswith("messages.0.colour: unknown field (OpenAI's chat message has no such field")
    assert post(server, CHAT_PATH, max_tokens=2, messages=CHAT).status_code == 200  # the server stays up


def test_every_message_field_of_the_openai_client_is_read_or_in_the_table():
    """No field the official client can put in a chat message is called unknown, and every entry
    of the message table is one it has."""
    chat = pytest.importorskip("openai.types.chat")
    from writescope.serve.protocol import ChatMessage

    fields = set()
    for name in ("System", "User", "Assistant", "Tool", "Developer", "Function"):
        fields |= set(getattr(chat, f"ChatCompletion{name}MessageParam").__annotations__)
    known = set(ChatMessage.model_fields) | set(ChatMessage.UNIMPLEMENTED)
    assert fields <= known, sorted(fields - known)
    assert set(ChatMessage.UNIMPLEMENTED) <= fields, sorted(set(ChatMessage.UNIMPLEMENTED) - fields)
