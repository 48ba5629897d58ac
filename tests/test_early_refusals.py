"""Refusals a new user met only after the long work: generate's out-of-vocabulary --prompt-ids
(after the weights loaded) and serve's --port already in use (uvicorn's raw "[Errno 98]", exit 3).
Both are now refused before the model loads, as ``writescope CMD: error: ...`` with exit 2."""

from __future__ import annotations

import socket

import pytest

from writescope.cli.main import main
from writescope.errors import ArgError

MODEL = "tiny-qwen3-moe"  # vocab 4096


@pytest.fixture
def no_work(monkeypatch):
    """Any model load or weight build fails the test: the refusal must come before it."""
    import writescope
    import writescope.checkpoint.synthetic as synthetic
    import writescope.engine.llm as llm

    writescope.LLM  # noqa: B018 - the package's lazy names resolved before the patch

    def loaded(*a, **k):
        raise AssertionError("the model started loading before the refusal")

    monkeypatch.setattr(llm, "LLM", loaded)
    monkeypatch.setattr(writescope, "LLM", loaded)
    monkeypatch.setattr(synthetic, "synthetic_tensors", loaded)


def _engine_words(ids, vocab_size: int) -> str:
    """What the engine's own check says, in generate's flags."""
    from writescope.engine.prompts import check_token_ids

    with pytest.raises(ArgError) as e:
        check_token_ids(ids, vocab_size, "prompt_token_ids")
    return e.value.worded({"prompt_token_ids": "--prompt-ids"})


def test_out_of_vocabulary_prompt_ids_are_refused_before_the_model_loads(no_work, capsys):
    argv = ["generate", "--model", "qwen3-30b-a3b", "--num-layers", "1", "--prompt-ids", "1,999999999", "--quiet"]
    assert main(argv) == 2
    err = capsys.readouterr().err
    want = ("--prompt-ids (request 0) has token id 999999999 at position 1, outside the model's vocabulary of 151,936 ids "
            "[0, 151936): use ids below 151936")
    assert err == f"writescope generate: error: {want}\n"
    assert want == _engine_words([[1, 999999999]], 151936), "the engine's wording, word for word"


@pytest.mark.parametrize("ids, bad", [("5,4096", "token id 4096 at position 1"), ("-1,2", "token id -1 at position 0")],
                         ids=["at-the-vocab-size", "negative"])
def test_each_id_outside_the_preset_s_vocabulary_is_refused_before_the_model_loads(no_work, capsys, ids, bad):
    assert main(["generate", "--model", MODEL, "--prompt-ids", ids, "--batch", "2", "--quiet"]) == 2
    err = capsys.readouterr().err
    assert err.startswith("writescope generate: error: --prompt-ids (request 0) has ") and bad in err
    assert "vocabulary of 4,096 ids [0, 4096): use ids below 4096" in err


def test_a_checkpoint_s_vocabulary_is_read_from_its_config_json(no_work, capsys, tmp_path):
    import json

    from writescope.engine.model_loader import resolve_config

    hf = resolve_config(MODEL)[0].hf_dict()
    hf["vocab_size"] = 1000  # the checkpoint's own, not the preset's 4096
    (tmp_path / "config.json").write_text(json.dumps(hf))
    assert main(["generate", "--model", str(tmp_path), "--synthetic", "--prompt-ids", "1,1000", "--quiet"]) == 2
    err = capsys.readouterr().err
    assert err == ("writescope generate: error: --prompt-ids (request 0) has token id 1000 at position 1, outside the model's "
                   "vocabulary of 1,000 ids [0, 1000): use ids below 1000\n")


def _listening() -> socket.socket:
    """A socket listening on a free loopback port, as another server would."""
    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    sock.bind(("127.0.0.1", 0))
    sock.listen()
    return sock


def test_port_in_use_is_refused_by_the_pre_check():
    pytest.importorskip("fastapi")
    from writescope.cli.serve import check_port_free

    with _listening() as sock:
        port = sock.getsockname()[1]
        with pytest.raises(ValueError) as e:
            check_port_free("127.0.0.1", port)
    msg = str(e.value)
    assert msg.startswith(f"127.0.0.1:{port} is already in use") and "another --port" in msg and "stop the process using it" in msg
    check_port_free("127.0.0.1", 0)  # any free port: nothing to check
    check_port_free("127.0.0.1", port)  # closed again: free


@pytest.fixture
def no_listening(monkeypatch):
    """Neither the server nor the model load starts."""
    pytest.importorskip("fastapi")
    import uvicorn

    import writescope.cli.serve as serve_cli

    def started(*args, **kwargs):
        raise AssertionError("the server or the model load started")

    monkeypatch.setattr(uvicorn.Server, "run", started)
    monkeypatch.setattr(serve_cli, "_load", started)


def test_serve_on_a_port_in_use_exits_2_with_what_to_do(no_listening, capsys):
    with _listening() as sock:
        port = sock.getsockname()[1]
        assert main(["serve", "--model", MODEL, "--port", str(port)]) == 2
    err = capsys.readouterr().err
    assert err.startswith(f"writescope serve: error: 127.0.0.1:{port} is already in use: another process listens on port {port}")
    assert "pass another --port (--port 0 picks a free one), or stop the process using it" in err
    assert "Errno" not in err


def test_serve_whose_server_does_not_start_exits_2(monkeypatch, capsys):
    """Taken between the check and uvicorn's bind (a race): uvicorn logs why and exits 3; serve says so, exit 2."""
    pytest.importorskip("fastapi")
    import uvicorn

    import writescope.cli.serve as serve_cli

    def failed(self, *args, **kwargs):
        raise SystemExit(3)

    monkeypatch.setattr(uvicorn.Server, "run", failed)
    monkeypatch.setattr(serve_cli, "_load", lambda *a: None)
    assert main(["serve", "--model", MODEL, "--port", "0", "--log-level", "warning"]) == 2
    err = capsys.readouterr().err
    assert err.startswith("writescope serve: error: the server did not start on 127.0.0.1:0 (uvicorn's message above says why)")


def test_serve_without_its_extra_says_how_to_install_it(monkeypatch, capsys):
    import sys

    monkeypatch.setitem(sys.modules, "uvicorn", None)  # import uvicorn raises ImportError(name="uvicorn")
    assert main(["serve", "--model", "tiny-qwen3-moe"]) == 2
    err = capsys.readouterr().err
    assert "uvicorn is not installed: in the project's clone, pip install -e '.[serve]'" in err
