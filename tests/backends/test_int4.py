"""``--dtype int4``: the GGUF's own 4-bit codes through PyTorch's CPU int4 kernel. The codes must reproduce the
file's dequantised values exactly (golden tests against the ``gguf`` library's own dequantisation), a layer must
compute with exactly those codes and bf16-rounded scales, a converted SmolLM2 must sit as close to the dequantised
GGUF as its bf16 copy does (a wrong row order must be caught), and every lossless method on it must equal its AR.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch
from gguf import GGMLQuantizationType
from gguf.quants import dequantize, quantize

from specgraft.backends import int4, load_transformers
from specgraft.errors import SpecgraftError

from ..conftest import assert_greedy_equal

BF16_STEP = 2.0 ** -8  # bf16 keeps 8 significant bits: one rounding moves a value by at most half of this


def random_q4k(rows: int, k: int, seed: int) -> np.ndarray:
    """Random valid Q4_K rows: any bytes are valid codes and packed 6-bit scales; d and dmin are set to finite
    fp16 values."""
    rng = np.random.default_rng(seed)
    raw = rng.integers(0, 256, (rows, k // 256, 144), dtype=np.uint8)
    for start, (lo, hi) in ((0, (1e-3, 1e-2)), (2, (1e-4, 1e-3))):
        half = rng.uniform(lo, hi, (rows, k // 256)).astype(np.float16)
        raw[..., start:start + 2] = half.view(np.uint8).reshape(rows, k // 256, 2)
    return raw.reshape(rows, -1)


@pytest.mark.parametrize("kind", ["Q4_0", "Q4_1", "Q4_K"])
def test_codes_reproduce_the_gguf_dequantisation_exactly(kind):
    n, k = 8, 512
    if kind == "Q4_K":  # the gguf library cannot quantise Q4_K: random blocks instead
        raw = random_q4k(n, k, 0)
    else:
        raw = quantize(np.random.default_rng(0).standard_normal((n, k)).astype(np.float32),
                       GGMLQuantizationType[kind])
    q, scale, offset = int4.codes(kind, raw, n, k)
    assert q.shape == (n, k) and q.min() >= 0 and q.max() <= 15 and scale.shape == offset.shape == (n, k // 32)
    mine = np.repeat(scale, 32, axis=1) * q + np.repeat(offset, 32, axis=1)
    np.testing.assert_array_equal(mine, dequantize(raw, GGMLQuantizationType[kind]))
    # a 6-bit type is not a 4-bit code: the caller keeps it in bf16
    assert int4.codes("Q6_K", raw, n, k) is None


def test_int4_layer_computes_with_its_codes():
    torch.manual_seed(0)
    n, k = 96, 256
    q = torch.randint(0, 16, (n, k), dtype=torch.uint8)
    scale, offset = torch.rand(n, k // 32) * 0.02, torch.randn(n, k // 32) * 0.05
    bias = torch.randn(n)
    layer = int4.Int4Linear(q, scale, offset, bias)
    x = torch.randn(3, 5, k, dtype=torch.bfloat16)
    y = layer(x)
    assert y.shape == (3, 5, n) and y.dtype == torch.bfloat16

    def error(weight):
        ref = x.float() @ weight.t() + bias.to(torch.bfloat16).float()
        return float((y.float() - ref).abs().max()), float(ref.abs().max())

    err, top = error(int4.Int4Linear.weight(q, scale, offset))
    assert err <= 2 * BF16_STEP * top  # the bf16 output's rounding (and fp32 summation order)
    # negative control: the kernel's zero convention (code 8) left out must be caught by the same tolerance
    wrong, _ = error(((q.float() - 8) * scale.repeat_interleave(32, 1) + offset.repeat_interleave(32, 1)))
    assert wrong > 2 * BF16_STEP * top


@pytest.fixture(scope="module")
def smollm2_fp32_state():
    from specgraft import models

    model, _ = models.load("smollm2-135m", "float32")
    return model.state_dict()


def converted(reference):
    from specgraft import models

    model, _ = models.load("smollm2-135m", "bfloat16")
    report = int4.convert(model, models.gguf_file("smollm2-135m")[0], reference)
    return model, report


@pytest.mark.slow
def test_smollm2_int4_is_as_close_to_the_gguf_as_bf16(smollm2_fp32_state, monkeypatch):
    model, report = converted(smollm2_fp32_state)
    layers = model.config.num_hidden_layers
    assert len(report.int4) == 7 * layers  # every projection of every layer is Q4_1 in this file
    assert report.bf16 == {"lm_head": "Q8_0"}  # the tied head is token_embd, Q8_0: kept in bf16
    assert all(isinstance(model.get_submodule(name), int4.Int4Linear) for name in report.int4)
    assert model.get_output_embeddings().weight is model.get_input_embeddings().weight  # so it stays tied
    worst = max(err / top for err, top in report.int4.values())
    assert worst <= BF16_STEP * 2  # about what rounding each weight to bf16 costs (measured: 0.0034 vs 0.0029)
    # negative control: llama's q/k rows left in the file's (rotary-permuted) order must be caught
    monkeypatch.setattr(int4, "_row_order", lambda name, n, config: np.arange(n))
    _, unpermuted = converted(smollm2_fp32_state)
    assert unpermuted.int4["model.layers.0.self_attn.q_proj"][0] > 10 * BF16_STEP * \
        unpermuted.int4["model.layers.0.self_attn.q_proj"][1]


@pytest.mark.slow
def test_lossless_methods_on_int4_equal_its_ar(smollm2_engine):
    from specgraft import Engine

    engine = Engine("smollm2-135m", "int4")
    caps = engine.capabilities
    assert caps.weights == "int4" and caps.name == "transformers" and caps.tie_gap == 0.5
    prompts = ["Write a Python function that removes duplicates from a list.",
               "List the planets of the solar system in order, one per line."]
    for prompt in prompts:
        ref = engine.generate(prompt, "ar", max_new_tokens=64)
        assert len(ref.token_ids) >= 16
        for method, opts in (("pld", {}), ("recycle", {"budget": 8}), ("graft", {"budget": 4})):
            out = engine.generate(prompt, method, max_new_tokens=64, **opts)
            assert_greedy_equal(engine, ref, out, f"int4 {method} {prompt[:20]}", gap=caps.tie_gap)
    # the same model, not another one: teacher-forced on the fp32 model's own continuation, int4 picks the fp32
    # model's next token nearly everywhere (measured: see docs/benchmarks.md, "CPU step")
    ref = smollm2_engine.generate(prompts[0], "ar", max_new_tokens=96)
    ids = torch.tensor([ref.prompt_ids + ref.token_ids])
    with torch.inference_mode():
        a = smollm2_engine.backend.model(input_ids=ids).logits[0, len(ref.prompt_ids) - 1:-1].argmax(-1)
        b = engine.backend.model(input_ids=ids).logits[0, len(ref.prompt_ids) - 1:-1].float().argmax(-1)
    assert float((a == b).float().mean()) >= 0.9


def test_int4_needs_a_registry_gguf_and_the_cpu(tmp_path):
    with pytest.raises(SpecgraftError, match="reads the 4-bit codes from the model's GGUF"):
        load_transformers(str(tmp_path), "int4", None, "cpu")
    with pytest.raises(SpecgraftError, match="CPU int4 kernel"):
        load_transformers("smollm2-135m", "int4", None, "cuda")
