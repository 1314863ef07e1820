"""Files users hand detaudit (suite YAML, gate policies, data rows), read and parsed with bounds.

Nothing in them is trusted, and a reader must not hang, exhaust memory or fail with a traceback on any of
them. So:

- `read_regular` reads a regular file only (a FIFO would block every reader until some writer came, a
  device never ends), and refuses one larger than its bound before reading it (the read itself stops one
  byte past the bound, in case the file grows meanwhile);
- `load_yaml` is PyYAML's safe loader (`Loader`), where a scalar the loader cannot build (`2024-13-45`,
  read as a date of month 13; an integer of more than MAX_INT_DIGITS digits), a string holding a lone
  surrogate (`"\\ud800"`: no UTF-8 encoding exists), nesting deeper than MAX_DEPTH, or aliases that expand
  to more than MAX_ALIAS_NODES values ("billion laughs") is one `DetauditError` line naming where;
- `load_json` is `json.loads` with the same bounds on integers and depth.
"""

from __future__ import annotations

import errno
import json
import os
import stat
from pathlib import Path

import yaml

from detaudit.errors import DetauditError

MAX_YAML_BYTES = 1 << 20  # suite files and policies; PyYAML parses about 0.2 MB/s in pure Python
MAX_DEPTH = 100  # nested lists / mappings; task files, policies and data rows use a handful
MAX_INT_DIGITS = 4300  # Python's own limit on int(str) (sys.get_int_max_str_digits), stated here
MAX_ALIAS_NODES = 100_000  # values YAML aliases may add to a document once expanded
TOO_DEEP = f"nested too deeply (more than {MAX_DEPTH} levels)"


def one_line(text: object) -> str:
    return " ".join(str(text).split())


def read_regular(path: Path, what: str, max_bytes: int | None = None) -> bytes:
    """The bytes of the regular file `path`; DetauditError (one line) when it is missing, not a regular
    file, unreadable, or larger than `max_bytes`. Opened without blocking, so a FIFO is refused, not
    waited on."""
    try:
        fd = os.open(path, os.O_RDONLY | getattr(os, "O_NONBLOCK", 0) | getattr(os, "O_CLOEXEC", 0))
    except FileNotFoundError:
        raise DetauditError(f"{what} {path} does not exist") from None
    except IsADirectoryError:
        raise DetauditError(f"{what} {path} is a directory, not a file") from None
    except OSError as e:
        why = "a symlink loop" if e.errno == errno.ELOOP else (e.strerror or str(e))
        raise DetauditError(f"cannot read {what} {path}: {why}") from None
    except ValueError as e:  # a NUL byte or a lone surrogate in the name
        raise DetauditError(f"cannot read {what} {path!r}: {e}") from None
    try:
        st = os.fstat(fd)
        if stat.S_ISDIR(st.st_mode):
            raise DetauditError(f"{what} {path} is a directory, not a file")
        if not stat.S_ISREG(st.st_mode):
            raise DetauditError(f"{what} {path} is not a regular file (a FIFO, socket or device is never read)")
        if max_bytes is not None and st.st_size > max_bytes:
            raise DetauditError(f"{what} {path} is {st.st_size} bytes, more than the {max_bytes} read")
        with os.fdopen(fd, "rb", closefd=False) as f:
            raw = f.read() if max_bytes is None else f.read(max_bytes + 1)
    except OSError as e:
        raise DetauditError(f"cannot read {what} {path}: {e.strerror or e}") from None
    finally:
        os.close(fd)
    if max_bytes is not None and len(raw) > max_bytes:
        raise DetauditError(f"{what} {path} is more than {max_bytes} bytes (it grew while read)")
    return raw


def decode(path: Path, raw: bytes, what: str) -> str:
    try:
        return raw.decode("utf-8")
    except UnicodeDecodeError as e:
        raise DetauditError(f"cannot read {what} {path}: not UTF-8 text (bad byte at offset {e.start})") from None


def unicode_error(text: str) -> str | None:
    """Why `text` cannot be written as UTF-8 (a lone surrogate, from a `\\ud800` escape), or None."""
    try:
        text.encode("utf-8")
    except UnicodeEncodeError as e:
        return f"a lone surrogate {text[e.start]!r} at character {e.start} (not valid Unicode text)"
    return None


# --------------------------------------------------------------------------------------------
# YAML


class _Refused(Exception):
    pass


class _RefusedValue(yaml.constructor.ConstructorError):
    """A scalar the loader could parse but refuses to build (see `Loader.construct_object`)."""


def _children(node: yaml.Node) -> list:
    if isinstance(node, yaml.SequenceNode):
        return list(node.value)
    if isinstance(node, yaml.MappingNode):
        return [n for pair in node.value for n in pair]
    return []


def _check_nodes(root: yaml.Node) -> None:
    """Refuse a document nested more than MAX_DEPTH deep, whose aliases expand to more than MAX_ALIAS_NODES
    extra nodes (nine aliases of nine aliases ... are a few lines of YAML and 10^9 values to every reader
    that walks them), or that contains itself. Iterative and memoised: linear in the distinct nodes."""
    sizes: dict[int, int] = {}
    depths: dict[int, int] = {}
    open_: set[int] = set()  # entered, not finished: the ancestors of the node being walked
    stack: list[tuple[yaml.Node, bool]] = [(root, False)]
    while stack:
        node, finished = stack.pop()
        key = id(node)
        if finished:
            open_.discard(key)
            kids = _children(node)
            sizes[key] = 1 + sum(sizes[id(c)] for c in kids)
            depths[key] = 1 + max((depths[id(c)] for c in kids), default=0)
            if depths[key] > MAX_DEPTH:
                raise _Refused(TOO_DEEP)
        elif key not in sizes:
            if key in open_:
                raise _Refused("an alias refers to a node that contains it (a recursive document)")
            if len(open_) > MAX_DEPTH:
                raise _Refused(TOO_DEEP)
            open_.add(key)
            stack.append((node, True))
            stack.extend((c, False) for c in _children(node) if id(c) not in sizes)
    added = sizes[id(root)] - len(sizes)
    if added > MAX_ALIAS_NODES:
        raise _Refused(f"its aliases expand to {added} more values (at most {MAX_ALIAS_NODES})")


class Loader(yaml.SafeLoader):
    """PyYAML's safe loader, bounded (see the module): subclass it to add tags."""

    _depth = 0

    def compose_node(self, parent, index):
        # PyYAML composes recursively, a few frames per level: refuse past MAX_DEPTH here rather than let
        # a 20,000-deep document run into RecursionError (which takes seconds to unwind)
        self._depth += 1
        try:
            if self._depth > MAX_DEPTH:
                raise _Refused(TOO_DEEP)
            return super().compose_node(parent, index)
        finally:
            self._depth -= 1

    def compose_document(self):
        node = super().compose_document()
        if node is not None:
            _check_nodes(node)
        return node

    def construct_object(self, node, deep=False):
        if isinstance(node, yaml.ScalarNode) and node.tag == "tag:yaml.org,2002:int":
            digits = sum(c.isdigit() for c in str(node.value))
            if digits > MAX_INT_DIGITS:
                raise _RefusedValue(
                    None, None, f"an integer of {digits} digits (at most {MAX_INT_DIGITS})", node.start_mark
                )
        try:
            data = super().construct_object(node, deep)
        except (ValueError, OverflowError, TypeError) as e:
            what = str(node.tag).rsplit(":", 1)[-1]
            value = f" {one_line(node.value)[:40]!r}" if isinstance(node, yaml.ScalarNode) else ""
            raise _RefusedValue(
                None, None, f"cannot read{value} as a {what} ({one_line(e)[:120]})", node.start_mark
            ) from None
        if isinstance(data, str):
            bad = unicode_error(data)
            if bad:
                raise _RefusedValue(None, None, f"a string holds {bad}", node.start_mark)
        return data


def load_yaml(text: str, where: str, loader: type[Loader] = Loader):
    """The YAML document in `text`; DetauditError `"{where}: ..."` (one line) for malformed or refused
    YAML."""
    try:
        return yaml.load(text, Loader=loader)  # noqa: S506 -- a SafeLoader subclass
    except _Refused as e:
        raise DetauditError(f"{where}: refused YAML: {e}") from None
    except RecursionError:
        raise DetauditError(f"{where}: refused YAML: nested too deeply for the parser") from None
    except yaml.YAMLError as e:
        mark = getattr(e, "problem_mark", None)
        at = f" at line {mark.line + 1}, column {mark.column + 1}" if mark is not None else ""
        reason = getattr(e, "problem", None) or e
        kind = "refused" if isinstance(e, _RefusedValue) else "malformed"
        raise DetauditError(f"{where}: {kind} YAML{at}: {one_line(reason)}") from None


# --------------------------------------------------------------------------------------------
# JSON


def _int(text: str) -> int:
    digits = len(text.lstrip("-"))
    if digits > MAX_INT_DIGITS:
        raise _Refused(f"an integer of {digits} digits (at most {MAX_INT_DIGITS})")
    return int(text)


def _check_depth(value: object) -> None:
    stack = [(value, 1)]
    while stack:
        item, depth = stack.pop()
        if isinstance(item, (dict, list)):
            if depth > MAX_DEPTH:
                raise _Refused(TOO_DEEP)
            stack.extend((v, depth + 1) for v in (item.values() if isinstance(item, dict) else item))


def load_json(text: str, where: str):
    """The JSON value in `text`; DetauditError `"{where}: ..."` (one line) for malformed JSON, an integer
    of more than MAX_INT_DIGITS digits, or nesting deeper than MAX_DEPTH."""
    try:
        value = json.loads(text, parse_int=_int)
        _check_depth(value)
    except json.JSONDecodeError as e:
        line = f", line {e.lineno}" if "\n" in text else ""  # (a JSON-lines row names its line in `where`)
        raise DetauditError(f"{where}{line}: not valid JSON ({e.msg} at column {e.colno})") from None
    except _Refused as e:
        raise DetauditError(f"{where}: refused JSON: {e}") from None
    except RecursionError:
        raise DetauditError(f"{where}: refused JSON: nested too deeply for the parser") from None
    return value
