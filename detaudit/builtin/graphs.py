"""Decode steps for the generator: eager, replayed from a CUDA graph, or on CPU replayed from a recording.

A decode step maps each request's next token and position to its fp32 logits and log-probabilities.
The graphed step captures that forward once per batch (static input buffers, the batch's own KV cache)
and replays it every step, so a step costs one graph launch instead of a few thousand kernel launches
from Python. It attends over the whole cache every step: slots past a query's position are masked,
which for `bio` / `bio+tbik` is an exact no-op (their attention skips nothing it would have added), so
graphed and eager decode give the same bits; for `bf16` the library attention sees a longer masked
sequence, as a graphed engine's does. Sampling stays outside the graph (per-request CPU generators).
On CPU the invariant backends' step is recorded instead (`replayed_step`, `kernels/cpu_replay.py`): its
compiled calls and the PyTorch ops between them, made again without the layers' Python (the backend's
`capture`: its kernels' recorder).
"""

from __future__ import annotations

from typing import Callable

import torch
from torch import Tensor

from detaudit.builtin.model import Decoder
from detaudit.builtin.moe import Routing

# (tokens [B], positions [B], kv_len) -> (logits, logprobs, routing of the B tokens or None: see
# moe.Routing.rows); kv_len: the caller's host-side furthest position + 1 (the CPU eager step attends that
# many slots; GPU steps attend the whole cache)
DecodeStep = Callable[[Tensor, Tensor, int], tuple]
# speculative verification: (tokens [B, R], positions [B, R], kv_len) -> (logits [B, R, V], logprobs, routing
# of the B*R rows, row-major, or None); each request's R rows are its pending token and its drafts
RowsStep = Callable[[Tensor, Tensor, int], tuple]


def eager_step(model: Decoder, cache: list[tuple[Tensor, Tensor]]) -> DecodeStep:
    whole = cache[0][0].shape[2] if model.device.type == "cuda" else None

    def step(tokens: Tensor, positions: Tensor, kv_len: int) -> tuple:
        routing = Routing()
        h = model.hidden(tokens[:, None], positions[:, None], cache, whole or kv_len, routing=routing)
        logits = model.logits(h)[:, 0]
        return logits, model.ctx.backend.log_softmax(logits), routing.rows(torch.arange(len(tokens), device=h.device))

    return step


def graphed_step(model: Decoder, cache: list[tuple[Tensor, Tensor]], batch: int, pad_id: int) -> DecodeStep:
    """Capture one decode step of `batch` requests over `cache` (every slot attended, masked past each
    query's position) into a CUDA graph. Warm-up and capture write a pad token's K/V into the last cache
    slot, which no earlier position can see and a real token overwrites before it is read."""
    device = model.device
    length = cache[0][0].shape[2]
    tokens = torch.full((batch,), pad_id, dtype=torch.long, device=device)
    positions = torch.full((batch,), length - 1, dtype=torch.long, device=device)

    def forward() -> tuple:
        routing = Routing()
        h = model.hidden(tokens[:, None], positions[:, None], cache, kv_len=length, routing=routing)
        logits = model.logits(h)[:, 0]
        return logits, model.ctx.backend.log_softmax(logits), routing.rows(torch.arange(batch, device=device))

    side = torch.cuda.Stream(device)
    side.wait_stream(torch.cuda.current_stream(device))
    with torch.cuda.stream(side):
        for _ in range(2):  # warm-up: lazy init, Triton compilation, cached constants
            forward()
    torch.cuda.current_stream(device).wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    # Under real TP the step's all-reduce (NCCL) is captured too, in the same order on every rank (each
    # rank captures the same forward). The process group's watchdog thread may query events of work
    # from before the capture: only this thread's CUDA calls are checked against the capture.
    mode = "global" if model.ctx.group is None else "thread_local"
    if mode != "global":
        torch.cuda.synchronize(device)
    with torch.cuda.graph(graph, capture_error_mode=mode):
        out = forward()

    def step(new_tokens: Tensor, new_positions: Tensor, kv_len: int) -> tuple:
        tokens.copy_(new_tokens)
        positions.copy_(new_positions)
        graph.replay()
        return out

    step.graph = graph  # keep the graph (and its memory pool) alive with the step
    return step


def replayed_step(model: Decoder, cache: list[tuple[Tensor, Tensor]], batch: int, pad_id: int) -> DecodeStep:
    """A CPU decode step of `batch` requests over the whole `cache`, recorded once (`cpu_replay.capture`,
    after a warm-up step that packs the weights and loads the kernels) and replayed every step: the
    eager step's calls on the same memory, so its bits (the backend's `WHOLE_CACHE_EXACT`: attending the
    whole cache adds nothing past a row's position). As `graphed_step`, warm-up and capture write a pad
    token's K/V into the last cache slot, which no real position reaches. Raises
    `cpu_replay.ReplayUnsupported` where the step cannot be recorded (`Backend.capture`)."""
    length = cache[0][0].shape[2]
    tokens = torch.full((batch,), pad_id, dtype=torch.long)
    positions = torch.full((batch,), length - 1, dtype=torch.long)
    eager = eager_step(model, cache)

    def forward() -> tuple:
        return eager(tokens, positions, length)

    forward()
    replay = model.ctx.backend.capture(forward)

    def step(new_tokens: Tensor, new_positions: Tensor, kv_len: int) -> tuple:
        tokens.copy_(new_tokens)
        positions.copy_(new_positions)
        return replay.run()

    step.replay = replay  # (its recording keeps every buffer the calls address alive)
    return step


def eager_rows_step(model: Decoder, cache: list[tuple[Tensor, Tensor]]) -> RowsStep:
    """A verify step of R query rows per request, eager. Under bio / bio+tbik every op is row-local and
    attention reads the KV chunks a row's position fixes, so each row gets the bits of the one-token
    decode step at that position (the cache is written before attention, as in decode)."""
    whole = cache[0][0].shape[2] if model.device.type == "cuda" else None

    def step(tokens: Tensor, positions: Tensor, kv_len: int) -> tuple:
        routing = Routing()
        h = model.hidden(tokens, positions, cache, whole or kv_len, routing=routing)
        logits = model.logits(h)
        rows = torch.arange(tokens.numel(), device=h.device)
        return logits, rows_log_softmax(model, logits), routing.rows(rows)

    return step


def rows_log_softmax(model: Decoder, logits: Tensor) -> Tensor:
    """log_softmax of logits [B, R, V], one [B, V] slice per row index: the shape a decode step's
    log_softmax has, so every backend sees what plain decoding gives it."""
    return torch.stack([model.ctx.backend.log_softmax(logits[:, j].contiguous()) for j in range(logits.shape[1])], 1)


def graphed_rows_step(
    model: Decoder, cache: list[tuple[Tensor, Tensor]], batch: int, rows: int, pad_id: int
) -> RowsStep:
    """`eager_rows_step` of `batch` x `rows` queries captured into a CUDA graph over the whole `cache`
    (as `graphed_step`: warm-up and capture write pad K/V into the last cache slot, which no real
    position reaches)."""
    device = model.device
    length = cache[0][0].shape[2]
    tokens = torch.full((batch, rows), pad_id, dtype=torch.long, device=device)
    positions = torch.full((batch, rows), length - 1, dtype=torch.long, device=device)
    eager = eager_rows_step(model, cache)

    def forward() -> tuple:
        return eager(tokens, positions, length)

    side = torch.cuda.Stream(device)
    side.wait_stream(torch.cuda.current_stream(device))
    with torch.cuda.stream(side):
        for _ in range(2):
            forward()
    torch.cuda.current_stream(device).wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    mode = "global" if model.ctx.group is None else "thread_local"  # (see graphed_step)
    if mode != "global":
        torch.cuda.synchronize(device)
    with torch.cuda.graph(graph, capture_error_mode=mode):
        out = forward()

    def step(new_tokens: Tensor, new_positions: Tensor, kv_len: int) -> tuple:
        tokens.copy_(new_tokens)
        positions.copy_(new_positions)
        graph.replay()
        return out

    step.graph = graph
    return step
