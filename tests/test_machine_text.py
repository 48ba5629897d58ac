"""Long prompts of real text read from this machine (writescope.engine.machine_text)."""

from __future__ import annotations

import pytest

from writescope.checkpoint.tokenizer import synthetic_tokenizer
from writescope.cli.main import main
from writescope.engine.machine_text import REQUEST_SHIFT, machine_prompts, machine_text


def test_text_is_real_prose_from_the_installation():
    t = machine_text(5000)
    assert len(t) >= 5000 and "Python" in t and "# " in t


def test_prompts_have_the_exact_length_and_differ():
    tok = synthetic_tokenizer(2000)
    prompts, have = machine_prompts(tok, 1500, 3)
    assert [len(p) for p in prompts] == [1500] * 3 and have > 1500 + 2 * REQUEST_SHIFT
    assert prompts[1][: 1500 - REQUEST_SHIFT] == prompts[0][REQUEST_SHIFT:]  # request i starts 997 i tokens in
    assert prompts[0] != prompts[1]


def test_text_repeats_where_it_runs_out():
    tok = synthetic_tokenizer(2000)
    total = len(tok.encode(machine_text(10**9)))  # all the text there is
    prompts, have = machine_prompts(tok, total + 5, 1)
    assert have == total and len(prompts[0]) == total + 5 and prompts[0][total:] == prompts[0][:5]
    with pytest.raises(ValueError, match=">= 1"):
        machine_prompts(tok, 0, 1)


def test_generate_with_machine_text(capsys):
    assert main(["generate", "--model", "tiny-qwen3-moe", "--machine-text", "600", "--batch", "2", "--max-new-tokens", "2",
                 "--quiet", "--policy", "static:0.5", "--window", "64"]) == 0
    out = capsys.readouterr().out
    assert "2 x 600 tokens of this machine's text" in out and out.count("600 prompt tokens") == 2
