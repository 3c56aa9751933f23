"""The device path: the target (and a draft model) on ``device``, drafting and verification on the CPU.

Parametrised over cpu and cuda; cuda is skipped where torch sees no GPU (this project's CI machines have none:
``scripts/gpu_check.sh`` runs the real-model checks on one)."""

import pytest
import torch

from specgraft.core.backend import TargetBackend
from specgraft.core.sampling import SamplingParams
from specgraft.core.tree import Tree
from specgraft.engine import Engine
from specgraft.errors import SpecgraftError
from specgraft.models import resolve_device
from specgraft.registry import make_drafter

from ..conftest import tiny_llama

DEVICES = ["cpu", pytest.param("cuda", marks=pytest.mark.skipif(not torch.cuda.is_available(), reason="no CUDA GPU"))]


@pytest.mark.parametrize("device", DEVICES)
def test_backend_on_device_returns_cpu_outputs_equal_to_sequential(device):
    model = tiny_llama(vocab=16, scale=4.0).to(device)
    be = TargetBackend(model)
    prompt = [1, 5, 7, 2, 9]
    out = be.prefill(torch.tensor(prompt), hidden_layers=(1,))
    assert out.logits.device.type == "cpu" and out.hidden[1].device.type == "cpu"
    tree = Tree.build([3, 4, 6, 8], [-1, 0, 0, 1])
    got = be.verify(tree).logits
    assert got.device.type == "cpu"
    with torch.no_grad():
        ref = model(input_ids=torch.tensor([prompt + [3, 4, 8]], device=device)).logits[0, -1].float().cpu()
    assert torch.allclose(got[3].float(), ref, atol=1e-4)
    be.commit([0, 1, 3])
    assert be.prefix_len == len(prompt) + 3


@pytest.mark.parametrize("device", DEVICES)
def test_engine_on_device_greedy_equals_ar_with_a_draft_model(device):
    target = tiny_llama(vocab=16, scale=4.0).to(device)
    engine = Engine.from_model(target, None)
    engine.eos_ids = set()
    assert engine.device.startswith(device)
    prompt = [1, 2, 3, 4, 1, 2]

    def run(drafter, budget):
        engine.add_request(prompt, drafter=drafter, sampling=SamplingParams(), max_new_tokens=30, budget=budget)
        (g,) = engine.run().values()
        return g.token_ids

    ref = run(make_drafter("ar", 16), 0)
    draft = tiny_llama(vocab=16, scale=4.0, seed=5).to(device)
    for drafter, budget in ((make_drafter("recycle", 16), 16), (make_drafter("draft", 16, model=draft), 4),
                            (make_drafter("draft", 16, model=draft, shape="tree", top_k=3, depth=3), 12)):
        assert run(drafter, budget) == ref


def test_resolve_device():
    assert resolve_device("cpu") == "cpu"
    assert resolve_device("auto") == ("cuda" if torch.cuda.is_available() else "cpu")
    with pytest.raises(SpecgraftError, match="unknown device"):
        resolve_device("tpu")
    if not torch.cuda.is_available():
        with pytest.raises(SpecgraftError, match="no CUDA GPU"):
            resolve_device("cuda")
