"""A suite file cannot exhaust the machine: templates render bounded in memory, time and size, a prompt
longer than the model's context could hold never reaches the tokenizer, and YAML aliases cannot expand
without end. Each is one line and exit 2 (or a DetauditError), never a traceback or a hang."""

from __future__ import annotations

import json
import resource

import pytest
from typer.testing import CliRunner

from detaudit.cli import app
from detaudit.errors import DetauditError
from detaudit.inputs import suite_render
from detaudit.inputs.suites import load_suite


def _suite(tmp_path, doc_to_text: str, extra: str = "") -> str:
    path = tmp_path / "dos.yaml"
    path.write_text(f"task: dos\ndoc_to_text: {json.dumps(doc_to_text)}\ndocs: [{{q: x}}]\n{extra}")
    return str(path)


def _one_line(tmp_path, path: str) -> str:
    result = CliRunner().invoke(app, ["suites", "show", path])
    assert result.exit_code == 2, result.output
    lines = [line for line in result.output.splitlines() if line.strip()]
    assert len(lines) == 1 and lines[0].startswith("error:") and "Traceback" not in result.output, result.output
    return lines[0]


def _peak_rss_mib() -> float:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024


def test_a_gigabyte_string_is_refused_in_a_bounded_child(tmp_path):
    before = _peak_rss_mib()
    line = _one_line(tmp_path, _suite(tmp_path, "{{ 'a' * 10**9 }}"))
    assert "needs more than 512 MiB to render" in line and "doc_to_text" in line
    assert _peak_rss_mib() - before < 256  # the 1 GB string never existed in this process


def test_doubling_in_a_namespace_is_refused(tmp_path):
    doubling = "{% set ns = namespace(s='ab') %}{% for i in range(40) %}{% set ns.s = ns.s ~ ns.s %}{% endfor %}"
    line = _one_line(tmp_path, _suite(tmp_path, doubling + "{{ ns.s }}"))
    assert "needs more than" in line


def test_a_template_that_loops_without_end_is_killed(tmp_path, monkeypatch):
    monkeypatch.setattr(suite_render, "RENDER_SECONDS", 2.0)  # (30 s by default: not worth waiting for here)
    monkeypatch.setattr(suite_render, "RENDER_SECONDS_PER_ROW", 0.0)
    loops = "{% for i in range(100000) %}{% for j in range(100000) %}{% endfor %}{% endfor %}x"
    line = _one_line(tmp_path, _suite(tmp_path, loops))
    assert "took more than 2 s" in line and "docs[0]" in line


def test_output_that_streams_past_the_cap_stops_there(tmp_path, monkeypatch):
    monkeypatch.setattr(suite_render, "MAX_FIELD_CHARS", 10_000)
    line = _one_line(
        tmp_path, _suite(tmp_path, "{% for i in range(100000) %}{% for j in range(100000) %}x{% endfor %}{% endfor %}")
    )
    assert "renders more than 10000 characters" in line


def test_a_huge_field_of_the_data_is_refused_before_any_tokenizer(tmp_path, monkeypatch):
    monkeypatch.setattr(suite_render, "MAX_FIELD_CHARS", 1_000_000)
    (tmp_path / "rows.jsonl").write_text(json.dumps({"q": "a" * 2_000_000}) + "\n")
    path = tmp_path / "big.yaml"
    path.write_text("task: big\ndataset_path: json\ndataset_kwargs: {data_files: rows.jsonl}\ntest_split: train\n"
                    "doc_to_text: \"Q: {{q}}\"\n")  # fmt: skip
    with pytest.raises(DetauditError, match="renders more than 1000000 characters"):
        load_suite(str(path))


def test_prompt_longer_than_the_context_could_hold_is_refused_before_tokenizing():
    """The bound relative to the model: `inputs.tokenize` refuses by length before the tokenizer runs."""
    from detaudit.inputs.prepare import tokenize
    from detaudit.inputs.suites import Prompt, Suite

    class Untouchable:  # stands in for a tokenizer: the point is that it is never called
        chat_template = None

        def __call__(self, *a, **k):
            raise AssertionError("the tokenizer saw the prompt")

    big = Prompt("s", 0, "p0", "a" * 1001, None)
    suite = Suite("s", None, (big,), "c", "inline")
    with pytest.raises(DetauditError, match="prompt 'p0' is 1001 characters, more than the model's context"):
        tokenize(suite, Untouchable(), chat=False, max_chars=1000)


BOMB = """metadata:
  a: &a [lol, lol, lol, lol, lol, lol, lol, lol, lol]
  b: &b [*a, *a, *a, *a, *a, *a, *a, *a, *a]
  c: &c [*b, *b, *b, *b, *b, *b, *b, *b, *b]
  d: &d [*c, *c, *c, *c, *c, *c, *c, *c, *c]
  e: &e [*d, *d, *d, *d, *d, *d, *d, *d, *d]
  f: &f [*e, *e, *e, *e, *e, *e, *e, *e, *e]
  g: &g [*f, *f, *f, *f, *f, *f, *f, *f, *f]
  h: &h [*g, *g, *g, *g, *g, *g, *g, *g, *g]
  i: &i [*h, *h, *h, *h, *h, *h, *h, *h, *h]
  description: *i
"""


def test_yaml_alias_bomb_is_refused(tmp_path):
    line = _one_line(tmp_path, _suite(tmp_path, "{{q}}", BOMB))
    assert "aliases expand to" in line and "at most 100000" in line


def test_recursive_and_deep_yaml_are_refused(tmp_path):
    assert "recursive" in _one_line(tmp_path, _suite(tmp_path, "{{q}}", "metadata: &m {x: *m}\n"))
    assert "nested too deeply" in _one_line(tmp_path, _suite(tmp_path, "{{q}}", "metadata: " + "[" * 5000 + "]" * 5000))


def test_a_few_aliases_are_fine(tmp_path):
    path = _suite(tmp_path, "{{q}}", "metadata: {a: &v [1, 2], b: *v, c: *v, description: ok}\n")
    assert load_suite(path).description == "ok"
