"""Sampling filters on CUDA (`backends.sampling`): a row's cumulative sums and its top-k / top-p filter are
bitwise the same alone and in batches of every size, where torch.cumsum's are not guaranteed to be (one
row: CUB's device-wide scan; several: a layout that follows the row count) and vLLM's filter switches
algorithm at 8 rows. What torch and vLLM themselves do on this card is printed, not asserted."""

from __future__ import annotations

import importlib.util

import pytest
import torch

from detaudit.backends.sampling import row_cumsum, top_k_top_p

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")]
BATCHES = (1, 2, 6, 14, 300)


def _rows(rows: int, vocab: int, seed: int = 0) -> torch.Tensor:
    """bf16-rounded logits in fp32 (exact ties, as vLLM samples a bf16 lm_head's output), row i the same
    for every `rows`."""
    g = torch.Generator().manual_seed(seed)
    base = (torch.randn(max(BATCHES), vocab, generator=g) * 3).to(torch.bfloat16).float()
    return base[:rows].cuda()


@pytest.mark.parametrize("n", [20, 49152])
def test_row_cumsum_is_the_same_alone_and_in_every_batch(n):
    probs = _rows(max(BATCHES), n).softmax(dim=-1)
    ref = row_cumsum(probs[:1])[0]
    torch_differs = []
    for b in BATCHES:
        assert torch.equal(row_cumsum(probs[:b])[0], ref), b
        torch_differs.append(not torch.equal(torch.cumsum(probs[:b], -1)[0], torch.cumsum(probs[:1], -1)[0]))
    print(f"\n[cumsum n={n}] torch.cumsum's row 0 unlike its single-row sums:", dict(zip(BATCHES, torch_differs)))


def test_top_k_top_p_is_the_same_alone_and_in_every_batch():
    vocab = 49152
    logits = _rows(max(BATCHES), vocab)
    k = torch.tensor([20, vocab, 50, 1] * 75, device="cuda")
    p = torch.tensor([0.95, 0.9, 1.0, 0.5] * 75, device="cuda")
    together = top_k_top_p(logits.clone(), k, p)
    for b in BATCHES:
        got = top_k_top_p(logits[:b].clone(), k[:b], p[:b])
        assert torch.equal(got, together[:b]), b


@pytest.mark.skipif(importlib.util.find_spec("vllm") is None, reason="needs vLLM")
def test_vllms_own_filter_printed_against_detaudits():
    """Informational: how many rows of vLLM's own filter change between 6 rows (its PyTorch sort) and 14
    (its Triton kernel) on tie-rich logits, where detaudit's changes none (asserted above)."""
    from vllm.v1.sample.ops import topk_topp_sampler

    vocab = 49152
    # one likely token and three tied ones: p 0.8 cuts inside the tie (0.71 alone, 0.81 with one of them)
    logits = torch.full((14, vocab), -20.0, device="cuda")
    for r in range(14):
        logits[r, 100 + r] = 5.0
        logits[r, [2000 + r, 3000 + 7 * r, 40000 - r]] = 3.0
    k = torch.full((14,), 20, device="cuda")
    p = torch.full((14,), 0.8, device="cuda")
    few = topk_topp_sampler.apply_top_k_top_p(logits[:6].clone(), k[:6], p[:6])
    many = topk_topp_sampler.apply_top_k_top_p(logits.clone(), k, p)
    changed = int((few != many[:6]).any(dim=-1).sum())
    ours = top_k_top_p(logits[:6].clone(), k[:6], p[:6])
    assert torch.equal(ours, top_k_top_p(logits.clone(), k, p)[:6])
    print(f"\n[vLLM filter] rows of 6 that change when 14 share the step: {changed}")
