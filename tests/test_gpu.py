"""CUDA checks, run on the GPU machine with ``python -m pytest -m gpu``."""

import pytest
import torch

from helpers import TINY, hf_reference_checkpoint

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")]


def test_synthetic_weights_are_identical_on_cpu_and_cuda():
    from writescope.checkpoint.synthetic import seeded_uniform

    shape = (3000, 7001)  # > one 2^24-element chunk, odd sizes
    for dtype in (torch.float32, torch.bfloat16):
        a = seeded_uniform("model.layers.0.mlp.gate.weight", shape, 5, 0.1, dtype, "cpu")
        b = seeded_uniform("model.layers.0.mlp.gate.weight", shape, 5, 0.1, dtype, "cuda")
        assert torch.equal(a, b.cpu()), dtype


@pytest.mark.parametrize("name", TINY)
def test_bf16_on_cuda_within_twice_transformers_error(name, tmp_path):
    import transformers

    from writescope import LLM

    path = hf_reference_checkpoint(name, tmp_path)
    ids = torch.randint(3, 4096, (1, 300), generator=torch.Generator().manual_seed(0))
    ref_model = transformers.AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).cuda().eval()
    hf16 = transformers.AutoModelForCausalLM.from_pretrained(path, dtype=torch.bfloat16).cuda().eval()
    with torch.no_grad():
        ref = ref_model(ids.cuda()).logits[0, -1].float()
        hf = hf16(ids.cuda()).logits[0, -1].float()
    llm = LLM(str(path), device="cuda", dtype="bf16", progress=False)
    from writescope.attention import ForwardBatch
    from writescope.kvcache import ContiguousKVCache

    cache = ContiguousKVCache(llm.config.kv_layout, llm.config.num_layers, torch.bfloat16, "cuda")
    ours = llm.model(ids[0].cuda(), ForwardBatch.build([cache.allocate(300)], [300], [0], "cuda"), cache)[0]
    err_ours = ((ours - ref).norm() / ref.norm()).item()
    err_hf = ((hf - ref).norm() / ref.norm()).item()
    assert err_ours <= 2 * err_hf + 5e-3, f"{name}: ours {err_ours:.2e} vs transformers bf16 {err_hf:.2e}"


def test_generate_on_cuda_reports_gpu_memory():
    from writescope import LLM, SamplingParams

    llm = LLM("tiny-deepseek-v2", device="cuda", progress=False)
    outs = llm.generate(prompt_token_ids=[[5, 6, 7], list(range(10, 200))], sampling_params=SamplingParams(max_tokens=8, ignore_eos=True))
    assert [len(o.token_ids) for o in outs] == [8, 8]
    assert outs[0].metrics.peak_memory_bytes > 0
    assert llm.cache.active_slots == []


def test_vram_budget_is_enforced_on_cuda():
    """--vram-budget on a device given without an index ("cuda"): the caching allocator is capped
    (an allocation beyond the budget raises), and generation under the cap still runs."""
    from writescope import LLM, SamplingParams

    try:
        llm = LLM("tiny-qwen3-moe", device="cuda", vram_budget="2GiB", policy="static:0.5", progress=False)
        out = llm.generate(prompt_token_ids=[list(range(3, 600))], sampling_params=SamplingParams(max_tokens=4, ignore_eos=True))
        assert len(out[0].token_ids) == 4
        with pytest.raises(torch.OutOfMemoryError):
            torch.empty(3 * 2**30, dtype=torch.uint8, device="cuda")
    finally:
        torch.cuda.set_per_process_memory_fraction(1.0, torch.cuda.current_device())


def test_host_experts_of_a_cuda_model_get_the_cpu_values():
    """Routed experts built in host memory for a CUDA model are generated on the GPU and copied
    down: the same values as generating them on the CPU."""
    from writescope.checkpoint.synthetic import param_std, seeded_uniform
    from writescope.engine.model_loader import load_model

    _, net, _, _ = load_model("tiny-qwen3-moe", True, torch.bfloat16, torch.device("cuda"), progress=False, host_experts={0: range(0, 3)})
    host = {k: v for k, v in net.state_dict().items() if v.device.type == "cpu"}
    assert host, "no parameter was built in host memory"
    for name, p in host.items():
        mean, std = param_std(name, tuple(p.shape))
        assert torch.equal(p, seeded_uniform(name, tuple(p.shape), 0, std, p.dtype, "cpu", mean)), name


def test_expanded_mla_widths_on_cuda():
    """MLA expanded prefill's widths (keys 192, values 128) on CUDA: the fused-kernel probe
    answers, and attend_sequence (bounded or not by its answer) matches a float64 reference
    within bf16 rounding, with a context before the queries."""
    from writescope.attention.reference import attend_sequence, fused_sdpa_available

    assert isinstance(fused_sdpa_available("cuda:0", torch.bfloat16, 192, 128), bool)
    g = torch.Generator(device="cuda").manual_seed(0)
    n, ctx, H = 300, 700, 16
    q = torch.randn(n, H, 192, device="cuda", generator=g).bfloat16()
    k = torch.randn(ctx + n, H, 192, device="cuda", generator=g).bfloat16()
    v = torch.randn(ctx + n, H, 128, device="cuda", generator=g).bfloat16()
    got = attend_sequence(q, k, v, ctx, 192**-0.5).double()
    s = torch.einsum("qhd,khd->hqk", q.double(), k.double()) * 192**-0.5
    s = s.masked_fill(torch.arange(ctx + n, device="cuda")[None, :] > torch.arange(ctx, ctx + n, device="cuda")[:, None], float("-inf"))
    want = torch.einsum("hqk,khd->qhd", s.softmax(-1), v.double())
    assert (got - want).abs().max().item() < 3e-2
