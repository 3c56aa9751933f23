"""Backends beyond transformers: where the target (and a draft model) run. The transformers backend is
``core.backend.TargetBackend``; every backend keeps its contract (``core.backend.Backend``)."""

from __future__ import annotations

import os
from pathlib import Path

BACKENDS = ("transformers", "llamacpp")

_MODELS: dict[tuple, object] = {}  # loaded GGUF weights, shared by every context made from them


def llamacpp_backend(name_or_path: str, cache_dir: str | os.PathLike | None = None, settings=None):
    """``(LlamaCppBackend, tokenizer_dir)`` for a registry model or a local ``.gguf`` file; weights load once."""
    from ..models import gguf_file
    from .llamacpp import LlamaCppBackend, LlamaModel, LlamaSettings, import_llama_cpp

    import_llama_cpp()  # one clear error before assembling a GGUF it could not run
    gguf, tok_dir = gguf_file(name_or_path, cache_dir)
    settings = settings or LlamaSettings()
    key = (str(Path(gguf).resolve()), settings)
    if key not in _MODELS:
        _MODELS[key] = LlamaModel(gguf, settings)
    return LlamaCppBackend(_MODELS[key]), tok_dir
