"""Checks made before any work starts (issue 19, items 2 and 6): output paths a run could not
write at its end, a negative --vram-budget, and plan's refusals in plan's own flags."""

from __future__ import annotations

import pytest

from writescope.cli.main import main
from writescope.cli.outputs import attach_negative_values


@pytest.fixture
def no_work(monkeypatch):
    """Any model load or weight build fails the test: the refusal must come before it."""
    import writescope
    import writescope.checkpoint.synthetic as synthetic
    import writescope.engine.llm as llm

    writescope.LLM  # noqa: B018 - the package's lazy names resolved (and kept) before the patch, not to the stand-in below

    def loaded(*a, **k):
        raise AssertionError("the work started before the output path was checked")

    monkeypatch.setattr(llm, "LLM", loaded)
    monkeypatch.setattr(writescope, "LLM", loaded)
    monkeypatch.setattr(synthetic, "synthetic_tensors", loaded)


def _commands(out: str) -> list[tuple[list[str], str]]:
    gen = ["generate", "--model", "tiny-qwen3-moe", "--prompt", "hi", "--quiet"]
    bench = ["bench", "--model", "tiny-qwen3-moe", "--quiet"]
    prof = ["profile", "--model", "tiny-qwen3-moe", "--quiet"]
    return [
        (gen + ["--output-json", out], "--output-json"),
        (bench + ["--output-json", out], "--output-json"),
        (bench + ["--plot", out], "--plot"),
        (prof + ["--output-json", out], "--output-json"),
        (prof + ["--trace", out], "--trace"),
    ]


@pytest.mark.parametrize("i", range(5), ids=["generate-json", "bench-json", "bench-plot", "profile-json", "profile-trace"])
def test_output_in_a_missing_directory_is_refused_before_the_run(tmp_path, capsys, no_work, i):
    missing = tmp_path / "no" / "such" / "dir"
    argv, flag = _commands(str(missing / "x.json"))[i]
    if flag == "--plot":
        pytest.importorskip("matplotlib")  # without it --plot is refused for that first
    assert main(argv) == 2
    err = capsys.readouterr().err
    assert f"{flag} {missing / 'x.json'}: directory {missing} does not exist" in err
    assert not (tmp_path / "no").exists(), "nothing is created"


@pytest.mark.parametrize("i", range(5), ids=["generate-json", "bench-json", "bench-plot", "profile-json", "profile-trace"])
def test_output_that_is_a_directory_is_refused_before_the_run(tmp_path, capsys, no_work, i):
    argv, flag = _commands(str(tmp_path))[i]
    if flag == "--plot":
        pytest.importorskip("matplotlib")
    assert main(argv) == 2
    assert f"{flag} {tmp_path}: is a directory" in capsys.readouterr().err


def test_make_checkpoint_out_is_checked_before_the_weights_are_built(tmp_path, capsys, no_work):
    base = ["make-checkpoint", "--preset", "tiny-qwen3-moe", "--quiet", "--out"]
    missing = tmp_path / "no" / "such"
    assert main(base + [str(missing / "ckpt")]) == 2
    assert f"--out {missing / 'ckpt'}: directory {missing} does not exist" in capsys.readouterr().err
    assert not (tmp_path / "no").exists()
    (tmp_path / "file").write_text("x")
    assert main(base + [str(tmp_path / "file")]) == 2
    assert "is a file, not a directory" in capsys.readouterr().err
    (tmp_path / "ckpt").mkdir()
    (tmp_path / "ckpt" / "model.safetensors").write_bytes(b"")
    assert main(base + [str(tmp_path / "ckpt")]) == 2
    assert "already holds a checkpoint" in capsys.readouterr().err


@pytest.mark.parametrize("command", [
    ["plan", "--model", "tiny-qwen3-moe", "--batch", "1", "--context", "1k"],
    ["generate", "--model", "tiny-qwen3-moe", "--prompt", "hi", "--quiet"],
])
def test_negative_vram_budget_gets_the_budget_message(capsys, command):
    """argparse alone reads "-1GiB" as an option and says "expected one argument"."""
    assert main(command + ["--vram-budget", "-1GiB"]) == 2
    err = capsys.readouterr().err
    assert "a size must be positive, got '-1GiB'" in err and "--vram-budget" in err
    assert main(command + ["--vram-budget", "0"]) == 2
    assert "a size must be positive, got '0'" in capsys.readouterr().err


def test_attach_negative_values():
    assert attach_negative_values(["plan", "--vram-budget", "-1GiB", "--context", "-2k"]) == ["plan", "--vram-budget=-1GiB",
                                                                                              "--context=-2k"]
    # argparse reads plain negative numbers itself; values and "--" are left alone
    assert attach_negative_values(["--batch", "-1", "--top-p", "-0.5"]) == ["--batch", "-1", "--top-p", "-0.5"]
    assert attach_negative_values(["--vram-budget=-1G", "--", "--x", "-1G"]) == ["--vram-budget=-1G", "--", "--x", "-1G"]


def test_plan_past_the_model_limit_names_the_largest_context_that_fits(capsys):
    assert main(["plan", "--model", "mixtral-8x7b", "--vram-budget", "32GiB", "--batch", "1", "--context", "32k"]) == 2
    err = capsys.readouterr().err
    assert "--context 32768 + --max-new-tokens 256 = 33,024 tokens per sequence passes mixtral-8x7b's limit of 32,768" in err
    assert "the largest --context that fits with --max-new-tokens 256 is 32512" in err  # plain: pasted as a flag
    assert main(["plan", "--model", "mixtral-8x7b", "--vram-budget", "32GiB", "--batch", "1", "--context", "32512",
                 "--host-memory", "1000GiB"]) == 0, "the suggested context fits the limit"
    assert main(["plan", "--model", "tiny-qwen3-moe", "--vram-budget", "2GiB", "--batch", "1", "--context", "1",
                 "--max-new-tokens", "9000"]) == 2
    assert "--max-new-tokens must stay below 8192" in capsys.readouterr().err


def test_plan_memory_hints_name_plans_flags(capsys):
    assert main(["plan", "--model", "tiny-qwen3-moe", "--vram-budget", "1MiB", "--batch", "2", "--context", "1k"]) == 2
    err = capsys.readouterr().err
    assert "below the minimum" in err and "lower --batch, --context or --max-new-tokens" in err
    assert "--max-model-len" not in err and "generate:" not in err
    assert main(["plan", "--model", "qwen3-30b-a3b", "--vram-budget", "32GiB", "--batch", "32", "--context", "32k",
                 "--host-memory", "125GiB"]) == 2
    err = capsys.readouterr().err
    assert "GiB of host memory" in err and "raise --vram-budget (fewer experts on the host), lower --batch, --context or " \
                                          "--max-new-tokens" in err
    assert "--max-model-len" not in err


def test_generate_memory_hint_names_generates_flags_and_the_api_its_arguments(capsys):
    from writescope import LLM
    from writescope.budget.plan import PlanDoesNotFit

    assert main(["generate", "--model", "tiny-qwen3-moe", "--prompt", "hi", "--quiet", "--vram-budget", "1MiB"]) == 2
    err = capsys.readouterr().err
    assert "below the minimum" in err and "raise --vram-budget, lower --batch or --max-model-len" in err
    with pytest.raises(PlanDoesNotFit, match="raise vram_budget, lower max_batch or max_model_len"):
        LLM("tiny-qwen3-moe", vram_budget="1MiB", progress=False)


def test_a_prompt_past_the_limit_is_refused_before_the_model_loads(no_work, capsys):
    long = "word " * 9000  # about 9,000 tokens against tiny-qwen3-moe's 8,192
    assert main(["generate", "--model", "tiny-qwen3-moe", "--prompt", long, "--max-new-tokens", "32"]) == 2
    err = capsys.readouterr().err
    assert "--prompt (request 0) has" in err and "beyond the limit of 8,192 tokens" in err
    assert "shorten the prompt to at most 8,160 tokens" in err and "--max-new-tokens to at most" not in err  # the prompt alone passes it
    assert main(["generate", "--model", "tiny-qwen3-moe", "--machine-text", "1000k", "--max-new-tokens", "4"]) == 2
    err = capsys.readouterr().err  # its length is a flag: the advice names it, with a value to pass as it is
    assert "--machine-text (request 0) has 1,024,000 tokens" in err and err.rstrip().endswith("use --machine-text 8188 or less")


def test_the_readme_s_first_command_runs(capsys):
    """The README's first set-up command's `writescope ...` part, as written (a README that grew past
    the tiny model's 8,192 tokens once broke it when it prompted with itself)."""
    from pathlib import Path

    readme = (Path(__file__).resolve().parent.parent / "README.md").read_text()
    first = next(ln for ln in readme.split("```bash\n", 1)[1].splitlines() if ln.strip())
    argv = first.split("&& writescope ", 1)[1].split()
    assert main(argv) == 0
    assert "TPOT" in capsys.readouterr().out


@pytest.mark.parametrize("argv, says", [
    (["generate", "--model", "tiny-qwen3-moe", "--machine-text", "2k,8k"], "--machine-text takes one token count, e.g. 32k or 2048; got '2k,8k'"),
    (["generate", "--model", "tiny-qwen3-moe", "--machine-text", "2x"], "--machine-text '2x' is not a token count: use e.g. 32k or 2048"),
    (["profile", "--model", "tiny-qwen3-moe", "--context", "1k,2k"], "--context takes one token count"),
    (["profile", "--model", "tiny-qwen3-moe", "--batch", "1", "--context", "9k"],
     "--context 9,216: with --skip 2 and --steps 8 a request reaches 9,228 tokens (12 generated), beyond the 8,192 positions "
     "of tiny-qwen3-moe: use a --context of at most 8,180"),
    (["generate", "--model", "tiny-qwen3-moe", "--prompt", "hi", "--top-p", "0.5"], "--top-p 0.5 samples, but --temperature 0 decodes greedily"),
    (["profile", "--model", "tiny-qwen3-moe", "--context", "1", "--steps", "9000"], "use --skip and --steps that add up to at most 8,189"),
    (["bench", "--model", "tiny-qwen3-moe", "--context", "infk"], "--context 'infk' is not a token count"),
    (["calibrate", "--model", "tiny-qwen3-moe", "--cpu-threads", "999"], "--cpu-threads must be 1 to"),
    (["generate", "--model", "tiny-qwen3-moe", "--prompt-ids", "1,,2"], "--prompt-ids '1,,2' has an empty entry"),
])
def test_a_flag_a_run_cannot_use_is_refused_before_the_model_loads(no_work, capsys, argv, says):
    """One token count where a list was given, profile's context past the model's positions with
    its generated steps, and --top-p without a temperature: each names the flag and what to do."""
    assert main(argv + ["--quiet"]) == 2
    assert says in capsys.readouterr().err


def test_ctrl_c_ends_a_command_without_a_traceback_and_says_what_was_kept(monkeypatch, tmp_path, capsys):
    import os

    from writescope.cli import bench, generate
    from writescope.cli.main import main

    def interrupted(args):
        raise KeyboardInterrupt

    monkeypatch.setattr(generate, "run", interrupted)
    assert main(["generate", "--model", "tiny-qwen3-moe", "--prompt", "hi"]) == 130
    err = capsys.readouterr().err
    assert "writescope generate: interrupted" in err and "Traceback" not in err
    rows = tmp_path / "rows.json"
    rows.write_text("{}")  # left by an earlier run: not this run's rows
    os.utime(rows, (1e9, 1e9))
    monkeypatch.setattr(bench, "run", interrupted)
    assert main(["bench", "--model", "tiny-qwen3-moe", "--output-json", str(rows)]) == 130
    assert "the rows finished so far" not in capsys.readouterr().err

    def saved_then_interrupted(args):  # what a bench saves as its rows finish
        rows.write_text("{}")
        raise KeyboardInterrupt

    monkeypatch.setattr(bench, "run", saved_then_interrupted)
    assert main(["bench", "--model", "tiny-qwen3-moe", "--output-json", str(rows)]) == 130
    assert f"the rows finished so far are in {rows} (run the same command with --resume" in capsys.readouterr().err
    os.utime(rows, (1e9, 1e9))  # resumed: the earlier rows are the ones to go on from
    monkeypatch.setattr(bench, "run", interrupted)
    assert main(["bench", "--model", "tiny-qwen3-moe", "--output-json", str(rows), "--resume"]) == 130
    assert "the rows finished so far are in" in capsys.readouterr().err


def test_make_checkpoint_suggests_the_preset_meant(tmp_path, capsys):
    from writescope.cli.main import main

    assert main(["make-checkpoint", "--preset", "Tiny_Qwen3", "--out", str(tmp_path / "c"), "--quiet"]) == 2
    err = capsys.readouterr().err
    assert "unknown preset 'Tiny_Qwen3'; did you mean 'tiny-qwen3-moe'?" in err and "checkpoint directory" not in err


def test_the_cli_words_its_own_warnings_without_a_source_line():
    import os
    import warnings

    from writescope.cli.main import _warning_format

    import writescope.engine.switches as switches

    fmt = _warning_format(warnings.formatwarning, "generate")
    ours = switches.__file__
    assert fmt("not a switch", UserWarning, ours, 115) == "writescope generate: warning: not a switch\n"
    lib = os.path.join(os.path.dirname(os.path.dirname(os.path.dirname(ours))), ".venv", "writescope", "torch", "x.py")  # a clone's venv
    theirs = fmt("old", DeprecationWarning, ours, 3), fmt("lib", UserWarning, lib, 7)
    assert all("x.py:7" in t or "switches.py:3" in t for t in theirs)  # others keep their source line


def test_a_busy_machine_is_noted_beside_the_timings(monkeypatch):
    import os

    from writescope.engine import threads

    monkeypatch.setattr(threads, "usable_cpus", lambda: 4)
    monkeypatch.setattr(os, "getloadavg", lambda: (6.5, 1.0, 1.0))
    assert "the load average (6.5) exceeds the 4 CPUs this process may use" in threads.busy_note()
    assert "OMP_WAIT_POLICY=passive" in threads.busy_note()  # what helped most on a busy 2-core machine
    monkeypatch.setattr(os, "getloadavg", lambda: (3.9, 9.0, 9.0))
    assert threads.busy_note() is None


def test_generate_notes_competition_measured_while_it_ran_not_the_load_average(capsys, monkeypatch):
    """generate's note on competing processes comes from what they took while the run was timed
    (writescope/engine/cpu_competition.py), where that can be measured: a high load average before
    a quiet run gives no note, and others' use during the run does."""
    import os

    from writescope.engine import cpu_competition, threads

    monkeypatch.setattr(threads, "usable_cpus", lambda: 2)
    monkeypatch.setattr(os, "getloadavg", lambda: (9.0, 9.0, 9.0))  # a busy minute before the run
    monkeypatch.setattr(cpu_competition.CpuCompetition, "measurable", property(lambda self: True))
    args = ["generate", "--model", "tiny-qwen3-moe", "--prompt-ids", "5,6,7,8", "--max-new-tokens", "2", "--quiet"]
    monkeypatch.setattr(cpu_competition.CpuCompetition, "note", lambda self, remedy: None)  # measured quiet
    assert main(args) == 0
    assert "load average" not in capsys.readouterr().out
    monkeypatch.setattr(cpu_competition.CpuCompetition, "note", lambda self, remedy: f"note: others busy ({remedy})")
    assert main(args) == 0
    out = capsys.readouterr().out
    assert "note: others busy (OMP_WAIT_POLICY=passive" in out and "load average" not in out


def test_plan_checks_the_switches_as_generate_does(capsys, monkeypatch):
    """`writescope plan` refuses a bad WRITESCOPE_* value and names a misspelt switch, as generate
    and bench do (a new user's trial found plan silent on both)."""
    args = ["plan", "--model", "tiny-qwen3-moe", "--vram-budget", "8GiB", "--batch", "2", "--context", "1k"]
    monkeypatch.setenv("WRITESCOPE_LOAD_COPIES", "soon")
    assert main(args) == 2
    assert "WRITESCOPE_LOAD_COPIES='soon'" in capsys.readouterr().err
    monkeypatch.delenv("WRITESCOPE_LOAD_COPIES")
    monkeypatch.setenv("WRITESCOPE_LOAD_COPIE", "early")
    with pytest.warns(UserWarning, match="did you mean WRITESCOPE_LOAD_COPIES"):
        assert main(args) == 0


def test_an_unknown_flag_is_named_by_its_subcommand(capsys, no_work):
    """A flag the subcommand does not take: its own usage and name, and where its flags are listed."""
    with pytest.raises(SystemExit) as e:
        main(["plan", "--model", "deepseek-v2-lite", "--vram-budget", "32GiB", "--batch", "4", "--context", "8k", "--quiet"])
    assert e.value.code == 2
    err = capsys.readouterr().err
    assert err.startswith("usage: writescope plan ")
    assert "writescope plan: error: unrecognized arguments: --quiet (see writescope plan --help)" in err


def test_the_readme_names_every_per_row_switch():
    """The bench section of the README or of docs/USAGE.md (the README's full reference) lists the
    switches a row may set (a new user found six missing): every name of PER_ROW, written WRITESCOPE_X
    or _X, in its "(switches: ...;" list."""
    import re
    from pathlib import Path

    from writescope.bench.switches import PER_ROW

    root = Path(__file__).resolve().parent.parent
    readme = (root / "README.md").read_text() + (root / "docs" / "USAGE.md").read_text()
    listed = readme.split("(switches: ", 1)[1].split(";", 1)[0]
    names = {n if n.startswith("WRITESCOPE") else "WRITESCOPE" + n for n in re.findall(r"(?:WRITESCOPE)?_[A-Z_]+", listed.replace("#", " "))}
    assert names == set(PER_ROW)


@pytest.mark.parametrize("budget, noted", [([], "without --vram-budget"), (["--vram-budget", "10gib"], "the budget holds every"),
                                           (["--vram-budget", "0.72gib"], None)])
def test_a_stream_share_that_changes_nothing_is_noted(capsys, budget, noted):
    """--expert-stream-share with every routed expert on the device says it changes nothing; with
    experts in host memory it says nothing of the kind."""
    argv = ["generate", "--model", "tiny-qwen3-moe", "--prompt", "hi", "--max-new-tokens", "1", "--quiet", "--expert-stream-share", "0.5"]
    assert main(argv + budget) == 0
    out = capsys.readouterr().out
    if noted is None:
        assert "changes nothing" not in out and "13 in host memory" in out
    else:
        assert f"note: --expert-stream-share 0.5 changes nothing here: {noted}" in out
