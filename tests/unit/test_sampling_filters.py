"""`backends.sampling`: top-p's cumulative sums and vLLM's top-k / top-p filter as the plugin runs it,
each row's result its own whatever rows share the tensor (bitwise, on CPU here; on CUDA in
tests/gpu/test_sampling_gpu.py, where torch.cumsum's own sums follow the batch's shape)."""

from __future__ import annotations

import pytest
import torch

from detaudit.backends.sampling import row_cumsum, top_k_top_p, top_p_drop

INF = float("-inf")


@pytest.mark.parametrize("n", [1, 5, 16, 17, 20, 33, 256, 257, 4099])
def test_row_cumsum_is_the_cumulative_sum(n):
    x = torch.rand(5, n, generator=torch.Generator().manual_seed(n))
    got = row_cumsum(x)
    assert got.shape == x.shape and got.dtype == x.dtype
    ref = x.double().cumsum(-1)
    # fp32 sums of at most n terms in [0, 1): within n ulps of the running total
    assert torch.allclose(got.double(), ref, rtol=n * 2**-23, atol=0)
    assert torch.equal(got[:, 0], x[:, 0])


@pytest.mark.parametrize("n", [20, 49152])
def test_row_cumsum_rows_alone_and_in_company_are_bitwise_equal(n):
    x = torch.rand(9, n, generator=torch.Generator().manual_seed(1))
    together = row_cumsum(x)
    for i in (0, 4, 8):
        assert torch.equal(row_cumsum(x[i : i + 1])[0], together[i])
        assert torch.equal(row_cumsum(x[i : i + 3])[0], together[i])


def test_top_p_drop_keeps_the_shortest_prefix_reaching_p():
    probs = torch.tensor([[0.5, 0.3, 0.15, 0.05]])
    assert top_p_drop(probs, 0.7).tolist() == [[False, False, True, True]]  # 0.5 + 0.3 reaches 0.7
    assert top_p_drop(probs, 0.4).tolist() == [[False, True, True, True]]  # the first alone reaches it
    assert top_p_drop(probs, 1.0).tolist() == [[False, False, False, False]]


def _kept(row: torch.Tensor) -> list[int]:
    return [i for i, v in enumerate(row.tolist()) if v != INF]


def test_top_k_keeps_the_k_largest_and_every_tie_at_the_cut():
    logits = torch.tensor([[1.0, 4.0, 3.0, 3.0, 0.0, 2.0]])
    out = top_k_top_p(logits.clone(), torch.tensor([2]), None)
    assert _kept(out[0]) == [1, 2, 3]  # 4.0, and both 3.0s tied at the 2nd place
    kept = out[0][out[0] != INF]
    assert torch.equal(kept, torch.tensor([4.0, 3.0, 3.0]))  # the kept logits untouched


def test_top_p_breaks_ties_at_the_cut_by_token_id():
    # probabilities 0.4, 0.2, 0.2, 0.2 (ids 3, 0, 2, 1 tie): p 0.5 keeps 0.4 and the lowest id of the ties
    logits = torch.log(torch.tensor([[0.2, 0.2, 0.2, 0.4]]))
    out = top_k_top_p(logits.clone(), None, torch.tensor([0.5]))
    assert _kept(out[0]) == [0, 3]


def test_per_request_k_and_p_and_nothing_asked_is_nothing_done():
    logits = torch.tensor([[3.0, 2.0, 1.0, 0.0], [0.0, 1.0, 2.0, 3.0]])
    out = top_k_top_p(logits.clone(), torch.tensor([1, 4]), torch.tensor([1.0, 0.7]))  # 0.64 + 0.24
    assert _kept(out[0]) == [0] and _kept(out[1]) == [2, 3]
    same = logits.clone()
    assert top_k_top_p(same, None, None) is same and torch.equal(same, logits)


def _tied_logits(rows: int, vocab: int) -> torch.Tensor:
    """bf16-rounded logits (many exact ties, as a model's bf16 lm_head gives) in fp32, as vLLM samples."""
    g = torch.Generator().manual_seed(rows)
    return (torch.randn(rows, vocab, generator=g) * 3).to(torch.bfloat16).float()


def test_top_k_top_p_rows_alone_and_in_company_are_bitwise_equal():
    logits = _tied_logits(12, 4096)
    k = torch.tensor([20, 4096, 50, 1] * 3)
    p = torch.tensor([0.95, 0.9, 1.0, 0.5] * 3)
    together = top_k_top_p(logits.clone(), k, p)
    for i in range(12):
        alone = top_k_top_p(logits[i : i + 1].clone(), k[i : i + 1], p[i : i + 1])
        assert torch.equal(alone[0], together[i]), i


def test_top_p_keeps_the_lowest_ids_of_a_wide_tie():
    # one likely token and 4095 tied ones: the cut falls inside the tie, which the sort must order by id
    logits = torch.zeros(1, 4096)
    logits[0, 4000] = 10.0
    out = top_k_top_p(logits.clone(), None, torch.tensor([0.845]))
    kept = _kept(out[0])
    assert kept[-1] == 4000 and 1 < len(kept) < 200
    assert kept[:-1] == list(range(len(kept) - 1))
