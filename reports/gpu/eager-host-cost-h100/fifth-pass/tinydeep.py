"""A Qwen3 checkpoint with qwen3-8b-shaped's depth (36 layers), head layout and vocabulary, but tiny
matrices (hidden 512): its decode step costs the GPU little, so eager decode shows the host's cost."""

import shutil
import sys
from pathlib import Path

import torch
from transformers import Qwen3Config, Qwen3ForCausalLM

out = Path(sys.argv[1])
src = Path(sys.argv[2])
torch.manual_seed(0)
cfg = Qwen3Config(
    vocab_size=151936,
    hidden_size=512,
    intermediate_size=1536,
    num_hidden_layers=36,
    num_attention_heads=4,
    num_key_value_heads=2,
    head_dim=128,
    max_position_embeddings=40960,
    tie_word_embeddings=False,
    dtype="bfloat16",
)
m = Qwen3ForCausalLM(cfg).to(torch.bfloat16)
m.save_pretrained(out)
for f in ("tokenizer.json", "tokenizer_config.json"):
    shutil.copy(src / f, out / f)
print("wrote", out)
