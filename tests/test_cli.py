"""``writescope generate`` end to end on CPU."""

import json

from writescope.cli.main import main


def test_generate_prints_text_and_timings_and_writes_json(tmp_path, capsys):
    out = tmp_path / "o.json"
    rc = main(["generate", "--model", "tiny-qwen3-moe", "--prompt", "def main():\n    return", "--max-new-tokens", "5",
               "--batch", "2", "--device", "cpu", "--output-json", str(out), "--quiet", "--ignore-eos"])
    assert rc == 0
    printed = capsys.readouterr().out
    for word in ("TTFT", "TPOT", "prefill", "decode", "peak memory"):
        assert word in printed
    doc = json.loads(out.read_text())
    assert len(doc["requests"]) == 2
    r = doc["requests"][0]
    assert len(r["token_ids"]) == 5 and isinstance(r["text"], str)
    assert r["metrics"]["ttft_s"] > 0 and r["metrics"]["prompt_tokens"] == len(r["prompt_token_ids"])
    assert doc["requests"][1]["token_ids"] == r["token_ids"], "greedy decoding of equal prompts must agree"


def test_generate_with_prompt_ids_and_sampling_is_seeded(tmp_path, capsys):
    args = ["generate", "--model", "tiny-mixtral", "--prompt-ids", "5,6,7,8", "--max-new-tokens", "6", "--temperature", "1.0",
            "--top-p", "0.9", "--seed", "3", "--quiet", "--ignore-eos", "--batch", "2"]
    outs = []
    for i in range(2):
        p = tmp_path / f"{i}.json"
        assert main(args + ["--output-json", str(p)]) == 0
        outs.append([r["token_ids"] for r in json.loads(p.read_text())["requests"]])
    assert outs[0] == outs[1], "same --seed, same samples"
    assert outs[0][0] != outs[0][1], "request i samples with seed + i, so copies of a prompt differ"
