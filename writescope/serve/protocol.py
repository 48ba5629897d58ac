"""Request bodies of the OpenAI API (the fields this server reads), validated by pydantic:
strict types (``"max_tokens": "10"`` is refused, not coerced), ranges, and sizes.

Fields the server does not read are ignored (clients send many); combinations it cannot honour
(completions' ``echo`` with ``logprobs``: the prompt's logprobs are not computed) are refused with a
message naming them. ``stop`` is a string or up to MAX_STOP non-empty strings; ``n`` is 1..MAX_N;
completions' ``logprobs`` is 0..MAX_TOP_LOGPROBS (the legacy API's limit), chat's is a bool with
``top_logprobs`` 0..MAX_TOP_LOGPROBS beside it; completions' ``max_tokens`` may be 0 with ``echo``
only (the prompt back, nothing generated).
"""

from __future__ import annotations

from typing import Annotated, Literal, Union

from pydantic import (BaseModel, ConfigDict, Field, StrictBool, StrictFloat, StrictInt, StrictStr, ValidationInfo, field_validator,
                      model_validator)

from writescope.engine.sampling import MAX_N  # noqa: F401 - choices per request (SamplingParams.n's limit)

MAX_PROMPT_CHARS = 4 * 2**20  # a prompt of more characters is refused before tokenization
MAX_MESSAGES = 4096
MAX_STOP = 4  # stop strings per request (OpenAI's limit)
MAX_TOP_LOGPROBS = 5  # top logprobs per token (the completions API's limit; chat's too here)

Number = Union[StrictInt, StrictFloat]
TokenIds = Annotated[list[Annotated[StrictInt, Field(ge=0)]], Field(min_length=1)]


class StreamOptions(BaseModel):
    model_config = ConfigDict(extra="ignore")
    include_usage: StrictBool = False


class _Common(BaseModel):
    """Sampling fields shared by completions and chat completions."""

    model_config = ConfigDict(extra="ignore")

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
            raise ValueError("max_tokens 0 generates nothing: give max_tokens >= 1, or echo: true to get the prompt back alone")
        return self


class TextPart(BaseModel):
    model_config = ConfigDict(extra="ignore")
    type: Literal["text"]
    text: StrictStr


class ChatMessage(BaseModel):
    model_config = ConfigDict(extra="ignore")
    role: Literal["system", "user", "assistant", "developer", "tool"]
    content: Annotated[StrictStr, Field(max_length=MAX_PROMPT_CHARS)] | list[TextPart]

    def text(self) -> str:
        return self.content if isinstance(self.content, str) else "".join(p.text for p in self.content)


class ChatCompletionRequest(_Common):
    """``POST /v1/chat/completions``; without ``max_tokens``, up to the rest of ``max_model_len``."""

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
