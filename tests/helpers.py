"""Helpers shared by the test modules (importable as `helpers`: pytest puts tests/ on sys.path)."""

from __future__ import annotations

import json
import shutil
from pathlib import Path


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


def engine_options(
    model,
    backend: str,
    tp: int = 1,
    tp_mode: str = "real",
    *,
    engine: str = "builtin",
    eos_ids=(),
    max_batch_size: int = 0,
    **settings,
):
    """`EngineOptions` for a test: `model` a ModelRef (a fixture's) or a checkpoint directory; `settings`
    the `EngineSettings` fields (dtype, device, cuda_graphs, hang_timeout)."""
    from detaudit.config import EngineOptions, EngineSettings, ModelRef
    from detaudit.models import resolve_model

    ref = model if isinstance(model, ModelRef) else resolve_model(str(model))
    return EngineOptions(
        EngineSettings(name=engine, **settings), ref, backend, tp, tp_mode, tuple(eos_ids), max_batch_size
    )


def local_engine(model, backend: str, tp: int = 1, *, emulated: bool = False, **kw):
    """The built-in engine in this process (TP 1, or emulated TP)."""
    from detaudit.builtin.local import LocalEngine

    return LocalEngine(engine_options(model, backend, tp, "emulated" if emulated else "real", **kw))


def builtin_engine(model, backend: str, tp: int = 1, tp_mode: str = "real", **kw):
    """The built-in engine as the sweep opens it (worker processes for real TP > 1)."""
    from detaudit.builtin import start

    return start(engine_options(model, backend, tp, tp_mode, **kw))


TOKENIZER_FILES = (
    "tokenizer.json",
    "tokenizer_config.json",
    "special_tokens_map.json",
    "chat_template.jinja",
    "generation_config.json",
)


def with_embedded_tokenizer(dest: Path) -> Path:
    """Copy the embedded model's tokenizer (vocab 49152, a chat template) into a checkpoint directory, so
    the CLI can tokenize suites for a tiny random checkpoint of that vocabulary."""
    from detaudit.models import resolve_model

    tok = resolve_model("smollm2-135m", auto_prepare=True).path
    for f in TOKENIZER_FILES:
        if (tok / f).exists():
            shutil.copy(tok / f, dest / f)
    return dest


def build_cli_once(app):
    """A context in which `CliRunner.invoke(app, ...)` reuses one click command: typer rebuilds it on every
    invoke (about 0.1 s, most of the time of a refused case), where the real CLI builds it once per process."""
    import contextlib

    import pytest
    import typer.main
    import typer.testing

    @contextlib.contextmanager
    def ctx():
        cmd = typer.main.get_command(app)
        with pytest.MonkeyPatch.context() as mp:
            mp.setattr(typer.testing, "_get_command", lambda a: cmd if a is app else typer.main.get_command(a))
            yield

    return ctx()
