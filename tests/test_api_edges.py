"""API and CLI edges a new user trips on (issue 19, item 5): token-id lists as prompts, the
documented public names, ``--version``, help for every flag and the policy defaults, the dtype
make-checkpoint wrote, errors naming the interface's own argument names, and plurals."""

from __future__ import annotations

import argparse
import importlib
import re
from importlib.metadata import version

import pytest

from writescope import LLM, SamplingParams
from writescope.cli.main import main

PRESET = "tiny-qwen3-moe"
PARAMS = SamplingParams(max_tokens=3, ignore_eos=True)


@pytest.fixture(scope="module")
def llm():
    return LLM(PRESET, device="cpu", progress=False)


# ------------------------------------------------------------------ prompts as token ids
def test_token_id_lists_as_prompts_match_prompt_token_ids(llm):
    ref = [o.token_ids for o in llm.generate(prompt_token_ids=[[5, 6, 7], [8, 9]], sampling_params=PARAMS)]
    assert [o.token_ids for o in llm.generate([[5, 6, 7], [8, 9]], PARAMS)] == ref
    outs = llm.generate([{"prompt_token_ids": [5, 6, 7]}, (8, 9)], PARAMS)  # vLLM's TokensPrompt; a tuple
    assert [o.token_ids for o in outs] == ref and outs[0].prompt is None
    text = llm.generate(["hello", [5, 6, 7]], PARAMS)  # text and ids in one batch
    assert text[0].prompt == "hello" and text[1].token_ids == ref[0]


def test_out_of_vocabulary_id_named_with_position_and_vocab_size(llm):
    with pytest.raises(ValueError, match=r"prompts\[0\] has token id 999999 at position 2, outside the model's "
                                         r"vocabulary of 4,096 ids \[0, 4096\)"):
        llm.generate([[1, 2, 999999]])
    with pytest.raises(ValueError, match=r"prompt_token_ids\[1\] has token id -3 at position 0"):
        llm.generate(prompt_token_ids=[[1], [-3]])
    assert llm.cache.active_slots == []


@pytest.mark.parametrize(
    "prompts, pattern",
    [([1, 2, 3], r"prompts is a flat list of integers: .*\[\[1, 2, 3\]\]"),
     ([[1, 2.5]], r"prompts\[0\]\[1\] is 2.5, not a token id"),
     ([None], r"prompts\[0\] is NoneType None: give a string or a list of token ids"),
     ([{"text": "hi"}], r"prompts\[0\] is a dict with keys \['text'\]")],
    ids=["flat-ints", "float-id", "none", "bad-dict"],
)
def test_prompts_that_are_neither_text_nor_ids_refused_clearly(llm, prompts, pattern):
    with pytest.raises(ValueError, match=pattern):
        llm.generate(prompts)


def test_api_errors_name_api_arguments_and_count_in_words(llm):
    with pytest.raises(ValueError, match=r"prompts\[0\] has 1 token \+ max_tokens 9,000 = 9,001, beyond the limit of 8,192 tokens"):
        llm.generate([[7]], SamplingParams(max_tokens=9000))
    with pytest.raises(ValueError, match="^top_p must be in") as e:
        SamplingParams(top_p=1.5)
    assert "--" not in str(e.value)
    with pytest.raises(ValueError, match="^vram_budget: ") as e:
        LLM(PRESET, device="cpu", progress=False, vram_budget="lots")
    assert "--" not in str(e.value)


# ------------------------------------------------------------------ the CLI names its flags
@pytest.mark.parametrize(
    "argv, named, not_named",
    [
        (["--prompt-ids", "1,2,999999"], r"--prompt-ids \(request 0\) has token id 999999 at position 2, .*4,096 ids", "prompt_token_ids"),
        (["--prompt-ids", "7", "--max-new-tokens", "9000"], r"--prompt-ids \(request 0\) has 1 token \+ --max-new-tokens 9,000", "max_tokens"),
        (["--prompt", "hi", "--top-p", "1.5"], r"--top-p must be in \(0, 1\]", "top_p"),
        (["--prompt", "hi", "--temperature", "-1"], r"--temperature must be >= 0", "temperature"),
        (["--prompt", "hi", "--prefill-chunk-tokens", "0"], r"--prefill-chunk-tokens must be >= 1", "prefill_chunk_tokens"),
        (["--prompt", "hi", "--max-model-len", "99999"], r"--max-model-len 99999 must be in \[1, 8192\]", "max_model_len"),
        (["--prompt", "hi", "--vram-budget", "lots"], r"--vram-budget: ", "vram_budget"),
    ],
    ids=["out-of-vocab", "too-long", "top-p", "temperature", "chunk", "max-model-len", "vram-budget"],
)
def test_cli_errors_name_the_cli_flags(capsys, argv, named, not_named):
    assert main(["generate", "--model", PRESET, "--device", "cpu", "--quiet", *argv]) == 2
    err = capsys.readouterr().err
    assert re.search(named, err), err
    assert not re.search(rf"(?<![-\w]){not_named}", err), err  # the API's name, not within its flag


# ------------------------------------------------------------------ documented public names
DOCUMENTED = {  # the API in README.md and docs/USAGE.md, and the package rows of docs/ARCHITECTURE.md
    "writescope": ["LLM", "SamplingParams", "RequestOutput", "CompletionOutput", "RequestMetrics"],
    "writescope.engine": ["LLM", "SamplingParams", "RequestOutput", "CompletionOutput"],
    "writescope.config": ["ModelConfig", "AttentionConfig", "RopeConfig", "MoEConfig", "KVLayout"],
    "writescope.attention": ["ForwardBatch", "attend_sequence", "merge_states"],
    "writescope.layers": ["RMSNorm", "GatedMLP", "GQAAttention", "MLAAttention"],
    "writescope.moe": ["SparseMoeBlock", "route"],
    "writescope.models": ["CausalLM", "build_model"],
    "writescope.kvcache": ["KVCache", "ContiguousKVCache"],
    "writescope.scheduler": ["parse_policy", "route_block"],
}


@pytest.mark.parametrize("package", list(DOCUMENTED))
def test_documented_names_import_from_their_package(package):
    mod = importlib.import_module(package)
    missing = [n for n in DOCUMENTED[package] if not hasattr(mod, n)]
    assert not missing, f"documented but not importable from {package}: {missing}"
    assert not [n for n in getattr(mod, "__all__", []) if not hasattr(mod, n)]


# ------------------------------------------------------------------ --version and help
def test_version_from_package_metadata(capsys):
    with pytest.raises(SystemExit) as e:
        main(["--version"])
    assert e.value.code == 0
    assert capsys.readouterr().out.strip() == f"writescope {version('writescope')}"


def test_version_and_help_do_not_import_torch():
    """`writescope --version` and `--help` answer without importing torch (seconds on a fresh
    machine): the package's public names are imported on first use."""
    import subprocess
    import sys

    code = ("import sys, writescope, writescope.cli.main as m\n"
            "try:\n    m.main(['--version'])\nexcept SystemExit:\n    pass\n"
            "print('torch' in sys.modules)")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout.split()
    assert out[-1] == "False" and out[0] == "writescope", out


def _subparsers() -> dict[str, argparse.ArgumentParser]:
    import writescope.cli.main as m

    parser = argparse.ArgumentParser(prog="writescope")
    sub = parser.add_subparsers(dest="command")
    for mod in (m.generate, m.calibrate, m.bench, m.plan, m.make_checkpoint, m.profile):
        mod.add_parser(sub)
    return dict(sub.choices)


def test_every_flag_has_help():
    bare = [(cmd, a.option_strings[0]) for cmd, p in _subparsers().items() for a in p._actions
            if a.option_strings and a.option_strings[0] != "-h" and not a.help]
    assert not bare, f"flags without help: {bare}"


def test_policy_defaults_equal_or_the_difference_said_in_help():
    parsers = _subparsers()
    policy = {cmd: next(a for a in parsers[cmd]._actions if "--policy" in a.option_strings) for cmd in ("generate", "plan", "profile")}
    defaults = {cmd: a.default for cmd, a in policy.items()}
    for cmd, a in policy.items():
        assert f"default {a.default}" in a.help, (cmd, a.help)
        for other, d in defaults.items():
            if d != a.default:  # a different default is named in this help
                assert other in a.help and d in a.help, (cmd, other, a.help)


def test_make_checkpoint_auto_dtype_says_what_it_wrote(tmp_path, capsys):
    assert main(["make-checkpoint", "--preset", "tiny-mixtral", "--out", str(tmp_path / "c"), "--dtype", "auto", "--quiet"]) == 0
    out = capsys.readouterr().out
    assert "MB fp32 (--dtype auto)" in out, out
