"""bf16 eager decode at the e2e bench's shapes (qwen3-8b-shaped, batch 8, 512 prompt tokens, cache 768):
per-step time, then torch.profiler's top CUDA kernels and CPU ops over 8 decode steps."""

from torch.profiler import ProfilerActivity, profile

from detaudit.bench.e2e import random_prompts
from detaudit.config import DecodingParams
from detaudit.engine.local import LocalEngine
from detaudit.models import resolve_model

path = resolve_model("qwen3-8b-shaped", auto_prepare=True).path
eng = LocalEngine(path, "bf16", 1, device="cuda", cuda_graphs=False, eos_ids=())
for bs, plen in ((8, 512), (8, 128), (32, 512)):
    prompts = random_prompts(bs, plen, 151936)
    ids = [str(i) for i in range(bs)]
    eng.generate(prompts, ids, DecodingParams(greedy=True, max_new_tokens=4), bs)
    eng.generate(prompts, ids, DecodingParams(greedy=True, max_new_tokens=32), bs)
    t = eng.last_timings
    print(f"bs {bs} prompt {plen}: {t['decode_s'] / t['decode_steps'] * 1e3:.2f} ms/step", flush=True)
prompts = random_prompts(8, 512, 151936)
ids = [str(i) for i in range(8)]
with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
    eng.generate(prompts, ids, DecodingParams(greedy=True, max_new_tokens=9), 8)
print(prof.key_averages().table(sort_by="cuda_time_total", row_limit=14, max_name_column_width=60))
print(prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=12, max_name_column_width=60))
