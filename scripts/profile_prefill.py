"""Dev tool (GPU): where a backend's prefill time goes (torch.profiler, CUDA time per kernel).

Usage: python3 scripts/profile_prefill.py MODEL BACKEND BATCH [PROMPT_TOKENS]
"""

from __future__ import annotations

import sys

import torch

from detaudit.bench.e2e import random_prompts
from detaudit.engine import open_engine
from detaudit.engine.model import ModelConfig
from detaudit.models import resolve_model
from detaudit.config import DecodingParams


def main() -> None:
    model, backend, batch = sys.argv[1], sys.argv[2], int(sys.argv[3])
    tokens = int(sys.argv[4]) if len(sys.argv) > 4 else 512
    path = resolve_model(model, auto_prepare=True).path
    eng = open_engine(path, backend, 1, "real", device="cuda", eos_ids=(), cuda_graphs=True)
    prompts = random_prompts(batch, tokens, ModelConfig.from_dir(path).vocab_size)
    ids = [str(i) for i in range(batch)]
    one = DecodingParams(greedy=True, max_new_tokens=1)
    eng.generate(prompts, ids, one, batch)
    eng.generate(prompts, ids, one, batch)
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
        eng.generate(prompts, ids, one, batch)
        torch.cuda.synchronize()
    print(f"{model} {backend} batch {batch} x {tokens} tokens: prefill {eng.last_timings['prefill_s'] * 1e3:.1f} ms")
    print(prof.key_averages().table(sort_by="cuda_time_total", row_limit=15, max_name_column_width=70))
    eng.close()


if __name__ == "__main__":
    main()
