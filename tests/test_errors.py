"""Bad input gives a clear error naming the offending value, and leaves the runtime usable.

After every test the module's ``LLM`` must still reproduce its reference generation with no
KV slot left allocated (see ``engine_still_works``).
"""

from __future__ import annotations

import json
import re
import shutil

import pytest
import torch

from writescope import LLM, SamplingParams
from writescope.checkpoint.loader import INDEX_NAME, CheckpointError, load_weights
from writescope.checkpoint.synthetic import fill_synthetic, synthetic_tensors
from writescope.checkpoint.writer import write_checkpoint
from writescope.cli.main import main
from writescope.config import ModelConfig
from writescope.models import build_model
from writescope.presets import preset_config, preset_hf_dict

PRESET = "tiny-qwen3-moe"  # vocab 4096, max_position_embeddings 8192
PROMPT = [5, 6, 7, 8, 9]
PARAMS = SamplingParams(max_tokens=4)


@pytest.fixture(scope="module")
def engine():
    """(llm, reference greedy token ids for PROMPT)."""
    llm = LLM(PRESET, progress=False)
    ref = llm.generate(prompt_token_ids=[PROMPT], sampling_params=PARAMS)[0].token_ids
    assert len(ref) == PARAMS.max_tokens
    return llm, ref


@pytest.fixture(autouse=True)
def engine_still_works(engine):
    yield
    llm, ref = engine
    assert llm.cache.active_slots == []
    assert llm.generate(prompt_token_ids=[PROMPT], sampling_params=PARAMS)[0].token_ids == ref
    assert llm.cache.active_slots == []


@pytest.fixture
def allocations(engine, monkeypatch):
    """Records every KV allocation the module's LLM makes during the test."""
    llm, _ = engine
    calls: list[int] = []
    real = llm.cache.allocate
    monkeypatch.setattr(llm.cache, "allocate", lambda capacity, **kw: calls.append(capacity) or real(capacity, **kw))
    return calls


# ------------------------------------------------------------------ bad requests
LONG = [1] * 8190  # + max_tokens 16 = 8206 > 8192


@pytest.mark.parametrize(
    "kwargs, pattern",
    [
        (dict(prompts=[""]), r"prompts\[0\] is empty"),
        (dict(prompts=""), r"prompts\[0\] is empty"),
        (dict(prompt_token_ids=[[]]), r"prompt_token_ids\[0\] is empty"),
        (dict(prompts=[]), "no prompts given"),
        (dict(prompt_token_ids=[]), "prompt_token_ids must be a non-empty list"),
        (dict(prompt_token_ids=[LONG], sampling_params=SamplingParams(max_tokens=16)), r"prompt_token_ids\[0\] has 8,190 tokens .*16 = 8,206, beyond the limit of 8,192 tokens"),
        (dict(prompt_token_ids=[[1, 4096]]), r"prompt_token_ids\[0\] has token id 4096 at position 1, outside the model\'s vocabulary of 4,096 ids"),
    ],
    ids=["empty-text", "empty-text-str", "empty-ids", "no-prompts", "no-prompt-ids", "beyond-max-positions", "out-of-vocab"],
)
def test_bad_request_rejected_before_allocating(engine, allocations, kwargs, pattern):
    llm, _ = engine
    with pytest.raises(ValueError, match=pattern):
        llm.generate(**kwargs)
    assert allocations == []
    assert llm.cache.active_slots == []


@pytest.mark.parametrize(
    "bad, pattern",
    [([], r"prompt_token_ids\[1\] is empty"), (LONG, r"prompt_token_ids\[1\] has 8,190 tokens"), ([3, -1], r"prompt_token_ids\[1\] has token id -1 at position 1")],
    ids=["empty", "too-long", "out-of-vocab"],
)
def test_batch_with_bad_second_request_generates_nothing(engine, allocations, bad, pattern):
    llm, ref = engine
    before = llm.generate(prompt_token_ids=[PROMPT], sampling_params=PARAMS)[0].request_id
    allocations.clear()
    with pytest.raises(ValueError, match=pattern):
        llm.generate(prompt_token_ids=[PROMPT, bad], sampling_params=SamplingParams(max_tokens=16))
    assert allocations == []
    assert llm.cache.active_slots == []
    after = llm.generate(prompt_token_ids=[PROMPT], sampling_params=PARAMS)[0]
    assert after.request_id == before + 1  # the failed batch took no request ids
    assert after.token_ids == ref


def test_max_model_len_limits_prompt_plus_new_tokens(engine):
    llm = LLM(PRESET, max_model_len=64, progress=False)
    with pytest.raises(ValueError, match=r"prompt_token_ids\[0\] has 50 tokens .*16 = 66, beyond the limit of 64 tokens"):
        llm.generate(prompt_token_ids=[[7] * 50], sampling_params=SamplingParams(max_tokens=16))
    assert llm.cache.active_slots == []
    out = llm.generate(prompt_token_ids=[[7] * 48], sampling_params=SamplingParams(max_tokens=16, ignore_eos=True))
    assert len(out[0].token_ids) == 16  # exactly at the limit is allowed
    assert llm.generate(prompt_token_ids=[PROMPT], sampling_params=PARAMS)[0].token_ids == engine[1]
    assert llm.cache.active_slots == []


@pytest.mark.parametrize("kwargs, pattern", [(dict(max_tokens=0), "max_tokens .*got 0"), (dict(temperature=-1), "temperature .*got -1"),
                                             (dict(top_p=0), "top_p .*got 0"), (dict(top_p=1.5), "top_p .*got 1.5")])
def test_bad_sampling_params(kwargs, pattern):
    with pytest.raises(ValueError, match=pattern):
        SamplingParams(**kwargs)


# ------------------------------------------------------------------ model, dtype, CLI
@pytest.mark.parametrize(
    "model, kwargs, pattern",
    [
        ("no-such-model", {}, "'no-such-model' is neither a checkpoint directory nor a preset"),
        ("tiny-qwen3-moes", {}, "'tiny-qwen3-moes' is neither a checkpoint directory nor a preset; did you mean 'tiny-qwen3-moe'\\?"),
        ("deepseek-ai/DeepSeek-V2-Lite", {}, "'deepseek-ai/DeepSeek-V2-Lite' looks like a Hugging Face hub id, and WriteScope "
         "downloads nothing: .*hf download deepseek-ai/DeepSeek-V2-Lite --local-dir DIR.*the preset 'deepseek-v2-lite'"),
        ("/no/such/dir", {}, "'/no/such/dir': no checkpoint directory there: pass a checkpoint directory or a preset"),
        (__file__, {}, re.escape(repr(__file__)) + " is a file: pass the checkpoint directory"),
        (PRESET, dict(dtype="int8"), "unknown dtype 'int8'"),
        (PRESET, dict(dtype=torch.int8), "dtype torch.int8 is not supported"),
        (PRESET, dict(max_model_len=0), r"max_model_len 0 must be in \[1, 8192\]"),
        (PRESET, dict(max_model_len=8193), r"max_model_len 8193 must be in \[1, 8192\]"),
    ],
    ids=["unknown-preset", "misspelled-preset", "hub-id", "missing-dir", "a-file", "dtype-int8-str", "dtype-int8-torch", "max_model_len-0", "max_model_len-too-big"],
)
def test_bad_llm_arguments(model, kwargs, pattern):
    with pytest.raises(ValueError, match=pattern):
        LLM(model, progress=False, **kwargs)


@pytest.mark.parametrize(
    "argv, named",
    [
        (["generate", "--model", "no-such-model", "--prompt", "hi", "--quiet"], "'no-such-model'"),
        (["generate", "--model", PRESET, "--dtype", "fp8", "--prompt", "hi", "--quiet"], "'fp8'"),
        (["make-checkpoint", "--preset", "no-such-model", "--out", "{tmp}", "--quiet"], "'no-such-model'"),
    ],
    ids=["generate-unknown-model", "generate-bad-dtype", "make-checkpoint-unknown-preset"],
)
def test_cli_error_exits_2(capsys, tmp_path, argv, named):
    assert main([a.replace("{tmp}", str(tmp_path)) for a in argv]) == 2
    err = capsys.readouterr().err
    assert err.startswith(f"writescope {argv[0]}: error:") and named in err


def test_unsupported_model_type(tmp_path):
    with pytest.raises(ValueError, match="unsupported model_type 'llama'"):
        ModelConfig.from_hf({**preset_hf_dict(PRESET), "model_type": "llama"})
    d = preset_hf_dict(PRESET)
    del d["model_type"]
    (tmp_path / "config.json").write_text(json.dumps(d))
    with pytest.raises(ValueError, match=re.escape(f"{tmp_path / 'config.json'}: unsupported model_type None")):  # the file named
        ModelConfig.from_file(tmp_path)
    (tmp_path / "config.json").write_text("[1, 2]")
    with pytest.raises(ValueError, match=re.escape(f"{tmp_path / 'config.json'} holds a JSON list, not an object")):
        ModelConfig.from_file(tmp_path)


def test_a_model_path_is_told_from_a_hub_id(tmp_path, monkeypatch):
    """``~`` is expanded (a checkpoint there loads); ``owner/name`` is a hub id only where no local
    folder ``owner`` exists, else a missing checkpoint directory."""
    from writescope.engine.model_loader import resolve_config

    monkeypatch.setenv("HOME", str(tmp_path))
    (tmp_path / "ckpt").mkdir()
    (tmp_path / "ckpt" / "config.json").write_text(json.dumps(preset_hf_dict(PRESET)))
    cfg, ckpt = resolve_config("~/ckpt")
    assert ckpt == tmp_path / "ckpt" and cfg.num_layers == resolve_config(PRESET)[0].num_layers
    monkeypatch.chdir(tmp_path)
    with pytest.raises(ValueError, match="'ckpt/qwen3': no checkpoint directory there"):  # ckpt/ is a local folder
        resolve_config("ckpt/qwen3")
    with pytest.raises(ValueError, match="'elsewhere/qwen3' looks like a Hugging Face hub id"):
        resolve_config("elsewhere/qwen3")
    with pytest.raises(ValueError, match="'a/b/c': no checkpoint directory there"):
        resolve_config("a/b/c")


@pytest.mark.parametrize("preset, field", [("tiny-deepseek-v2", "num_experts_per_tok")])
def test_missing_config_field(preset, field):
    """Only a field transformers has no default for is required (the others take its default:
    tests/test_config_defaults.py)."""
    d = preset_hf_dict(preset)
    del d[field]
    with pytest.raises(ValueError, match=f"missing required field '{field}'"):
        ModelConfig.from_hf(d)


# ------------------------------------------------------------------ checkpoints
def shapes_of(cfg) -> dict[str, tuple[int, ...]]:
    return {k: tuple(v.shape) for k, v in build_model(cfg, torch.float32, "cpu").state_dict().items()}


def write(out, shapes, max_shard_bytes=1 << 20):
    cfg = preset_config(PRESET)
    return write_checkpoint(out, cfg, synthetic_tensors(shapes, 0, torch.float32, "cpu"), len(shapes), torch.float32, None,
                            max_shard_bytes=max_shard_bytes, progress=False)


@pytest.fixture(scope="module")
def sharded(tmp_path_factory):
    out = write(tmp_path_factory.mktemp("ckpt") / "tiny", shapes_of(preset_config(PRESET)))
    assert len(list(out.glob("*.safetensors"))) >= 3
    return out


@pytest.fixture
def ckpt(sharded, tmp_path):
    """A fresh copy of the sharded checkpoint, free to damage; returns (dir, its shard files)."""
    d = shutil.copytree(sharded, tmp_path / "ckpt")
    return d, sorted(d.glob("*.safetensors"))


def test_intact_sharded_checkpoint_matches_preset(engine, ckpt):
    """Control for the damage tests below: the undamaged copy loads and equals the preset."""
    _, ref = engine
    llm = LLM(str(ckpt[0]), progress=False)
    assert llm.generate(prompt_token_ids=[PROMPT], sampling_params=PARAMS)[0].token_ids == ref


def test_missing_shard(ckpt, capsys):
    d, shards = ckpt
    shards[1].unlink()
    with pytest.raises(CheckpointError, match=re.escape(shards[1].name)):
        LLM(str(d), progress=False)
    assert main(["generate", "--model", str(d), "--prompt", "hi", "--quiet"]) == 2
    assert shards[1].name in capsys.readouterr().err


@pytest.mark.parametrize(
    "damage",
    [lambda b: bytes(range(256)) * (len(b) // 256), lambda b: b[: len(b) // 2], lambda b: b[:5], lambda b: b""],
    ids=["garbage", "truncated-half", "truncated-header", "empty"],
)
def test_corrupt_shard(ckpt, damage):
    d, shards = ckpt
    shards[1].write_bytes(damage(shards[1].read_bytes()))
    with pytest.raises(CheckpointError, match=re.escape(str(shards[1]))):
        LLM(str(d), progress=False)


def expect_checkpoint_error(d, *fragments):
    """load_weights fails with one CheckpointError holding every fragment, and changes no weight."""
    model = build_model(preset_config(PRESET), torch.float32, "cpu")
    fill_synthetic(model, seed=1, progress=False)
    before = {k: v.clone() for k, v in model.state_dict().items()}
    with pytest.raises(CheckpointError) as info:
        load_weights(model, d, progress=False)
    for frag in fragments:
        assert frag in str(info.value)
    assert all(torch.equal(before[k], v) for k, v in model.state_dict().items()), "a failed load changed weights"


MISSING, EXTRA, RESHAPED = "model.layers.1.mlp.gate.weight", "model.layers.0.mlp.extra.weight", "model.norm.weight"


@pytest.mark.parametrize("problems", [("missing",), ("unexpected",), ("mis-shaped",), ("missing", "unexpected", "mis-shaped")])
def test_tensor_mismatches_listed_in_one_error(tmp_path, problems):
    shapes = shapes_of(preset_config(PRESET))
    fragments = []
    if "missing" in problems:
        del shapes[MISSING]
        fragments += ["1 missing tensor(s)", MISSING]
    if "unexpected" in problems:
        shapes[EXTRA] = (4, 4)
        fragments += ["1 unexpected tensor(s)", EXTRA]
    if "mis-shaped" in problems:
        shapes[RESHAPED] = (32,)
        fragments += ["1 mis-shaped tensor(s)", f"{RESHAPED}: checkpoint (32,) vs model (64,)"]
    expect_checkpoint_error(write(tmp_path / "bad", shapes), *fragments)


def test_index_pointing_at_wrong_shard(ckpt):
    d, shards = ckpt
    index = json.loads((d / INDEX_NAME).read_text())
    name = next(k for k, f in index["weight_map"].items() if f == shards[1].name)
    index["weight_map"][name] = shards[2].name  # the tensor really is in shards[1]
    (d / INDEX_NAME).write_text(json.dumps(index))
    expect_checkpoint_error(d, "1 wrongly indexed tensor(s)", f"{name} (not in {shards[2].name})")


def test_tensor_left_out_of_index(ckpt):
    d, _ = ckpt
    index = json.loads((d / INDEX_NAME).read_text())
    del index["weight_map"][MISSING]  # still in its shard, but the loader would never read it
    (d / INDEX_NAME).write_text(json.dumps(index))
    expect_checkpoint_error(d, "1 missing tensor(s)", MISSING)


@pytest.mark.parametrize("name,bad", [("WRITESCOPE_MOE_KERNEL", "foo"), ("WRITESCOPE_LOAD_READ", "bogus"),
                                      ("WRITESCOPE_PINGPONG_BUFFERS", "abc"), ("WRITESCOPE_MICRO_BATCHES", "3"),
                                      ("WRITESCOPE_GPU_ATTENTION", "cuda"), ("WRITESCOPE_CUDA_GRAPHS", "maybe"),
                                      ("WRITESCOPE_PREFILL_LOAD_STREAM", "side"), ("WRITESCOPE_CPU_WORKER", "rust"),
                                      ("WRITESCOPE_MLA_PREFILL", "both"), ("WRITESCOPE_EXPERT_ISA", "avx1024"),
                                      ("WRITESCOPE_PINNED_POOL", "lots"), ("WRITESCOPE_CPU_THREADS", "0"),
                                      ("WRITESCOPE_CPU_THREADS", "many"), ("WRITESCOPE_CPU_PIN", "yes"),
                                      ("WRITESCOPE_HUGE_PAGES", "2m"), ("WRITESCOPE_CPU_PREREAD", "-1"),
                                      ("WRITESCOPE_PROMPT_PLAN", "middle"), ("WRITESCOPE_LINK_FIXED", "-1")])
def test_a_bad_switch_fails_before_the_weights_load(name, bad, monkeypatch):
    """Every WRITESCOPE_* switch is read when LLM starts, whatever the policy uses (resident
    uses none of these), before the model is built: the error names the variable and value."""
    import writescope.engine.llm as llm_mod

    def never(*a, **k):
        raise AssertionError("the model was being built before the bad switch was seen")

    monkeypatch.setattr(llm_mod, "load_model", never)
    monkeypatch.setenv(name, bad)
    with pytest.raises(ValueError, match=f"{name}='{bad}'"):
        LLM("tiny-qwen3-moe", policy="resident", progress=False)


def test_a_misspelt_switch_is_named_with_the_switch_it_resembles(monkeypatch):
    """A WRITESCOPE_* variable no part reads has no effect: the engine's check warns, naming the
    switch it resembles; WRITESCOPE_API_KEY (serve's key) is no switch but is read."""
    from writescope.engine.switches import check_switches, unknown_switches

    env = {"WRITESCOPE_CPU_THREAD": "1", "WRITESCOPE_API_KEY": "k", "WRITESCOPE_ZZZ": "1", "HOME": "/"}
    assert unknown_switches(env) == ["WRITESCOPE_CPU_THREAD (did you mean WRITESCOPE_CPU_THREADS?)", "WRITESCOPE_ZZZ"]
    for name in list(__import__("os").environ):
        if name.startswith("WRITESCOPE_"):
            monkeypatch.delenv(name)
    monkeypatch.setenv("WRITESCOPE_MICRO_BATCHE", "2")
    with pytest.warns(UserWarning, match=r"WRITESCOPE_MICRO_BATCHE \(did you mean WRITESCOPE_MICRO_BATCHES\?\)"):
        check_switches()


def test_the_too_long_error_gives_each_change_that_alone_makes_the_request_fit():
    """The prompt's and max_tokens' largest values that fit, each only where it alone can help, and
    where the limit comes from (max_model_len below the model's own, else the model's)."""
    from writescope.engine.prompts import too_long

    msg = str(too_long("prompts", 0, 8190, 16, 8192, 8192))
    assert "8,190 tokens + max_tokens 16 = 8,206, beyond the limit of 8,192 tokens (the model's max_position_embeddings)" in msg
    assert msg.endswith("shorten the prompt to at most 8,176 tokens, or lower max_tokens to at most 2")
    msg = str(too_long("prompts", 0, 1, 9000, 8192, 8192))  # max_tokens alone passes the limit
    assert "shorten the prompt" not in msg and msg.endswith("lower max_tokens to at most 8,191")
    msg = str(too_long("prompts", 0, 9000, 4, 8192, 8192))  # the prompt alone passes it
    assert "lower max_tokens" not in msg and msg.endswith("shorten the prompt to at most 8,188 tokens")
    msg = str(too_long("prompts", 0, 100, 20, 64, 8192))  # a max_model_len below the model's limit
    assert "(max_model_len)" in msg and msg.endswith("shorten the prompt to at most 44 tokens, or raise max_model_len")
    msg = str(too_long("prompts", 0, 64, 64, 64, 64))  # neither alone: both
    assert msg.endswith("shorten the prompt and lower max_tokens")


def test_the_too_long_error_carries_its_numbers_as_fields():
    """Callers that reword the advice read the numbers, not the message; it stays an ArgError."""
    from writescope.engine.prompts import TooLong, too_long
    from writescope.errors import ArgError

    e = too_long("prompt_token_ids", 3, 100, 20, 64, 8192)
    assert isinstance(e, TooLong) and isinstance(e, ArgError) and isinstance(e, ValueError)
    assert (e.name, e.index, e.tokens, e.max_tokens, e.limit, e.model_limit) == ("prompt_token_ids", 3, 100, 20, 64, 8192)
    assert (e.source, e.prompt_fits, e.max_tokens_fits, e.can_raise) == ("max_model_len", 44, None, True)
    assert str(e) == e.problem + ": shorten the prompt to at most 44 tokens, or raise max_model_len"
    e = too_long("prompts", 0, 64, 64, 64, 64)
    assert (e.source, e.prompt_fits, e.max_tokens_fits, e.can_raise) == ("the model's max_position_embeddings", None, None, False)
