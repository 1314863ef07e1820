"""Host time per op of eager decode (qwen3-8b-shaped, batch 8, 24 greedy tokens), measured with
perf_counter around each call (no sync: the step is host-bound, so a call's host time is its cost),
plus micro-benchmarks of the bf16 linear / SDPA / allocation calls at the engine's decode shapes."""

import sys
import time
from collections import defaultdict

import torch

from detaudit.backends.kernels import fused
from detaudit.bench.e2e import random_prompts
from detaudit.config import DecodingParams
from detaudit.engine import model as M
from detaudit.engine.local import LocalEngine
from detaudit.models import resolve_model

acc, cnt = defaultdict(float), defaultdict(int)


def wrap(owner, name, label):
    f = getattr(owner, name)

    def w(*a, **k):
        t = time.perf_counter()
        r = f(*a, **k)
        acc[label] += time.perf_counter() - t
        cnt[label] += 1
        return r

    setattr(owner, name, w)


path = resolve_model("qwen3-8b-shaped", auto_prepare=True).path
import os

PLEN = int(os.environ.get("PLEN", "128"))
prompts = random_prompts(8, PLEN, 151936, seed=1)
pids = [str(i) for i in range(8)]
for backend in sys.argv[1:]:
    eng = LocalEngine(path, backend, 1, device="cuda", cuda_graphs=False)
    eng.generate(prompts, pids, DecodingParams(greedy=True, max_new_tokens=30), 8)
    dec = eng.model
    import gc

    if os.environ.get("FREEZE"):
        gc.collect()
        gc.freeze()
    print("gc counts", gc.get_count(), "tracked", len(gc.get_objects()), "frozen", gc.get_freeze_count())
    bk = type(dec.ctx.backend)
    saved = {n: getattr(bk, n) for n in ("linear", "row_partial", "attention")}
    saved_f = {n: getattr(fused, n) for n in ("rms_norm", "rope_store_qkv", "silu_mul_halves")}
    saved_m = {"Block.__call__": M.Block.__call__, "hidden": M.Decoder.hidden, "logits": M.Decoder.logits}
    for n in saved:
        wrap(bk, n, f"backend.{n}")
    for n in saved_f:
        wrap(fused, n, f"fused.{n}")
    wrap(M.Block, "__call__", "Block (whole layer)")
    wrap(M.Decoder, "hidden", "Decoder.hidden (whole forward)")
    wrap(M.Decoder, "logits", "Decoder.logits")
    acc.clear()
    cnt.clear()
    eng.generate(prompts, pids, DecodingParams(greedy=True, max_new_tokens=30), 8)
    t = eng.last_timings
    steps = t["decode_steps"]
    print(
        f"== {backend} prompt {PLEN}: decode {t['decode_s'] / steps * 1e3:.2f} ms/step with the timers ({steps} steps + prefill)"
    )
    for k in sorted(acc, key=acc.get, reverse=True):
        print(
            f"  {k:34s} calls {cnt[k]:6d}  {acc[k] / cnt[k] * 1e6:8.1f} us/call  {acc[k] / (steps + 1) * 1e3:7.2f} ms/step"
        )
    for n, f in saved.items():
        setattr(bk, n, f)
    for n, f in saved_f.items():
        setattr(fused, n, f)
    M.Block.__call__, M.Decoder.hidden, M.Decoder.logits = (
        saved_m["Block.__call__"],
        saved_m["hidden"],
        saved_m["logits"],
    )
    import gc

    del eng, dec
    gc.collect()
    torch.cuda.empty_cache()
