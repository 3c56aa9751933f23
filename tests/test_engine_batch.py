"""Batch mode: ragged acceptance with masked holes and compaction; outputs equal single-request decoding."""

import torch

from specgraft.core.backend import TargetBackend
from specgraft.eval.batch_bench import clone_drafter, decode_batch
from specgraft.registry import make_drafter
from specgraft.graft.drafter import GraftDrafter
from specgraft.drafters.recycling import AdjacencyMatrix
from specgraft.graft.pruning import SparseGate
from specgraft.core.sampling import SamplingParams

from .conftest import tiny_llama
from .stattest import N_NEGATIVE, check_loop, with_negative_control
from .test_engine import run
from .eagle.test_head import random_head

PROMPTS = [[1, 2, 3, 4], [9, 9, 2, 7, 7, 3, 1], [5], [3, 1, 4, 1, 5, 9, 2, 6]]


def test_batch_equals_single_requests_with_compaction():
    target = tiny_llama(vocab=16, layers=4, scale=4.0)
    backend = TargetBackend(target)
    refs = [run(backend, make_drafter("ar", 16), p, SamplingParams(), 60, 0)[0] for p in PROMPTS]
    head = random_head(target, [0, 1, 2, 3, 5, 8, 13, 15])
    eagle = make_drafter("eagle", 16, target=target, head=head, top_k=3, depth=4)
    graft = GraftDrafter(make_drafter("eagle", 16, target=target, head=head, top_k=3, depth=4), 16, "batch",
                         SparseGate((0.6, 0.5, 0.4)))
    shared = AdjacencyMatrix(16, 8)
    for proto in (eagle, graft, make_drafter("ar", 16)):
        drafters = [proto if proto.name == "ar" else clone_drafter(proto, shared) for _ in PROMPTS]
        res = decode_batch(target, drafters, PROMPTS, SamplingParams(), 60, 6, set())
        assert res.outputs == refs, proto.name
        assert res.compactions >= 1  # long enough that holes outgrew the valid columns at least once
        if proto.name != "ar":
            assert res.mat > 1.0


def test_graft_batch_fills_fixed_slots_from_one_shared_matrix():
    target = tiny_llama(vocab=16, layers=4, scale=4.0)
    head = random_head(target, list(range(16)), seed=2)
    with torch.no_grad():
        head.lm_head.weight.div_(20)  # an unsure head: stages fire, retrieval replaces draft nodes
    proto = GraftDrafter(make_drafter("eagle", 16, target=target, head=head, top_k=3, depth=6), 16, "batch",
                         SparseGate((0.9, 0.9, 0.9)))
    shared = AdjacencyMatrix(16, 8)
    drafters = [clone_drafter(proto, shared) for _ in PROMPTS]
    res = decode_batch(target, drafters, PROMPTS, SamplingParams(), 30, 10, set())
    for d, steps in zip(drafters, res.committed):
        c = d.counters
        assert c["offered_retrieval"] > 0 and c["offered_draft"] > 0
        assert c["offered_retrieval"] + c["offered_draft"] <= 10 * len(steps)
        assert sum(d.stages.values()) == len(steps)  # a stage decision (or none) at every step
    assert all(d.matrix is shared for d in drafters) and shared.rows_filled > 0


@with_negative_control
def test_batch_sampling_matches_ar(broken, monkeypatch):
    """Under sampling each request of a batch follows the AR distribution: two requests per batch (the same
    prompt, own generators), the first three tokens of both pooled; the negative control breaks the verifier
    the batch loop calls and must fail."""
    import specgraft.eval.batch_bench

    from .stattest import broken_verify_tree
    from .test_engine import exact_ar_joint

    vocab = 6
    target = tiny_llama(vocab=vocab, scale=3.0, seed=3)
    params = SamplingParams(temperature=0.9, top_k=5)
    prompt = [1, 2, 3, 1, 2]
    exact = exact_ar_joint(target, prompt, params, vocab)
    if broken:
        monkeypatch.setattr(specgraft.eval.batch_bench, "verify_tree", broken_verify_tree)

    def sample(n: int) -> dict:
        counts: dict = {}
        for i in range(n // 2):  # seed 2i: generators 2i and 2i + 1, distinct for every request of the run
            drafters = [make_drafter("recycle", vocab, scope="hot") for _ in range(2)]
            res = decode_batch(target, drafters, [prompt, prompt], SamplingParams(0.9, 5, seed=2 * i), 3, 8, set())
            for out in res.outputs:
                counts[tuple(out)] = counts.get(tuple(out), 0) + 1
        return counts

    n = N_NEGATIVE if broken else 4000
    check_loop(monkeypatch, broken, sample, exact, n, "batch")
