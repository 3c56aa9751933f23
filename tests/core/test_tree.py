"""Golden outputs of the worked examples in docs/design.md §3.1."""

import pytest
import torch

from specgraft.core.tree import Tree, ancestor_mask, children_lists, depths, leaf_paths, path_to

GOLDEN_PARENTS = [-1, 0, 0, 1, 1, 3]


def test_golden_depth_ancestors_paths():
    assert depths(GOLDEN_PARENTS) == [0, 1, 1, 2, 2, 3]
    anc = ancestor_mask(GOLDEN_PARENTS)
    rows = [set(map(int, r.nonzero()[0])) for r in anc]
    assert rows == [{0}, {0, 1}, {0, 2}, {0, 1, 3}, {0, 1, 4}, {0, 1, 3, 5}]
    assert leaf_paths(GOLDEN_PARENTS) == [[0, 2, -1, -1], [0, 1, 4, -1], [0, 1, 3, 5]]
    assert children_lists(GOLDEN_PARENTS) == [[1, 2], [3, 4], [], [5], [], []]
    assert path_to(GOLDEN_PARENTS, 5) == [0, 1, 3, 5]


def test_mask_is_min_exactly_where_not_ancestor():
    tree = Tree.build([7, 1, 2, 3, 4, 5], GOLDEN_PARENTS)
    for dtype in (torch.float32, torch.bfloat16):
        mask = tree.attention_mask(prefix_len=3, dtype=dtype)
        assert mask.shape == (1, 1, 6, 9) and mask.dtype == dtype
        assert (mask[0, 0, :, :3] == 0).all()
        tree_part = mask[0, 0, :, 3:]
        assert torch.equal(tree_part == torch.finfo(dtype).min, ~tree.ancestors)
        assert torch.equal(tree_part == 0, tree.ancestors)


def test_positions_and_chain():
    tree = Tree.build([7, 1, 2, 3, 4, 5], GOLDEN_PARENTS)
    assert tree.position_ids(10).tolist() == [[10, 11, 11, 12, 12, 13]]
    chain = Tree.chain(9, [4, 5, 6])
    assert chain.parents.tolist() == [-1, 0, 1, 2]
    assert chain.tokens.tolist() == [9, 4, 5, 6]
    assert chain.source.tolist()[0] == 0
    assert Tree.chain(9, []).size == 1


@pytest.mark.parametrize("parents", [[0, 0], [-1, 1], [-1, 0, 3, 1], []])
def test_invalid_parents_rejected(parents):
    with pytest.raises(ValueError):
        Tree.build(list(range(len(parents))), parents)
