"""Helpers shared by the test modules (importable as `helpers`: pytest puts tests/ on sys.path)."""

from __future__ import annotations

import json


def cli_json(result):
    """The JSON a `--json` command printed: stdout only (typer's CliRunner keeps stderr apart)."""
    assert result.exit_code == 0, result.output
    return json.loads(result.stdout)


def one_line_error(result, message: str, code: int = 2) -> None:
    """Bad input: exit `code`, the message, one line (two with a warning), no traceback."""
    assert result.exit_code == code, result.output
    assert message in result.output, result.output
    assert "Traceback" not in result.output
    assert len([line for line in result.output.splitlines() if line.strip()]) <= 2, result.output
