"""Suite templates are untrusted input (task files are downloaded and shared like data): they render
in Jinja2's immutable sandbox, and a template that reaches for Python internals fails with one line and
exit 2 through `suites show` and `sweep`, before it can do anything."""

from __future__ import annotations

from pathlib import Path

import pytest
from helpers import sweep_args
from typer.testing import CliRunner

from detaudit.cli import app

# each payload would create MARKER (or read /etc/passwd into the prompt) outside the sandbox
PAYLOADS = {
    "cycler-popen": "{{ cycler.__init__.__globals__.os.popen('touch MARKER').read() }}",
    "lipsum-open-write": "{{ lipsum.__globals__['__builtins__']['open']('MARKER', 'w').write('pwned') }}",
    "self-open-read": "{{ self.__init__.__globals__.__builtins__.open('/etc/passwd').read() }}",
    "subclasses": "{{ ''.__class__.__mro__[1].__subclasses__() }}",
    "joiner-import": "{{ joiner.__init__.__globals__.__builtins__.__import__('os').system('touch MARKER') }}",
    "format-leak": "{{ '{0.__class__.__mro__[1].__subclasses__}'.format(q) }}",
    "mutate-row": "{% set _ = docs_list.append(1) %}{{ q }}",  # the immutable sandbox: no mutation of the row
}


def _suite(tmp_path: Path, key: str, payload: str) -> Path:
    marker = tmp_path / "marker"
    fields = {"doc_to_text": '"{{q}}"', "doc_to_target": '"{{a}}"', "doc_to_id": '"{{id}}"'}
    fields[key] = repr(payload.replace("MARKER", str(marker)))  # single-quoted YAML-compatible literal
    body = "task: evil\n" + "".join(f"{k}: {v}\n" for k, v in fields.items())
    body += "docs:\n  - {id: one, q: 'What is 2+2?', a: '4', docs_list: [1]}\n"
    path = tmp_path / "evil.yaml"
    path.write_text(body)
    return path


def _one_line_exit_2(result, marker: Path) -> str:
    assert result.exit_code == 2, result.output
    assert result.exception is None or isinstance(result.exception, SystemExit), repr(result.exception)
    lines = [line for line in result.output.splitlines() if line.strip()]
    assert len(lines) == 1 and lines[0].startswith("error:"), result.output
    assert "Traceback" not in result.output and "root:" not in result.output and "<class" not in result.output
    assert not marker.exists(), "the payload ran"
    return lines[0]


@pytest.mark.parametrize("name", sorted(PAYLOADS))
def test_payload_in_doc_to_text_fails_in_suites_show(tmp_path, name):
    path = _suite(tmp_path, "doc_to_text", PAYLOADS[name])
    line = _one_line_exit_2(CliRunner().invoke(app, ["suites", "show", str(path)]), tmp_path / "marker")
    assert "evil" in line and "doc_to_text" in line


@pytest.mark.parametrize("key", ["doc_to_text", "doc_to_target", "doc_to_id"])
@pytest.mark.parametrize("name", ["cycler-popen", "self-open-read"])
def test_payload_fails_in_sweep_before_any_model_work(tmp_path, name, key):
    path = _suite(tmp_path, key, PAYLOADS[name])
    out = tmp_path / "run"
    grid = sweep_args(suites=path, limit=1, max_new_tokens=2, backends="bio", tp=1, batch_sizes=1, output_path=out)
    result = CliRunner().invoke(app, ["sweep", *grid])
    line = _one_line_exit_2(result, tmp_path / "marker")
    assert key in line and "sandbox" in line
    assert not out.exists() or not any(out.iterdir())  # nothing was written for the run


def test_payload_in_an_included_file(tmp_path):
    marker = tmp_path / "marker"
    (tmp_path / "base.yaml").write_text(
        "doc_to_text: " + repr(PAYLOADS["cycler-popen"].replace("MARKER", str(marker))) + "\n"
    )
    (tmp_path / "task.yaml").write_text("include: base.yaml\ntask: inc\ndocs: [{q: x}]\n")
    _one_line_exit_2(CliRunner().invoke(app, ["suites", "show", str(tmp_path / "task.yaml")]), marker)


def test_ordinary_templates_still_render(tmp_path):
    # what lm-eval task files do: filters, string methods, conditionals, loops over a row's list
    (tmp_path / "ok.yaml").write_text(
        "task: ok\n"
        'doc_to_text: "{{ question | trim }} Options: '
        '{% for c in choices %}{{ loop.index }}. {{ c | upper }} {% endfor %}"\n'
        "doc_to_target: \"{{ answer.split('####')[-1].strip() if answer is defined else target }}\"\n"
        "docs: [{question: ' Pick one. ', choices: [a, b], answer: 'work #### 7'}]\n"
    )
    result = CliRunner().invoke(app, ["suites", "show", str(tmp_path / "ok.yaml"), "--json"])
    assert result.exit_code == 0, result.output
    assert '"text": "Pick one. Options: 1. A 2. B "' in result.output and '"answer": "7"' in result.output
