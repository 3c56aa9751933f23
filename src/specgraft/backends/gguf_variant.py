"""A prepared variant of the user's GGUF whose tensors all take llama.cpp's batched CPU kernels (opt-in, lossy
with respect to the original file: its quality change is measured in docs/backends.md).

On x86, llama.cpp multiplies Q4_0 / Q4_K / IQ4_NL weights with a repacked GEMM and Q8_0 with tinyBLAS, both of
which read a weight row once for several tokens; Q6_K has neither, so its cost grows with every token of a
verify (one dot product per weight row and token), as for Q4_1, Q5_K and the other types without either. A
Q4_K_M file keeps the tied output matrix and half the ``ffn_down`` / ``attn_v`` tensors in Q6_K; SmolLM2's file
is Q4_1. ``batched_variant`` writes a copy in which every tensor of such a type is re-quantised to Q8_0 by
llama.cpp's own quantizer (``llama_model_quantize`` with one tensor-type override per tensor) and every other
tensor keeps its type, so it is copied unchanged. Q8_0 holds those values to within its own rounding (8.5 bits
per weight): the variant is not the user's file, and specgraft says so wherever it is used. Greedy output is
lossless with respect to llama.cpp AR *on the variant*.

The copy is made once, beside the original (or in the cache when that folder is read-only), named after the
original's path, size and modification time, written to a temporary name and renamed at the end.
"""

from __future__ import annotations

import ctypes
import hashlib
import os
import sys
import tempfile
from pathlib import Path

from ..errors import SpecgraftError

Q8_VARIANT = "gguf-q8"  # the weights label: records, cost-curve keys, --dtype on --backend llamacpp
GGML_TYPE_Q8_0 = 8
# ggml types with a batched x86 kernel (ggml.h numbering): F32, F16, Q4_0, Q8_0, Q4_K, IQ4_NL, BF16
BATCHED_TYPES = frozenset({0, 1, 2, 8, 12, 20, 30})


def target_type(t: int) -> int:
    return t if t in BATCHED_TYPES else GGML_TYPE_Q8_0


def variant_path(original: Path, cache_dir: Path) -> Path:
    """Named after the original's path, size and modification time, so a changed or another file of the same
    name never reuses a stale copy."""
    st = original.stat()
    stamp = hashlib.sha256(f"{original.resolve()}|{st.st_size}|{st.st_mtime_ns}".encode()).hexdigest()[:10]
    name = f"{original.stem}.{Q8_VARIANT}-{stamp}.gguf"
    beside = original.parent / name
    return beside if os.access(original.parent, os.W_OK) else cache_dir / name


def _tensor_types(path: Path) -> dict[str, int]:
    from gguf import GGUFReader

    return {t.name: int(t.tensor_type) for t in GGUFReader(str(path)).tensors}


def batched_variant(original: Path, cache_dir: Path) -> Path:
    """The variant of ``original`` (made once); refuses a file it would not change."""
    import llama_cpp as lc

    from .llamacpp import _quiet

    _quiet(lc)  # the quantizer logs every tensor otherwise
    out = variant_path(Path(original), Path(cache_dir))
    if out.exists():
        return out
    types = _tensor_types(Path(original))
    if all(target_type(t) == t for t in types.values()):
        raise SpecgraftError(f"every tensor of '{original}' already takes llama.cpp's batched kernels: its "
                             f"{Q8_VARIANT} variant would equal it")
    # one anchored override per tensor: to Q8_0, or to its own type (then llama.cpp copies it unchanged)
    names = [n.encode() for n in types]  # kept alive while the quantizer runs
    overrides = (lc.llama_model_tensor_override * (len(types) + 1))()
    for i, (name, t) in enumerate(types.items()):
        names[i] = b"^" + name.replace(".", r"\.").encode() + b"$"
        overrides[i].pattern = names[i]
        overrides[i].type = target_type(t)
    overrides[len(types)].pattern = None
    params = lc.llama_model_quantize_default_params()
    params.nthread = os.cpu_count() or 1
    params.ftype = 15  # LLAMA_FTYPE_MOSTLY_Q4_K_M: only names the file's type; every tensor is overridden
    params.allow_requantize = True
    params.quantize_output_tensor = True
    params.tt_overrides = ctypes.cast(overrides, ctypes.POINTER(lc.llama_model_tensor_override))
    out.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=out.parent, prefix=f".{out.name}.", suffix=".tmp")
    os.close(fd)
    print(f"specgraft: writing {out.name}: the tensors of {Path(original).name} without a batched llama.cpp "
          "kernel re-quantised to Q8_0 (once)", file=sys.stderr)
    try:
        if lc.llama_model_quantize(str(original).encode(), tmp.encode(), ctypes.byref(params)) != 0:
            raise SpecgraftError(f"llama.cpp's quantizer failed on '{original}'")
        got = _tensor_types(Path(tmp))
        wrong = [n for n, t in types.items() if got.get(n) != target_type(t)]
        if wrong:
            raise SpecgraftError(f"llama.cpp's quantizer did not keep the requested types for {wrong[:3]}")
        os.replace(tmp, out)
    finally:
        Path(tmp).unlink(missing_ok=True)
    return out
