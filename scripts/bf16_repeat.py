"""Dev tool (GPU): is bf16 (cuBLAS + SDPA) run-to-run deterministic in the built-in engine?

Builds a random Llama checkpoint with transformers (no download), then generates the same batch twice
with fresh engines, eager and CUDA-graphed, and reports how many prompts' tokens / log-probabilities
differ between the two runs; also repeats single F.linear and SDPA calls. Usage:
python3 scripts/bf16_repeat.py
"""

from __future__ import annotations

import tempfile

import torch
from transformers import LlamaConfig, LlamaForCausalLM

from detaudit.bench.e2e import random_prompts
from detaudit.config import DecodingParams
from detaudit.engine.local import LocalEngine


def main() -> None:
    d = tempfile.mkdtemp()
    torch.manual_seed(0)
    # the embedded model's shapes (SmolLM2-135M padded to 24/8 heads), random weights
    cfg = LlamaConfig(vocab_size=49152, hidden_size=576, intermediate_size=1536, num_hidden_layers=30,
                      num_attention_heads=24, num_key_value_heads=8, head_dim=64, tie_word_embeddings=True,
                      max_position_embeddings=4096)
    LlamaForCausalLM(cfg).to(torch.bfloat16).save_pretrained(d)
    prompts = [p[: 60 + 7 * i] for i, p in enumerate(random_prompts(16, 200, 49152, seed=3))]
    ids = [str(i) for i in range(16)]
    dec = DecodingParams(greedy=True, max_new_tokens=64)
    for backend in ("bf16", "bio"):
        for graphs in (False, True):
            runs = []
            for _ in range(3):
                eng = LocalEngine(d, backend, 1, device="cuda", cuda_graphs=graphs)
                runs.append([(g.token_ids, g.token_logprobs) for g in eng.generate(prompts, ids, dec, 8)])
            diff = [sum(a != b for a, b in zip(runs[0], r)) for r in runs[1:]]
            first = [sum(a[1][0] != b[1][0] for a, b in zip(runs[0], r)) for r in runs[1:]]
            print(f"{backend} graphs={graphs}: prompts (of 16) differing from run 1: {diff}; at the first token: {first}")
    g = torch.Generator(device="cuda").manual_seed(0)
    x = torch.randn(8, 4096, device="cuda", generator=g).bfloat16()
    w = torch.randn(4096, 4096, device="cuda", generator=g).bfloat16()
    ref = torch.nn.functional.linear(x, w)
    print("F.linear repeats equal:", all(torch.equal(torch.nn.functional.linear(x, w), ref) for _ in range(50)))
    q = torch.randn(8, 16, 1, 64, device="cuda", generator=g).bfloat16()
    k = torch.randn(8, 16, 700, 64, device="cuda", generator=g).bfloat16()
    mask = torch.ones(8, 1, 1, 700, dtype=torch.bool, device="cuda")
    ref = torch.nn.functional.scaled_dot_product_attention(q, k, k, attn_mask=mask)
    print("SDPA repeats equal:", all(torch.equal(torch.nn.functional.scaled_dot_product_attention(q, k, k, attn_mask=mask), ref)
                                     for _ in range(50)))


if __name__ == "__main__":
    main()
