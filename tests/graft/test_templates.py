"""Graft's pure parts: stage split, template generator (golden), width scaling, shared-root trie merge (docs/design.md §5.3, §5.4)."""

import numpy as np
import pytest

from specgraft.graft.templates import (STAGE_WIDTHS, build_template, graft_merge, scale_widths, stage_split,
                             stage_template, sweep_template)

GOLDEN_STAGE0 = """\
0 1 2 3 4 5 6 7
00 01 02 03 04 10 11 20 30 40
000 001 002 003 010 020 100 200
0000 0001 0002 0010 0100 1000
00000 00001 00010 00100 01000
000000 000001 000010 000100
0000000 0000001 0000010 0000100
00000000 00000001 00000010 00000100
000000000 000000010 000000100"""


def test_stage0_template_golden():
    tpl = build_template(STAGE_WIDTHS[0])
    assert "\n".join(" ".join(level) for level in tpl.levels()) == GOLDEN_STAGE0
    assert tpl.n_template == 52 and len(tpl.paths) == 52 + 16
    placed = set()
    for p in tpl.paths:  # template and reserve are prefix-closed, in an order that puts parents first
        assert p[:-1] == () or p[:-1] in placed
        placed.add(p)
    parents, ranks, depths = tpl.arrays
    assert len(parents) == 69 and depths.max() == 9 and (parents[1:] < np.arange(1, 69)).all()


def test_stage_split_and_scaled_shapes():
    assert stage_split(60) == (8, 24, 40)
    assert stage_split(16) == (2, 6, 11) and stage_split(1) == (1, 1, 1)
    for stage, widths in enumerate(STAGE_WIDTHS):
        assert scale_widths(widths, sum(widths)) == widths  # the defaults are fixed points
        for slots in (1, 5, 8, 14, 36, 52, 80):
            got = scale_widths(widths, slots)
            assert sum(got) == slots and min(got) >= 1
            assert got[0] <= 8 and all(b <= 8 * a for a, b in zip(got, got[1:]))
            tpl = stage_template(stage, slots)
            assert tpl.n_template == slots
            # asymmetric: the deepest node is on the rank-0 chain's side (first ranks), never a lone low rank
            assert max(tpl.paths[: tpl.n_template], key=len)[0] == 0


def test_sweep_template_respects_depth_and_width():
    for depth in (2, 4, 8, 12):
        for width in (4, 8, 10):
            tpl = sweep_template(36, depth, width)
            levels = tpl.levels()
            assert len(levels) <= depth and max(len(x) for x in levels) <= width
    assert len(sweep_template(36, 12, 8).levels()) == 12


def test_merge_docstring_example():
    # pruned draft: r -> a -> c, r -> b   (a=10, b=11, c=12); template: M[r,0]=a, M[a,0]=d, M[r,1]=e, M[e,0]=f
    tokens, parents = [99, 10, 12, 11], [-1, 0, 1, 0]
    tpl_parents = np.array([-1, 0, 1, 0, 3])
    retrieved = [99, 10, 13, 14, 15]  # a (dup of the draft child), d, e, f
    h = graft_merge(tokens, parents, retrieved, tpl_parents, slots=2, n_template=4)
    assert h.tokens == [99, 10, 12, 11, 13, 14] and h.parents == [-1, 0, 1, 0, 1, 0]
    assert h.source == [0, 1, 1, 1, 2, 2] and (h.n_retrieved, h.n_dedup) == (2, 1)  # f does not fit
    h = graft_merge(tokens, parents, retrieved, tpl_parents, slots=5, n_template=4)
    assert h.tokens[-1] == 15 and h.parents[-1] == 5  # f under e, once there is room
    # dedup="skip": the duplicate merges (d still attaches under a) and its slot goes to the root row's next
    # rank that is not a child yet (row of 99 = [10, 11, 16]: 10 and 11 are children, so 16)
    h = graft_merge(tokens, parents, retrieved, tpl_parents, slots=2, n_template=4, dedup="skip",
                    row=lambda t: {99: [10, 11, 16, -1]}.get(t, [-1]))
    assert h.tokens == [99, 10, 12, 11, 16, 13] and h.parents == [-1, 0, 1, 0, 0, 1] and h.n_dedup == 1


def test_merge_drops_cold_subtrees_and_never_exceeds_slots():
    tpl_parents = np.array([-1, 0, 0, 1, 2, 4])
    retrieved = [5, 7, -1, 8, 9, 3]  # node 2 cold: its descendants 4 and 5 are dropped with it
    h = graft_merge([5], [-1], retrieved, tpl_parents, slots=10, n_template=5)
    assert h.tokens == [5, 7, 8] and h.parents == [-1, 0, 1]
    rng = np.random.default_rng(0)
    tpl = stage_template(0, 30)
    parents, _, _ = tpl.arrays
    for _ in range(50):
        draft_n = int(rng.integers(0, 10))
        toks = [0] + rng.integers(1, 6, draft_n).tolist()
        pars = [-1] + [int(rng.integers(0, i)) for i in range(1, draft_n + 1)]
        got = [0] + rng.integers(-1, 6, len(parents) - 1).tolist()
        slots = int(rng.integers(0, 30))
        h = graft_merge(toks, pars, got, parents, slots, tpl.n_template)
        assert len(h.tokens) - len(toks) == h.n_retrieved <= slots
        assert all(p < i for i, p in enumerate(h.parents) if i)
        seen = set()
        for i in range(1, len(h.tokens)):  # merge: no retrieved node duplicates a sibling
            if h.source[i] == 2:
                assert (h.parents[i], h.tokens[i]) not in seen
            seen.add((h.parents[i], h.tokens[i]))


@pytest.mark.parametrize("slots", [0, 3])
def test_merge_with_an_empty_matrix_is_the_pruned_tree(slots):
    tpl = stage_template(1, 12)
    parents, _, _ = tpl.arrays
    h = graft_merge([4, 1, 2], [-1, 0, 1], [4] + [-1] * (len(parents) - 1), parents, slots, tpl.n_template)
    assert h.tokens == [4, 1, 2] and h.n_retrieved == 0
