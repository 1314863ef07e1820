"""The built-in engine's sampler (`builtin.generate.Generator._choose`): each request draws with its own
seeded generator from softmax(logits / temperature), restricted to the top k and to the smallest prefix
reaching top p."""

from __future__ import annotations

from types import SimpleNamespace

import numpy as np
import pytest
import torch

from detaudit.backends import get_backend
from detaudit.builtin.generate import Generator
from detaudit.config import DecodingParams

LOGITS = [2.0, 1.5, 1.0, 0.5, 0.0, -0.5, -1.0, -3.0]
DRAWS = 4000  # requests, each with its own seed: a frequency within 0.03 of its probability is 4 sigma


def sampler(backend: str = "bio") -> Generator:
    """A Generator over a stand-in model: choosing a token from given logits needs only the model's device
    and its backend's log-softmax (a real backend here), not its weights."""
    model = SimpleNamespace(device=torch.device("cpu"), ctx=SimpleNamespace(backend=get_backend(backend)))
    return Generator(model, eos_ids=())


def draw(logits: torch.Tensor, **decoding) -> torch.Tensor:
    gens = [torch.Generator().manual_seed(i) for i in range(logits.shape[0])]
    return sampler()._choose(logits, DecodingParams(**decoding), gens)


def frequencies(**decoding) -> np.ndarray:
    picks = draw(torch.tensor([LOGITS] * DRAWS), **decoding)
    return np.bincount(picks.numpy(), minlength=len(LOGITS)) / DRAWS


def expected(temperature: float, top_k: int = 0, top_p: float = 1.0) -> np.ndarray:
    """softmax(logits / T) in fp64, cut to the top k and the top-p prefix, renormalised."""
    p = np.exp(np.array(LOGITS) / temperature)
    p /= p.sum()
    keep = np.zeros(len(p), dtype=bool)
    order = np.argsort(-p, kind="stable")[: top_k or len(p)]
    cum = np.cumsum(p[order])
    keep[order[(cum - p[order]) <= top_p]] = True
    p = np.where(keep, p, 0)
    return p / p.sum()


@pytest.mark.parametrize(
    "decoding",
    [
        dict(temperature=0.5, top_k=0, top_p=1.0),
        dict(temperature=1.0, top_k=0, top_p=1.0),
        dict(temperature=2.0, top_k=0, top_p=1.0),
        dict(temperature=2.0, top_k=3, top_p=1.0),
        dict(temperature=0.6, top_k=20, top_p=0.95),  # the published settings
    ],
    ids=lambda d: f"T{d['temperature']}-k{d['top_k']}-p{d['top_p']}",
)
def test_draws_follow_softmax_of_logits_over_temperature(decoding):
    want = expected(decoding["temperature"], decoding["top_k"], decoding["top_p"])
    got = frequencies(**decoding)
    assert np.abs(got - want).max() < 0.03, (got.round(3), want.round(3))
    assert (got[want == 0] == 0).all()  # cut by top k / top p: never drawn


def test_temperature_changes_the_distribution_as_its_definition_says():
    """Sharper below 1, flatter above: the top token's share moves from 0.63 (T 0.5) through 0.40 (T 1) to
    0.26 (T 2), far apart for the 4000 draws, so a sampler that ignored T could not pass the test above;
    and only logits / T matters: scaling both by 2 gives the same draws, seed for seed."""
    tops = [expected(t)[0] for t in (0.5, 1.0, 2.0)]
    assert tops[0] - tops[1] > 0.2 and tops[1] - tops[2] > 0.1
    g = torch.Generator().manual_seed(3)
    logits = torch.randn(64, 300, generator=g) * 3
    for t, k, p in ((0.6, 20, 0.95), (1.3, 0, 1.0), (0.25, 50, 0.8)):
        same = draw(logits * 2, temperature=2 * t, top_k=k, top_p=p)
        assert torch.equal(same, draw(logits, temperature=t, top_k=k, top_p=p)), (t, k, p)
        assert not torch.equal(draw(logits, temperature=2 * t, top_k=k, top_p=p), same), (t, k, p)
