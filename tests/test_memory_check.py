"""The memory check before a model is built (issue 19, item 3): a run whose weights and KV
cannot fit the memory available is refused before any tensor is built, naming the bytes and
what to do. The machine's memory is replaced by a fixed number, so no test depends on it."""

import re

import pytest
import torch

from writescope.budget.memory import check_fits, kv_bytes, weight_bytes
from writescope.cli.main import main
from writescope.engine.model_loader import resolve_config

GiB = 2**30


class _Built(Exception):
    pass


@pytest.fixture
def machine(monkeypatch):
    """A CPU machine with 24 GiB available; every way of building a model is a spy that
    records the call and stops there."""
    import writescope.engine.llm as engine
    import writescope.engine.model_loader as loader

    calls = []

    def spy(name):
        def f(*a, **k):
            calls.append(name)
            raise _Built(name)
        return f

    import writescope.engine.arguments as arguments

    free = lambda device: 24 * GiB if device.type == "cpu" else None  # noqa: E731
    monkeypatch.setattr(engine, "available_memory", free)
    monkeypatch.setattr(arguments, "available_memory", free)  # the plan's host memory (engine/arguments.py)
    monkeypatch.setattr(loader, "build_model", spy("build_model"))
    monkeypatch.setattr(loader, "fill_synthetic", spy("fill_synthetic"))
    monkeypatch.setattr(engine.cpu_kernel, "prepare", spy("cpu_kernel.prepare"))  # builds the C++ kernel
    return calls


def test_llm_refuses_a_model_beyond_host_memory_before_building_anything(machine):
    from writescope import LLM

    with pytest.raises(ValueError) as e:
        LLM("qwen3-30b-a3b", device="cpu", progress=False)
    msg = str(e.value)
    want = weight_bytes(resolve_config("qwen3-30b-a3b")[0], torch.float32)
    assert f"needs {want / GiB:.2f} GiB of host memory" in msg and "24.00 GiB is available" in msg
    assert "Nothing was built" in msg and "dtype bf16" in msg and "--" not in msg  # the API's names
    assert "shorter requests" not in msg  # the KV of a few tokens is not what fails
    fit = int(re.search(r"num_layers (\d+) fits", msg).group(1))  # the most layers of this shape that fit
    assert [weight_bytes(resolve_config("qwen3-30b-a3b", n)[0], torch.float32) <= 0.9 * 24 * GiB for n in (fit, fit + 1)] == [True, False]
    assert machine == [], f"built before the check: {machine}"


def test_generate_cli_refuses_before_building_and_counts_the_requests_kv(machine, capsys):
    assert main(["generate", "--model", "qwen3-30b-a3b", "--prompt", "hello", "--device", "cpu", "--quiet"]) == 2
    err = capsys.readouterr().err
    assert "needs 113.7" in err and re.search(r"--num-layers \d+ fits", err) and "--dtype bf16" in err and "--vram-budget)" in err
    assert "num_layers" not in err and "vram_budget" not in err and machine == []
    # 7 layers fit the weights alone; a batch whose KV does not fit beside them is refused too
    cfg = resolve_config("qwen3-30b-a3b", 7)[0]
    assert weight_bytes(cfg, torch.float32) < 0.9 * 24 * GiB
    room = 0.9 * 24 * GiB - weight_bytes(cfg, torch.float32)
    per_seq = kv_bytes(cfg, torch.float32, 3 + 4000)
    batch = int(room // per_seq) + 1
    argv = ["generate", "--model", "qwen3-30b-a3b", "--num-layers", "7", "--prompt-ids", "5,6,7", "--max-new-tokens", "4000",
            "--device", "cpu", "--quiet"]
    with pytest.raises(_Built):  # fits: the build starts (and the spy stops it)
        main(argv + ["--batch", str(batch - 1)]) if batch > 1 else main(argv + ["--batch", "1", "--max-new-tokens", "1"])
    machine.clear()
    assert main(argv + ["--batch", str(batch)]) == 2
    err = capsys.readouterr().err
    assert f"{batch * 4003:,} tokens" in err and machine == []
    assert "fewer or shorter requests (--batch, --max-new-tokens or a shorter prompt)" in err  # generate's flags for the API's kv_tokens


def test_profile_checks_before_building(machine, capsys):
    assert main(["profile", "--model", "qwen3-30b-a3b", "--num-layers", "12", "--device", "cpu", "--policy", "resident", "--quiet"]) == 2
    assert "Nothing was built" in capsys.readouterr().err and machine == []
    with pytest.raises(_Built):  # docs/USAGE.md's quick shape benchmark fits 24 GiB
        main(["profile", "--model", "qwen3-30b-a3b", "--num-layers", "2", "--device", "cpu", "--policy", "resident", "--quiet"])


def test_device_memory_is_checked_on_cuda_with_and_without_a_budget():
    """Pure arithmetic (no GPU needed): the weights (or the plan's device part) against the
    device's free memory, partitioned KV against the host's."""
    from writescope.budget.plan import make_plan

    cfg = resolve_config("qwen3-30b-a3b")[0]
    cuda = torch.device("cuda")
    w = weight_bytes(cfg, torch.bfloat16)  # 56.9 GiB
    check_fits(cfg, torch.bfloat16, cuda, 1000, host_free=None, device_free=80 * GiB)
    with pytest.raises(ValueError, match=r"needs 56\.\d\d GiB of cuda.*40\.00 GiB is available \(free device memory\).*a vram_budget that fits"):
        check_fits(cfg, torch.bfloat16, cuda, 1000, host_free=None, device_free=40 * GiB)
    kv = 100 * GiB // (cfg.num_layers * cfg.kv_layout.bytes_per_token(2))  # tokens of 100 GiB of KV
    check_fits(cfg, torch.bfloat16, cuda, kv, host_free=None, device_free=80 * GiB, kv_on_device=False)  # partitioned: KV on the host
    with pytest.raises(ValueError, match="KV needs .* GiB of host memory"):
        check_fits(cfg, torch.bfloat16, cuda, kv, host_free=64 * GiB, device_free=80 * GiB, kv_on_device=False)
    plan = make_plan(cfg, torch.bfloat16, 32 * GiB, 4, 8192, 0, None)
    check_fits(cfg, torch.bfloat16, cuda, 0, None, device_free=40 * GiB, plan=plan)
    with pytest.raises(ValueError, match="the plan's device part.*a smaller vram_budget"):
        check_fits(cfg, torch.bfloat16, cuda, 0, None, device_free=20 * GiB, plan=plan)
    assert w > 0.9 * 40 * GiB


def test_tiny_model_passes_and_unknown_memory_is_not_checked():
    cfg = resolve_config("tiny-qwen3-moe")[0]
    check_fits(cfg, torch.float32, torch.device("cpu"), 10_000, host_free=1 * GiB)
    check_fits(resolve_config("mixtral-8x7b")[0], torch.float32, torch.device("cpu"), 0, host_free=None)
    with pytest.raises(ValueError, match="kv_tokens must be >= 0"):
        check_fits(cfg, torch.float32, torch.device("cpu"), -1, host_free=1 * GiB)


def test_a_plan_for_a_known_prompt_names_what_sets_its_length(machine, capsys):
    """generate plans a budget for the prompt plus --max-new-tokens when the prompt's length is
    known: the advice names those, not --max-model-len (which it did not read)."""
    argv = ["generate", "--model", "qwen3-30b-a3b", "--device", "cpu", "--machine-text", "2k", "--vram-budget", "40GiB",
            "--dtype", "bf16", "--quiet"]
    assert main(argv) == 2
    err = capsys.readouterr().err
    assert "the plan's device and host parts" in err and machine == []
    assert "fewer or shorter requests (--batch, --max-new-tokens (or a shorter prompt))" in err and "--max-model-len" not in err
