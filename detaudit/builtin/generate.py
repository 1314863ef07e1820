"""Static-batch generation with a KV cache, per-request seeded sampling and top-k log-probabilities.

Batch invariance by construction: every request keeps its own positions (0..len-1, right padding),
its own cache row and its own random generator seeded by (seed, prompt id), so nothing a request
computes depends on the other requests in its batch except through the backend's kernels.

Speculative decoding (`generate(..., speculative=)`, `speculative.py`) keeps all of that: each verify
step runs every request's pending token and its drafts as query rows at their own positions, and draws
each verified token with the request's generator exactly as plain decoding draws it.
"""

from __future__ import annotations

import gc
import time
from typing import Callable, Sequence

import torch
from torch import Tensor

from detaudit.backends.base import ReplayUnsupported
from detaudit.backends.sampling import top_p_drop
from detaudit.builtin.graphs import (
    DecodeStep,
    RowsStep,
    eager_rows_step,
    eager_step,
    graphed_rows_step,
    graphed_step,
    replayed_step,
    rows_log_softmax,
)
from detaudit.builtin.layers import TPContext
from detaudit.builtin.model import Decoder
from detaudit.builtin.moe import Routing
from detaudit.builtin.speculative import DraftModel, ngram_propose, verify
from detaudit.config import DecodingParams, ModelRef, Speculative, request_seed
from detaudit.decoding import StopWatch
from detaudit.errors import DetauditError
from detaudit.runs.records import Generation, ProgressFn


def request_generators(decoding: DecodingParams, prompt_ids) -> list[torch.Generator]:
    """One generator per request, seeded by (seed, prompt id): a request draws the same numbers wherever it
    sits in the batch, with or without speculation."""
    return [torch.Generator().manual_seed(request_seed(decoding.seed, pid)) for pid in prompt_ids]


class _Clock:
    """Wall-clock laps, synchronizing the device first so GPU work is counted where it happens."""

    def __init__(self, device: torch.device) -> None:
        self.cuda = device.type == "cuda"
        self.t = self._now()

    def _now(self) -> float:
        if self.cuda:
            torch.cuda.synchronize()
        return time.perf_counter()

    def lap(self) -> float:
        t, self.t = self.t, self._now()
        return self.t - t


def settle_gc() -> None:
    """Collect, then move every object alive now out of the cyclic collector's reach (`gc.freeze`, as vLLM
    does once start-up is done): a full collection inside the decode loop would walk every object torch,
    transformers and Triton keep (200k+), a pause of milliseconds in a loop that issues a step every few
    milliseconds. Frozen objects are still freed by reference counting; `LocalEngine.close` unfreezes."""
    gc.collect()
    gc.freeze()


def _to_host(*tensors: Tensor, lists: bool = True):
    """Start copying `tensors` (a step's picks) to the host and return a function that waits for those
    copies alone (not for work queued after them) and gives them as lists (`lists`, else as host
    tensors). On GPU: one pinned buffer and an asynchronous copy each, then an event; on CPU the values
    are there already."""
    out = (lambda ts: [t.tolist() for t in ts]) if lists else list
    if not tensors[0].is_cuda:
        return lambda: out(tensors)
    host = [torch.empty(t.shape, dtype=t.dtype, pin_memory=True).copy_(t, non_blocking=True) for t in tensors]
    done = torch.cuda.Event()
    done.record()

    def wait() -> list:
        done.synchronize()
        return out(host)

    return wait


# CPU replay: a batch size's decode steps are recorded once it has this many of them to run (a call's, and
# the eager ones before it). The capture (a warm-up step and a recorded one, with the dispatch of every op
# watched) costs about ten eager steps and a replayed step saves a third of one (the embedded model at
# batch 4 on a 2-core EPYC: capture 0.6 s, eager steps 76 ms, replayed 49 ms), so calls of a few tokens, as
# tests make, stay eager, and a sweep's batch size is recorded by its second call of 16 tokens
REPLAY_AFTER_STEPS = 24


class Generator:
    def __init__(
        self,
        model: Decoder,
        eos_ids: Sequence[int],
        pad_id: int = 0,
        cuda_graphs: bool = False,
        decode: Callable[[list[int]], str] | None = None,
        cpu_replay: bool = False,
    ) -> None:
        self.model = model
        self.eos = set(int(e) for e in eos_ids)
        self.decode = decode  # token ids -> text, special tokens kept: stop strings (`DecodingParams.stop`)
        self.pad_id = pad_id
        self.device = model.device
        self.cuda_graphs = cuda_graphs and model.device.type == "cuda"
        # CPU: decode steps recorded once per batch and replayed (`graphs.replayed_step`); the caller
        # says where the model and backend allow it
        self.cpu_replay = cpu_replay and model.device.type == "cpu"
        self.timings: dict[str, float] = {}  # of the last generate call: prefill_s, capture_s, decode_s, ...
        # batch -> (cache, graphed or replayed decode step, graphed verify steps by rows per request)
        self._graphs: dict[int, tuple[list[tuple[Tensor, Tensor]], DecodeStep, dict[int, RowsStep]]] = {}
        self._drafts: dict[str, DraftModel] = {}  # draft models by checksum, loaded on first use
        self._eager_steps: dict[int, int] = {}  # CPU: decode steps run eagerly per batch size (`_decode_setup`)

    def _decode_setup(
        self, batch: int, needed: int, steps: int = 0
    ) -> tuple[list[tuple[Tensor, Tensor]], DecodeStep | None]:
        """A KV cache of at least `needed` slots and, with CUDA graphs (or CPU replay), the graphed
        (replayed) step over it. A batch size's cache and graph are reused while they are long enough
        (slots another batch left behind sit past every query's position: masked), and replaced by a
        longer pair (`_slots`) when not. Eager decode on GPU attends the whole cache too, so its cache is
        rounded the same way: a sweep's calls then share a few key lengths, and the library attention
        (bf16: cuDNN, which builds an execution plan per new key length, about as long as a whole decode
        step's launches) plans once per length. bio's attention walks only the chunks a row can see: the
        extra slots change no bit. A CPU step that cannot be recorded now (a profiler is recording) is
        eager for this call, and so are the `steps` decode steps of a call at a batch size that has not
        yet run REPLAY_AFTER_STEPS of them (this call's included; why: at the constant)."""
        if not (self.cuda_graphs or self.cpu_replay) or (self.cpu_replay and torch.autograd._profiler_enabled()):
            return self._eager_cache(batch, needed), None
        hit = self._graphs.get(batch)
        if hit is None or hit[0][0][0].shape[2] < needed:
            ran = self._eager_steps.get(batch, 0) + steps
            if self.cpu_replay and ran < REPLAY_AFTER_STEPS:
                self._eager_steps[batch] = ran
                return self._eager_cache(batch, needed), None
            self._graphs.pop(batch, None)
            if self.cpu_replay:  # one batch size's cache and recording at a time: host memory is the model's
                self._graphs.clear()
            cache = self.model.new_cache(batch, self._slots(needed))
            if self.cuda_graphs:
                hit = self._graphs[batch] = (cache, graphed_step(self.model, cache, batch, self.pad_id), {})
            else:
                try:
                    hit = self._graphs[batch] = (cache, replayed_step(self.model, cache, batch, self.pad_id), {})
                except ReplayUnsupported:  # (speed only: this engine's steps stay eager, which `timings` say)
                    self.cpu_replay = False
                    return self._eager_cache(batch, needed), None
        return hit[0], hit[1]

    def _eager_cache(self, batch: int, needed: int) -> list[tuple[Tensor, Tensor]]:
        return self.model.new_cache(batch, self._slots(needed) if self.device.type == "cuda" else needed)

    def _verify_setup(self, batch: int, needed: int) -> tuple[list[tuple[Tensor, Tensor]], Callable[[int], RowsStep]]:
        """As `_decode_setup`, for speculative decoding: the cache and a function giving the step of R query
        rows per request, graphed per (batch, R) on first use with CUDA graphs (over the batch's decode
        cache, which it shares), else eager."""
        if not self.cuda_graphs:
            cache = self._eager_cache(batch, needed)
            eager = eager_rows_step(self.model, cache)
            return cache, lambda rows: eager
        cache, _ = self._decode_setup(batch, needed)
        graphs = self._graphs[batch][2]

        def rows_step(rows: int) -> RowsStep:
            if rows not in graphs:
                graphs[rows] = graphed_rows_step(self.model, cache, batch, rows, self.pad_id)
            return graphs[rows]

        return cache, rows_step

    def _slots(self, needed: int) -> int:
        """`needed` rounded up to a multiple of 256, but not past the positions the model allows."""
        limit = self.model.cfg.rope.max_positions
        rounded = -(-needed // 256) * 256
        return rounded if limit is None else max(needed, min(rounded, limit))

    # ---- sampling (per row, invariant)
    def _distribution(self, logits: Tensor, decoding: DecodingParams) -> tuple[Tensor, Tensor]:
        """Sampled decoding's distribution of each row of `logits` [B, V]: (probabilities [B, k], token ids
        [B, k]), k the top-k width, descending."""
        backend = self.model.ctx.backend
        scaled = logits / decoding.temperature
        k = decoding.top_k if 0 < decoding.top_k < scaled.shape[-1] else scaled.shape[-1]
        vals, idx = torch.topk(scaled, k, dim=-1)  # exact selection, sorted descending
        probs = backend.log_softmax(vals).exp()
        if decoding.top_p < 1.0:
            # row-local sums (`sampling.row_cumsum`): torch.cumsum's on CUDA follow the batch's shape
            probs = probs.masked_fill(top_p_drop(probs, decoding.top_p), 0.0)
        return probs, idx

    def _choose(self, logits: Tensor, decoding: DecodingParams, gens: list[torch.Generator]) -> Tensor:
        if decoding.greedy:
            return logits.argmax(dim=-1)
        probs, idx = self._distribution(logits, decoding)
        host = probs.cpu()  # one copy (one device sync) for every row, not one per row
        picks = torch.stack([_draw(host[row], gens[row]) for row in range(host.shape[0])])
        return idx.gather(1, picks.to(idx.device))[:, 0]

    def _stop_watch(self, decoding: DecodingParams) -> StopWatch | None:
        if not decoding.stop:
            return None
        if self.decode is None:
            raise ValueError("stop strings need the Generator's `decode` (the model's tokenizer)")
        return StopWatch(decoding.stop, self.decode)

    @torch.inference_mode()
    def generate(
        self,
        prompts: Sequence[Sequence[int]],
        prompt_ids: Sequence[str],
        decoding: DecodingParams,
        progress: ProgressFn | None = None,
        speculative: Speculative | None = None,
    ) -> list[Generation]:
        if speculative is not None and speculative.on:
            return self._speculate(prompts, prompt_ids, decoding, progress, speculative)
        m = self.model
        B = len(prompts)
        lens = torch.tensor([len(p) for p in prompts], device=self.device)
        T = int(lens.max())
        ids = torch.full((B, T), self.pad_id, dtype=torch.long, device=self.device)
        for i, p in enumerate(prompts):
            ids[i, : len(p)] = torch.tensor(p, dtype=torch.long)
        pos = torch.arange(T, device=self.device).expand(B, T)
        gens = request_generators(decoding, prompt_ids)
        clock = _Clock(self.device)
        cache, step_fn = self._decode_setup(B, T + decoding.max_new_tokens, decoding.max_new_tokens - 1)
        replayed = step_fn is not None and not self.cuda_graphs
        step_fn = step_fn or eager_step(m, cache)
        if self.device.type == "cuda":
            settle_gc()
        capture_s = clock.lap()
        routing = Routing()
        issued = time.perf_counter()
        h = m.hidden(ids, pos, cache, kv_len=T, routing=routing)
        last_rows = torch.arange(B, device=self.device) * T + lens - 1
        h_last = h.view(B * T, -1)[last_rows][:, None]  # [B, 1, H]
        logits = m.logits(h_last)[:, 0]  # [B, V] fp32
        logprobs = m.ctx.backend.log_softmax(logits)
        route = routing.rows(last_rows)  # the routing of the forward that gave these logits
        prefill_issue_s = time.perf_counter() - issued  # the host's launches, before the device is waited for
        prefill_s = clock.lap()
        outs = [Generation([], [], [], [], "length") for _ in range(B)]
        if route is not None:
            for g in outs:
                g.route_experts, g.route_gates, g.route_margins = [], [], []
        active = [True] * B
        watch = self._stop_watch(decoding)
        still = torch.ones(B, dtype=torch.bool, device=self.device)  # `active` on the device, one step ahead
        eos = torch.tensor(sorted(self.eos), dtype=torch.long, device=self.device) if self.eos else None
        cur = lens.clone()
        steps = 0
        issue_s = 0.0  # host time spent issuing decode steps (eager: the launches; graphed: a replay)
        for step in range(decoding.max_new_tokens):
            top_lp, top_id = torch.topk(logprobs, decoding.logprobs, dim=-1)
            nxt = self._choose(logits, decoding, gens)
            chosen_lp = logprobs.gather(1, nxt[:, None])[:, 0]
            picked = _to_host(nxt, top_id, top_lp, chosen_lp, *(route or ()))
            last = step == decoding.max_new_tokens - 1
            if not last:
                # the next step is launched before this one's tokens reach the host (pipelined, as serving
                # engines schedule asynchronously): its input is decided on the device from the same values
                # (a request that drew an EOS is fed padding from then on), so the host's bookkeeping and
                # the device's forward overlap and nothing computed changes. If every request has just
                # finished, that step is one forward wasted, never read.
                if eos is not None:
                    still &= ~torch.isin(nxt, eos)
                feed = torch.where(still, nxt, torch.full_like(nxt, self.pad_id))
                issued = time.perf_counter()
                following = step_fn(feed, cur, T + step + 1)  # the furthest position is T + step
                issue_s += time.perf_counter() - issued
                steps += 1
                cur = cur + 1
            nxt_l, top_id_l, top_lp_l, chosen_l, *route_l = picked()
            produced = 0
            for i in range(B):
                if not active[i]:
                    continue
                g = outs[i]
                g.token_ids.append(nxt_l[i])
                g.token_logprobs.append(chosen_l[i])
                g.topk_ids.append(top_id_l[i])
                g.topk_logprobs.append(top_lp_l[i])
                if route_l:
                    g.route_experts.append(route_l[0][i])
                    g.route_gates.append(route_l[1][i])
                    g.route_margins.append(route_l[2][i])
                produced += 1
                # a row stopped by a stop string is still fed its token on the device (the step after this
                # one is already issued); nothing of it is read again, and rows never mix
                if nxt_l[i] in self.eos or (watch is not None and watch.hit(g.token_ids)):
                    g.finish_reason = "stop"
                    active[i] = False
            if progress:
                progress(produced)
            if not any(active) or last:
                break
            logits, logprobs, route = following
        self.timings = {
            "prefill_s": prefill_s,
            "prefill_issue_s": prefill_issue_s,
            "capture_s": capture_s,
            "decode_s": clock.lap(),
            "decode_steps": steps,
            "issue_s": issue_s,
            "batch": B,
            "prompt_tokens": int(lens.sum()),
            "cuda_graphs": self.cuda_graphs,
            "cpu_replay": replayed,
        }
        return outs

    # ---- speculative decoding
    def _speculate(
        self,
        prompts: Sequence[Sequence[int]],
        prompt_ids: Sequence[str],
        decoding: DecodingParams,
        progress: ProgressFn | None,
        spec: Speculative,
    ) -> list[Generation]:
        """Generate with drafts verified by the target (`speculative.py`). Per request: the prefill's
        distribution gives the first token as in plain decoding; then every step proposes up to k drafts
        after the request's context, runs the pending token and the drafts as query rows at positions
        p..p+n (one row more than the longest draft in the batch; a shorter one is padded with rows at
        later positions, whose cache slots are overwritten before any real query reads them), and walks
        the rows: each row's token drawn as plain decoding draws it, kept while it equals the draft."""
        m = self.model
        B = len(prompts)
        lens = [len(p) for p in prompts]
        T = max(lens)
        ids = torch.full((B, T), self.pad_id, dtype=torch.long, device=self.device)
        for i, p in enumerate(prompts):
            ids[i, : len(p)] = torch.tensor(p, dtype=torch.long)
        pos = torch.arange(T, device=self.device).expand(B, T)
        gens = request_generators(decoding, prompt_ids)
        clock = _Clock(self.device)
        cache, rows_step = self._verify_setup(B, T + decoding.max_new_tokens)
        length = cache[0][0].shape[2]  # slot length - 1 is past every real position (T + max_new - 2 at most)
        draft = self._draft_for(spec)
        if draft is not None:
            draft.start(B, length)
        if self.device.type == "cuda":
            settle_gc()
        capture_s = clock.lap()
        routing = Routing()
        issued = time.perf_counter()
        h = m.hidden(ids, pos, cache, kv_len=T, routing=routing)
        last_rows = torch.arange(B, device=self.device) * T + torch.tensor(lens, device=self.device) - 1
        logits = m.logits(h.view(B * T, -1)[last_rows][:, None])  # [B, 1, V] fp32, as plain decoding's rows
        logprobs = rows_log_softmax(m, logits)
        route = routing.rows(last_rows)
        prefill_issue_s = time.perf_counter() - issued
        prefill_s = clock.lap()
        outs = [Generation([], [], [], [], "length", drafted=0, accepted=0) for _ in range(B)]
        if route is not None:
            for g in outs:
                g.route_experts, g.route_gates, g.route_margins = [], [], []
        contexts = [list(p) for p in prompts]
        active = [True] * B
        watch = self._stop_watch(decoding)
        drafts: list[list[int]] = [[] for _ in range(B)]
        steps = 0
        issue_s = draft_s = 0.0
        while True:
            picked = self._row_picks(logits, logprobs, decoding, route)
            produced = 0
            for i in range(B):
                if active[i]:
                    emitted, active[i] = self._walk(outs[i], picked, i, drafts[i], gens[i], decoding, watch)
                    contexts[i] += emitted
                    produced += len(emitted)
            if progress:
                progress(produced)
            if not any(active):
                break
            # up to k drafts per active request, never past its token limit: the verify step then emits at
            # most max_new_tokens tokens and its real rows stay below position T + max_new - 1
            left = [decoding.max_new_tokens - len(g.token_ids) for g in outs]
            wants = [min(spec.k, n - 1) if a else 0 for a, n in zip(active, left)]
            t0 = time.perf_counter()
            drafts = self._propose(spec, draft, contexts, wants)
            draft_s += time.perf_counter() - t0
            rows = 1 + max(len(d) for d in drafts)
            pending = [c[-1] if a else self.pad_id for c, a in zip(contexts, active)]
            at = [len(c) - 1 for c in contexts]  # the pending token's position
            tokens, positions = _rows_to_device(
                [[pending[i], *drafts[i]] + [self.pad_id] * (rows - 1 - len(drafts[i])) for i in range(B)],
                [[min(at[i] + j, length - 1) for j in range(rows)] for i in range(B)],
                self.device,
            )
            furthest = min(max(at) + rows - 1, length - 1)  # the largest position, known here without a sync
            issued = time.perf_counter()
            logits, logprobs, route = rows_step(rows)(tokens, positions, furthest + 1)
            issue_s += time.perf_counter() - issued
            steps += 1
        self.timings = {
            "prefill_s": prefill_s,
            "prefill_issue_s": prefill_issue_s,
            "capture_s": capture_s,
            "decode_s": clock.lap(),
            "decode_steps": steps,
            "issue_s": issue_s,
            "draft_s": draft_s,
            "drafted": sum(g.drafted for g in outs),
            "accepted": sum(g.accepted for g in outs),
            "batch": B,
            "prompt_tokens": sum(lens),
            "cuda_graphs": self.cuda_graphs,
            "cpu_replay": False,  # verify steps run eager
        }
        return outs

    def _walk(
        self,
        g: Generation,
        picked: "_RowPicks",
        i: int,
        drafts: list[int],
        gen: torch.Generator,
        decoding: DecodingParams,
        watch: StopWatch | None,
    ) -> tuple[list[int], bool]:
        """Verify request i's drafts (`speculative.verify`), appending each emitted token and its record to
        `g`: (the emitted tokens, whether the request goes on)."""
        finished = False

        def draw(j: int) -> int:
            token, chosen = picked.token(i, j, gen)
            g.token_ids.append(token)
            g.token_logprobs.append(chosen)
            picked.record(g, i, j)
            return token

        def done(token: int) -> bool:
            nonlocal finished
            if token in self.eos or (watch is not None and watch.hit(g.token_ids)):
                g.finish_reason = "stop"
                finished = True
            finished = finished or len(g.token_ids) >= decoding.max_new_tokens
            return finished

        emitted, accepted = verify(draw, drafts, done)
        g.drafted = (g.drafted or 0) + len(drafts)
        g.accepted = (g.accepted or 0) + accepted
        return emitted, not finished

    def _row_picks(self, logits: Tensor, logprobs: Tensor, decoding: DecodingParams, route) -> "_RowPicks":
        """What the walk reads of a verify step's rows, on the host in one copy. Row j of every request
        ([B, V], as a decode step's logits) goes through the sampler's ops exactly as plain decoding's step
        does: the recorded top-k, and the greedy pick or the sampled distribution with the log-probability
        of each token it can draw."""
        parts = []
        for j in range(logits.shape[1]):
            lj, lpj = logits[:, j].contiguous(), logprobs[:, j].contiguous()
            top_lp, top_id = torch.topk(lpj, decoding.logprobs, dim=-1)
            if decoding.greedy:  # one candidate, drawn with certainty: no probabilities to copy
                cand = lj.argmax(dim=-1)[:, None]
                parts.append((top_id, top_lp, cand, lpj.gather(1, cand)))
            else:
                probs, cand = self._distribution(lj, decoding)
                parts.append((top_id, top_lp, cand, lpj.gather(1, cand), probs))
        stacked = [torch.stack(p, dim=1) for p in zip(*parts)]  # each [B, R, ...]
        n = len(stacked)
        host = _to_host(*stacked, *(route or ()), lists=False)()
        probs = None if decoding.greedy else host[4]
        return _RowPicks(*host[:4], probs, [t.tolist() for t in host[n:]], logits.shape[1])

    def _draft_for(self, spec: Speculative) -> DraftModel | None:
        """The draft model of `spec` (loaded once per checkpoint), where this process runs it: in real TP
        only rank 0 does, and broadcasts its drafts (`_propose`), so every rank verifies the same ones."""
        if spec.kind != "draft" or self.model.ctx.rank != 0:
            return None
        ref = spec.model
        if ref is None:
            raise DetauditError(f"--speculative {spec}: the draft model was not resolved")
        if ref.checksum not in self._drafts:
            self._drafts[ref.checksum] = DraftModel(load_draft(ref, self.model), self.pad_id, self.cuda_graphs)
        return self._drafts[ref.checksum]

    def _propose(
        self, spec: Speculative, draft: DraftModel | None, contexts: list[list[int]], wants: list[int]
    ) -> list[list[int]]:
        if spec.kind == "ngram":  # the same function of the same tokens on every rank
            return [ngram_propose(c, w) if w else [] for c, w in zip(contexts, wants)]
        group = self.model.ctx.group
        drafts = draft.propose(contexts, wants) if draft is not None else None
        if group is None:
            assert drafts is not None
            return drafts
        k = max(wants, default=0)
        if k == 0:  # (every rank computed the same wants)
            return [[] for _ in contexts]
        sent = torch.full((len(contexts), max(k, 1)), -1, dtype=torch.long, device=self.device)
        if drafts is not None:
            for i, d in enumerate(drafts):
                sent[i, : len(d)] = torch.tensor(d, dtype=torch.long)
        got = group.all_gather(sent)[0].tolist()  # rank 0's drafts
        return [[t for t in row[:w] if t >= 0] for row, w in zip(got, wants)]

    @torch.inference_mode()
    def score(
        self,
        prompts: Sequence[Sequence[int]],
        continuations: Sequence[Sequence[int]],
        forced: Sequence[Sequence[Sequence[int]]] | None = None,
    ):
        """Teacher forcing: log-probabilities of each continuation's tokens given its prompt, from one
        full-sequence forward per sequence (a fresh cache, as a training step computes it); and, for MoE
        models, the routing of each position that predicts a continuation token (else None):
        (logprobs per sequence, routing per sequence as (experts, gates, margins) lists). `forced`
        (routing replay): per sequence and predicting position, the expert ids (layer-major, L*k, as
        recorded) its MoE layers use instead of their own top k."""
        m = self.model
        B = len(prompts)
        seqs = [list(p) + list(c) for p, c in zip(prompts, continuations)]
        T = max(len(s) for s in seqs)
        ids = torch.full((B, T), self.pad_id, dtype=torch.long, device=self.device)
        for i, s in enumerate(seqs):
            ids[i, : len(s)] = torch.tensor(s, dtype=torch.long)
        pos = torch.arange(T, device=self.device).expand(B, T)
        routing = Routing(self._forced(forced, prompts, B, T) if forced is not None else None)
        h = m.hidden(ids, pos, m.new_cache(B, T), routing=routing)
        out, routes = [], []
        for i, (p, c) in enumerate(zip(prompts, continuations)):
            rows = torch.arange(len(p) - 1, len(p) - 1 + len(c), device=self.device)  # predict c[0..]
            route = routing.rows(i * T + rows)
            routes.append(None if route is None else tuple(t.tolist() for t in route))
            if not c:
                out.append([])
                continue
            lp = m.ctx.backend.log_softmax(m.logits(h[i, rows]))
            out.append(lp.gather(1, torch.tensor(c, device=self.device)[:, None])[:, 0].tolist())
        return out, (routes if m.routes else None)

    def _forced(self, forced, prompts, batch: int, length: int) -> Tensor:
        """[L, B*T, k] expert ids, -1 where a row routes itself: each sequence's replayed positions are
        the ones that predict its continuation tokens."""
        spec = self.model.cfg.moe
        layers = sum(spec.layers) if spec is not None else 0
        if not layers:
            raise DetauditError("routing replay needs a mixture-of-experts model")
        out = torch.full((layers, batch * length, spec.top_k), -1, dtype=torch.long)
        for i, (p, routes) in enumerate(zip(prompts, forced)):
            for j, experts in enumerate(routes):
                ids = torch.tensor(experts, dtype=torch.long)
                if ids.numel() != layers * spec.top_k or ids.min() < 0 or ids.max() >= spec.num_experts:
                    raise DetauditError(
                        f"replayed routing of sequence {i}, position {j}: not {layers} x {spec.top_k} expert ids"
                    )
                out[:, i * length + len(p) - 1 + j] = ids.view(layers, spec.top_k)
        return out.to(self.device)


def _rows_to_device(tokens: list[list[int]], positions: list[list[int]], device: torch.device) -> tuple[Tensor, Tensor]:
    """A verify step's inputs on the device: one host tensor and, on GPU, one asynchronous copy from
    pinned memory, ordered before the step on the stream, so the host does not wait for the device here
    (`torch.tensor(..., device=)` copies blocking: the host would wait for the stream once per tensor)."""
    host = torch.tensor([tokens, positions], dtype=torch.long)
    if device.type == "cuda":
        host = host.pin_memory().to(device, non_blocking=True)
    return host[0], host[1]


def _draw(probs: Tensor, gen: torch.Generator) -> Tensor:
    """One draw from a row of the sampled distribution with its request's generator: the one call both
    plain and speculative decoding make per generated token."""
    return torch.multinomial(probs, 1, generator=gen)


class _RowPicks:
    """A verify step's rows on the host (`Generator._row_picks`): per request i and row j the recorded
    top-k, and the candidates a draw picks among with their probabilities and log-probabilities."""

    def __init__(self, top_id, top_lp, cand, cand_lp, probs, route, rows: int) -> None:
        self.top_id, self.top_lp, self.cand, self.cand_lp, self.probs = top_id, top_lp, cand, cand_lp, probs
        self.route, self.rows = route, rows

    def token(self, i: int, j: int, gen: torch.Generator) -> tuple[int, float]:
        """The token drawn at request i's row j, and its log-probability (greedy, `probs` None: the one
        candidate, the argmax)."""
        pick = 0 if self.probs is None else int(_draw(self.probs[i, j], gen))
        return int(self.cand[i, j, pick]), float(self.cand_lp[i, j, pick])

    def record(self, g: Generation, i: int, j: int) -> None:
        g.topk_ids.append(self.top_id[i, j].tolist())
        g.topk_logprobs.append(self.top_lp[i, j].tolist())
        if self.route:
            row = i * self.rows + j
            g.route_experts.append(self.route[0][row])
            g.route_gates.append(self.route[1][row])
            g.route_margins.append(self.route[2][row])


def load_draft(ref: ModelRef, target: Decoder) -> Decoder:
    """A draft checkpoint as a TP-1 decoder beside `target`: its backend, dtype and device."""
    ctx = TPContext(target.ctx.backend, 1, 0, False, None, target.ctx.dtype)
    return Decoder(ref, ctx, target.device)
