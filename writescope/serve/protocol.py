"""Request bodies of the OpenAI API (the fields this server reads), validated by pydantic:
strict types (``"max_tokens": "10"`` is refused, not coerced), ranges, and sizes.

Fields are checked as OpenAI's own API checks them: a field that is neither OpenAI's (for that
route) nor one of the vLLM extensions read here (:data:`VLLM_EXTENSIONS`) is refused ("unknown
field"); one of OpenAI's that this server does not implement (``best_of``, ``logit_bias``,
``tools``, ...: each body's ``UNIMPLEMENTED``) is accepted at the values that change nothing
(``"user"``, ``"best_of": 1``, ``"frequency_penalty": 0``, ``"logit_bias": {}``, as clients and
libraries send them) and refused at any other, the 400 naming the field and its value; each of
``messages`` is checked the same way (:class:`ChatMessage`).
Combinations the server cannot honour (completions' ``echo`` with ``logprobs``: the prompt's
logprobs are not computed) are refused with a message naming them. ``stop`` is a string or up
to MAX_STOP non-empty strings; ``n`` is 1..MAX_N; completions' ``logprobs`` is
0..MAX_TOP_LOGPROBS (the legacy API's limit), chat's is a bool with ``top_logprobs``
0..MAX_TOP_LOGPROBS beside it; completions' ``max_tokens`` may be 0 with ``echo`` only (the
prompt back, nothing generated).
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Annotated, Callable, ClassVar, Literal, Union

from pydantic import (BaseModel, ConfigDict, Field, StrictBool, StrictFloat, StrictInt, StrictStr, ValidationError,
                      ValidationInfo, field_validator, model_validator)
from pydantic_core import InitErrorDetails, PydanticCustomError

from writescope.engine.sampling import MAX_N  # noqa: F401 - choices per request (SamplingParams.n's limit)

MAX_PROMPT_CHARS = 4 * 2**20  # a prompt of more characters is refused before tokenization
MAX_MESSAGES = 4096
MAX_STOP = 4  # stop strings per request (OpenAI's limit)
MAX_TOP_LOGPROBS = 5  # top logprobs per token (the completions API's limit; chat's too here)
VLLM_EXTENSIONS = ("ignore_eos", "stop_token_ids", "return_token_ids", "include_stop_str_in_output")  # read beside OpenAI's
#: the validation error types whose message names the field's value itself (the 400 adds no "(got ...)")
VALUE_WORDED = ("unknown_field", "unsupported_field", "field_value")

Number = Union[StrictInt, StrictFloat]
TokenIds = Annotated[list[Annotated[StrictInt, Field(ge=0)]], Field(min_length=1)]


# ---------------------------------------------------------------- fields not implemented, unknown fields
@dataclass(frozen=True)
class Unimplemented:
    """One of OpenAI's request fields that this server does not implement, and its values that
    change nothing (sent, and ignored).

    Attributes:
        harmless: ``(value, body) -> bool``: True for a value that changes nothing (``value`` as
            JSON decoded it; ``body``: the request, for a value that depends on its other fields,
            as ``best_of`` on ``n``).
        why: what this server does instead (the 400's words).
        instead: the harmless values, as the 400 names them (JSON).
    """

    harmless: Callable[[object, BaseModel], bool]
    why: str = ""
    instead: str = "null"


def _only(*values) -> Callable[[object, BaseModel], bool]:
    """A ``harmless`` of null and ``values`` (JSON equality: ``0`` is ``0.0``, ``false`` is neither)."""
    return lambda v, body: v is None or any(isinstance(v, bool) == isinstance(a, bool) and v == a for a in values)


def _best_of(v, body) -> bool:
    return v is None or (type(v) is int and v in (1, body.n))


ANY = Unimplemented(lambda v, body: True)  # changes nothing at any value
NO_PENALTY = Unimplemented(_only(0), "no repetition penalty is applied", "0")
NO_BIAS = Unimplemented(_only({}), "the logits are not biased", "{}")
NO_TOOLS = Unimplemented(_only([]), "no tool calling", "[]")
NO_TOOL_CHOICE = Unimplemented(_only("none", "auto"), "no tool calling", '"none" or "auto"')

#: OpenAI's fields of both routes that this server does not implement
UNIMPLEMENTED_COMMON = {
    "frequency_penalty": NO_PENALTY,
    "presence_penalty": NO_PENALTY,
    "logit_bias": NO_BIAS,
    "user": ANY,  # an end-user id for OpenAI's abuse monitoring
}


class _Body(BaseModel):
    """A request object whose fields are checked, not dropped: one of OpenAI's in ``UNIMPLEMENTED``
    at a value that changes the result, or one in neither OpenAI's object (``API``) nor this
    model, is a validation error at its own place (``loc``), so the 400 names it."""

    model_config = ConfigDict(extra="allow")  # the extra fields are checked by _extra_fields
    API: ClassVar[str] = "OpenAI's API"  # what the unknown-field error calls the object ("OpenAI's completions API")
    UNIMPLEMENTED: ClassVar[dict[str, Unimplemented]] = {}
    EXTENSIONS: ClassVar[tuple[str, ...]] = ()  # the vLLM extensions among this model's fields, named in that error

    @model_validator(mode="after")
    def _extra_fields(self):
        errors = []  # (error type, message, field, value)
        read = ", ".join(self.EXTENSIONS)
        also = f", nor is it one of the vLLM extensions this server reads: {read}" if read else ""
        for name, value in (self.model_extra or {}).items():
            field = self.UNIMPLEMENTED.get(name)
            if field is None:
                errors.append(("unknown_field", f"unknown field ({self.API} has no such field{also}): remove it", name, value))
            elif not field.harmless(value, self):
                words = f"{json_value(value)} is not supported by this server ({field.why}): leave it out or send {field.instead}"
                errors.append(("unsupported_field", words, name, value))
        if errors:
            raise _field_errors(self, errors)
        return self


def _field_errors(body: BaseModel, errors: list[tuple[str, str, str, object]]) -> ValidationError:
    """A validation error of ``body`` (a model validator's), each of ``errors`` (error type,
    message, field, value) at its field's place (``loc``), so the 400 names the field, also as
    ``param``; a model validator's ValueError would have no place."""
    return ValidationError.from_exception_data(type(body).__name__, [
        InitErrorDetails(type=PydanticCustomError(kind, "{message}", {"message": msg}), loc=(name,), input=value)
        for kind, msg, name, value in errors])


def json_value(value) -> str:
    """``value`` as the body had it (JSON), shortened."""
    text = json.dumps(value, ensure_ascii=False, default=repr)
    return text if len(text) <= 60 else text[:57] + "..."


class StreamOptions(_Body):
    API = "OpenAI's stream_options"
    UNIMPLEMENTED = {"include_obfuscation": ANY}  # random padding OpenAI adds to chunks: none is added here
    include_usage: StrictBool = False


class _Common(_Body):
    """Sampling fields shared by completions and chat completions."""

    EXTENSIONS = VLLM_EXTENSIONS

    model: StrictStr
    max_tokens: StrictInt | None = Field(None, ge=1)
    temperature: Number = Field(1.0, ge=0, le=2)
    top_p: Number = Field(1.0, gt=0, le=1)
    n: StrictInt = Field(1, ge=1, le=MAX_N)  # independent choices of one prompt (choice i samples with seed + i)
    seed: StrictInt | None = None
    stream: StrictBool = False
    stream_options: StreamOptions | None = None
    stop: StrictStr | list[StrictStr] | None = None
    # vLLM's extensions
    ignore_eos: StrictBool = False
    stop_token_ids: list[Annotated[StrictInt, Field(ge=0)]] = Field(default_factory=list, max_length=1024)
    return_token_ids: StrictBool = False  # each choice also carries its token ids (``token_ids``)
    include_stop_str_in_output: StrictBool = False  # the stop string that ended the text stays in it

    @model_validator(mode="after")
    def _stream_options_with_stream(self):
        if self.stream_options is not None and not self.stream:
            raise _field_errors(self, [("field_value", "stream_options is only allowed with stream: true (as OpenAI's API "
                                        "says): send stream: true or leave stream_options out", "stream_options",
                                        self.stream_options.model_dump())])
        return self

    @field_validator("temperature", "top_p", "n", mode="before")
    @classmethod
    def _null_is_the_default(cls, v, info: ValidationInfo):
        """null is the field's default, as OpenAI reads it (clients send null for a None argument)."""
        return cls.model_fields[info.field_name].default if v is None else v

    @field_validator("stop")
    @classmethod
    def _stop(cls, v):
        stops = [v] if isinstance(v, str) else (v or [])
        if len(stops) > MAX_STOP:
            raise ValueError(f"at most {MAX_STOP} stop strings, not {len(stops)}")
        if not all(stops):
            raise ValueError("a stop string must not be empty")
        return v

    @property
    def stop_strings(self) -> tuple[str, ...]:
        return (self.stop,) if isinstance(self.stop, str) else tuple(self.stop or ())


class CompletionRequest(_Common):
    """``POST /v1/completions``: ``prompt`` is one string or one list of token ids."""

    API = "OpenAI's completions API"
    UNIMPLEMENTED = {
        **UNIMPLEMENTED_COMMON,
        "best_of": Unimplemented(_best_of, "each choice is returned as sampled: no extra candidates are ranked", "1 or n"),
        "suffix": Unimplemented(_only(""), "no text is inserted before a suffix", '""'),
    }

    prompt: Annotated[StrictStr, Field(max_length=MAX_PROMPT_CHARS)] | TokenIds
    max_tokens: StrictInt | None = Field(16, ge=0)  # OpenAI's default; 0 with echo only

    @field_validator("prompt", mode="before")
    @classmethod
    def _one_prompt(cls, v):
        if isinstance(v, list) and len(v) == 1 and isinstance(v[0], (str, list)):  # a batch of one, as OpenAI clients send
            return v[0]
        if isinstance(v, list) and v and all(isinstance(p, (str, list)) for p in v):
            raise ValueError(f"one prompt per request (a string or a list of token ids), got a list of {len(v)} prompts: "
                             "send one request per prompt, or use n for several choices of one")
        return v
    echo: StrictBool = False  # each choice's text starts with the prompt's
    logprobs: StrictInt | None = Field(None, ge=0, le=MAX_TOP_LOGPROBS)  # the legacy shape: tokens, token_logprobs, ...

    @property
    def top_logprobs_count(self) -> int | None:
        """Top logprobs per token to compute (None: no logprobs)."""
        return self.logprobs

    @field_validator("logprobs")
    @classmethod
    def _logprobs(cls, v, info: ValidationInfo):
        if v is not None and info.data.get("echo"):
            raise ValueError("echo with logprobs is not supported (the prompt's logprobs, which echo would return, are not "
                             "computed here): drop echo or logprobs")
        return v

    @model_validator(mode="after")
    def _max_tokens(self):
        if self.max_tokens == 0 and not self.echo:
            raise _field_errors(self, [("field_value", "0 generates nothing: give max_tokens >= 1, or echo: true to get the "
                                        "prompt back alone", "max_tokens", 0)])
        return self


class TextPart(BaseModel):
    model_config = ConfigDict(extra="ignore")
    type: Literal["text"]
    text: StrictStr

    @model_validator(mode="before")
    @classmethod
    def _text_only(cls, v):
        """A part of another type (an image, audio, a file) is refused by its type, before its
        missing ``text`` would be."""
        if isinstance(v, dict) and "type" in v and v["type"] != "text":
            raise ValueError(f"a content part of type {json_value(v.get('type'))} is not supported: this server reads text "
                             'only, as a string or parts {"type": "text", "text": ...}')
        return v


class ChatMessage(_Body):
    """One of ``messages``: its role and text. OpenAI's other message fields are checked as a
    body's are: ``name``, ``tool_call_id`` and ``refusal`` change nothing here (the chat template
    renders the role and the text); ``tool_calls``, ``function_call`` and ``audio`` would need what
    this server does not do, so they are refused unless empty."""

    API = "OpenAI's chat message"
    UNIMPLEMENTED = {
        "name": ANY,  # a participant's name: not rendered by the template
        "tool_call_id": ANY,  # which call a tool message answers: its text is what is rendered
        "refusal": ANY,  # an assistant's earlier refusal text, sent back
        "tool_calls": NO_TOOLS,
        "function_call": Unimplemented(_only(), "no tool calling"),
        "audio": Unimplemented(_only(), "text only"),
    }
    role: Literal["system", "user", "assistant", "developer", "tool"]
    # null (or left out) only beside tool_calls or function_call, as OpenAI's assistant messages send it: those
    # are then refused by name (UNIMPLEMENTED) rather than the missing text
    content: Annotated[StrictStr, Field(max_length=MAX_PROMPT_CHARS)] | list[TextPart] | None = None

    @model_validator(mode="after")
    def _content_or_a_call(self):
        extra = self.model_extra or {}
        if self.content is None and not extra.get("tool_calls") and not extra.get("function_call"):
            raise _field_errors(self, [("field_value", "a message needs its text (a string or a list of text parts); null is "
                                        "OpenAI's form only beside tool_calls, which this server does not do", "content", None)])
        return self

    def text(self) -> str:
        if self.content is None:
            return ""
        return self.content if isinstance(self.content, str) else "".join(p.text for p in self.content)


class ChatCompletionRequest(_Common):
    """``POST /v1/chat/completions``; without ``max_tokens``, up to the rest of ``max_model_len``."""

    API = "OpenAI's chat completions API"
    UNIMPLEMENTED = {
        **UNIMPLEMENTED_COMMON,
        "audio": Unimplemented(_only(), "text output only"),
        "function_call": NO_TOOL_CHOICE,
        "functions": NO_TOOLS,
        "metadata": ANY,  # tags of a stored completion
        "modalities": Unimplemented(_only(["text"]), "text output only", '["text"]'),
        "moderation": Unimplemented(_only(), "no moderation is run"),
        "parallel_tool_calls": ANY,  # means something with tools only
        "prediction": ANY,  # predicted output: a latency hint, the output is the same
        "prompt_cache_key": ANY,  # prompt caching hints
        "prompt_cache_options": ANY,
        "prompt_cache_retention": ANY,
        "reasoning_effort": Unimplemented(_only("none"), "the reasoning effort is not set", '"none"'),
        "response_format": Unimplemented(_only({"type": "text"}), "the output is not constrained to a format",
                                         '{"type": "text"}'),
        "safety_identifier": ANY,  # an end-user id, as user
        "service_tier": ANY,  # latency and pricing
        "store": Unimplemented(_only(False), "completions are not stored", "false"),
        "tool_choice": NO_TOOL_CHOICE,
        "tools": NO_TOOLS,
        "verbosity": Unimplemented(_only("medium"), "no verbosity control", '"medium" (the default)'),
        "web_search_options": Unimplemented(_only(), "no web search"),
    }

    messages: list[ChatMessage] = Field(min_length=1, max_length=MAX_MESSAGES)
    max_completion_tokens: StrictInt | None = Field(None, ge=1)  # the newer name of max_tokens
    logprobs: StrictBool | None = False  # {"content": [{token, logprob, bytes, top_logprobs}]}
    top_logprobs: StrictInt | None = Field(None, ge=0, le=MAX_TOP_LOGPROBS)

    @field_validator("top_logprobs")
    @classmethod
    def _top_logprobs(cls, v, info: ValidationInfo):
        if v is not None and not info.data.get("logprobs"):
            raise ValueError("top_logprobs needs logprobs: true")
        return v

    @property
    def top_logprobs_count(self) -> int | None:
        return (self.top_logprobs or 0) if self.logprobs else None

    @property
    def max_new(self) -> int | None:
        return self.max_completion_tokens if self.max_completion_tokens is not None else self.max_tokens


# ---------------------------------------------------------------- union errors in plain words
#: what a field of several types takes, in the 400's words (the union's branches otherwise each say their own)
EXPECTED = {
    "prompt": "a string or a list of token ids (integers >= 0)",
    "temperature": "a number from 0 to 2",
    "top_p": "a number above 0, at most 1",
    "stop": f"a string or a list of up to {MAX_STOP} strings",
    "content": 'a string or a list of text parts {"type": "text", "text": ...}',
}


def _branch_kind(tag: str) -> str | None:
    """The JSON kind of a union branch as pydantic tags it in an error's ``loc``
    (``"constrained-str"``, ``"list[constrained-int]"``, ``"float"``), or None where the element
    is no such tag (a field name, or a model's)."""
    if tag.startswith("list["):
        return "list"
    base = tag.removeprefix("constrained-")
    return {"str": "string", "int": "number", "float": "number", "bool": "boolean"}.get(base)


def _json_kind(value) -> str:
    if isinstance(value, bool):
        return "boolean"
    if isinstance(value, (int, float)):
        return "number"
    return {str: "string", list: "list", dict: "object", type(None): "null"}.get(type(value), "other")


def plain_errors(errors: list[dict]) -> list[dict]:
    """pydantic's errors (``ValidationError.errors()``) with each field of several types (a
    union) said once: where one branch is of the value's JSON kind, that branch's errors alone,
    its tag left out of ``loc`` (``prompt: [-1]`` -> ``prompt.0``: ">= 0"); else one error that
    says what the field takes (:data:`EXPECTED`) and what came (``prompt: 5`` -> "must be a
    string or a list of token ids"), of type ``field_value`` (its message names the value).
    Other errors pass unchanged, in order."""
    out, groups = [], {}
    for e in errors:
        loc = tuple(e.get("loc", ()))
        at = next((i for i, x in enumerate(loc) if isinstance(x, str) and _branch_kind(x)), None)
        if at is None:
            out.append(e)
            continue
        prefix = loc[:at]
        if prefix not in groups:
            groups[prefix] = []
            out.append(prefix)  # the group's place in the order
        groups[prefix].append((loc[at], loc[at + 1:], e))
    result = []
    for item in out:
        if isinstance(item, dict):
            result.append(item)
            continue
        branches = groups[item]
        if len({tag for tag, _, _ in branches}) < 2:  # a failed union reports every branch: this is a name, not a tag
            result.extend(e for _, _, e in branches)
            continue
        value = next((e["input"] for _, rest, e in branches if not rest and "input" in e), None)
        kind = _json_kind(value)
        same = [(rest, e) for tag, rest, e in branches if _branch_kind(tag) == kind]
        if same and len({tag for tag, _, _ in branches if _branch_kind(tag) == kind}) == 1:
            result.extend({**e, "loc": item + rest} for rest, e in same)
            continue
        name = next((x for x in reversed(item) if isinstance(x, str)), "")
        takes = EXPECTED.get(name) or " or ".join(sorted({_branch_kind(t) for t, _, _ in branches}))
        result.append({"type": "field_value", "loc": item, "msg": f"must be {takes}, got {json_value(value)}", "input": value})
    return result
