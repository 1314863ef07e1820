"""Static-batch generation with a KV cache, per-request seeded sampling and top-k log-probabilities.

Batch invariance by construction: every request keeps its own positions (0..len-1, right padding),
its own cache row and its own random generator seeded by (seed, prompt id), so nothing a request
computes depends on the other requests in its batch except through the backend's kernels.
"""

from __future__ import annotations

import gc
import time
from typing import Callable, Sequence

import torch
from torch import Tensor

from detaudit.builtin.graphs import DecodeStep, eager_step, graphed_step
from detaudit.builtin.model import Decoder
from detaudit.builtin.moe import Routing
from detaudit.config import DecodingParams, request_seed
from detaudit.errors import DetauditError
from detaudit.generation import StopWatch
from detaudit.records import Generation, ProgressFn


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


def _to_host(*tensors: Tensor):
    """Start copying `tensors` (a step's picks) to the host and return a function that waits for those
    copies alone (not for work queued after them) and gives them as lists. On GPU: one pinned buffer and
    an asynchronous copy each, then an event; on CPU the values are there already."""
    if not tensors[0].is_cuda:
        return lambda: [t.tolist() for t in tensors]
    host = [torch.empty(t.shape, dtype=t.dtype, pin_memory=True).copy_(t, non_blocking=True) for t in tensors]
    done = torch.cuda.Event()
    done.record()

    def wait() -> list:
        done.synchronize()
        return [t.tolist() for t in host]

    return wait


class Generator:
    def __init__(
        self,
        model: Decoder,
        eos_ids: Sequence[int],
        pad_id: int = 0,
        cuda_graphs: bool = False,
        decode: Callable[[list[int]], str] | None = None,
    ) -> None:
        self.model = model
        self.eos = set(int(e) for e in eos_ids)
        self.decode = decode  # token ids -> text, special tokens kept: stop strings (`DecodingParams.stop`)
        self.pad_id = pad_id
        self.device = model.device
        self.cuda_graphs = cuda_graphs and model.device.type == "cuda"
        self.timings: dict[str, float] = {}  # of the last generate call: prefill_s, capture_s, decode_s, ...
        self._graphs: dict[int, tuple[list[tuple[Tensor, Tensor]], DecodeStep]] = {}  # batch -> (cache, graphed step)

    def _decode_setup(self, batch: int, needed: int) -> tuple[list[tuple[Tensor, Tensor]], DecodeStep | None]:
        """A KV cache of at least `needed` slots and, with CUDA graphs, the graphed step over it. A batch
        size's cache and graph are reused while they are long enough (slots another batch left behind sit
        past every query's position: masked), and replaced by a longer pair (`_slots`) when not. Eager
        decode on GPU attends the whole cache too, so its cache is rounded the same way: a sweep's calls
        then share a few key lengths, and the library attention (bf16: cuDNN, which builds an execution
        plan per new key length, about as long as a whole decode step's launches) plans once per length.
        bio's attention walks only the chunks a row can see: the extra slots change no bit."""
        if not self.cuda_graphs:
            return self.model.new_cache(batch, self._slots(needed) if self.device.type == "cuda" else needed), None
        hit = self._graphs.get(batch)
        if hit is None or hit[0][0][0].shape[2] < needed:
            self._graphs.pop(batch, None)
            cache = self.model.new_cache(batch, self._slots(needed))
            hit = self._graphs[batch] = (cache, graphed_step(self.model, cache, batch, self.pad_id))
        return hit

    def _slots(self, needed: int) -> int:
        """`needed` rounded up to a multiple of 256, but not past the positions the model allows."""
        limit = self.model.cfg.rope.max_positions
        rounded = -(-needed // 256) * 256
        return rounded if limit is None else max(needed, min(rounded, limit))

    # ---- sampling (per row, invariant)
    def _choose(self, logits: Tensor, decoding: DecodingParams, gens: list[torch.Generator]) -> Tensor:
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
        host = probs.cpu()  # one copy (one device sync) for every row, not one per row
        picks = torch.stack([torch.multinomial(host[row], 1, generator=gens[row]) for row in range(host.shape[0])])
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
    ) -> list[Generation]:
        m = self.model
        B = len(prompts)
        lens = torch.tensor([len(p) for p in prompts], device=self.device)
        T = int(lens.max())
        ids = torch.full((B, T), self.pad_id, dtype=torch.long, device=self.device)
        for i, p in enumerate(prompts):
            ids[i, : len(p)] = torch.tensor(p, dtype=torch.long)
        pos = torch.arange(T, device=self.device).expand(B, T)
        gens = [torch.Generator().manual_seed(request_seed(decoding.seed, pid)) for pid in prompt_ids]
        clock = _Clock(self.device)
        cache, step_fn = self._decode_setup(B, T + decoding.max_new_tokens)
        step_fn = step_fn or eager_step(m, cache)
        if self.device.type == "cuda":
            settle_gc()
        capture_s = clock.lap()
        routing = Routing()
        h = m.hidden(ids, pos, cache, kv_len=T, routing=routing)
        last_rows = torch.arange(B, device=self.device) * T + lens - 1
        h_last = h.view(B * T, -1)[last_rows][:, None]  # [B, 1, H]
        logits = m.logits(h_last)[:, 0]  # [B, V] fp32
        logprobs = m.ctx.backend.log_softmax(logits)
        route = routing.rows(last_rows)  # the routing of the forward that gave these logits
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
            "capture_s": capture_s,
            "decode_s": clock.lap(),
            "decode_steps": steps,
            "issue_s": issue_s,
            "batch": B,
            "prompt_tokens": int(lens.sum()),
            "cuda_graphs": self.cuda_graphs,
        }
        return outs

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
