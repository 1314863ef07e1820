"""A suite's rows rendered into prompts, answers and ids, bounded in time, memory and size.

Templates come from task files, which are untrusted. The sandbox (`suite_yaml.jinja_env`) keeps them away
from Python internals, not from work: `{{ 'a' * 10**9 }}` is a 1 GB string, two nested `range(100000)`
loops never end. So:

- a field that is a column, a constant, or a template of only text and `{{ name }}` substitutions renders
  in this process: its work and its size are those of the row;
- any other template renders in a child process (a forkserver child: small and single-threaded) that may
  allocate at most RENDER_MEMORY bytes plus three times the size of its rows beyond what it holds at its
  start (RLIMIT_AS: room for the rendered prompts and their way back, never for a string made from
  nothing), and runs at most RENDER_SECONDS + RENDER_SECONDS_PER_ROW x rows of wall time before it is
  killed; either limit is one line naming the suite (and the row);
- every rendered field is at most MAX_FIELD_CHARS characters, checked as the output streams (a loop that
  prints without end stops there).
The model's context bounds a prompt further before it reaches the tokenizer (`inputs.tokenize`).
"""

from __future__ import annotations

import itertools
import pickle
from dataclasses import dataclass, replace
from typing import Iterable

from detaudit.errors import DetauditError
from detaudit.inputs.suite_yaml import Field, NullField, jinja_env, one_line
from detaudit.inputs.user_files import unicode_error

MAX_FIELD_CHARS = 4_000_000
RENDER_MEMORY = 512 << 20
RENDER_SECONDS = 30.0
RENDER_SECONDS_PER_ROW = 0.01


@dataclass(frozen=True)
class RenderJob:
    """Plain data (it travels to the child): the suite's name, its three fields and its rows."""

    suite: str
    text: Field
    target: Field | None
    id: Field | None
    rows: list[tuple[str, dict]]  # (label for messages, row)
    max_chars: int = MAX_FIELD_CHARS  # the bound on every rendered field (set by the parent)
    memory: int = RENDER_MEMORY  # bytes the child may allocate beyond what it holds at its start


@dataclass(frozen=True)
class Rendered:
    id: str
    text: str
    answer: str | None  # None: ungraded


class _Missing(Exception):
    """The row lacks a field that the template or column names."""


class _Fields:
    """The job's templates, compiled once per process."""

    def __init__(self, job: RenderJob) -> None:
        self.job = job
        env = jinja_env()
        self.templates = {
            f.key: env.from_string(f.source) for f in (job.text, job.target, job.id) if f is not None and f.is_template
        }

    def render(self, f: Field, row: dict, label: str) -> str:
        """One field of one row, as lm-eval resolves it: a constant, `row[column]`, or the template rendered
        in the sandbox. Raises _Missing / NullField for an absent / null field."""
        import jinja2
        from jinja2.exceptions import SecurityError

        if f.constant is not None:
            return f.constant
        if f.column is not None:
            if f.column not in row:
                raise _Missing(f"{f.column!r} is not a column of the row")
            return self._bounded(f, label, [self._scalar(f, row[f.column], label)])
        try:
            return self._bounded(f, label, self.templates[f.key].generate(row))
        except SecurityError as e:
            raise DetauditError(
                f"suite {self.job.suite}: {label}: `{f.key}` is refused by the template sandbox ({one_line(e)[:200]})"
            ) from None
        except jinja2.UndefinedError as e:
            raise _Missing(one_line(e.message)) from None
        except (NullField, DetauditError):
            raise
        except MemoryError:
            raise DetauditError(
                f"suite {self.job.suite}: {label}: `{f.key}` needs more than {self.job.memory >> 20} MiB to render"
            ) from None
        except RecursionError:
            raise DetauditError(f"suite {self.job.suite}: {label}: `{f.key}` recurses too deeply") from None
        except Exception as e:
            raise DetauditError(
                f"suite {self.job.suite}: {label}: `{f.key}` failed: {type(e).__name__}: {one_line(e)[:200]}"
            ) from None

    def _bounded(self, f: Field, label: str, chunks: Iterable[str]) -> str:
        out, n = [], 0
        for chunk in chunks:
            n += len(chunk)
            if n > self.job.max_chars:
                raise DetauditError(
                    f"suite {self.job.suite}: {label}: `{f.key}` renders more than {self.job.max_chars} characters"
                )
            out.append(chunk)
        text = "".join(out)
        bad = unicode_error(text)  # a `\ud800` escape in a row or a template: no tokenizer or file takes it
        if bad:
            raise DetauditError(f"suite {self.job.suite}: {label}: `{f.key}` renders {bad}")
        return text

    def _scalar(self, f: Field, value: object, label: str) -> str:
        if value is None:
            raise NullField()
        if isinstance(value, (list, dict, tuple)):
            raise DetauditError(
                f"suite {self.job.suite}: {label}: `{f.key}: {f.source}` is a {type(value).__name__}, not text "
                "(detaudit builds one prompt and grades against one reference answer per row)"
            )
        return str(value)

    def text(self, f: Field, row: dict, label: str, what: str) -> str:
        try:
            text = self.render(f, row, label)
        except _Missing as e:
            fields = ", ".join(map(str, row)) or "none"
            kind = "names a column" if f.column is not None else "uses a field"
            raise DetauditError(
                f"suite {self.job.suite}: {label}: `{f.key}: {one_line(f.source)[:60]}` {kind} the row lacks ({e}; "
                f"the row has: {fields})"
            ) from None
        except NullField:
            raise DetauditError(
                f"suite {self.job.suite}: {label}: `{f.key}` uses a field that is null in this row"
            ) from None
        if not text.strip():
            raise DetauditError(f"suite {self.job.suite}: {label}: `{f.key}` renders {what}")
        return text


def render(job: RenderJob, progress=None) -> tuple[list[Rendered], list[str]]:
    """Every row of the job: (prompts, ids of the rows kept ungraded). `progress(i)` is told each row's
    index before it renders."""
    fields = _Fields(job)
    out: list[Rendered] = []
    seen: dict[str, str] = {}
    ungraded, absent = [], []
    for index, (label, row) in enumerate(job.rows):
        if progress is not None:
            progress(index)
        text = fields.text(job.text, row, label, "an empty prompt")
        pid = str(index)
        if job.id is not None:
            pid = fields.text(job.id, row, label, "an empty id").strip()
        if pid in seen:
            raise DetauditError(f"suite {job.suite}: {label}: id {pid!r} repeats the id of {seen[pid]}")
        seen[pid] = label
        answer = None
        if job.target is not None:
            try:
                answer = fields.render(job.target, row, label).strip() or None
            except _Missing as e:
                absent.append((label, str(e), ", ".join(map(str, row)) or "none"))
            except NullField:
                pass
            if answer is None:
                ungraded.append(pid)
        out.append(Rendered(pid, text, answer))
    if out and job.target is not None and len(absent) == len(out):
        label, why, names = absent[0]
        raise DetauditError(
            f"suite {job.suite}: `doc_to_target: {one_line(job.target.source)[:60]}` names a field no row has "
            f"({label}: {why}; the row has: {names}); drop `doc_to_target` for an ungraded suite"
        )
    return out, ungraded


def _simple(source: str) -> bool:
    """A template of only literal text and `{{ name }}` substitutions: its output is the row's text."""
    from jinja2 import nodes

    try:
        tree = jinja_env().parse(source)
    except RecursionError:  # (`suite_yaml` refused what nests too deeply; this stack may be deeper)
        return False
    return all(
        isinstance(node, nodes.Output) and all(isinstance(c, (nodes.TemplateData, nodes.Name)) for c in node.nodes)
        for node in tree.body
    )


def needs_child(job: RenderJob) -> bool:
    return any(f is not None and f.is_template and not _simple(f.source) for f in (job.text, job.target, job.id))


def _limit_memory(extra: int) -> None:
    """RLIMIT_AS: what this process maps now plus `extra` (Linux; elsewhere the time limit remains)."""
    import os
    import resource

    try:
        with open("/proc/self/statm") as f:
            mapped = int(f.read().split()[0]) * os.sysconf("SC_PAGE_SIZE")
    except (OSError, ValueError):
        return
    _, hard = resource.getrlimit(resource.RLIMIT_AS)
    want = mapped + extra
    resource.setrlimit(resource.RLIMIT_AS, (want if hard == resource.RLIM_INFINITY else min(want, hard), hard))


def _child(conn, job: RenderJob, at) -> None:
    try:
        _limit_memory(job.memory)
        result: tuple = ("ok", render(job, progress=lambda i: setattr(at, "value", i)))
    except DetauditError as e:
        result = ("error", str(e))
    except MemoryError:
        result = ("error", f"suite {job.suite}: rendering needs more than {job.memory >> 20} MiB")
    except Exception as e:  # anything else the templates raise is still one line, in the parent
        result = ("error", f"suite {job.suite}: rendering failed: {type(e).__name__}: {one_line(e)[:200]}")
    conn.send(result)
    conn.close()


def _in_child(job: RenderJob) -> tuple[list[Rendered], list[str]]:
    import multiprocessing as mp

    ctx = mp.get_context("forkserver")
    ctx.set_forkserver_preload(["detaudit.inputs.suite_render"])
    timeout = RENDER_SECONDS + RENDER_SECONDS_PER_ROW * len(job.rows)
    at = ctx.Value("q", -1, lock=False)
    receive, send = ctx.Pipe(duplex=False)
    proc = ctx.Process(target=_child, args=(send, job, at), daemon=True)
    proc.start()
    send.close()
    try:
        if not receive.poll(timeout):
            proc.kill()
            label = job.rows[at.value][0] if 0 <= at.value < len(job.rows) else "?"
            raise DetauditError(
                f"suite {job.suite}: {label}: rendering its templates took more than {timeout:.0f} s "
                "(a template that loops without end?); refused"
            )
        try:
            status, value = receive.recv()
        except (EOFError, OSError):
            proc.join(5)
            raise DetauditError(
                f"suite {job.suite}: the process rendering its templates died (exit code {proc.exitcode})"
            ) from None
    finally:
        receive.close()
        proc.join(5)
        if proc.is_alive():
            proc.kill()
            proc.join()
    if status != "ok":
        raise DetauditError(value)
    return value


def render_rows(suite: str, text: Field, target: Field | None, id_: Field | None, rows: Iterable, limit: int | None):
    """Render the first `limit` rows (rows past it are never read): templates that can do work beyond the
    row's own size in a bounded child process, the rest here."""
    job = RenderJob(suite, text, target, id_, list(itertools.islice(rows, limit)), MAX_FIELD_CHARS)
    if hasattr(rows, "close"):
        rows.close()  # a reader past `limit` stops now (and frees what it holds)
    if not needs_child(job):
        return render(job)
    return _in_child(replace(job, memory=RENDER_MEMORY + 3 * len(pickle.dumps(job.rows))))
