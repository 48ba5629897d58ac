"""make-checkpoint output: loads in transformers and in our runtime, equals the in-memory
synthetic weights, is sharded when asked; synthetic weights are seeded and well scaled."""

import json

import pytest
import torch

from helpers import TINY, hf_logits, load_hf, load_ours
from writescope.checkpoint.synthetic import seeded_uniform
from writescope.cli.main import main


@pytest.fixture(scope="module", params=TINY)
def made(request, tmp_path_factory):
    out = tmp_path_factory.mktemp(request.param) / "ckpt"
    assert main(["make-checkpoint", "--preset", request.param, "--out", str(out), "--dtype", "fp32", "--quiet"]) == 0
    return request.param, out


def test_make_checkpoint_loads_in_transformers_with_equal_logits(made):
    name, path = made
    hf, ours = load_hf(path, torch.float32), load_ours(path, torch.float32)
    ids = torch.randint(3, ours.config.vocab_size, (23,), generator=torch.Generator().manual_seed(0)).tolist()
    from helpers import ours_prefill_then_decode

    (pre,), _ = ours_prefill_then_decode(ours, [ids], [[]])
    ref = hf_logits(hf, ids)
    torch.testing.assert_close(pre, ref, atol=1e-4, rtol=0)


def test_make_checkpoint_tokenizer_loads_in_transformers(made):
    from transformers import PreTrainedTokenizerFast

    name, path = made
    tok = PreTrainedTokenizerFast(tokenizer_file=str(path / "tokenizer.json"))
    text = "def forward(self, x):\n    return x + 1  # ünïcode"
    ids = tok.encode(text)
    assert len(ids) < len(text) // 2, "a trained BPE should merge common code fragments"
    assert tok.decode(ids) == text
    assert max(ids) < json.loads((path / "config.json").read_text())["vocab_size"]


def test_config_is_the_presets(made):
    from writescope.presets import preset_hf_dict

    name, path = made
    written = json.loads((path / "config.json").read_text())
    expected = preset_hf_dict(name)
    expected["torch_dtype"] = "float32"
    assert written == expected


def test_in_memory_synthetic_equals_written_checkpoint(tmp_path):
    from writescope import LLM

    out = tmp_path / "ckpt"
    # bf16, several shards with an index
    assert main(["make-checkpoint", "--preset", "tiny-deepseek-v2", "--out", str(out), "--seed", "7", "--max-shard-gib", "0.0005", "--quiet"]) == 0
    index = json.loads((out / "model.safetensors.index.json").read_text())
    assert len(set(index["weight_map"].values())) > 1
    from_disk = load_ours(out, torch.bfloat16).state_dict()
    in_memory = LLM("tiny-deepseek-v2", seed=7, dtype="bf16", device="cpu", progress=False).model.state_dict()
    assert from_disk.keys() == in_memory.keys()
    for k in from_disk:
        assert torch.equal(from_disk[k], in_memory[k]), k


def test_seeded_uniform_is_deterministic_and_scaled():
    a = seeded_uniform("w", (256, 512), seed=1, std=0.5, dtype=torch.float32, device="cpu")
    b = seeded_uniform("w", (256, 512), seed=1, std=0.5, dtype=torch.float32, device="cpu")
    c = seeded_uniform("w", (256, 512), seed=2, std=0.5, dtype=torch.float32, device="cpu")
    d = seeded_uniform("v", (256, 512), seed=1, std=0.5, dtype=torch.float32, device="cpu")
    assert torch.equal(a, b)
    assert not torch.equal(a, c) and not torch.equal(a, d)
    assert abs(a.mean().item()) < 0.01 and abs(a.std().item() - 0.5) < 0.01
    assert a.abs().max() <= 0.5 * 3**0.5 + 1e-6
    # neighbouring elements are uncorrelated
    flat = a.flatten()
    assert abs(torch.corrcoef(torch.stack([flat[:-1], flat[1:]]))[0, 1].item()) < 0.02


@pytest.mark.parametrize("name", TINY)
def test_synthetic_activations_are_finite_and_non_degenerate(name):
    from writescope import LLM
    from writescope.attention import ForwardBatch
    from writescope.kvcache import ContiguousKVCache

    llm = LLM(name, device="cpu", progress=False)
    cfg, model = llm.config, llm.model
    stds = []
    hook = lambda m, i, o: stds.append(o.float().std().item())  # noqa: E731
    handles = [layer.register_forward_hook(hook) for layer in model.model.layers]
    cache = ContiguousKVCache(cfg.kv_layout, cfg.num_layers, llm.dtype, "cpu")
    ids = torch.randint(3, cfg.vocab_size, (64,), generator=torch.Generator().manual_seed(0))
    logits = model(ids, ForwardBatch.build([cache.allocate(64)], [64], [0], "cpu"), cache, all_logits=True)
    for h in handles:
        h.remove()
    assert all(0.3 < s < 30 for s in stds), f"hidden-state std per layer {stds}"
    probs = logits.softmax(-1)
    entropy = -(probs * probs.clamp_min(1e-30).log()).sum(-1)  # nats, [64]
    assert torch.isfinite(logits).all()
    assert (entropy > 0.5).all() and (entropy < 0.99 * torch.log(torch.tensor(float(cfg.vocab_size)))).all(), entropy


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the refusal on a machine without CUDA")
def test_make_checkpoint_on_a_missing_gpu_fails_before_writing(tmp_path, capsys):
    out = tmp_path / "ckpt"
    assert main(["make-checkpoint", "--preset", "tiny-qwen3-moe", "--out", str(out), "--device", "cuda", "--quiet"]) == 2
    assert "no CUDA GPU" in capsys.readouterr().err and not out.exists()


@pytest.mark.gpu
def test_make_checkpoint_on_cuda_writes_the_cpu_values(tmp_path):
    for device in ("cpu", "cuda"):
        assert main(["make-checkpoint", "--preset", "tiny-deepseek-v2", "--out", str(tmp_path / device), "--device", device, "--quiet"]) == 0
    a, b = load_ours(tmp_path / "cpu", torch.bfloat16).state_dict(), load_ours(tmp_path / "cuda", torch.bfloat16).state_dict()
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


def test_a_checkpoint_without_its_tokenizer_is_warned_of(made, tmp_path):
    """Its text would go through the stand-in BPE, which is not the model's: said at load."""
    import shutil

    from writescope import LLM

    name, path = made
    bare = tmp_path / "bare"
    shutil.copytree(path, bare)
    (bare / "tokenizer.json").unlink()
    with pytest.warns(UserWarning, match="has no tokenizer.json: text is tokenized by a stand-in"):
        LLM(str(bare), progress=False)
    import warnings

    with warnings.catch_warnings(record=True) as seen:
        warnings.simplefilter("always")
        LLM(str(path), progress=False)  # with it: no such warning
    assert not [w for w in seen if "tokenizer.json" in str(w.message)]


@pytest.mark.parametrize("size", ["0", "-1", "nan", "inf"])
def test_make_checkpoint_refuses_a_shard_size_that_is_not_a_size(tmp_path, capsys, size):
    """0 or a negative size wrote one file per tensor; refused before anything is written."""
    out = tmp_path / "ckpt"
    assert main(["make-checkpoint", "--preset", "tiny-mixtral", "--out", str(out), "--max-shard-gib", size, "--quiet"]) == 2
    assert f"--max-shard-gib must be a size in GiB above 0, got {float(size)}" in capsys.readouterr().err
    assert not out.exists()
