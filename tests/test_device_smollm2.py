"""Real-model greedy exactness on the device ``SPECGRAFT_TEST_DEVICE`` names (scripts/gpu_check.sh sets cuda):
SmolLM2 in fp32 on that device, every lossless method of the loop equal to AR. Without the variable it runs on
the CPU through the same device path (inputs moved to the model's device, outputs back to the CPU)."""

import os

import pytest

from .conftest import assert_greedy_equal
from .test_smollm2 import PROMPTS

DEVICE = os.environ.get("SPECGRAFT_TEST_DEVICE", "cpu")


@pytest.mark.slow
def test_lossless_methods_equal_ar_on_device():
    from specgraft import Engine

    engine = Engine("smollm2-135m", "float32", device=DEVICE)
    assert engine.device.startswith(DEVICE)
    for prompt in PROMPTS[:4 if DEVICE == "cpu" else 8]:
        ref = engine.generate(prompt, "ar", max_new_tokens=64)
        for method, opts in (("pld", {}), ("recycle", {}), ("eagle", {"budget": 15})):
            assert_greedy_equal(engine, ref, engine.generate(prompt, method, max_new_tokens=64, **opts),
                                f"{DEVICE} {method} {prompt[:30]}")
