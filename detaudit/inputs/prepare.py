"""What every workflow (sweep, align, bench) prepares before an engine runs: the model, its tokenizer
and end-of-sequence ids, the suites and their prompts as token ids (chat-templated or plain text)."""

from __future__ import annotations

import hashlib
from dataclasses import dataclass, field
from pathlib import Path
from typing import Sequence

from detaudit.config import DecodingParams, ModelRef, Speculative
from detaudit.errors import DetauditError
from detaudit.models import eos_ids, tokenizer_for  # noqa: F401  (re-exported: what every workflow prepares)

# A prompt of more characters than this many per position of the model's context cannot fit it (tokens
# of real vocabularies hold a few characters; the longest, whitespace runs, a few dozen): it is refused
# before the tokenizer sees it (a 100 MB string aborts a fast tokenizer's process).
MAX_CHARS_PER_TOKEN = 64


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
    chat_template: bool = True  # the prompts went through the model's chat template (else plain text)
    decoding: DecodingParams | None = None  # the suite's own decoding (generation_kwargs applied)

    def digest(self) -> str:
        return hashlib.sha256("".join(self.hashes).encode()).hexdigest()[:16]


def load_suites(names: Sequence[str], data_dir: Path | None, limit: int | None, trust_paths: bool = False) -> list:
    """Suites by name or YAML path; cells are named by the task, which must be unique."""
    from detaudit.inputs.suites import load_suite

    suites = [load_suite(name, data_dir=data_dir, limit=limit, trust_paths=trust_paths) for name in names]
    seen: dict[str, str] = {}
    for s, name in zip(suites, names):
        if s.name in seen:
            raise DetauditError(f"--suites: {seen[s.name]!r} and {name!r} are both task {s.name!r}")
        seen[s.name] = name
    return suites


def chat_form(suite, tokenizer, apply_chat_template: bool | None) -> bool:
    """Whether the suite's prompts go through the chat template: the command line's choice, else the
    suite's (`apply_chat_template:` in its YAML; lm-eval task files default to plain text). A tokenizer
    without a chat template gets plain text, unless the command line asked for the template."""
    from detaudit.inputs.suites import has_chat_template

    chat = suite.apply_chat_template if apply_chat_template is None else apply_chat_template
    if chat and not has_chat_template(tokenizer):
        if apply_chat_template:
            raise DetauditError(
                "--apply-chat-template: the model's tokenizer has no chat template (use --no-apply-chat-template)"
            )
        return False
    return chat


def tokenize(
    suite,
    tokenizer,
    chat: bool | None = None,
    max_chars: int | None = None,
    decoding: DecodingParams | None = None,
) -> PromptSet:
    """The suite's prompts as token ids: through the chat template when `chat` (None: the suite's own
    default, plain text without a template). A prompt longer than `max_chars` is refused by name before
    the tokenizer sees it."""
    from detaudit.inputs.suites import prompt_hash, prompt_token_ids

    chat = chat_form(suite, tokenizer, None) if chat is None else chat
    if max_chars is not None:
        for p in suite.prompts:
            if len(p.text) > max_chars:
                raise DetauditError(
                    f"suite {suite.name}: prompt {p.id!r} is {len(p.text)} characters, more than the model's context "
                    f"could hold ({max_chars} = {MAX_CHARS_PER_TOKEN} per position); refused before tokenizing"
                )
    toks = [prompt_token_ids(tokenizer, p, chat) for p in suite.prompts]
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
        chat_template=chat,
        decoding=decoding,
    )


def resolve_speculative(
    settings: Sequence[Speculative], model: ModelRef, tokenizer, own_architecture: bool, console=None
) -> dict[str, Speculative]:
    """label -> setting, each draft model resolved (a named one prepared on demand) and checked: the
    built-in engine runs its architecture (at TP 1: drafts run replicated), its vocabulary is the
    target's (same vocab_size, and the same token -> id map: a draft token must mean what the target
    verifies), refused in one line otherwise."""
    from dataclasses import replace

    from detaudit.models import resolve_model

    out: dict[str, Speculative] = {}
    target_vocab = None
    for s in settings:
        if s.kind == "draft":
            draft = resolve_model(s.draft, auto_prepare=True, console=console)
            check_model(draft, (1,), own_architecture)
            where = f"--speculative {s}: draft model {draft.name}"
            mine, theirs = draft.config.get("vocab_size"), model.config.get("vocab_size")
            if mine != theirs:
                raise DetauditError(f"{where} has vocab_size {mine}, the target {model.name} {theirs}")
            target_vocab = tokenizer.get_vocab() if target_vocab is None else target_vocab
            if tokenizer_for(draft.path).get_vocab() != target_vocab:
                raise DetauditError(f"{where} has another tokenizer than the target {model.name} (token ids differ)")
            s = replace(s, model=draft)
        out[s.label] = s
    return out


def check_model(
    model: ModelRef,
    tps: Sequence[int],
    own_architecture: bool,
    prompts: Sequence[PromptSet] = (),
    max_new_tokens: int = 0,
    context_cap: int | None = None,
) -> None:
    """Before any engine starts: the built-in engine runs only the architectures it implements (refused
    by name first: nothing else about an unsupported checkpoint is worth reporting), TP sizes that divide
    the heads, and sequence lengths it computes as transformers does; every prompt plus its suite's
    `max_new_tokens` (the PromptSet's decoding, else `max_new_tokens`) fits the model's context (refused
    per row, never truncated) and, for the built-in engine, holds only token ids within its vocabulary.
    Other engines (vLLM, servers) decide architecture support themselves."""
    from detaudit.inputs.prompt_limits import check_prompt_lengths, check_prompt_vocab, model_context_len

    mcfg = None
    if own_architecture:
        from detaudit.builtin.arch import ModelConfig

        mcfg = ModelConfig.of(model)
        for tp in tps:
            mcfg.check_tp(tp)
    if not prompts:
        return
    context = model_context_len(model, cap=context_cap)
    new = {ps.suite: ps.decoding.max_new_tokens if ps.decoding is not None else max_new_tokens for ps in prompts}
    for ps in prompts:
        check_prompt_lengths(ps.suite, ps.ids, ps.token_ids, new[ps.suite], context)
        if mcfg is not None:  # the built-in engine's embedding has vocab_size rows (vLLM checks its own ids)
            check_prompt_vocab(ps.suite, ps.ids, ps.token_ids, mcfg.vocab_size, model.path)
    if mcfg is not None:
        mcfg.check_length(max(len(t) + new[ps.suite] for ps in prompts for t in ps.token_ids))
