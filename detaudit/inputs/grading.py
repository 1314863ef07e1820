"""Answer extraction and checking.

`extract_answer` finds the model's final answer in its output, in this order:

1. the content of the last complete `\\boxed{...}` (or `\\fbox{...}`), braces balanced, so
   `\\boxed{\\frac{1}{2}}` gives `\\frac{1}{2}`; an unclosed box (output cut off) is skipped;
2. else the last "answer is X" / "answer: X" phrase, where X is a `$...$` span or a number;
3. else the last number in the text (as lm-eval's "flexible-extract" does for GSM8K).

`is_correct` compares that answer with the reference using math-verify (`parse` + `verify`), both
wrapped in `\\boxed{}` so that they parse as one LaTeX answer: `\\frac{1}{2}` matches `0.5`, `025`
matches `25`, `27.0` matches `27`. It never raises.

Threads: math-verify enforces its timeouts with `signal.alarm`, which only works in the main thread
(elsewhere it raises). In the main thread we keep its timeouts; in any other thread we pass
`parsing_timeout=None` / `timeout_seconds=None`, which turns them off (a pathological expression
could then take long, but grading never fails because of the thread it runs in).
"""

from __future__ import annotations

import logging
import re
import threading

TIMEOUT_S = 5

_BOX_RE = re.compile(r"\\(?:boxed|fbox)\s*\{")
_NUMBER = r"(?:(?<![\w)\]])-)?(?:\d{1,3}(?:,\d{3})+|\d+)(?:\.\d+)?(?:\s*/\s*\d+)?"
_NUMBER_RE = re.compile(_NUMBER)
_ANSWER_IS_RE = re.compile(
    r"answer\s*(?:is|:|=)\s*[:*\s]*(?:\$+([^$]+?)\$+|\\\((.+?)\\\)|(" + _NUMBER + r"))", re.IGNORECASE
)


def _last_boxed(text: str) -> str | None:
    for match in reversed(list(_BOX_RE.finditer(text))):
        depth, start = 1, match.end()
        for i in range(start, len(text)):
            if text[i] == "{":
                depth += 1
            elif text[i] == "}":
                depth -= 1
                if depth == 0:
                    content = text[start:i].strip()
                    if content:
                        return content
                    break  # an empty box: look at an earlier one
    return None


def extract_answer(text: str) -> str | None:
    """The final answer in a model output, or None (see the module docstring for the rules)."""
    if not text:
        return None
    boxed = _last_boxed(text)
    if boxed is not None:
        return boxed
    phrases = list(_ANSWER_IS_RE.finditer(text))
    if phrases:
        latex, paren, number = phrases[-1].groups()
        return (latex or paren).strip() if number is None else _plain(number)
    numbers = _NUMBER_RE.findall(text)
    return _plain(numbers[-1]) if numbers else None


def _plain(number: str) -> str:
    return re.sub(r"[,\s]", "", number)  # "1,625" -> "1625", "3 / 4" -> "3/4"


def _boxed(answer: str) -> str:
    answer = answer.strip().strip("$").strip()
    return answer if "\\boxed" in answer else f"\\boxed{{{answer}}}"


class _KnownTimeoutOff(logging.Filter):
    """Drop math-verify's "Timeout is disabled" warning: off-main-thread we turn it off on purpose."""

    def filter(self, record: logging.LogRecord) -> bool:
        return not str(record.msg).startswith("Timeout is disabled")


def _timeout() -> int | None:
    if threading.current_thread() is threading.main_thread():
        return TIMEOUT_S
    for name in ("math_verify.parser", "math_verify.grader"):
        logger = logging.getLogger(name)
        if not any(isinstance(f, _KnownTimeoutOff) for f in logger.filters):
            logger.addFilter(_KnownTimeoutOff())
    return None


def answers_match(predicted: str, reference: str) -> bool:
    """math-verify equivalence of two extracted answers (e.g. `\\frac{1}{2}` and `0.5`); never raises."""
    try:
        from math_verify import parse, verify
        from math_verify.errors import TimeoutException
    except Exception:  # pragma: no cover - math-verify is a dependency
        return False
    timeout = _timeout()
    try:
        gold = parse(_boxed(reference), parsing_timeout=timeout)
        pred = parse(_boxed(predicted), parsing_timeout=timeout)
        if not gold or not pred:
            return False
        return bool(verify(gold, pred, timeout_seconds=timeout))
    except (Exception, TimeoutException):  # TimeoutException is a BaseException
        return False


def is_correct(output_text: str, reference: str | None) -> bool:
    """Whether the answer extracted from `output_text` equals `reference` (math-verify); never raises."""
    return grade(output_text, reference)[1]


def grade(output_text: str, reference: str | None) -> tuple[str | None, bool]:
    """(extracted answer, correct) for a record's `predicted_answer` and `correct` columns."""
    try:
        predicted = extract_answer(output_text)
    except Exception:
        return None, False
    if predicted is None or not reference or not str(reference).strip():
        return predicted, False
    return predicted, answers_match(predicted, str(reference))
