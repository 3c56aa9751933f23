import pytest
import torch

from specgraft.errors import SpecgraftError
from specgraft.core.sampling import SamplingParams, target_probs


def test_temperature_topk_topp():
    logits = torch.log(torch.tensor([0.4, 0.25, 0.2, 0.1, 0.05]))
    p = target_probs(logits, SamplingParams(temperature=1.0))
    assert torch.allclose(p, torch.tensor([0.4, 0.25, 0.2, 0.1, 0.05]), atol=1e-6)
    p = target_probs(logits, SamplingParams(temperature=1.0, top_k=2))
    assert torch.allclose(p, torch.tensor([0.4, 0.25, 0, 0, 0]) / 0.65, atol=1e-6)
    # top_p = 0.8: 0.4 + 0.25 < 0.8, so the third token (cumulative 0.85) is the last kept.
    p = target_probs(logits, SamplingParams(temperature=1.0, top_p=0.8))
    assert torch.allclose(p, torch.tensor([0.4, 0.25, 0.2, 0, 0]) / 0.85, atol=1e-6)
    p = target_probs(logits, SamplingParams(temperature=0.5))
    q = torch.tensor([0.4, 0.25, 0.2, 0.1, 0.05]) ** 2
    assert torch.allclose(p, q / q.sum(), atol=1e-6)


@pytest.mark.parametrize("kwargs", [dict(temperature=-0.1), dict(temperature=float("nan")), dict(top_k=-1),
                                    dict(top_p=0.0), dict(top_p=1.5), dict(seed=-3)])
def test_invalid_params(kwargs):
    with pytest.raises(SpecgraftError):
        SamplingParams(**kwargs)


def test_a_vanishing_top_p_keeps_the_top_token():
    """top_p = 5e-324 (the server's fuzzer sent it) rounds to 0 against float32 sums: every token used to be
    dropped, the probabilities were NaN and sampling raised. The top token always stays."""
    logits = torch.tensor([[1.0, 3.0, 2.0, 0.5]])
    for top_p in (5e-324, 1e-50, 1e-9):
        p = target_probs(logits, SamplingParams(temperature=1.0, top_p=top_p))
        assert torch.equal(p, torch.tensor([[0.0, 1.0, 0.0, 0.0]])), (top_p, p)
