"""Engine outputs of the code on PYTHONPATH, saved (save) or compared bitwise with the saved ones (compare):
qwen3-8b-shaped, eager decode, 4 prompts x 8 greedy tokens, logits-derived token logprobs and top-k."""

import json
import sys

import torch

sys.path.insert(0, ".carry")
from prof import q3dir

from detaudit.bench.e2e import random_prompts
from detaudit.config import DecodingParams
from detaudit.engine.local import LocalEngine

mode, path = sys.argv[1], sys.argv[2]
prompts = random_prompts(4, 200, 151936)
prompts[1] = prompts[1][:150]
prompts[3] = prompts[3][:77]
out = {}
for b in ("bio", "bio+tbik", "bf16"):
    for graphs in (False, True):
        eng = LocalEngine(q3dir(), b, 1, device="cuda", cuda_graphs=graphs)
        gens = eng.generate(prompts, [str(i) for i in range(4)], DecodingParams(greedy=True, max_new_tokens=8), 4)
        out[f"{b} graphs={graphs}"] = [(g.token_ids, g.token_logprobs, g.topk_logprobs) for g in gens]
        del eng
        import gc

        gc.collect()
        torch.cuda.empty_cache()
if mode == "save":
    json.dump(out, open(path, "w"))
else:
    old = json.load(open(path))
    new = json.loads(json.dumps(out))
    for k in new:
        print("old == new (bitwise):", k, old[k] == new[k])
    for b in ("bio", "bio+tbik", "bf16"):
        print("new eager == new graphed:", b, new[f"{b} graphs=False"] == new[f"{b} graphs=True"])
    from detaudit.backends import bio

    print("fused RMSNorm kept (bitwise equal to op-by-op at first use):", bio._FUSED_OK)
