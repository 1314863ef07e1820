"""The mutation check: would the tests catch a plausible bug?

`python -m detaudit.devtools.mutants` plants each bug of the catalogue (`mutants.yaml` beside this file:
a search text, its replacement and the tests that should catch it) one at a time in a scratch copy of the
checkout, never in the working tree, runs those tests there and prints one row per mutant (the test that
killed it, or SURVIVED) and the score. `--fast` runs only the `-m "not slow"` part of each mutant's tests.
`--only NAME[,NAME]` picks mutants, `--json` prints the result as JSON, `--min-score P` exits 1 below P
percent, `--list` prints the catalogue, `--timeout S` bounds each mutant's test run.

Before any mutant, the chosen tests run once on the unmutated copy: a test that failed there would
"kill" every mutant, so the check refuses to go on. Hypothesis draws with a fixed seed and no example
database, so a rerun gives the same table. Catalogue rot fails loudly: a search text found other than
exactly once in its file, a replacement that does not compile, a test file that does not exist. Bad input
is one line and exit 2.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from dataclasses import asdict, dataclass
from pathlib import Path

import yaml

from detaudit.errors import DetauditError

ROOT = Path(__file__).resolve().parents[2]  # the checkout: the package, tests/ and pyproject.toml
CATALOGUE = Path(__file__).with_name("mutants.yaml")
AREAS = ("numerics", "records", "analysis", "gate/diff", "run directories", "suites")
REQUIRED = ("name", "area", "file", "bug", "search", "replace", "tests")
OPTIONAL = ("k",)  # a pytest -k expression applied to the mutant's tests
NOT_COPIED = (".git", ".venv", ".cache-test", "__pycache__", ".hypothesis", ".pytest_cache", ".ruff_cache")
NOT_COPIED += ("*.egg-info",)
# at the checkout's top only: run directories, build outputs, device carries (`detaudit/runs/` is a package)
NOT_COPIED_AT_TOP = ("runs", "out", "build", "dist", ".carry", ".whl")
FAILED_LINE = re.compile(r"^(?:FAILED|ERROR) (\S.*?)(?: - .*)?$")


@dataclass(frozen=True)
class Mutant:
    name: str
    area: str
    file: str  # relative to the checkout
    bug: str  # what the mutant breaks, in words
    search: str  # found exactly once in `file`
    replace: str
    tests: tuple[str, ...]  # pytest node ids or paths, cheapest first (the run stops at the first failure)
    k: str | None = None


@dataclass
class Outcome:
    name: str
    area: str
    file: str
    status: str  # killed, survived, timeout, error
    killed_by: str | None
    seconds: float
    note: str = ""

    @property
    def result(self) -> str:
        if self.status == "killed":
            return f"killed by {self.killed_by}"
        return {"survived": "SURVIVED", "timeout": "TIMEOUT (not counted as killed)"}.get(self.status, "ERROR") + (
            f" ({self.note})" if self.note else ""
        )


def load_catalogue(path: Path = CATALOGUE, root: Path = ROOT) -> list[Mutant]:
    """The catalogue, checked against the tree at `root` (DetauditError on the first problem)."""
    try:
        entries = yaml.safe_load(path.read_text())
    except (OSError, yaml.YAMLError) as e:
        raise DetauditError(f"mutant catalogue {path}: {' '.join(str(e).split())}") from None
    if not isinstance(entries, list) or not entries:
        raise DetauditError(f"mutant catalogue {path}: must be a non-empty list of mutants")
    mutants: list[Mutant] = []
    for i, entry in enumerate(entries):
        mutant = _checked(entry, f"mutant catalogue {path}, entry {i + 1}", root)
        if any(m.name == mutant.name for m in mutants):
            raise DetauditError(f"mutant catalogue {path}: two mutants are named {mutant.name!r}")
        mutants.append(mutant)
    return mutants


def _checked(entry: object, where: str, root: Path) -> Mutant:
    if not isinstance(entry, dict):
        raise DetauditError(f"{where}: must be a mapping")
    missing = [k for k in REQUIRED if k not in entry]
    unknown = [k for k in entry if k not in REQUIRED + OPTIONAL]
    if missing or unknown:
        raise DetauditError(f"{where}: " + (f"lacks {missing[0]!r}" if missing else f"unknown key {unknown[0]!r}"))
    name = entry["name"]
    if not isinstance(name, str) or not re.fullmatch(r"[a-z0-9][a-z0-9-]*", name):
        raise DetauditError(f"{where}: name {name!r} must be lower-case words joined by '-'")
    where = f"mutant {name}"
    texts = {k: entry[k] for k in ("file", "bug", "search", "replace")}
    if not all(isinstance(v, str) and v for v in texts.values()):
        raise DetauditError(f"{where}: file, bug, search and replace must be non-empty strings")
    if entry["area"] not in AREAS:
        raise DetauditError(f"{where}: area {entry['area']!r} is not one of {', '.join(AREAS)}")
    tests, k = entry["tests"], entry.get("k")
    if not isinstance(tests, list) or not tests or not all(isinstance(t, str) and t for t in tests):
        raise DetauditError(f"{where}: tests must be a non-empty list of pytest node ids")
    if k is not None and not (isinstance(k, str) and k):
        raise DetauditError(f"{where}: k must be a pytest -k expression")
    source = _inside(root, texts["file"], where)
    if not source.is_file():
        raise DetauditError(f"{where}: {texts['file']} is not a file of the checkout")
    text = source.read_text()
    count = text.count(texts["search"])
    if count != 1:
        raise DetauditError(f"{where}: its search text occurs {count} times in {texts['file']}, not once")
    if texts["replace"] == texts["search"]:
        raise DetauditError(f"{where}: its replacement is its search text")
    try:
        compile(text.replace(texts["search"], texts["replace"]), texts["file"], "exec")
    except SyntaxError as e:
        raise DetauditError(
            f"{where}: the mutated {texts['file']} does not compile ({e.msg}, line {e.lineno})"
        ) from None
    for test in tests:
        if not _inside(root, test.split("::")[0], where).exists():
            raise DetauditError(f"{where}: test {test} names no file")
    return Mutant(name, entry["area"], texts["file"], texts["bug"], texts["search"], texts["replace"], tuple(tests), k)


def _inside(root: Path, relative: str, where: str) -> Path:
    path = (root / relative).resolve()
    if not path.is_relative_to(root.resolve()):
        raise DetauditError(f"{where}: {relative} is outside the checkout")
    return path


# ---------------------------------------------------------------- running


def _env(copy: Path) -> dict[str, str]:
    env = dict(os.environ)
    others = [p for p in env.get("PYTHONPATH", "").split(os.pathsep) if p and Path(p).resolve() != ROOT]
    env["PYTHONPATH"] = os.pathsep.join([str(copy), *others])  # worker processes import the copy too
    env["PYTHONDONTWRITEBYTECODE"] = "1"  # no .pyc of a mutant is left to be read for the restored file
    env.setdefault("DETAUDIT_HOME", str(ROOT / ".cache-test" / "home"))  # the checkout's prepared test model
    return env


def _pytest(copy: Path, tests: tuple[str, ...], k: str | None, fast: bool, timeout: float):
    """(status, first failing test id or a note, seconds) of one pytest run in the copy."""
    shutil.rmtree(copy / ".hypothesis", ignore_errors=True)  # no example of an earlier mutant is replayed
    cmd = [sys.executable, "-m", "pytest", "-x", "-q", "-rfE", "-p", "no:cacheprovider", "--hypothesis-seed=0"]
    cmd += (["-m", "not slow"] if fast else []) + (["-k", k] if k else []) + list(tests)
    start = time.monotonic()
    proc = subprocess.Popen(
        cmd,
        cwd=copy,
        env=_env(copy),
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        start_new_session=True,
    )
    try:
        out, _ = proc.communicate(timeout=timeout)
    except BaseException as e:  # a timeout, or this process interrupted: the run must not outlive it
        os.killpg(proc.pid, signal.SIGKILL)  # the run and every process it started (its own session)
        proc.communicate()
        if not isinstance(e, subprocess.TimeoutExpired):
            raise
        return "timeout", f"over {timeout:.0f} s", time.monotonic() - start
    seconds = time.monotonic() - start
    failed = [m.group(1) for m in map(FAILED_LINE.match, out.splitlines()) if m]
    if proc.returncode == 0:
        return "survived", None, seconds
    if proc.returncode in (1, 2) and failed:
        return "killed", failed[0], seconds
    if proc.returncode == 5:
        return "survived", "no test selected" + (" by -m 'not slow'" if fast else ""), seconds
    last = next((line for line in reversed(out.splitlines()) if line.strip()), "no output")
    return "error", f"pytest exit {proc.returncode}: {last.strip()[:200]}", seconds


def _not_copied(folder: str, names: list[str]) -> set[str]:
    skipped = set(shutil.ignore_patterns(*NOT_COPIED)(folder, names))
    return skipped | ({n for n in names if n in NOT_COPIED_AT_TOP} if Path(folder) == ROOT else set())


def _copy_checkout(into: Path) -> Path:
    copy = into / "checkout"
    shutil.copytree(ROOT, copy, ignore=_not_copied, symlinks=True)
    probe = subprocess.run(
        [sys.executable, "-c", "import detaudit; print(detaudit.__file__)"],
        cwd=copy,
        env=_env(copy),
        capture_output=True,
        text=True,
    )
    imported = Path(probe.stdout.strip() or "?").resolve()
    if probe.returncode or not imported.is_relative_to(copy.resolve()):
        raise DetauditError(f"the scratch copy's tests would import detaudit from {imported}, not from the copy")
    return copy


def _baseline(copy: Path, mutants: list[Mutant], fast: bool, timeout: float) -> None:
    """Every chosen test passes on the unmutated copy (else each mutant's kill would mean nothing)."""
    groups: dict[str | None, list[str]] = {}
    for m in mutants:
        groups.setdefault(m.k, [])
        groups[m.k] += [t for t in m.tests if t not in groups[m.k]]
    for k, tests in groups.items():
        status, detail, _ = _pytest(copy, tuple(tests), k, fast, timeout * len(tests))
        if status == "killed":
            raise DetauditError(f"a test fails without any mutant: {detail} (fix it before measuring)")
        # "survived" with a detail: no test selected, which --fast allows (a mutant's tests may all be slow)
        if status != "survived" or (detail is not None and not fast):
            raise DetauditError(f"the tests could not run on the unmutated copy: {detail}")


def run_mutant(copy: Path, mutant: Mutant, index: int, fast: bool, timeout: float) -> Outcome:
    """The mutant applied to the copy, its tests run, the file restored (bytes and time stamp) whatever
    happens. Each version of a file gets its own modification time, so no cache keyed by it (numba's
    compiled kernels) can hand one version's code to another."""
    path = copy / mutant.file
    original, stat = path.read_bytes(), path.stat()
    try:
        path.write_text(original.decode().replace(mutant.search, mutant.replace, 1))
        stamp = stat.st_mtime_ns + (index + 1) * 1_000_000_000
        os.utime(path, ns=(stamp, stamp))
        status, detail, seconds = _pytest(copy, mutant.tests, mutant.k, fast, timeout)
    finally:
        path.write_bytes(original)
        os.utime(path, ns=(stat.st_atime_ns, stat.st_mtime_ns))
    killed_by = detail if status == "killed" else None
    return Outcome(mutant.name, mutant.area, mutant.file, status, killed_by, seconds, "" if killed_by else detail or "")


def _commit() -> str:
    try:
        head = subprocess.run(["git", "rev-parse", "HEAD"], cwd=ROOT, capture_output=True, text=True, check=True)
        dirty = subprocess.run(["git", "status", "--porcelain"], cwd=ROOT, capture_output=True, text=True).stdout
    except (OSError, subprocess.CalledProcessError):
        return "unknown (not a git checkout)"
    return head.stdout.strip() + (" with uncommitted changes" if dirty.strip() else "")


# ---------------------------------------------------------------- command line


class _Parser(argparse.ArgumentParser):
    def error(self, message: str):  # one line, exit 2 (argparse would print the usage first)
        sys.stderr.write(f"{self.prog}: error: {message}\n")
        sys.exit(2)


def _arguments(argv: list[str] | None) -> argparse.Namespace:
    p = _Parser(prog="python -m detaudit.devtools.mutants", description=__doc__.split("\n\n")[0])
    p.add_argument("--fast", action="store_true", help="run only the -m 'not slow' part of each mutant's tests")
    p.add_argument("--only", action="append", default=[], metavar="NAME[,NAME]", help="these mutants only")
    p.add_argument("--json", action="store_true", help="print the result as JSON")
    p.add_argument("--min-score", type=float, default=0.0, metavar="PERCENT", help="exit 1 below this score")
    p.add_argument("--timeout", type=float, default=900.0, metavar="SECONDS", help="per mutant (default 900)")
    p.add_argument("--list", action="store_true", help="print the catalogue (checked) and exit")
    args = p.parse_args(argv)
    if not 0 <= args.min_score <= 100:
        p.error(f"--min-score must be a percentage from 0 to 100 (got {args.min_score:g})")
    if not args.timeout > 0:
        p.error(f"--timeout must be a positive number of seconds (got {args.timeout:g})")
    return args


def _chosen(mutants: list[Mutant], only: list[str]) -> list[Mutant]:
    names = [n.strip() for item in only for n in item.split(",") if n.strip()]
    known = {m.name for m in mutants}
    unknown = [n for n in names if n not in known]
    if unknown:
        raise DetauditError(f"--only: no mutant is named {unknown[0]!r} (see --list)")
    return [m for m in mutants if not names or m.name in names]


def _table(rows: list[tuple[str, ...]]) -> str:
    widths = [max(len(r[i]) for r in rows) for i in range(len(rows[0]) - 1)]
    return "\n".join("  ".join([*(c.ljust(w) for c, w in zip(r, widths)), r[-1]]).rstrip() for r in rows)


def main(argv: list[str] | None = None) -> int:
    args = _arguments(argv)
    try:
        if not (ROOT / "tests").is_dir() or not (ROOT / "pyproject.toml").is_file():
            raise DetauditError(f"{ROOT} is not a detaudit checkout (the mutation check needs its tests/)")
        mutants = _chosen(load_catalogue(), args.only)
        if args.list:
            print(
                _table(
                    [("mutant", "area", "file", "tests")]
                    + [(m.name, m.area, m.file, " ".join(m.tests)) for m in mutants]
                )
            )
            return 0
        tests = "pytest -m 'not slow' (--fast)" if args.fast else "each mutant's whole list (slow included)"
        commit = _commit()
        with tempfile.TemporaryDirectory(prefix="detaudit-mutants-") as tmp:
            copy = _copy_checkout(Path(tmp))
            _baseline(copy, mutants, args.fast, args.timeout)
            outcomes = []
            for i, m in enumerate(mutants):
                outcomes.append(run_mutant(copy, m, i, args.fast, args.timeout))
                o = outcomes[-1]
                print(f"[{i + 1}/{len(mutants)}] {m.name}: {o.result} ({o.seconds:.1f} s)", file=sys.stderr, flush=True)
    except DetauditError as e:
        print(f"mutants: error: {e}", file=sys.stderr)
        return 2
    killed = sum(o.status == "killed" for o in outcomes)
    score = 100.0 * killed / len(outcomes)
    if args.json:
        print(
            json.dumps(
                dict(
                    commit=commit,
                    tests=tests,
                    killed=killed,
                    mutants=len(outcomes),
                    score=score,
                    outcomes=[asdict(o) for o in outcomes],
                ),
                indent=2,
            )
        )
    else:
        rows = [("mutant", "file", "result")] + [(o.name, o.file, o.result) for o in outcomes]
        print(f"commit {commit}; tests: {tests}")
        print(_table(rows))
        print(f"score: {killed} of {len(outcomes)} mutants killed ({score:.1f}%)")
    return 1 if score < args.min_score else 0


if __name__ == "__main__":
    sys.exit(main())
