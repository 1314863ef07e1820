import threading

import pytest

from detaudit.inputs.grading import answers_match, extract_answer, grade, is_correct


@pytest.mark.parametrize(
    "text, expected",
    [
        ("So the product is \\boxed{56}.", "56"),
        ("\\boxed{\\frac{1}{2}}", "\\frac{1}{2}"),  # nested braces
        ("\\boxed{2^{10}}", "2^{10}"),
        ("\\boxed{\\sqrt{\\frac{a}{b}}} units", "\\sqrt{\\frac{a}{b}}"),
        ("first \\boxed{3}, then \\boxed{4}", "4"),  # the last box wins
        ("\\boxed{7} ... \\boxed{8", "7"),  # an unclosed (cut-off) box is skipped
        ("\\fbox{204} minutes", "204"),
        ("\\boxed{} and nothing else", None),
        ("The answer is 42.", "42"),
        ("Final answer: $\\frac{3}{4}$", "\\frac{3}{4}"),
        ("The answer is **1,625**", "1625"),
        ("7 times 8 is 56", "56"),  # last-number fallback
        ("x = -5", "-5"),
        ("from 2023-2024 we get 9", "9"),  # a hyphen between numbers is not a minus sign
        ("I have no idea.", None),
        ("", None),
    ],
)
def test_extract_answer(text, expected):
    assert extract_answer(text) == expected


@pytest.mark.parametrize(
    "output, reference, expected",
    [
        ("\\boxed{56}", "56", True),
        ("\\boxed{\\frac{1}{2}}", "0.5", True),
        ("\\boxed{0.5}", "\\frac{1}{2}", True),
        ("\\boxed{2^{10}}", "1024", True),
        ("\\boxed{25}", "025", True),  # AIME answers are zero-padded in the data
        ("\\boxed{27}", "27.0", True),
        ("The answer is 56.", "56", True),
        ("7 times 8 is 56", "56", True),
        ("\\boxed{57}", "56", False),
        ("\\boxed{\\frac{1}{3}}", "0.5", False),
        ("I have no idea.", "56", False),
        ("", "56", False),
        ("\\boxed{56}", "", False),
        ("\\boxed{56}", None, False),
    ],
)
def test_is_correct(output, reference, expected):
    assert is_correct(output, reference) is expected


@pytest.mark.parametrize("garbage", ["\\boxed{\\frac{", "\\boxed{}}}{{", "\\boxed{\\left(}", "$$$", "\\boxed{" * 50])
def test_is_correct_never_raises(garbage):
    assert is_correct(garbage, "1") is False
    assert answers_match(garbage, garbage) in (True, False)


def test_grade_returns_the_extracted_answer():
    assert grade("so \\boxed{\\frac{1}{2}}", "0.5") == ("\\frac{1}{2}", True)
    assert grade("no answer here", "3") == (None, False)


def test_is_correct_off_the_main_thread():
    # math-verify's signal-based timeouts only work in the main thread; grading must work anywhere
    results = []
    worker = threading.Thread(target=lambda: results.append(is_correct("\\boxed{\\frac{1}{2}}", "0.5")))
    worker.start()
    worker.join()
    assert results == [True]
