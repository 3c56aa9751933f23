"""Where the target (and a draft model) run. Every backend keeps one contract (``core.backend.Backend``) and
declares what it can do (``core.backend.Capabilities``); adding one means implementing that protocol and
naming its opener in ``OPENERS`` (docs/design.md, "The Backend protocol"). The transformers backend's class
is ``core.backend.TargetBackend``; llama.cpp's is ``backends.llamacpp.LlamaCppBackend``."""

from __future__ import annotations

import os
import sys
from pathlib import Path
from typing import Callable

from ..errors import SpecgraftError

_MODELS: dict[tuple, object] = {}  # loaded GGUF weights, shared by every context made from them


GGUF = "gguf"  # llama.cpp on the model's GGUF as it is
INT4 = "int4"  # --dtype int4: the GGUF's own 4-bit codes through PyTorch's int4 kernel (backends/int4.py)


def load_transformers(name_or_path: str, dtype: str, cache_dir, device: str):
    """``(hf_model, tokenizer, weights)``: ``dtype`` float32 / bfloat16 / float16 / auto (``models.resolve_dtype``),
    or ``int4`` (a registry model's GGUF 4-bit tensors kept as codes, bf16 activations and other tensors; CPU
    only)."""
    from ..models import REGISTRY, gguf_file, load, resolve_dtype

    dtype = resolve_dtype(dtype, device)
    if dtype != INT4:
        model, tok = load(name_or_path, dtype, cache_dir, device)
        _prepack(model, device)
        return model, tok, str(next(model.parameters()).dtype).replace("torch.", "")
    if device != "cpu":
        raise SpecgraftError("--dtype int4 runs PyTorch's CPU int4 kernel; use --device cpu (or bfloat16 on a GPU)")
    if name_or_path not in REGISTRY:
        raise SpecgraftError(f"--dtype int4 reads the 4-bit codes from the model's GGUF: use one of "
                             f"{', '.join(REGISTRY)} ('{name_or_path}' is not one)")
    from .int4 import convert

    model, tok = load(name_or_path, "bfloat16", cache_dir, device)
    convert(model, gguf_file(name_or_path, cache_dir)[0])
    _prepack(model, device)  # the tensors the file keeps in Q6_K / Q8_0, and the head, stay bf16
    return model, tok, INT4


def _prepack(model, device: str) -> None:
    """bf16 and fp32 linear layers on the CPU get their weights in oneDNN's layout once (``backends/packed.py``)."""
    if device == "cpu":
        from .packed import prepack

        prepack(model)


def transformers_backend(name_or_path: str, dtype: str = "float32", cache_dir: str | os.PathLike | None = None,
                         device: str = "cpu"):
    """``(TargetBackend, tokenizer)`` for a registry model or a local HF directory; draft models by name load
    with the same dtype, cache and device."""
    from ..core.backend import TargetBackend

    model, tok, weights = load_transformers(name_or_path, dtype, cache_dir, device)
    return TargetBackend(model, transformers_drafts(dtype, cache_dir, device), weights=weights), tok


def transformers_drafts(dtype: str, cache_dir, device: str):
    def load_draft(name: str):
        from ..core.backend import TargetBackend

        model, _, weights = load_transformers(name, dtype, cache_dir, device)
        return TargetBackend(model, weights=weights)

    return load_draft


def llamacpp_backend(name_or_path: str, cache_dir: str | os.PathLike | None = None, settings=None,
                     weights: str = GGUF, hidden: bool = True):
    """``(LlamaCppBackend, tokenizer_dir)`` for a registry model or a local ``.gguf`` file; weights load once.
    ``weights``: ``gguf`` (the file as it is) or ``gguf-q8`` (its prepared variant, ``gguf_variant``);
    ``hidden=False`` for contexts that never return hidden states (draft models)."""
    from ..models import cache_root, gguf_file
    from .gguf_variant import Q8_VARIANT, batched_variant
    from .llamacpp import LlamaCppBackend, LlamaModel, LlamaSettings, import_llama_cpp

    import_llama_cpp()  # one clear error before assembling a GGUF it could not run
    gguf, tok_dir = gguf_file(name_or_path, cache_dir)
    if weights == Q8_VARIANT:
        original, gguf = gguf, batched_variant(gguf, cache_root(cache_dir) / "gguf")
        print(f"specgraft: llama.cpp runs {gguf.name}, a copy of {original.name} re-quantised by llama.cpp "
              f"({Q8_VARIANT}), not the original file", file=sys.stderr)
    elif weights != GGUF:
        raise SpecgraftError(f"unknown llama.cpp weights '{weights}'; choose {GGUF} or {Q8_VARIANT}")
    settings = settings or LlamaSettings()
    key = (str(Path(gguf).resolve()), settings)
    if key not in _MODELS:
        _MODELS[key] = LlamaModel(gguf, settings, weights)
    return LlamaCppBackend(_MODELS[key], hidden=hidden), tok_dir


def _open_llamacpp(name_or_path: str, dtype: str, cache_dir, device: str):
    """``--dtype gguf-q8`` opens the prepared variant; any other dtype the file as it is (llama.cpp runs the
    GGUF's own quantisation)."""
    if device != "cpu":
        raise SpecgraftError("--backend llamacpp runs on the CPU here (built without CUDA); use --device cpu")
    from transformers import AutoTokenizer

    from .gguf_variant import Q8_VARIANT

    backend, tok_dir = llamacpp_backend(name_or_path, cache_dir, weights=Q8_VARIANT if dtype == Q8_VARIANT else GGUF)
    return backend, AutoTokenizer.from_pretrained(tok_dir)


# backend name -> opener(model, dtype, cache_dir, device) -> (Backend, tokenizer); dtype is the transformers
# weights' (llama.cpp runs the GGUF's own quantisation)
OPENERS: dict[str, Callable] = {"transformers": transformers_backend, "llamacpp": _open_llamacpp}
BACKENDS = tuple(OPENERS)


def open_backend(kind: str, name_or_path: str, dtype: str = "float32", cache_dir=None, device: str = "cpu"):
    """``(Backend, tokenizer)`` of backend ``kind`` for a model."""
    if kind not in OPENERS:
        raise SpecgraftError(f"unknown backend '{kind}'; choose one of: {', '.join(BACKENDS)}, or auto")
    return OPENERS[kind](name_or_path, dtype, cache_dir, device)
