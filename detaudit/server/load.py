"""Background load: N concurrent requests of other prompts, one after another per slot, for the whole
time the audited requests run. Their answers are not recorded; they only change which batches the
audited requests land in, and what the server's cache holds when they arrive.

The patterns (`--background-prompts`), after SGLang's determinism test (`test_deterministic.py`:
single / mixed / prefix):

- `suite`: the cell's own prompts, each slot starting on another prompt than the audited request.
- `random`: random token prompts of the suite's lengths (fixed seed).
- `mixed`: short and long prompts in flight together: the suite's prompts alternate with one long
  prompt (`LONG_TOKENS` tokens: the suite's prompts concatenated), so prefill chunks of a long prompt
  share steps with short decodes.
- `prefix`: one long text per audited prompt (the prompt followed by the others) cut at several prefix
  lengths, a quarter, half and three quarters of the prompt and two lengths past it, sent in a seeded
  random order: the audited prompt shares a prefix with requests the server has just seen, so prefix
  caching and chunked prefill come into play.
"""

from __future__ import annotations

import asyncio
import random
from dataclasses import dataclass, field
from typing import Awaitable, Callable, Sequence

from detaudit.errors import DetauditError

LONG_TOKENS = 1024  # the long prompts of `mixed` and `prefix`; with the generated tokens it fits a 2k context


@dataclass
class LoadStats:
    sent: int = 0  # background requests sent (in flight while the audited ones ran, finished or not)
    requests: int = 0  # background requests answered before the audited ones were done
    failed: int = 0
    errors: list[str] = field(default_factory=list)


def random_prompts(n: int, lengths: Sequence[int], vocab_size: int, seed: int = 0) -> list[list[int]]:
    """Token prompts of the suite's lengths, ids drawn from [100, vocab) with a fixed seed."""
    rng = random.Random(seed)
    hi = max(101, vocab_size)
    return [[rng.randrange(100, hi) for _ in range(max(1, lengths[i % len(lengths)]))] for i in range(n)]


def long_prompt(prompts: Sequence[Sequence[int]], start: int = 0, tokens: int = LONG_TOKENS) -> list[int]:
    """The prompts concatenated from `start` on (cyclically), `tokens` long."""
    out: list[int] = []
    if tokens <= 0:
        return out
    nonempty = [list(p) for p in prompts if len(p)]
    if not nonempty:
        return [0] * tokens
    i = start
    while len(out) < tokens:
        out += nonempty[i % len(nonempty)]
        i += 1
    return out[:tokens]


def prefix_cuts(prompt: Sequence[int], long: Sequence[int]) -> list[list[int]]:
    """`prompt + long` cut at 1/4, 1/2, 3/4 of the prompt and at two lengths past it (distinct, >= 1)."""
    text = list(prompt) + list(long)
    n = len(prompt)
    lengths = [n // 4, n // 2, 3 * n // 4, n + (len(text) - n) // 2, len(text)]
    return [text[:m] for m in dict.fromkeys(max(1, m) for m in lengths)]


def background_pool(
    pattern: str, prompts: Sequence[Sequence[int]], vocab_size: int, n: int, seed: int = 0
) -> list[list[int]]:
    """The token prompts background slots send (slot i sends items i, i + n, i + 2n, ...)."""
    prompts = [list(map(int, p)) for p in prompts]
    if pattern == "random":
        return random_prompts(max(8, n), [len(p) for p in prompts], vocab_size, seed)
    if pattern == "mixed":
        long = long_prompt(prompts)
        return [x for p in prompts for x in (p, long)]
    if pattern == "prefix":
        pool = [
            cut
            for i, p in enumerate(prompts)
            for cut in prefix_cuts(p, long_prompt(prompts, i + 1, LONG_TOKENS - len(p)))
        ]
        random.Random(seed).shuffle(pool)
        return pool
    if pattern == "suite":
        return prompts[1:] + prompts[:1]  # slot i starts on another prompt than audited request i
    raise DetauditError(f"--background-prompts {pattern}: unknown load pattern")


async def run_background(
    n: int, pool: Sequence, send: Callable[[object, int], Awaitable[None]], stop: asyncio.Event, stats: LoadStats
) -> None:
    """N slots each send pool items (slot-staggered) until `stop` is set."""

    async def slot(i: int) -> None:
        j = i
        while not stop.is_set():
            try:
                stats.sent += 1
                await send(pool[j % len(pool)], j)
                stats.requests += 1
            except asyncio.CancelledError:
                raise
            except DetauditError as e:
                stats.failed += 1
                if len(stats.errors) < 3:
                    stats.errors.append(str(e))
                await asyncio.sleep(0.2)
            j += n

    if n > 0 and pool:
        tasks = [asyncio.create_task(slot(i)) for i in range(n)]
        try:
            await stop.wait()
        finally:
            for t in tasks:
                t.cancel()
            await asyncio.gather(*tasks, return_exceptions=True)
