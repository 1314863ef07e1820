"""Prompts that do not fit the model's context, or hold token ids past its vocabulary, are refused before
any model work.

A prompt of P tokens generating up to N new tokens needs P + N positions; past the model's context
(`max_position_embeddings`, or vLLM's `max_model_len` when that is smaller) the positions are
extrapolated (or vLLM rejects the request mid-sweep) after minutes of work. detaudit does not truncate
(a truncated prompt is a different prompt, and the audit would compare outputs of inputs nobody asked
for): the sweep stops with one line naming the suite, the row and the lengths, and exits 2.
"""

from __future__ import annotations

from typing import Sequence

from detaudit.config import ModelRef
from detaudit.errors import DetauditError


def model_context_len(model: ModelRef, cap: int | None = None) -> int:
    """The number of positions the checkpoint supports (`max_position_embeddings` of its config, or of
    its `text_config`; GPT-2-style configs call it `n_positions`), capped at `cap` (vLLM's `max_model_len`)
    when given."""
    n = None
    for cfg in (model.config, model.config.get("text_config")):
        if isinstance(cfg, dict) and n is None:
            n = cfg.get("max_position_embeddings", cfg.get("n_positions"))
    if isinstance(n, bool) or not isinstance(n, int) or n < 1:
        raise DetauditError(
            f"{model.path}/config.json: max_position_embeddings must be a positive integer (got {str(n)[:40]!r})"
        )
    return min(n, cap) if cap else n


def check_prompt_lengths(
    suite_name: str,
    prompt_ids: Sequence[str],
    token_id_lists: Sequence[Sequence[int]],
    max_new_tokens: int,
    context_len: int,
) -> None:
    """Raise DetauditError (one line, exit 2) when a prompt is empty or when its tokens plus
    `max_new_tokens` exceed `context_len`, naming the suite, the first such row and the lengths (and
    how many more rows fail)."""
    if len(prompt_ids) != len(token_id_lists):
        raise ValueError(f"{len(prompt_ids)} prompt ids for {len(token_id_lists)} token lists")
    if context_len < 1:
        raise DetauditError(f"the model's context length must be >= 1 (got {context_len})")
    if max_new_tokens >= context_len:
        raise DetauditError(
            f"--max-new-tokens {max_new_tokens} leaves no room for a prompt in the model's "
            f"context of {context_len} tokens"
        )
    empty = [pid for pid, toks in zip(prompt_ids, token_id_lists) if len(toks) == 0]
    if empty:
        more = f" (and {len(empty) - 1} more)" if len(empty) > 1 else ""
        raise DetauditError(f"suite {suite_name}: prompt {empty[0]!r} is empty after tokenization{more}")
    over = [
        (pid, len(toks)) for pid, toks in zip(prompt_ids, token_id_lists) if len(toks) + max_new_tokens > context_len
    ]
    if over:
        pid, n = over[0]
        more = f" (and {len(over) - 1} more prompts of this suite)" if len(over) > 1 else ""
        raise DetauditError(
            f"suite {suite_name}: prompt {pid!r} is {n} tokens + --max-new-tokens {max_new_tokens} = "
            f"{n + max_new_tokens} > the model's context of {context_len} tokens{more}; "
            f"lower --max-new-tokens or remove the row (detaudit does not truncate prompts)"
        )


def check_prompt_vocab(
    suite_name: str, prompt_ids: Sequence[str], token_id_lists: Sequence[Sequence[int]], vocab_size: int, path: object
) -> None:
    """Raise DetauditError (one line, exit 2) naming the suite, the first row and the id when a prompt holds
    a token id outside [0, vocab_size)."""
    bad = [(pid, t) for pid, toks in zip(prompt_ids, token_id_lists) for t in toks if not 0 <= t < vocab_size]
    if bad:
        pid, t = bad[0]
        raise DetauditError(
            f"suite {suite_name}: prompt {pid!r} has token id {t}, outside the model's vocab_size of {vocab_size}: "
            f"the tokenizer does not match the checkpoint at {path}"
        )
