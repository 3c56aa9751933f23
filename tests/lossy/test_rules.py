"""Lossy verification rules: hand-computed closed-form vectors (the worked ones are in docs/design.md §6),
properties, Monte Carlo vs closed form through the production verifiers, parsing."""

import math

import pytest
import torch

from specgraft.errors import SpecgraftError
from specgraft.lossy.rules import (CapOnly, Combined, CoS, InterpOnly, Lenience, Rule, SpecCascade, Typical, eta_set,
                             eta_threshold, kl, lenience_delta, minp_set, parse_rule, tree_node_yield, truncate, tv)
from specgraft.core.sampling import SamplingParams, target_probs
from specgraft.core.tree import Tree
from specgraft.lossy.verify import lossy_chain, verify_tree_lossy

from ..stattest import N_NEGATIVE, assert_matches, cells, check_loop, with_negative_control

D = torch.float64
P = torch.tensor([0.40, 0.25, 0.20, 0.10, 0.05], dtype=D)
V1 = torch.tensor([0.10, 0.30, 0.20, 0.15, 0.25], dtype=D)
V2 = torch.tensor([0.05, 0.55, 0.10, 0.05, 0.25], dtype=D)

CHAIN_GOLDEN = [  # (rule, pi on V1, pi on V2); lenience 0.5 and SpecCascade 0.3 on V1: docs/design.md §6
    (Rule(), P.tolist(), P.tolist()),
    (Lenience(0.5), [0.25, 0.30, 0.20, 0.15, 0.10], [0.19, 0.50, 0.14, 0.07, 0.10]),
    (CoS(0.3), [0.19, 0.285, 0.20, 0.135, 0.19], [0.155, 0.46, 0.13, 0.065, 0.19]),
    (CoS(0.5), [0.25, 0.275, 0.20, 0.125, 0.15], [0.225, 0.40, 0.15, 0.075, 0.15]),
    (SpecCascade(0.3, "draft_truncated"), [1 / 6, 1 / 2, 1 / 3, 0, 0], [0.071429, 0.785714, 0.142857, 0, 0]),
    (SpecCascade(0.3), [0.50, 0.30, 0.20, 0, 0], [0.26, 0.55, 0.16, 0.03, 0]),
    (SpecCascade(0.3, "target_truncated"), [0.288235, 0.417647, 0.294118, 0, 0],
     [0.191176, 0.638235, 0.170588, 0, 0]),
    (Typical(0.2), [0.26, 0.40, 0.28, 0.04, 0.02], [0.17, 0.625, 0.16, 0.03, 0.015]),
    (Combined(0.3, 0.5), [0.25, 0.30, 0.20, 0.15, 0.10], [0.155, 0.55, 0.13, 0.065, 0.10]),
    (InterpOnly(0.5), [0.25, 0.275, 0.20, 0.125, 0.15], [0.19, 0.43, 0.14, 0.07, 0.17]),
    (CapOnly(0.5), [0.25, 0.30, 0.20, 0.15, 0.10], [0.214286, 0.476190, 0.142857, 0.071429, 0.095238]),
]
ALL_RULES = [r for r, _, _ in CHAIN_GOLDEN] + [Typical(0.09), SpecCascade(0.0), Combined(0.7, 0.3), CapOnly(0.2),
                                               InterpOnly(0.2), Lenience(0.2), CoS(0.0), Typical(0.2, "residual")]


@pytest.mark.parametrize("rule,g1,g2", CHAIN_GOLDEN, ids=lambda x: getattr(x, "spec", ""))
def test_chain_closed_forms_match_spec_vectors(rule, g1, g2):
    for q, want in ((V1, g1), (V2, g2)):
        pi = rule.induced(P, q)
        assert torch.allclose(pi, torch.tensor(want, dtype=D), atol=1e-6), (rule.spec, pi)


def test_sets_thresholds_delta_and_kl_vectors():
    assert minp_set(P, 0.3).tolist() == [True, True, True, False, False]
    assert minp_set(P, 0.5).tolist() == [True, True, True, False, False]  # 0.20 == 0.5 * 0.40: kept (>=, as HF)
    assert eta_threshold(P, 0.2) == pytest.approx(0.108637, abs=1e-6)
    assert eta_threshold(P, 0.09) == pytest.approx(0.072876, abs=1e-6)
    assert eta_set(P, 0.09).tolist() == [True, True, True, True, False]
    p_a = truncate(P, minp_set(P, 0.3))
    assert torch.allclose(p_a, torch.tensor([0.470588, 0.294118, 0.235294, 0, 0], dtype=D), atol=1e-6)
    q_a1 = SpecCascade(0.3, "draft_truncated").induced(P, V1)
    q_a2 = SpecCascade(0.3, "draft_truncated").induced(P, V2)
    assert kl(p_a, q_a1) == pytest.approx(0.250443, abs=1e-6)
    assert kl(p_a, q_a2) == pytest.approx(0.715599, abs=1e-6)
    assert lenience_delta(P, V1, 0.5) == pytest.approx(0.5)
    assert lenience_delta(P, V2, 0.5) == pytest.approx(0.4)
    assert kl(torch.tensor([0.5, 0.5], dtype=D), torch.tensor([1.0, 0.0], dtype=D)) == math.inf


TREE_GOLDEN = [  # (children, lenience 0.5, min-p gate 0.3, soft eta 0.2); children [1, 0]: docs/design.md §6
    ([1, 0], [0.5, 0.5, 0, 0, 0], [0, 1, 0, 0, 0], [0, 1, 0, 0, 0]),
    ([3, 4], [0.334641, 0.209150, 0.167320, 0.2, 0.088889], [0.470588, 0.294118, 0.235294, 0, 0],
     [0.020194, 0.012621, 0.010097, 0.920495, 0.036592]),
    ([4, 3], [0.334365, 0.208978, 0.167183, 0.189474, 0.1], [0.470588, 0.294118, 0.235294, 0, 0],
     [0.020194, 0.012621, 0.010097, 0.496839, 0.460248]),
]


@pytest.mark.parametrize("children,len_,minp,eta", TREE_GOLDEN)
def test_tree_gate_yields_match_spec_vectors(children, len_, minp, eta):
    for rule, want in ((Lenience(0.5), len_), (SpecCascade(0.3), minp), (Typical(0.2), eta)):
        got = tree_node_yield(rule, P, children)
        assert torch.allclose(got, torch.tensor(want, dtype=D), atol=1e-6), (rule.spec, children, got)
    assert torch.allclose(tree_node_yield(Rule(), P, children), P)  # lossless is order-invariant
    if children == [1, 0]:  # the tree lower bound: the first sibling in A is a point mass
        assert kl(tree_node_yield(SpecCascade(0.3), P, children), truncate(P, minp_set(P, 0.3))) == \
            pytest.approx(1.223775, abs=1e-6)


def _random_pq(seed, v=256):
    g = torch.Generator().manual_seed(seed)
    p = torch.softmax(torch.randn(v, generator=g, dtype=D) * 2, 0)
    q = torch.softmax(torch.randn(v, generator=g, dtype=D) * 2, 0)
    return p, q


@pytest.mark.parametrize("seed", range(5))
def test_properties_on_random_distributions(seed):
    p, q = _random_pq(seed)
    lossless_a = Rule().accept_prob(p, q)
    assert torch.allclose(Lenience(1.0).accept_prob(p, q), lossless_a)
    assert torch.allclose(CoS(1.0).accept_prob(p, q), lossless_a)
    for r in (Lenience(1.0), CoS(1.0), InterpOnly(1.0), CapOnly(1.0), Rule()):
        assert torch.allclose(r.induced(p, q), p, atol=1e-12), r.spec
    assert torch.allclose(CoS(0.0).induced(p, q), q)
    assert bool((SpecCascade(0.0).accept_prob(p, q) == 1).all())
    only = SpecCascade(1.0).accept_prob(p, q)
    assert only.sum() == 1 and only[p.argmax()] == 1
    for r in ALL_RULES:
        pi = r.induced(p, q)
        assert float(pi.sum()) == pytest.approx(1.0, abs=1e-12), r.spec
        assert bool((pi >= -1e-15).all())
    for l in (0.2, 0.5, 0.8):
        pi = Lenience(l).induced(p, q)
        over = q >= p / l
        assert bool(over.any())
        assert torch.allclose(pi[over], p[over] / l)  # the cap, exactly
        assert bool((pi <= torch.maximum(q, p / l) + 1e-12).all())
        comb = Combined(0.3, l).induced(p, q)
        out = over & ~minp_set(p, 0.3)
        assert torch.allclose(comb[out], p[out] / l)
    trunc = SpecCascade(0.3, "draft_truncated").induced(p, q)
    assert float(trunc.sum()) == pytest.approx(1.0)


def _mc_chain_vectorised(rule, p, q, n, gen):
    x = torch.multinomial(q, n, replacement=True, generator=gen)
    u = torch.rand(n, generator=gen, dtype=D)
    fb = torch.multinomial(rule.fallback(p, q), n, replacement=True, generator=gen)
    out = torch.where(u < rule.accept_prob(p, q)[x], x, fb)
    return torch.bincount(out, minlength=p.shape[0]).to(D) / n


@pytest.mark.parametrize("rule", ALL_RULES, ids=lambda r: r.spec)
def test_monte_carlo_matches_closed_form(rule):
    """1e5 draws of (accept_prob, fallback) vs ``induced``: TV < 0.01 (the issue's criterion); and the
    production chain verifier (lossy_chain, one draft token) passes the pooled chi-square check."""
    gen = torch.Generator().manual_seed(1)
    for q in (V1, V2):
        pi = rule.induced(P, q)
        assert tv(_mc_chain_vectorised(rule, P, q, 100_000, gen), pi) < 0.01
    for q in (V2,):  # V2 separates the rules
        pi = rule.induced(P, q)
        n = 2500
        p_rows = torch.stack([P, P]).float()
        counts = torch.zeros(5, dtype=D)
        for _ in range(n):
            x = int(torch.multinomial(q, 1, generator=gen))
            n_acc, nxt = lossy_chain(torch.tensor([x]), p_rows, q.float()[None], rule, gen)
            counts[x if n_acc == 1 else nxt] += 1
        assert_matches(cells(counts), cells(pi), n, rule.spec)


class _AlteredLenience(Lenience):
    """Lenience with Medusa's fallback (p instead of the residual): a plausible implementation slip."""

    def fallback(self, p, q):
        return p


def _production_chain_freqs(rule, p_rows, q_rows, n, gen):
    """Frequencies of (emitted tokens) over n calls of lossy_chain with drafts sampled from q_rows."""
    counts: dict = {}
    for _ in range(n):
        drafts = torch.stack([torch.multinomial(q, 1, generator=gen)[0] for q in q_rows])
        n_acc, nxt = lossy_chain(drafts, p_rows.float(), q_rows.float(), rule, gen)
        key = (*drafts[:n_acc].tolist(), nxt)
        counts[key] = counts.get(key, 0) + 1
    return counts


def test_production_chain_check_detects_an_altered_rule():
    """The production-verifier check has power: a lenience whose fallback is p fails it."""
    gen = torch.Generator().manual_seed(2)
    n = 2500
    counts = _production_chain_freqs(_AlteredLenience(0.5), torch.stack([P, P]), V2[None], n, gen)
    first = torch.tensor([sum(c for k, c in counts.items() if k[0] == t) for t in range(5)], dtype=D)
    assert tv(first / n, Lenience(0.5).induced(P, V2)) > 0.03
    with pytest.raises(AssertionError):  # the check the correct rules pass (test_monte_carlo_matches_closed_form)
        assert_matches(cells(first), cells(Lenience(0.5).induced(P, V2)), n)


@pytest.mark.parametrize("rule", [Lenience(0.5), SpecCascade(0.3), CoS(0.4)], ids=lambda r: r.spec)
def test_lossy_chain_later_positions_and_bonus(rule):
    """A 2-token chain: given the first draft accepted, the second emitted token follows induced(p2, q2), and
    given both accepted, the bonus follows p3 (catches off-by-one rows in lossy_chain)."""
    p2 = torch.tensor([0.1, 0.5, 0.2, 0.1, 0.1], dtype=D)
    p3 = torch.tensor([0.05, 0.05, 0.1, 0.3, 0.5], dtype=D)
    p_rows, q_rows = torch.stack([P, p2, p3]), torch.stack([V1, V2])
    gen = torch.Generator().manual_seed(4)
    counts = _production_chain_freqs(rule, p_rows, q_rows, 3000, gen)
    second = torch.zeros(5, dtype=D)
    bonus = torch.zeros(5, dtype=D)
    for k, c in counts.items():
        if len(k) >= 2:
            second[k[1]] += c
        if len(k) == 3:
            bonus[k[2]] += c
    for cnt, want in ((second, rule.induced(p2, V2)), (bonus, p3)):
        n = int(cnt.sum())
        assert n > 150  # enough steps reach that position
        assert_matches(cells(cnt), cells(want), n, rule.spec)


@pytest.mark.parametrize("rule", [Lenience(0.5), SpecCascade(0.3), Typical(0.2), Combined(0.3, 0.5), Rule()],
                         ids=lambda r: r.spec)
@pytest.mark.parametrize("children", [[3, 4, 3], [4, 1, 3]])
def test_lossy_tree_verifier_matches_node_yield(rule, children):
    """The production verifier (verify_tree_lossy -> lossy_tree) emits its first token with tree_node_yield's
    distribution; duplicates are skipped; [4, 1, 3] puts a child inside A after one outside it."""
    tree = Tree.build([0, *children], [-1, 0, 0, 0])
    probs = torch.stack([P] * 4).float()
    logits = probs.log()  # temperature 1: target_probs(logits) == probs
    gen = torch.Generator().manual_seed(3)
    n = 3000
    counts = torch.zeros(5, dtype=D)
    for _ in range(n):
        v = verify_tree_lossy(tree, logits, SamplingParams(1.0), gen, rule)
        counts[int(tree.tokens[v.accepted[1]]) if v.accept_length else v.bonus] += 1
    assert_matches(cells(counts), cells(tree_node_yield(rule, P, children)), n, rule.spec)


def test_combined_tree_gate_differs_from_lenience_inside_the_set():
    kids = [4, 1]  # 4 outside A (p/l = 0.1 < 1), 1 inside A
    comb, len_ = tree_node_yield(Combined(0.3, 0.5), P, kids), tree_node_yield(Lenience(0.5), P, kids)
    assert comb[1] == pytest.approx(0.9) and comb[4] == pytest.approx(0.1)
    assert len_[1] < 0.9


def test_lone_root_and_leaves_need_no_gate():
    """A one-node tree (budget 0) under a rule without a tree form: the bonus comes from the target."""
    tree = Tree.build([0], [-1])
    v = verify_tree_lossy(tree, P.float().log()[None], SamplingParams(1.0), torch.Generator().manual_seed(0), CoS(0.5))
    assert v.accepted == [0] and 0 <= v.bonus < 5


def test_rules_without_a_tree_form_raise():
    for r in (CoS(0.5), InterpOnly(0.5), CapOnly(0.5)):
        with pytest.raises(SpecgraftError, match="needs draft probabilities"):
            r.tree_gate(P)


def test_truncation_sampling_params_equal_truncation_sets():
    logits = torch.randn(3, 50, generator=torch.Generator().manual_seed(0)) * 3
    for kw, setf in (({"min_p": 0.3}, lambda p: minp_set(p, 0.3)), ({"eta": 0.09}, lambda p: eta_set(p, 0.09))):
        got = target_probs(logits, SamplingParams(0.7, **kw)).double()
        base = target_probs(logits, SamplingParams(0.7)).double()
        for i in range(3):
            assert torch.allclose(got[i], truncate(base[i], setf(base[i])), atol=1e-6)
        assert bool((got > 0).sum(-1).lt(50).all())
    for bad in ({"min_p": 1.5}, {"eta": -0.1}, {"min_p": "x"}):
        with pytest.raises(SpecgraftError):
            SamplingParams(0.7, **bad)


def test_rules_validate_on_construction_and_lossy_rules_have_a_spec():
    for bad in (lambda: Lenience(0), lambda: CoS(1.5), lambda: Typical(0.0), lambda: SpecCascade(-0.1),
                lambda: Combined(0.3, 0.0), lambda: SpecCascade(0.3, "nope")):
        with pytest.raises(SpecgraftError):
            bad()
    for r in ALL_RULES:
        assert r.spec.startswith("lossy:") == r.lossy

    class Unnamed(InterpOnly):
        pass

    with pytest.raises(NotImplementedError):
        _ = Rule.spec.fget(Unnamed())  # the base spec refuses to call a lossy rule "lossless"


def test_report_pairs_each_rule_with_its_correct_baseline():
    from specgraft.lossy.report import baseline_of, config_of

    def rec(label, verify="lossless", **samp):
        return {"label": label, "method": label.split(":")[0], "model": "m", "verify": verify,
                "sampling": {"temperature": 0.7, "top_k": 0, "top_p": 1.0, **samp}}

    sc = rec("draft:shape=chain,verify=lossy:speccascade:0.3", "lossy:speccascade:0.3")
    assert baseline_of(sc) == config_of(rec("draft:min_p=0.3,shape=chain", min_p=0.3))
    assert baseline_of(sc) != config_of(rec("draft:min_p=0.3,shape=tree", min_p=0.3))  # other drafter options
    le = rec("draft:min_p=0.1,verify=lossy:lenience:0.5", "lossy:lenience:0.5", min_p=0.1)
    assert baseline_of(le) == config_of(rec("draft:min_p=0.1", min_p=0.1))  # keeps the run's own truncation
    ty = rec("draft:verify=lossy:typical:0.2", "lossy:typical:0.2")
    assert baseline_of(ty) == config_of(rec("draft:eta=0.2", eta=0.2))


def test_parse_rule():
    assert parse_rule("lossless") == Rule() and not parse_rule(None).lossy
    assert parse_rule("lossy:lenience:0.5") == Lenience(0.5)
    assert parse_rule("lossy:speccascade:0.3:fallback=target") == SpecCascade(0.3, "target")
    assert parse_rule("lossy:combined:0.3:l=0.4") == Combined(0.3, 0.4)
    for r in (parse_rule(s) for s in ("lossy:cos:0.4", "lossy:typical:0.09", "lossy:cap:0.2", "lossy:interp:0.2",
                                     "lossy:combined:0.3", "lossy:speccascade:0.1:fallback=draft_truncated")):
        assert r.lossy and parse_rule(r.spec) == r
    for bad, msg in (("lossy:nope:0.5", "unknown lossy rule"), ("lossy:lenience:0", r"\(0, 1\]"),
                     ("lossy:lenience:x", "must be a number"), ("lenience", "verify must be"),
                     ("lossy:cos:1.5", r"\[0, 1\]"), ("lossy:speccascade:0.3:fallback=foo", "fallback must be"),
                     ("lossy:lenience:0.5:l=0.3", "no option"), ("lossy:typical:0", r"\(0, 1\]"),
                     ("lossy:lenience:0.5:", "empty option list"),
                     ("lossy:combined:0.3:l=0.5,l=0.4", "given twice")):
        with pytest.raises(SpecgraftError, match=msg):
            parse_rule(bad)


# ---- through the engine loop (tiny random models) ------------------------------------------------------

def _loop_counts(backend, drafter, prompt, params, budget, n, length, rule=None):
    from dataclasses import replace

    from ..engine.test_engine import decode

    counts: dict = {}
    for i in range(n):
        out = decode(backend.model, drafter, prompt, replace(params, seed=i), length, budget,
                     verify=rule or "lossless").token_ids
        counts[tuple(out)] = counts.get(tuple(out), 0) + 1
    return counts


@with_negative_control
def test_lossless_sd_under_truncation_sampling_matches_ar_truncation_sampling(broken, monkeypatch):
    """The correct baselines: min-p / eta sampling decoded with lossless SD equal AR min-p / eta sampling."""
    from specgraft.core.backend import TargetBackend
    from specgraft.registry import make_drafter

    from ..conftest import tiny_llama
    from ..engine.test_engine import exact_ar_joint

    vocab = 6
    target = tiny_llama(vocab=vocab, scale=8.0, seed=3)  # sharp enough for truncation to remove tokens
    backend = TargetBackend(target)
    drafter = make_drafter("draft", vocab, model=tiny_llama(vocab=vocab, scale=8.0, seed=11))
    prompt = [1, 2, 3, 1, 2]
    for params in (SamplingParams(0.9, min_p=0.3), SamplingParams(0.9, eta=0.3)):
        exact: dict = {}
        for k, v in exact_ar_joint(target, prompt, params, vocab).items():  # the first two tokens
            exact[k[:2]] = exact.get(k[:2], 0.0) + v
        assert sum(v == 0 for v in exact.values()) > 0  # truncation removed outcomes
        check_loop(monkeypatch, broken, lambda n: _loop_counts(backend, drafter, prompt, params, 3, n, 2), exact,
                   N_NEGATIVE if broken else 1000, str(params))


@pytest.mark.parametrize("rule", [Lenience(0.4), SpecCascade(0.3)], ids=lambda r: r.spec)
def test_lossy_chain_through_the_loop_matches_closed_form(rule):
    """Token 2 (the first verified one) follows ``rule.induced(p, q)`` at its context, token 1 follows p."""
    from specgraft.core.backend import TargetBackend
    from specgraft.registry import make_drafter

    from ..conftest import tiny_llama

    vocab = 6
    target, draft = tiny_llama(vocab=vocab, scale=3.0, seed=3), tiny_llama(vocab=vocab, scale=3.0, seed=11)
    params = SamplingParams(0.9)
    prompt = [1, 2, 3, 1, 2]
    expected = {}
    with torch.no_grad():
        def probs(model, ids):
            return target_probs(model(input_ids=torch.tensor([ids])).logits[0, -1], params).double()

        p1 = probs(target, prompt)
        for t1 in range(vocab):
            pi = rule.induced(probs(target, prompt + [t1]), probs(draft, prompt + [t1]))
            for t2 in range(vocab):
                expected[(t1, t2)] = float(p1[t1] * pi[t2])
    n = 1200
    counts = _loop_counts(TargetBackend(target), make_drafter("draft", vocab, model=draft), prompt, params, 3, n, 2,
                          rule)
    assert_matches(counts, expected, n, rule.spec)
    # and it is not the target's distribution: the same counts fail against lossless AR
    lossless = {}
    with torch.no_grad():
        for t1 in range(vocab):
            p2 = probs(target, prompt + [t1])
            for t2 in range(vocab):
                lossless[(t1, t2)] = float(p1[t1] * p2[t2])
    with pytest.raises(AssertionError):
        assert_matches(counts, lossless, n, "lossless")
