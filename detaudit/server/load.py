"""Background load: N concurrent requests of other prompts, one after another per slot, for the whole
time the audited requests run (SGLang's "mixed" mode). Their answers are not recorded; they only
change which batches the audited requests land in."""

from __future__ import annotations

import asyncio
import random
from dataclasses import dataclass, field
from typing import Awaitable, Callable, Sequence

from detaudit.errors import DetauditError


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
