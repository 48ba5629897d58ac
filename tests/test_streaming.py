"""Decoded text as it is produced (issue 19, item 1): the incremental detokenizer, the engine's
per-step callback, and ``writescope generate`` streaming one request / showing a batch's bar."""

import json

from writescope.cli.generate import STREAM_HEADER
from writescope.cli.main import main
from writescope.engine.streaming import REPLACEMENT, BatchProgress, IncrementalDetokenizer, TokenEvent

PROMPT = "def main():\n    return"


def _tokenizer():
    from writescope.checkpoint.tokenizer import synthetic_tokenizer

    return synthetic_tokenizer(4096)  # the byte-level BPE of the tiny presets


def test_incremental_detokenizer_prints_split_characters_whole():
    """Characters whose UTF-8 bytes are spread over tokens (accents, CJK, emoji in a 4096-token
    BPE trained on Python sources) come out whole, once their last byte arrives, and the pieces
    concatenate to the decode of all ids."""
    tok = _tokenizer()
    text = "naïve café — 世界 🙂 naïve 🙂🙂 end\n"
    ids = tok.encode(text)
    assert any(REPLACEMENT in tok.decode([i]) for i in ids), "no token ends inside a character: the case is not exercised"
    detok = IncrementalDetokenizer(tok.decode)
    pieces = [detok.push(i) for i in ids]
    assert "" in pieces, "a token ending inside a character must print nothing yet"
    assert not any(REPLACEMENT in p for p in pieces)
    assert detok.finish() == ""
    assert "".join(pieces) == tok.decode(ids) == text


def test_incremental_detokenizer_finish_prints_an_unfinished_tail_as_the_final_text_does():
    tok = _tokenizer()
    ids = tok.encode("ab 🙂")
    cut = next(n for n in range(len(ids), 0, -1) if tok.decode(ids[:n]).endswith(REPLACEMENT))  # stop inside the emoji
    detok = IncrementalDetokenizer(tok.decode)
    streamed = "".join(detok.push(i) for i in ids[:cut]) + detok.finish()
    assert streamed == tok.decode(ids[:cut])


def test_generate_calls_on_tokens_with_every_token_as_it_is_sampled():
    from writescope import LLM, SamplingParams

    llm = LLM("tiny-qwen3-moe", device="cpu", progress=False)
    calls = []
    outs = llm.generate(prompt_token_ids=[[5, 6, 7], [8, 9]],
                        sampling_params=[SamplingParams(max_tokens=4, ignore_eos=True), SamplingParams(max_tokens=2, ignore_eos=True)],
                        on_tokens=lambda events: calls.append(list(events)))
    assert [len(c) for c in calls] == [2, 2, 1, 1], "one event per running request: after the prefill, then per decode step"
    for i, o in enumerate(outs):
        mine = [e for c in calls for e in c if e.index == i]
        assert [e.token_id for e in mine] == o.token_ids
        assert [e.finish_reason for e in mine] == [None] * (len(mine) - 1) + ["length"]


def test_generate_streams_a_single_request_and_the_stream_equals_the_final_text(tmp_path, capsys):
    out = tmp_path / "o.json"
    assert main(["generate", "--model", "tiny-qwen3-moe", "--synthetic", "--prompt", PROMPT, "--max-new-tokens", "40",
                 "--device", "cpu", "--ignore-eos", "--output-json", str(out)]) == 0
    printed = capsys.readouterr().out
    text = json.loads(out.read_text())["requests"][0]["text"]
    assert STREAM_HEADER in printed, "a single request streams its text"
    streamed = printed.split(STREAM_HEADER + "\n", 1)[1].split("\n--- request 0:", 1)[0]
    assert streamed == text
    assert printed.count(text) == 1, "the streamed text is not printed a second time"


def test_quiet_streams_nothing_and_prints_the_text_once_finished(tmp_path, capsys, monkeypatch):
    import writescope.engine.llm as engine

    seen = []
    generate = engine.LLM.generate
    monkeypatch.setattr(engine.LLM, "generate", lambda self, *a, **kw: seen.append(kw.get("on_tokens")) or generate(self, *a, **kw))
    out = tmp_path / "o.json"
    assert main(["generate", "--model", "tiny-qwen3-moe", "--prompt", PROMPT, "--max-new-tokens", "12", "--device", "cpu",
                 "--ignore-eos", "--quiet", "--output-json", str(out)]) == 0
    captured = capsys.readouterr()
    assert seen == [None], "--quiet passes no streaming callback"
    assert STREAM_HEADER not in captured.out and "tok/s]" not in captured.err
    text = json.loads(out.read_text())["requests"][0]["text"]
    assert captured.out.split("\n--- request 0:", 1)[1].split("\n", 1)[1].startswith(text + "\n")


def test_batch_shows_a_progress_bar_with_tok_s(capsys):
    assert main(["generate", "--model", "tiny-qwen3-moe", "--prompt", PROMPT, "--max-new-tokens", "6", "--device", "cpu",
                 "--ignore-eos", "--batch", "3"]) == 0
    captured = capsys.readouterr()
    assert STREAM_HEADER not in captured.out, "a batch is not streamed (its texts would interleave)"
    assert "tok/s" in captured.err and "18/18" in captured.err and "requests done 3/3" in captured.err
    assert captured.out.count("\n--- request ") == 3


def test_batch_progress_takes_an_early_stop_off_the_total():
    bar = BatchProgress([5, 5], disable=True)
    bar([TokenEvent(0, 1, None), TokenEvent(1, 1, "stop")])  # request 1 stops at its first token
    assert bar.bar.total == 6 and bar.finished == 1
    for _ in range(3):
        bar([TokenEvent(0, 1, None)])
    bar([TokenEvent(0, 1, "length")])
    assert sum(bar.produced) == bar.bar.total == 6 and bar.finished == 2
