"""Speculative decoding in the built-in engine: deterministic drafts and their verification.

Drafts are deterministic (prompt lookup, or a draft model's greedy tokens), so each is a point-mass
proposal q = 1[d]. Standard rejection sampling with such a proposal accepts d with probability
min(1, p(d) / q(d)) = p(d) and, on rejection, samples from norm(max(0, p - q)), which is p with d
removed. Drawing x ~ p and accepting iff x == d does exactly that: P(accept) = p(d), and a rejected
draw is distributed as p conditioned on x != d. So verification draws, at each verified position, the
token plain decoding would draw there (the request's own seeded generator, the same draw from the same
distribution) and stops at the first one that differs from the draft, emitting it. The output then has
the target's distribution, and is bitwise the plain output whenever the verify step's logits are
bitwise the decode step's (bio / bio+tbik: `graphs.eager_rows_step`). Greedy decoding is the same walk
with argmax as the draw.
"""

from __future__ import annotations

from typing import Callable, Sequence

import numpy as np
import torch
from numpy.lib.stride_tricks import sliding_window_view
from torch import Tensor

from detaudit.builtin.graphs import eager_step, graphed_step
from detaudit.builtin.model import Decoder
from detaudit.config import NGRAM_MAX


def ngram_propose(context: Sequence[int], k: int, max_n: int = NGRAM_MAX) -> list[int]:
    """Prompt lookup: the longest suffix of `context` of up to `max_n` tokens that also occurs earlier in
    it, its earliest such occurrence, and up to `k` tokens that followed that occurrence (fewer where the
    context ends first); [] when no suffix of one token or more recurs. The same drafts as vLLM's n-gram
    proposer with `prompt_lookup_min` 1 and `prompt_lookup_max` `max_n` (NGRAM_MAX 5: vLLM's default).
    A pure function of the tokens: every rank, every run, every batch proposes the same drafts for the
    same context.

    Why the earliest occurrence and up to 5 tokens: an answer that copies its prompt follows the text it
    copies, usually the earliest occurrence of what it has just written (a later one is the answer's own
    copy, or a repeat such as a second loop over the same list, whose continuation may differ); and in
    code, suffixes of 3 tokens (`    for x in`) recur with other continuations far more than 5-token ones.
    Both raised the acceptance of the embedded model's greedy answers on the `quote` suite."""
    a = np.asarray(context, dtype=np.int64)
    n_ctx = len(a)
    if k < 1 or n_ctx < 2:
        return []
    for n in range(min(max_n, n_ctx - 1), 0, -1):
        # windows that start at s <= n_ctx - 1 - n: a token follows each, and the suffix itself is excluded
        windows = sliding_window_view(a[: n_ctx - 1], n)
        hits = np.flatnonzero((windows == a[n_ctx - n :]).all(axis=1))
        if hits.size:
            start = int(hits[0]) + n
            return a[start : start + k].tolist()
    return []


def verify(draw: Callable[[int], int], drafts: Sequence[int], done: Callable[[int], bool]) -> tuple[list[int], int]:
    """Walk one request's verified rows: `draw(j)` gives the token the target draws at row j (row 0
    predicts the token after the pending one; row j the token after draft j - 1), in row order, exactly
    once per emitted token; `done(token)` says whether the request ends with it (end of sequence, a stop
    string, the token limit). Returns (emitted tokens, drafts accepted): every drawn token is emitted,
    and the walk goes on only while the drawn token equals the draft at that position."""
    emitted: list[int] = []
    accepted = 0
    for j in range(len(drafts) + 1):
        x = draw(j)
        emitted.append(x)
        match = j < len(drafts) and x == drafts[j]
        accepted += match
        if done(x) or not match:  # (`done` sees every emitted token)
            break
    return emitted, accepted


class DraftModel:
    """A draft checkpoint (sharing the target's tokenizer) run greedily at TP 1 in this process under the
    target's backend, with its own KV cache: per request, `valid` cache slots hold its context, and each
    proposal feeds the context tokens it has not seen (its last accepted drafts and the target's token)
    in one forward, then decodes k - 1 tokens more. Slots past `valid` hold rejected drafts or padding,
    overwritten before any query reads them (as the target's)."""

    def __init__(self, model: Decoder, pad_id: int, cuda_graphs: bool) -> None:
        self.model = model
        self.pad_id = pad_id
        self.cuda_graphs = cuda_graphs and model.device.type == "cuda"
        self._graphs: dict[int, tuple[list[tuple[Tensor, Tensor]], Callable]] = {}
        self.cache: list[tuple[Tensor, Tensor]] = []
        self.valid: list[int] = []

    def start(self, batch: int, length: int) -> None:
        """A new batch: a cache of `length` slots (the target's), nothing in it yet."""
        if self.cuda_graphs:
            hit = self._graphs.get(batch)
            if hit is None or hit[0][0][0].shape[2] != length:
                cache = self.model.new_cache(batch, length)
                hit = self._graphs[batch] = (cache, graphed_step(self.model, cache, batch, self.pad_id))
            self.cache, self.step = hit
        else:
            self.cache = self.model.new_cache(batch, length)
            self.step = eager_step(self.model, self.cache)
        self.valid = [0] * batch

    @torch.inference_mode()
    def propose(self, contexts: Sequence[Sequence[int]], wants: Sequence[int]) -> list[list[int]]:
        """`wants[i]` greedy draft tokens continuing `contexts[i]` (none where 0)."""
        k = max(wants, default=0)
        if k == 0:
            return [[] for _ in contexts]
        m, device = self.model, self.model.device
        length = self.cache[0][0].shape[2]
        news = [list(c[self.valid[i] :]) if wants[i] else [] for i, c in enumerate(contexts)]
        rows = max(1, max(len(n) for n in news))
        tokens = torch.tensor([n + [self.pad_id] * (rows - len(n)) for n in news], dtype=torch.long, device=device)
        pos = torch.tensor(
            [[min(self.valid[i] + j, length - 1) for j in range(rows)] for i in range(len(news))], device=device
        )
        kv_len = length if device.type == "cuda" else int(pos.max()) + 1
        h = m.hidden(tokens, pos, self.cache, kv_len)
        last = torch.tensor([max(len(n) - 1, 0) for n in news], device=device)
        picks = [m.logits(h[torch.arange(len(news), device=device), last][:, None])[:, 0].argmax(dim=-1)]
        for i, n in enumerate(news):
            self.valid[i] += len(n)
        at = torch.tensor(self.valid, device=device)
        for s in range(1, k):
            positions = torch.clamp(at + s - 1, max=length - 1)
            furthest = min(max(self.valid) + s - 1, length - 1)  # positions.max(), without a device sync
            logits = self.step(picks[-1], positions, furthest + 1)[0]
            picks.append(logits.argmax(dim=-1))
        drafted = torch.stack(picks, dim=1).tolist()
        return [d[:w] for d, w in zip(drafted, wants)]
