"""Where oneDNN has no packed bf16 path (neither AVX-512 BW/VL/DQ nor AVX-NE-CONVERT: an AVX2-only AMD EPYC),
bf16 models keep their plain layers instead of failing to load (``backends/packed.py``)."""

import pytest
import torch

from specgraft.backends import packed
from specgraft.core.backend import packed_layers
from specgraft.env import cpu_flags

from ..conftest import tiny_llama


def test_the_probe_agrees_with_the_cpu_flags():
    flags = cpu_flags()
    if not flags or not torch.backends.mkldnn.is_available():
        pytest.skip("no x86 CPU flags (or no oneDNN) to compare the probe with")
    wide = {"avx512bw", "avx512vl", "avx512dq"} <= flags or "avx_ne_convert" in flags
    assert packed.bf16_path() == wide


def test_without_the_path_a_bf16_model_keeps_its_plain_layers(monkeypatch):
    monkeypatch.setattr(packed, "packed_path", lambda dtype: dtype != torch.bfloat16)
    model = tiny_llama(vocab=64, layers=1).to(torch.bfloat16)
    assert not packed.available(torch.bfloat16) and packed.prepack(model) == []
    assert packed_layers(model) == 0 and type(model.lm_head) is torch.nn.Linear
    x = torch.tensor([[1, 2, 3]])
    assert torch.isfinite(model(input_ids=x).logits).all()
