"""The blocked top-k of the adjacency matrix's update (``drafters/matrix.py``: ``top_indices``) against
``torch.topk``: the same columns on distinct values, the same values on ties, on layouts built to defeat a
wrong candidate set."""

import pytest
import torch

from specgraft.drafters.matrix import BLOCK, AdjacencyMatrix, block_maxima, blocked_topk, top_indices

QWEN_VOCAB, SMOLLM2_VOCAB = 151936, 49152


@pytest.mark.parametrize("vocab", [QWEN_VOCAB, SMOLLM2_VOCAB, 130 * BLOCK + 57, 8 * BLOCK])
@pytest.mark.parametrize("k", [1, 8])
@pytest.mark.parametrize("top", [blocked_topk, top_indices])
def test_top_indices_are_torch_topk_on_distinct_values(vocab, k, top):
    logits = torch.randn(5, vocab, generator=torch.Generator().manual_seed(vocab + k))
    assert torch.equal(top(logits, k), torch.topk(logits, k, dim=-1).indices)


def adversarial_rows(vocab: int, k: int) -> torch.Tensor:
    """Rows whose k largest entries sit where a wrong candidate set misses them."""
    g = torch.Generator().manual_seed(1)
    rows = torch.rand(3, vocab, generator=g)  # background in [0, 1)
    top = 10 + torch.arange(k, 0, -1, dtype=torch.float32)  # k distinct winners, all above the background
    rows[0, 7 * BLOCK: 7 * BLOCK + k] = top  # all k in one block (one candidate per block would miss k - 1)
    rows[1, -k:] = top  # all k in the columns past the last full block
    rows[2, torch.arange(k) * 3 * BLOCK + 5] = top  # one per block, k blocks (fewer blocks would miss one)
    rows[2, 1 * BLOCK: 2 * BLOCK] = 5.0 + torch.rand(BLOCK, generator=g)  # a block of near-winners, never max
    return rows


@pytest.mark.parametrize("k", [1, 4, 8])
def test_top_indices_finds_winners_a_wrong_candidate_set_misses(k):
    rows = adversarial_rows(200 * BLOCK + 9, k)
    assert torch.equal(blocked_topk(rows, k), torch.topk(rows, k, dim=-1).indices)


def test_top_indices_selects_over_the_candidates_only_where_it_saves_time(monkeypatch):
    widths = []
    real = torch.topk

    def counted(x, k, *args, **kwargs):
        widths.append(x.shape[-1])
        return real(x, k, *args, **kwargs)

    monkeypatch.setattr(torch, "topk", counted)
    top_indices(torch.randn(3, QWEN_VOCAB), 8)
    assert widths == [QWEN_VOCAB // BLOCK, 8 * BLOCK]  # block maxima, then 8 blocks' columns: never the row
    widths.clear()
    top_indices(torch.randn(3, 1000), 8)  # too few blocks to save anything: one selection over the row
    top_indices(torch.randn(1, SMOLLM2_VOCAB), 8)  # one row of a small vocabulary: the same
    assert widths == [1000, SMOLLM2_VOCAB]


def test_top_indices_on_bf16_and_strided_rows():
    g = torch.Generator().manual_seed(4)
    batch = torch.randn(3, 6, QWEN_VOCAB, generator=g)
    row_slice = batch[1, :4]  # a request's rows of a batched verify
    strided = torch.randn(SMOLLM2_VOCAB, 5, generator=g).T  # columns not contiguous
    bf16 = (torch.rand(2, QWEN_VOCAB, generator=g) - 0.5).to(torch.bfloat16)  # ties everywhere below the top 9
    bf16[:, torch.randperm(QWEN_VOCAB, generator=g)[:9]] = torch.arange(9, 0, -1, dtype=torch.bfloat16)
    for logits in (row_slice, strided, bf16):
        assert torch.equal(blocked_topk(logits, 8), torch.topk(logits, 8, dim=-1).indices)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
def test_block_maxima_order_blocks_as_their_float_maxima(dtype):
    g = torch.Generator().manual_seed(5)
    blocks = (3 * torch.randn(4, 300, BLOCK, generator=g) - 4).to(dtype)  # many blocks entirely negative
    blocks[0, :10] = -blocks[0, :10].abs()
    blocks[1, :6] = -0.0
    blocks[2, :3, 0] = float("-inf")
    blocks[3, 7, 9] = float("inf")
    maxima = blocks.float().amax(-1)
    in_key_order = maxima.gather(-1, block_maxima(blocks).argsort(dim=-1))
    assert (in_key_order[:, 1:] >= in_key_order[:, :-1]).all()


def test_top_indices_on_ties_at_the_kth_value_keeps_the_winners_and_picks_tied_columns():
    logits = torch.zeros(2, QWEN_VOCAB, dtype=torch.bfloat16)
    winners = torch.tensor([100000, 3, 77777, 4096, 151935])
    logits[:, winners] = torch.tensor([9.0, 8, 7, 6, 5], dtype=torch.bfloat16)
    tied = torch.tensor([12, 640, 70000, 151900])
    logits[:, tied] = 1.0  # three of these four fill ranks 6-8
    got = blocked_topk(logits, 8)
    for row in got.tolist():
        assert row[:5] == winners.tolist()
        assert len(set(row[5:])) == 3 and set(row[5:]) <= set(tied.tolist())


def test_matrix_update_blocked_equals_plain_topk():
    logits = torch.randn(7, SMOLLM2_VOCAB, generator=torch.Generator().manual_seed(3))
    tokens = torch.tensor([11, 40000, 5, 11, 123, 9, 40000])  # repeats: the last occurrence's row wins
    tables = []
    for blocked in (True, False):
        m = AdjacencyMatrix(SMOLLM2_VOCAB, 8)
        m.blocked_topk = blocked
        m.update(tokens, logits)
        m.update(tokens[:3], logits[4:])  # no repeats: the path without a copy
        tables.append(m.table)
    assert torch.equal(tables[0], tables[1])
    assert tables[0][123].tolist() == torch.topk(logits[4], 8).indices.tolist()
