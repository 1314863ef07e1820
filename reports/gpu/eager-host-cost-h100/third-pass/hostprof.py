"""cProfile of eager decode (qwen3-8b-shaped, batch 8, 24 greedy tokens): where the host time goes."""

import cProfile
import io
import pstats
import sys

import torch

from detaudit.bench.e2e import random_prompts
from detaudit.config import DecodingParams
from detaudit.engine.local import LocalEngine
from detaudit.models import resolve_model

path = resolve_model("qwen3-8b-shaped", auto_prepare=True).path
prompts = random_prompts(8, 128, 151936, seed=1)
pids = [str(i) for i in range(8)]
for backend in sys.argv[1:]:
    eng = LocalEngine(path, backend, 1, device="cuda", cuda_graphs=False)
    eng.generate(prompts, pids, DecodingParams(greedy=True, max_new_tokens=4), 8)
    pr = cProfile.Profile()
    pr.enable()
    eng.generate(prompts, pids, DecodingParams(greedy=True, max_new_tokens=24), 8)
    pr.disable()
    t = eng.last_timings
    print(f"== {backend}: decode {t['decode_s'] / max(t['decode_steps'], 1) * 1e3:.1f} ms/step under cProfile")
    s = io.StringIO()
    pstats.Stats(pr, stream=s).sort_stats("tottime").print_stats(18)
    print("\n".join(l for l in s.getvalue().splitlines()[6:30] if l.strip()))
    del eng
    torch.cuda.empty_cache()
