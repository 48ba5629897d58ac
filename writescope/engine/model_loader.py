"""Turn a ``--model`` argument into (config, model, tokenizer) on a device."""

from __future__ import annotations

import re
import time
import warnings
from pathlib import Path

import torch

from writescope.checkpoint.loader import load_weights
from writescope.checkpoint.synthetic import fill_synthetic
from writescope.checkpoint.tokenizer import Tokenizer, synthetic_tokenizer
from writescope.config import ModelConfig
from writescope.errors import ArgError
from writescope.engine.timing import synchronize
from writescope.models import build_model
from writescope.models.causal_lm import CausalLM
from writescope.presets import PRESETS, closest_preset, did_you_mean, preset_config

DTYPES = {
    "bf16": torch.bfloat16, "bfloat16": torch.bfloat16,
    "fp16": torch.float16, "float16": torch.float16,
    "fp32": torch.float32, "float32": torch.float32,
}


def parse_dtype(name: str | torch.dtype, device: torch.device) -> torch.dtype:
    """``auto`` (bf16 on CUDA, fp32 on CPU), bf16, fp16, fp32 or a torch dtype.

    Raises:
        ValueError: any other name (the message lists the accepted ones).
    """
    if isinstance(name, torch.dtype):
        if name not in DTYPES.values():
            raise ValueError(f"dtype {name} is not supported; use one of bf16, fp16, fp32")
        return name
    if name == "auto":
        return torch.bfloat16 if device.type == "cuda" else torch.float32
    if name not in DTYPES:
        raise ValueError(f"unknown dtype {name!r}; use one of auto, bf16, fp16, fp32")
    return DTYPES[name]


def resolve_device(name: str) -> torch.device:
    """``auto`` (CUDA when present), ``cpu`` or ``cuda[:N]``.

    Raises:
        ValueError: CUDA asked for but not available, or an unknown device string.
    """
    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    try:
        dev = torch.device(name)
    except RuntimeError as e:
        raise ValueError(f"unknown device {name!r}; use auto, cpu or cuda") from e
    if dev.type == "cuda" and not torch.cuda.is_available():
        raise ValueError(f"device {name!r} asked for, but this machine has no CUDA GPU; use --device cpu")
    if dev.type not in ("cpu", "cuda"):
        raise ValueError(f"device {name!r} is not supported; use cpu or cuda")
    return dev


def _unknown_model(model: str, p: Path) -> str:
    """Why ``model`` names neither a checkpoint directory nor a preset, and what to pass instead:
    a file, a path with no directory there, a Hugging Face hub id (nothing is downloaded), or a
    misspelt preset."""
    presets = f"presets: {', '.join(PRESETS)}"
    if p.is_file():
        return f"model {model!r} is a file: pass the checkpoint directory (config.json and *.safetensors) or a preset; {presets}"
    owner, _, name = model.partition("/")
    if re.fullmatch(r"[A-Za-z0-9][\w.-]*/[\w.-]+", model) and not Path(owner).is_dir():  # owner/name, and no local folder owner
        close = closest_preset(name)
        preset = f"or, for its config with seeded synthetic weights, the preset {close!r}; " if close else ""
        return (f"model {model!r} looks like a Hugging Face hub id, and WriteScope downloads nothing: download it first "
                f"(e.g. `hf download {model} --local-dir DIR`) and pass DIR; {preset}{presets}")
    if "/" in model or model.startswith(("~", ".")):
        full = str(p.resolve())
        where = "" if full == model else f" ({full})"
        return f"model {model!r}: no checkpoint directory there{where}: pass a checkpoint directory or a preset; {presets}"
    return f"model {model!r} is neither a checkpoint directory nor a preset; {did_you_mean(model)}{presets}"


def resolve_config(model: str, num_layers: int | None = None, synthetic: bool = False) -> tuple[ModelConfig, Path | None]:
    """(config, checkpoint dir or None for a preset). ``num_layers`` keeps the model's shape
    but only its first ``num_layers`` decoder layers (benchmarks of one model's layer shape).

    Raises:
        ValueError: neither a checkpoint directory nor a preset name; ``num_layers`` not in
            [1, the model's num_hidden_layers], or given for a checkpoint's own weights
            (``synthetic`` False: a truncated model is for synthetic weights only).
    """
    p = Path(model).expanduser()
    if p.is_dir():
        cfg, ckpt = ModelConfig.from_file(p), p
    elif model in PRESETS:
        cfg, ckpt = preset_config(model), None
    else:
        raise ArgError(_unknown_model(model, p), "model")
    if num_layers is not None:
        if not 1 <= num_layers <= cfg.num_layers:
            raise ArgError(f"num_layers {num_layers} must be in [1, {cfg.num_layers}] (the layers of {model})", "num_layers")
        if ckpt is not None and not synthetic:
            raise ArgError("num_layers keeps only some layers: use it with synthetic weights (synthetic=True)", "num_layers",
                           "synthetic=True")
        cfg = cfg.with_overrides(num_hidden_layers=num_layers)
    return cfg, ckpt


def load_model(
    model: str, synthetic: bool, dtype: torch.dtype, device: torch.device, seed: int = 0, progress: bool = True,
    num_layers: int | None = None,
    host_experts: dict[int, range] | None = None,
) -> tuple[ModelConfig, CausalLM, Tokenizer, dict]:
    """Build the model on ``device`` and fill its weights.

    A preset name always means synthetic weights (there is no file to read); a directory is
    loaded from its safetensors unless ``synthetic`` is set. Returns (config, model,
    tokenizer, info) where info has ``source`` and ``load_s``.

    Raises:
        ValueError: see :func:`resolve_config`.

    ``host_experts`` (``{layer id: expert ids}``) are built and filled in host memory.
    """
    t0 = time.perf_counter()
    cfg, ckpt = resolve_config(model, num_layers, synthetic)
    net = build_model(cfg, dtype, device, host_experts)
    if ckpt is None or synthetic:
        fill_synthetic(net, seed, progress=progress)
        source = f"synthetic weights (seed {seed})"
    else:
        load_weights(net, ckpt, progress=progress)
        source = f"checkpoint {ckpt}"
    tok = _tokenizer(cfg, ckpt)
    if ckpt is not None and not synthetic and not (ckpt / "tokenizer.json").is_file():
        warnings.warn(f"{ckpt} has no tokenizer.json: text is tokenized by a stand-in byte-level BPE that is not this model's, "
                      "so text prompts and the output text mean nothing (token ids in and out are unaffected). Give the "
                      "checkpoint its tokenizer.json (transformers: AutoTokenizer.from_pretrained(DIR).save_pretrained(DIR) "
                      "writes one)", stacklevel=2)
    synchronize(device)
    return cfg, net, tok, {"source": source, "load_s": time.perf_counter() - t0}


def _tokenizer(cfg: ModelConfig, ckpt: Path | None) -> Tokenizer:
    if ckpt is not None and (ckpt / "tokenizer.json").is_file():
        return Tokenizer.from_file(ckpt / "tokenizer.json")
    return synthetic_tokenizer(cfg.vocab_size)


def load_tokenizer(model: str, synthetic: bool = False) -> Tokenizer:
    """The tokenizer ``load_model`` gives ``model`` (the checkpoint's ``tokenizer.json``, else the
    synthetic BPE), without building the model: to count a prompt's tokens before the build.

    Raises:
        ValueError: see :func:`resolve_config`; an unreadable tokenizer.json.
    """
    return _tokenizer(*resolve_config(model, None, synthetic))


def capped_model_len(model: str, tokens: int, num_layers: int | None = None, synthetic: bool = False) -> int:
    """``tokens`` (what a run's requests reach: prompt + new tokens) capped at the model's
    ``max_position_embeddings``: the ``max_model_len`` a budget plan is sized for. A request past
    the limit then gets the engine's own length message instead of one about ``max_model_len``."""
    return min(resolve_config(model, num_layers, synthetic)[0].max_position_embeddings, tokens)
