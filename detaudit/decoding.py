"""A suite's decoding: lm-eval's `generation_kwargs` read into `DecodingParams`, and stop strings.

lm-eval hands a task's `generation_kwargs` to the model; detaudit honours exactly the keys below and
refuses any other by name (`num_beams`, `repetition_penalty`, ... would change what is generated):

- `until` (a string or a list of strings) -> `DecodingParams.stop`;
- `max_gen_toks` -> `max_new_tokens`;
- `do_sample: false` -> greedy; `do_sample: true` -> seeded sampling;
- `temperature`: 0 -> greedy (lm-eval's Hugging Face backend reads an unset `do_sample` with
  temperature 0 as greedy), > 0 -> sampling at that temperature;
- `top_p`, `top_k`.
`do_sample: true` with `temperature: 0` is refused (transformers refuses it too).

Precedence: a decoding flag given on the command line (`--max-new-tokens`, `--temperature`, `--greedy`,
`--top-p`, `--top-k`) wins over the suite's key, and the sweep prints each such override; a key the suite
does not set keeps the command line's value (or its default). `--temperature` and `--greedy` each
decide sampling versus greedy, so either overrides both `do_sample` and `temperature`.

What a task file leaves out decodes as lm-eval decodes it (`TaskConfig.__post_init__`, v0.4.9 and later;
`lm_eval_defaults`): a `generate_until` task without `generation_kwargs` decodes greedily (`do_sample:
false`, `temperature: 0`) with `until: [fewshot_delimiter]` (`"\n\n"` unless the file sets
`fewshot_delimiter`); `generation_kwargs` without `until` gets that same stop string. Decoding flags still
override these. `decoding_sources` says, per value, whether it came from the file, from lm-eval's defaults,
from a flag or from detaudit's defaults (the sweep prints it).

Stop strings, as lm-eval defines them: generation stops after the token whose decoded text completes a
stop string (the engine looks at the decoded text of the row's last tokens, as lm-eval's Hugging Face
backend does: `StopWatch`); the record keeps every generated token up to and including that one (as vLLM
reports them) with finish reason "stop", and its text is the decoded output cut before the first
occurrence of any stop string (lm-eval: `text.split(stop)[0]` for each stop: `cut_at_stop`).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, replace
from typing import Any, Callable, Collection, Sequence

from detaudit.config import DecodingParams
from detaudit.errors import DetauditError

HONOURED = ("until", "max_gen_toks", "do_sample", "temperature", "top_p", "top_k")
FEWSHOT_DELIMITER = "\n\n"  # lm-eval's TaskConfig default: the stop string of a task that names none
# command-line flags (DecodingParams fields) -> the generation_kwargs keys each one overrides
OVERRIDES = {
    "max_new_tokens": ("max_gen_toks",),
    "temperature": ("do_sample", "temperature"),
    "greedy": ("do_sample", "temperature"),
    "top_p": ("top_p",),
    "top_k": ("top_k",),
}


@dataclass(frozen=True)
class GenerationKwargs:
    """A task file's `generation_kwargs`, validated; None: the key is not set."""

    until: tuple[str, ...] | None = None
    max_gen_toks: int | None = None
    do_sample: bool | None = None
    temperature: float | None = None
    top_p: float | None = None
    top_k: int | None = None
    defaults: tuple[str, ...] = ()  # the keys set by lm-eval's defaults, not by the file

    def to_dict(self) -> dict[str, Any]:
        """The keys the suite decodes with (its file's and lm-eval's defaults), as the YAML spells them."""
        out = {k: getattr(self, k) for k in HONOURED if getattr(self, k) is not None}
        if "until" in out:
            out["until"] = list(out["until"])
        return out

    def from_file(self) -> dict[str, Any]:
        """The keys the task file itself sets."""
        return {k: v for k, v in self.to_dict().items() if k not in self.defaults}


def lm_eval_defaults(gen: GenerationKwargs, given: bool, delimiter: str | None = FEWSHOT_DELIMITER):
    """lm-eval's defaults for a `generate_until` task (`TaskConfig.__post_init__`): no `generation_kwargs`
    (`given` False) -> greedy (`do_sample: false`, `temperature: 0`) with `until: [fewshot_delimiter]`;
    `generation_kwargs` without `until` -> that `until`. A null delimiter stops nowhere."""
    until = (delimiter,) if delimiter else ()
    if not given:
        greedy = dict(do_sample=False, temperature=0.0)
        return replace(gen, until=until, **greedy, defaults=("until", "do_sample", "temperature"))
    if gen.until is None:
        return replace(gen, until=until, defaults=("until",))
    return gen


def _number(value: object) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)


def parse_generation_kwargs(value: object, where: str) -> GenerationKwargs:
    """`generation_kwargs` of a task file; DetauditError (one line) naming any key detaudit cannot
    honour or any value of the wrong kind."""
    if value is None:
        return GenerationKwargs()
    if not isinstance(value, dict):
        raise DetauditError(f"{where}: `generation_kwargs` must be a mapping (got {type(value).__name__})")
    unknown = [str(k) for k in value if k not in HONOURED]
    if unknown:
        raise DetauditError(
            f"{where}: `generation_kwargs` key(s) {', '.join(unknown)} cannot be honoured "
            f"(detaudit honours {', '.join(HONOURED)})"
        )

    def bad(key: str, want: str) -> DetauditError:
        return DetauditError(f"{where}: `generation_kwargs.{key}` must be {want} (got {value[key]!r:.60})")

    until = value.get("until")
    if until is not None:
        until = [until] if isinstance(until, str) else until
        if not isinstance(until, list) or not all(isinstance(s, str) and s for s in until):
            raise bad("until", "a non-empty string or a list of non-empty strings")
        until = tuple(dict.fromkeys(until))
    toks = value.get("max_gen_toks")
    if toks is not None and (not isinstance(toks, int) or isinstance(toks, bool) or toks < 1):
        raise bad("max_gen_toks", "an integer >= 1")
    sample = value.get("do_sample")
    if sample is not None and not isinstance(sample, bool):
        raise bad("do_sample", "true or false")
    temp = value.get("temperature")
    if temp is not None and (not _number(temp) or temp < 0):
        raise bad("temperature", "a number >= 0")
    top_p = value.get("top_p")
    if top_p is not None and (not _number(top_p) or not 0 < top_p <= 1):
        raise bad("top_p", "a number in (0, 1]")
    top_k = value.get("top_k")
    if top_k is not None and (not isinstance(top_k, int) or isinstance(top_k, bool) or top_k < 0):
        raise bad("top_k", "an integer >= 0")
    if sample is True and temp == 0:
        raise DetauditError(
            f"{where}: `generation_kwargs` asks for `do_sample: true` with `temperature: 0` (sampling needs a "
            "temperature > 0; use `do_sample: false` for greedy decoding)"
        )
    return GenerationKwargs(
        until=until,
        max_gen_toks=toks,
        do_sample=sample,
        temperature=float(temp) if temp is not None else None,
        top_p=float(top_p) if top_p is not None else None,
        top_k=top_k,
    )


def suite_decoding(
    base: DecodingParams, gen: GenerationKwargs, flags: Collection[str] = ()
) -> tuple[DecodingParams, list[str]]:
    """The decoding one suite runs with: `base` (the command line's, defaults included) with the suite's
    `generation_kwargs` applied, except where a flag in `flags` (DecodingParams fields given on the
    command line) overrides it. Returns (decoding, one note per overridden key)."""
    given = gen.to_dict()
    overridden: dict[str, str] = {}
    for flag in flags:
        for key in OVERRIDES.get(flag, ()):
            if key in given and key not in overridden:
                overridden[key] = flag
    changes: dict[str, Any] = {}
    if gen.until is not None:
        changes["stop"] = gen.until
    if gen.max_gen_toks is not None and "max_gen_toks" not in overridden:
        changes["max_new_tokens"] = gen.max_gen_toks
    if (gen.do_sample is not None or gen.temperature is not None) and "temperature" not in overridden:
        if "do_sample" not in overridden:
            if gen.temperature is not None:
                changes["temperature"] = gen.temperature
            changes["greedy"] = gen.do_sample is False or (gen.do_sample is None and gen.temperature == 0)
    if gen.top_p is not None and "top_p" not in overridden:
        changes["top_p"] = gen.top_p
    if gen.top_k is not None and "top_k" not in overridden:
        changes["top_k"] = gen.top_k
    notes = [
        f"{key}: {given[key]}{_LM_EVAL if key in gen.defaults else ''} -> {_flag(base, flag)}"
        for key, flag in overridden.items()
    ]
    return replace(base, **changes), notes


_LM_EVAL = " (lm-eval's default)"
FROM_FILE, FROM_LM_EVAL, FROM_FLAGS, FROM_DETAUDIT = "the file", "lm-eval's defaults", "flags", "detaudit's defaults"


def _flag(base: DecodingParams, flag: str) -> str:
    return f"--{flag.replace('_', '-')}" + ("" if flag == "greedy" else f" {getattr(base, flag)}")


def _spelled(key: str, value: Any) -> str:
    """`do_sample false`, `until ['\\n\\n']`, `temperature 0.0`: a key and its value as the YAML means it."""
    if isinstance(value, bool):
        return f"{key} {str(value).lower()}"
    return f"{key} {value!r}" if key == "until" else f"{key} {value}"


def decoding_sources(base: DecodingParams, gen: GenerationKwargs, flags: Collection[str] = ()) -> dict[str, list[str]]:
    """Where each value the suite decodes with comes from: {FROM_FILE / FROM_LM_EVAL / FROM_FLAGS /
    FROM_DETAUDIT: ["do_sample false", "--max-new-tokens 16", ...]}, in that order, empty sources left out.
    Sampling knobs (top-p, top-k) are listed only where the suite samples."""
    decoding, _ = suite_decoding(base, gen, flags)
    out: dict[str, list[str]] = {FROM_FILE: [], FROM_LM_EVAL: [], FROM_FLAGS: [], FROM_DETAUDIT: []}
    given = set(flags)

    def from_suite(*keys: str) -> bool:
        found = [k for k in keys if getattr(gen, k) is not None]
        for k in found:
            out[FROM_LM_EVAL if k in gen.defaults else FROM_FILE].append(_spelled(k, gen.to_dict()[k]))
        return bool(found)

    if given & {"temperature", "greedy"}:
        out[FROM_FLAGS] += [_flag(base, f) for f in ("greedy", "temperature") if f in given]
    elif not from_suite("do_sample", "temperature"):
        out[FROM_DETAUDIT].append("greedy" if base.greedy else f"temperature {base.temperature:g}")
    if not decoding.greedy:
        for flag in ("top_p", "top_k"):
            if flag in given:
                out[FROM_FLAGS].append(_flag(base, flag))
            elif not from_suite(flag):
                out[FROM_DETAUDIT].append(f"{flag.replace('_', '-')} {getattr(base, flag):g}")
    if "max_new_tokens" in given:
        out[FROM_FLAGS].append(_flag(base, "max_new_tokens"))
    elif not from_suite("max_gen_toks"):
        out[FROM_DETAUDIT].append(f"--max-new-tokens {base.max_new_tokens} (lm-eval's is 256)")
    from_suite("until")
    return {k: v for k, v in out.items() if v}


def describe(decoding: DecodingParams) -> str:
    """One line for the console: how a suite decodes."""
    how = "greedy" if decoding.greedy else f"T={decoding.temperature:g} top-p {decoding.top_p:g} top-k {decoding.top_k}"
    stops = f", stop {list(decoding.stop)}" if decoding.stop else ""
    return f"{how}, max {decoding.max_new_tokens} new tokens{stops}"


def cut_at_stop(text: str, stops: Sequence[str]) -> str:
    """The text before the first occurrence of any stop string (lm-eval's post-processing)."""
    cut = min((i for i in (text.find(s) for s in stops) if i >= 0), default=-1)
    return text if cut < 0 else text[:cut]


class StopWatch:
    """Engine side: whether a row's generated tokens have completed a stop string. `decode` turns token
    ids into text with special tokens kept (lm-eval's look-back decodes them, so `<|im_end|>` matches).
    Only the last tokens are decoded (the longest stop string's UTF-8 length + 2: every token of a byte-
    level vocabulary decodes to at least one byte, so the window holds any stop string the last token can
    have completed), so a step costs the same however long the output already is."""

    def __init__(self, stops: Sequence[str], decode: Callable[[list[int]], str]) -> None:
        if not stops:
            raise ValueError("StopWatch needs at least one stop string")
        self.stops = tuple(stops)
        self.decode = decode
        self.lookback = max(len(s.encode("utf-8")) for s in self.stops) + 2

    def hit(self, token_ids: Sequence[int]) -> bool:
        tail = self.decode(list(token_ids[-self.lookback :]))
        return any(s in tail for s in self.stops)
