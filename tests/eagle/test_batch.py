"""EAGLE-3 drafting batched across requests (eagle/batch.py, core.drafter.drive_all): one head pass per round
for the whole batch, the same trees as each request drafted alone, lossless outputs, and steps that draft
nothing not running the head at all."""

import torch

from specgraft.core.backend import TargetBackend
from specgraft.core.drafter import DraftContext, drive, drive_all
from specgraft.core.sampling import SamplingParams
from specgraft.eagle import batch
from specgraft.eagle.batch import HeadCall, HeadRunner, pad_group, padded_attention
from specgraft.engine import Engine
from specgraft.registry import make_drafter

from ..conftest import tiny_llama
from ..engine.test_engine import run
from .test_head import random_head

PROMPTS = [[1, 2, 3, 4], [9, 9, 2, 7, 7, 3, 1], [5], [3, 1, 4, 1, 5, 9, 2, 6]]


class Counting:
    """Wraps a head's runner: counts its forwards and the units in each."""

    def __init__(self, runner: HeadRunner):
        self.real, self.sizes, self.rows = runner.run, [], []
        runner.run = self

    def __call__(self, units):
        self.sizes.append(len(units))
        self.rows.append([u.tokens.numel() for u in units])
        return self.real(units)


def solo_and_engine(prompt, n):
    """AR's output for ``prompt`` (the reference), an engine on the same tiny target, and a counted EAGLE
    prototype on a random head."""
    target = tiny_llama(vocab=16, layers=4, scale=4.0)
    head = random_head(target, [0, 1, 2, 3, 5, 8, 13, 15])
    ref = run(TargetBackend(target), make_drafter("ar", 16), prompt, SamplingParams(), n, 0)[0]
    engine = Engine.from_model(target, None)
    engine.eos_ids = set()
    proto = make_drafter("eagle", 16, target=target, head=head, top_k=3, depth=4)
    return ref, engine, proto, Counting(proto.runner)


def runner_and_owner():
    """A random head's runner on a tiny target, and an owner its forwards are credited to."""
    head = random_head(tiny_llama(vocab=16, layers=4), list(range(16)))
    return HeadRunner.of(head), type("Owner", (), {"forward_s": 0.0})()


def head_call(runner, owner, t: int, s: int, fuse: bool) -> HeadCall:
    """A unit of ``t`` new rows over ``s`` cached ones: target features through fc (causal, the last row's logits),
    or a tree level (each row sees the cache and itself only, every row's logits)."""
    H, nkv, d = 32, runner.head.config.num_key_value_heads, runner.head.config.head_dim
    past = None if s == 0 else (torch.randn(1, nkv, s, d), torch.randn(1, nkv, s, d))
    bias = None
    if not fuse:
        bias = torch.zeros(1, 1, t, s + t)
        bias[0, 0, :, s:] = float("-inf")
        bias[0, 0, :, s:].fill_diagonal_(0)
    return HeadCall(runner, owner, torch.randn(t, 3 * H if fuse else H), fuse, torch.randint(0, 16, (t,)),
                    torch.arange(s, s + t), past, bias, slice(-1, None) if fuse else slice(None))


def test_ragged_units_in_one_pass_equal_each_alone():
    """Units of different lengths, caches and masks, some through fc, some with logits: the batched pass
    returns what each unit gets alone."""
    runner, owner = runner_and_owner()
    torch.manual_seed(0)
    calls = [head_call(runner, owner, t, s, fuse) for t, s, fuse in ((3, 0, True), (1, 5, False), (4, 9, True),
                                                                      (2, 2, False))]
    together = runner.run(calls)
    for call, got in zip(calls, together):
        (alone,) = runner.run([call])
        for a, b in ((got.h, alone.h), (got.k, alone.k), (got.v, alone.v), (got.logp, alone.logp)):
            assert a.shape == b.shape and torch.allclose(a, b, atol=1e-5)
    assert together[0].logp.shape == (1, 16) and together[1].logp.shape == (1, 16)
    assert owner.forward_s > 0


def test_padded_attention_equals_each_unit_alone():
    """Units of different row counts and cache lengths, with and without a cache or a mask, in one padded call:
    each gets what Eagle3Head.attend gives it alone (2 key/value heads under 4 query heads, sharp scores)."""
    target = tiny_llama(vocab=16, layers=4)
    head = random_head(target, list(range(16)))
    nh, nkv, d = head.config.num_attention_heads, head.config.num_key_value_heads, head.config.head_dim
    assert nh > nkv
    torch.manual_seed(0)
    units = []
    for t, s, masked in ((3, 0, False), (1, 5, True), (4, 9, True), (2, 2, False), (6, 7, True)):
        q, k, v = 3 * torch.randn(1, nh, t, d), 3 * torch.randn(1, nkv, t, d), torch.randn(1, nkv, t, d)
        past = None if s == 0 else (3 * torch.randn(1, nkv, s, d), torch.randn(1, nkv, s, d))
        bias = None
        if masked:  # a tree level: each row sees a random part of the cache and itself
            bias = torch.zeros(1, 1, t, s + t)
            bias[0, 0, :, :s][torch.rand(t, s) < 0.4] = float("-inf")
            bias[0, 0, :, s:] = float("-inf")
            bias[0, 0, :, s:].fill_diagonal_(0)
        units.append((q, k, v, past, bias))
    together = padded_attention(head, units)
    for unit, got in zip(units, together):
        alone = head.attend(*unit)[0]
        assert got.shape == alone.shape == (unit[0].shape[2], nh * d)
        assert torch.allclose(got, alone, atol=1e-5)


def test_pad_group_leaves_out_a_prompt_beside_one_row_neighbours():
    """Golden groups: similar units pad together; a unit whose padding would multiply the work attends alone."""
    assert pad_group([(6, 200), (5, 180), (6, 210), (4, 150)]) == [0, 1, 2, 3]
    assert pad_group([(6, 200), (5, 180), (300, 0), (6, 210)]) == [0, 1, 3]
    assert pad_group([(300, 0), (1, 40)]) == []
    assert pad_group([(100, 0), (10, 2000), (10, 2000)]) == [1, 2]  # the prompt goes, not a long-cached level
    assert pad_group([(2, 10)]) == []
    assert pad_group([]) == []


def test_the_runner_pads_the_batch_and_gives_what_per_unit_attention_gives(monkeypatch):
    """One padded call for a batch of tree levels, a new request's prompt beside them attending alone: the same
    outputs, in the same order, as every unit attending alone."""
    runner, owner = runner_and_owner()
    torch.manual_seed(0)
    calls = [head_call(runner, owner, t, s, fuse) for t, s, fuse in ((3, 12, False), (4, 9, False), (40, 0, True),
                                                                      (2, 14, False), (4, 11, False))]
    padded_calls = []
    real = batch.padded_attention
    monkeypatch.setattr(batch, "padded_attention", lambda h, units: padded_calls.append(len(units)) or real(h, units))
    padded = runner.run(calls)
    monkeypatch.setattr(HeadRunner, "pad_attention", False)
    per_unit = runner.run(calls)
    assert padded_calls == [4]
    for a, b in zip(padded, per_unit):
        assert a.h.shape == b.h.shape and a.logp.shape == b.logp.shape
        assert torch.allclose(a.h, b.h, atol=1e-5) and torch.allclose(a.logp, b.logp, atol=1e-4)


def test_batched_trees_equal_solo_trees_and_run_one_pass_per_round():
    """Four EAGLE drafters on one head at the same state: drive_all proposes the trees each proposes alone,
    with one head forward per round (extend, then one per level) instead of one per request and round."""
    target = tiny_llama(vocab=16, layers=4, scale=4.0)
    backend = TargetBackend(target)
    head = random_head(target, [0, 1, 2, 3, 5, 8, 13, 15])
    proto = make_drafter("eagle", 16, target=target, head=head, top_k=3, depth=4)
    solo, batched = [], []
    for p in PROMPTS:
        pre = backend.prefill(torch.tensor(p), False, proto.hidden_layers)
        for group in (solo, batched):
            d = proto.fork()
            d.start(p, None, pre.hidden)
            group.append(d)
        backend.reset()
    counter = Counting(proto.runner)
    ctxs = [DraftContext([*p, 7], 6, SamplingParams()) for p in PROMPTS]  # the prefill emitted 7
    alone = [drive(d.propose_steps(c)) for d, c in zip(solo, ctxs)]
    assert len(counter.sizes) == 4 * 5 and set(counter.sizes) == {1}  # extend + 4 levels, per request
    counter.sizes.clear()
    together, spent = drive_all([d.propose_steps(c) for d, c in zip(batched, ctxs)])
    assert counter.sizes == [4] * 5  # every round: one forward for the four requests
    for a, b in zip(alone, together):
        assert a.tokens.tolist() == b.tokens.tolist() and a.parents.tolist() == b.parents.tolist()
        assert a.size == 7
    assert all(s > 0 for s in spent)


def test_engine_drafts_the_batch_in_one_pass_per_round_and_stays_lossless():
    """In the engine: four EAGLE requests share each round's head forward; outputs equal AR's."""
    target = tiny_llama(vocab=16, layers=4, scale=4.0)
    backend = TargetBackend(target)
    head = random_head(target, [0, 1, 2, 3, 5, 8, 13, 15])
    refs = [run(backend, make_drafter("ar", 16), p, SamplingParams(), 30, 0)[0] for p in PROMPTS]
    engine = Engine.from_model(target, None)
    engine.eos_ids = set()
    proto = make_drafter("eagle", 16, target=target, head=head, top_k=3, depth=4)
    counter = Counting(proto.runner)
    ids = [engine.add_request(p, drafter=proto.fork(), max_new_tokens=30, budget=6) for p in PROMPTS]
    engine.step()  # first tokens, and the first step with all four in flight
    assert counter.sizes == [4] * 5
    results = engine.run()
    for rid, ref in zip(ids, refs):
        assert results[rid].token_ids == ref
        assert results[rid].stats.mat > 1.0 and results[rid].stats.draft_s > 0


def test_steps_that_draft_nothing_leave_the_head_idle_and_feed_it_later():
    """Budget 0 (the scheduler's policy under load): no head forward; the waiting features are fed in one
    pass the next time the request drafts, and the output still equals AR's."""
    ref, engine, proto, counter = solo_and_engine(PROMPTS[1], 40)
    schedule, drawn = iter([0, 0, 0] + [6, 0, 0] * 20), []
    engine.budget_policy = lambda req, batch: drawn.append(next(schedule)) or drawn[-1]
    rid = engine.add_request(PROMPTS[1], drafter=proto.fork(), max_new_tokens=40, budget=6)
    engine.step()
    engine.step()
    engine.step()  # three steps at budget 0 (the first emits the prefill's token too)
    assert counter.sizes == []
    engine.step()  # budget 6: one extend feeds the prompt's pairs and the three waiting steps' at once
    assert counter.rows[0] == [len(PROMPTS[1]) + 3] and len(counter.rows) == 5
    result = engine.run()[rid]
    assert result.token_ids == ref
    assert len(counter.rows) == 5 * drawn.count(6)  # extend + 4 levels per drafting step; none at budget 0
    extends = [r[0] for r in counter.rows[::5]]
    after_last_draft = result.stats.committed[-(drawn[::-1].index(6) + 1):]  # tokens of that step and after
    assert sum(extends) == len(PROMPTS[1]) + 40 - sum(after_last_draft) - 1  # every pair fed exactly once


def test_sampled_requests_draft_alone_unless_batch_invariance_is_off():
    """Batch invariance (engine.batch_invariant, on by default): a sampled request's head passes never share a
    forward (its tree, hence its random draws, must not depend on its neighbours' rounding); greedy requests
    share. Off: all share. Outputs stay lossless either way."""
    target = tiny_llama(vocab=16, layers=4, scale=4.0)
    head = random_head(target, [0, 1, 2, 3, 5, 8, 13, 15])
    proto = make_drafter("eagle", 16, target=target, head=head, top_k=3, depth=4)
    counter = Counting(proto.runner)
    sampled = SamplingParams(temperature=1.0, seed=3)
    for invariant, expected in ((True, [2, 1] * 5), (False, [3] * 5)):
        engine = Engine.from_model(target, None)
        engine.eos_ids = set()
        engine.batch_invariant = invariant
        for p, params in zip(PROMPTS, (SamplingParams(), SamplingParams(), sampled)):
            engine.add_request(p, drafter=proto.fork(), sampling=params, max_new_tokens=20, budget=6)
        counter.sizes.clear()
        engine.step()
        assert sorted(counter.sizes, reverse=True) == sorted(expected, reverse=True), invariant
        engine.run()


def test_waiting_features_are_fed_once_defer_max_rows_wait(monkeypatch):
    """At budget 0 the head stays idle until DEFER_MAX rows wait; then it feeds them (no draft logits) and the
    output still equals AR's."""
    import specgraft.eagle.drafter as eagle_drafter

    monkeypatch.setattr(eagle_drafter, "DEFER_MAX", 3)
    ref, engine, proto, counter = solo_and_engine(PROMPTS[2], 20)
    engine.budget_policy = lambda req, batch: 0
    rid = engine.add_request(PROMPTS[2], drafter=proto.fork(), max_new_tokens=20, budget=6)
    result = engine.run()[rid]
    assert result.token_ids == ref
    # a one-token prompt: 1, 2, then 3 waiting rows -> fed; then every third step feeds 3 rows
    assert counter.rows and all(r == [3] for r in counter.rows)
    assert len(counter.rows) == (len(PROMPTS[2]) + 19 - 1) // 3


def test_a_tree_drafts_only_the_frontier_it_can_keep_and_is_the_same_tree():
    """``expand_topk_steps``'s count rule in the head drafter: at every budget the capped expansion proposes
    the full expansion's tree, with at most ``min(top_k, budget - d - 1)`` head rows per level instead of
    ``top_k``, and fewer over the run."""
    target = tiny_llama(vocab=16, layers=4, scale=4.0)
    backend = TargetBackend(target)
    head = random_head(target, [0, 1, 2, 3, 5, 8, 13, 15])
    proto = make_drafter("eagle", 16, target=target, head=head, top_k=4, depth=5)
    counter = Counting(proto.runner)
    below_level_bound = 0
    for p in PROMPTS:
        pre = backend.prefill(torch.tensor(p), False, proto.hidden_layers)
        backend.reset()
        for budget in (1, 3, 6, 12):
            trees, rows = [], []
            for cap in (False, True):
                d = proto.fork()
                d.cap_frontier = cap
                d.start(p, None, pre.hidden)
                counter.rows.clear()
                trees.append(drive(d.propose_steps(DraftContext([*p, 7], budget, SamplingParams()))))
                rows.append(sum(sum(r) for r in counter.rows[1:]))  # every head row after the extend
            assert trees[0].tokens.tolist() == trees[1].tokens.tolist()
            assert trees[0].parents.tolist() == trees[1].parents.tolist() and trees[1].size == budget + 1
            level_bound = sum(min(4, budget - d - 1) for d in range(min(5, budget - 1)))
            assert rows[0] == 5 * 4 and rows[1] <= level_bound
            below_level_bound += level_bound - rows[1]
    assert below_level_bound > 0
