"""What every workflow (sweep, align, bench) prepares before an engine runs: the model, its tokenizer
and end-of-sequence ids, the suites and their prompts as chat-templated token ids."""

from __future__ import annotations

import hashlib
from dataclasses import dataclass, field
from pathlib import Path
from typing import Sequence

from detaudit.config import ModelRef
from detaudit.errors import DetauditError
from detaudit.models import eos_ids, tokenizer_for  # noqa: F401  (re-exported: what every workflow prepares)


@dataclass
class PromptSet:
    suite: str
    ids: list[str]
    token_ids: list[list[int]]
    hashes: list[str]
    answers: list[str | None]
    checksum: str
    source: str
    texts: list[str] = field(default_factory=list)  # the user messages, before the chat template
    ungraded: tuple[str, ...] = ()
    ignored_keys: tuple[str, ...] = ()

    def digest(self) -> str:
        return hashlib.sha256("".join(self.hashes).encode()).hexdigest()[:16]


def load_suites(names: Sequence[str], data_dir: Path | None, limit: int | None) -> list:
    """Suites by name or YAML path; cells are named by the task, which must be unique."""
    from detaudit.suites import load_suite

    suites = [load_suite(name, data_dir=data_dir, limit=limit) for name in names]
    seen: dict[str, str] = {}
    for s, name in zip(suites, names):
        if s.name in seen:
            raise DetauditError(f"--suites: {seen[s.name]!r} and {name!r} are both task {s.name!r}")
        seen[s.name] = name
    return suites


def tokenize(suite, tokenizer) -> PromptSet:
    from detaudit.suites import prompt_hash, prompt_token_ids

    toks = [prompt_token_ids(tokenizer, p) for p in suite.prompts]
    return PromptSet(
        suite=suite.name,
        ids=[p.id for p in suite.prompts],
        token_ids=toks,
        hashes=[prompt_hash(t) for t in toks],
        answers=[p.answer for p in suite.prompts],
        checksum=suite.checksum,
        source=suite.source,
        texts=[p.text for p in suite.prompts],
        ungraded=tuple(getattr(suite, "ungraded", ()) or ()),
        ignored_keys=tuple(getattr(suite, "ignored_keys", ()) or ()),
    )


def check_model(
    model: ModelRef,
    tps: Sequence[int],
    own_architecture: bool,
    prompts: Sequence[PromptSet] = (),
    max_new_tokens: int = 0,
    context_cap: int | None = None,
) -> None:
    """Before any engine starts: every prompt plus `max_new_tokens` fits the model's context (refused
    per row, never truncated); the built-in engine runs only the architectures it implements (refused by
    name otherwise), TP sizes that divide the heads, and sequence lengths it computes as transformers
    does. Other engines (vLLM, servers) decide architecture support themselves."""
    from detaudit.prompt_limits import check_prompt_lengths, model_context_len

    if prompts:
        context = model_context_len(model, cap=context_cap)
        for ps in prompts:
            check_prompt_lengths(ps.suite, ps.ids, ps.token_ids, max_new_tokens, context)
    if not own_architecture:
        return
    from detaudit.builtin.arch import ModelConfig

    mcfg = ModelConfig.of(model)
    for tp in tps:
        mcfg.check_tp(tp)
    if prompts:
        mcfg.check_length(max(len(t) for ps in prompts for t in ps.token_ids) + max_new_tokens)
