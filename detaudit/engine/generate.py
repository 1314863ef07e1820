"""Static-batch generation with a KV cache, per-request seeded sampling and top-k log-probabilities.

Batch invariance by construction: every request keeps its own positions (0..len-1, right padding),
its own cache row and its own random generator seeded by (seed, prompt id), so nothing a request
computes depends on the other requests in its batch except through the backend's kernels.
"""

from __future__ import annotations

import hashlib
from dataclasses import dataclass
from typing import Callable, Sequence

import torch
from torch import Tensor

from detaudit.config import DecodingParams
from detaudit.engine.model import Decoder

ProgressFn = Callable[[int], None]  # called with the number of tokens just produced


@dataclass
class Generation:
    token_ids: list[int]
    token_logprobs: list[float]
    topk_ids: list[list[int]]
    topk_logprobs: list[list[float]]
    finish_reason: str


def request_seed(seed: int, prompt_id: str) -> int:
    return int.from_bytes(hashlib.sha256(f"{seed}:{prompt_id}".encode()).digest()[:8], "little") & (2**63 - 1)


class Generator:
    def __init__(self, model: Decoder, eos_ids: Sequence[int], pad_id: int = 0) -> None:
        self.model = model
        self.eos = set(int(e) for e in eos_ids)
        self.pad_id = pad_id
        self.device = model.device

    # ---- sampling (per row, invariant)
    def _choose(self, logits: Tensor, logprobs: Tensor, decoding: DecodingParams, gens: list[torch.Generator]) -> Tensor:
        if decoding.greedy:
            return logits.argmax(dim=-1)
        backend = self.model.ctx.backend
        scaled = logits / decoding.temperature
        k = decoding.top_k if 0 < decoding.top_k < scaled.shape[-1] else scaled.shape[-1]
        vals, idx = torch.topk(scaled, k, dim=-1)  # exact selection, sorted descending
        probs = backend.log_softmax(vals).exp()
        if decoding.top_p < 1.0:
            cum = probs.cumsum(dim=-1)
            drop = (cum - probs) > decoding.top_p  # keep the smallest prefix reaching top_p
            probs = probs.masked_fill(drop, 0.0)
        out = []
        for row in range(probs.shape[0]):
            j = torch.multinomial(probs[row].cpu(), 1, generator=gens[row])
            out.append(idx[row, j.to(idx.device)])
        return torch.cat(out)

    @torch.inference_mode()
    def generate(
        self,
        prompts: Sequence[Sequence[int]],
        prompt_ids: Sequence[str],
        decoding: DecodingParams,
        progress: ProgressFn | None = None,
    ) -> list[Generation]:
        m = self.model
        B = len(prompts)
        lens = torch.tensor([len(p) for p in prompts], device=self.device)
        T = int(lens.max())
        ids = torch.full((B, T), self.pad_id, dtype=torch.long, device=self.device)
        for i, p in enumerate(prompts):
            ids[i, : len(p)] = torch.tensor(p, dtype=torch.long)
        pos = torch.arange(T, device=self.device).expand(B, T)
        cache = m.new_cache(B, T + decoding.max_new_tokens)
        gens = [torch.Generator().manual_seed(request_seed(decoding.seed, pid)) for pid in prompt_ids]

        h = m.hidden(ids, pos, cache)
        h_last = h[torch.arange(B, device=self.device), lens - 1][:, None]  # [B, 1, H]
        outs = [Generation([], [], [], [], "length") for _ in range(B)]
        active = [True] * B
        cur = lens.clone()
        for step in range(decoding.max_new_tokens):
            logits = m.logits(h_last)[:, 0]  # [B, V] fp32
            logprobs = m.ctx.backend.log_softmax(logits)
            top_lp, top_id = torch.topk(logprobs, decoding.logprobs, dim=-1)
            nxt = self._choose(logits, logprobs, decoding, gens)
            chosen_lp = logprobs.gather(1, nxt[:, None])[:, 0]
            nxt_l, top_id_l, top_lp_l, chosen_l = nxt.tolist(), top_id.tolist(), top_lp.tolist(), chosen_lp.tolist()
            produced = 0
            for i in range(B):
                if not active[i]:
                    continue
                g = outs[i]
                g.token_ids.append(nxt_l[i])
                g.token_logprobs.append(chosen_l[i])
                g.topk_ids.append(top_id_l[i])
                g.topk_logprobs.append(top_lp_l[i])
                produced += 1
                if nxt_l[i] in self.eos:
                    g.finish_reason = "stop"
                    active[i] = False
            if progress:
                progress(produced)
            if not any(active) or step == decoding.max_new_tokens - 1:
                break
            feed = torch.where(torch.tensor(active, device=self.device), nxt, torch.full_like(nxt, self.pad_id))
            h_last = m.hidden(feed[:, None], cur[:, None], cache)
            cur = cur + 1
        return outs

    @torch.inference_mode()
    def score(self, prompts: Sequence[Sequence[int]], continuations: Sequence[Sequence[int]]) -> list[list[float]]:
        """Teacher forcing: log-probabilities of each continuation's tokens given its prompt, from
        one full-sequence forward per sequence (a fresh cache, as a training step computes it)."""
        m = self.model
        B = len(prompts)
        seqs = [list(p) + list(c) for p, c in zip(prompts, continuations)]
        T = max(len(s) for s in seqs)
        ids = torch.full((B, T), self.pad_id, dtype=torch.long, device=self.device)
        for i, s in enumerate(seqs):
            ids[i, : len(s)] = torch.tensor(s, dtype=torch.long)
        pos = torch.arange(T, device=self.device).expand(B, T)
        h = m.hidden(ids, pos, m.new_cache(B, T))
        out = []
        for i, (p, c) in enumerate(zip(prompts, continuations)):
            if not c:
                out.append([])
                continue
            rows = h[i : i + 1, len(p) - 1 : len(p) - 1 + len(c)]  # predicts c[0..]
            lp = m.ctx.backend.log_softmax(m.logits(rows)[0])
            out.append(lp.gather(1, torch.tensor(c, device=self.device)[:, None])[:, 0].tolist())
        return out
