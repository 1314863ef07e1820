"""Flags users type from other tools (lm-eval, vLLM): an unknown option that is one of them gets a pointer
to detaudit's own flag in its one-line error, instead of click's bare "No such option"."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class Foreign:
    tool: str
    flags: tuple[str, ...]  # detaudit's flags that do its job (those of the command are named)
    note: str = ""  # said whether or not the command has one of `flags`


_DECODING = ("--temperature", "--top-p", "--top-k", "--greedy", "--max-new-tokens")
_FOREIGN = {
    ("--tasks",): Foreign("lm-eval", ("--suites", "--suite"), "built-in suite names or lm-eval task YAML paths"),
    ("--gen_kwargs", "--gen-kwargs"): Foreign(
        "lm-eval", _DECODING, "or the task file's generation_kwargs; the flags win over the file"
    ),
    ("--num_fewshot", "--num-fewshot"): Foreign(
        "lm-eval", (), "detaudit runs zero-shot prompts only; a task file's num_fewshot above 0 is refused"
    ),
    ("--model_args", "--model-args"): Foreign("lm-eval", ("--model",), "a named model, a directory or a hub id"),
    ("--batch_size",): Foreign("lm-eval", ("--batch-sizes", "--batch-size")),
    ("--output_path",): Foreign("lm-eval", ("--output-path",)),
    ("--apply_chat_template",): Foreign("lm-eval", ("--apply-chat-template",)),
    ("--max_gen_toks", "--max-gen-toks"): Foreign("lm-eval", ("--max-new-tokens",)),
    ("--tensor-parallel-size", "--tensor_parallel_size"): Foreign("vLLM", ("--tp", "--rollout", "--trainer")),
    ("--max-tokens", "--max_tokens"): Foreign("vLLM", ("--max-new-tokens",)),
}
FOREIGN: dict[str, Foreign] = {name: f for names, f in _FOREIGN.items() for name in names}


def foreign_flag(option: str, known: set[str], command: str) -> str | None:
    """The pointer for `option`, given the option names `command` knows; None for an option of no other
    tool (click's own message stands)."""
    name = option.split("=", 1)[0]
    hint = FOREIGN.get(name)
    if hint is None:
        return None
    own = [f for f in hint.flags if f in known]
    if own:
        where = f"detaudit's is {' / '.join(own)}"
    elif hint.flags:
        where = f"`{command}` has no equivalent (`detaudit sweep` takes {' / '.join(hint.flags[:1])})"
    else:
        where = "detaudit has no equivalent"
    return f"No such option: {name}: that is {hint.tool}'s flag; {where}" + (f" ({hint.note})" if hint.note else "")
