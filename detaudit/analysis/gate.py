"""CI gate: a policy (YAML) applied to a run's metrics -> pass / fail with reasons.

Policy format (see `detaudit/data/default-policy.yaml`, the default)::

    version: 1
    backends:                      # backend -> rules on its summary metrics (per suite)
      bio+tbik:
        bitwise_diff_records: {max: 0}                     # every recorded number bitwise equal
        unique_mean: {max: 1}
        teacher_forced_div_max: {max: 0, optional: true}   # skipped when the run has no value
      bf16: {report_only: true}    # measured, never fails the gate
    baseline_tolerance:            # with --baseline: allowed worsening per metric (absolute)
      unique_mean: 0.25
    alignment:                     # `detaudit align` results: backend -> rules on its alignment row
      bio+tbik:
        bitwise_equal_frac: {min: 1}

A backend may also carry its own `baseline_tolerance`. Whatever the policy says, cells that are
missing, failed or pending fail the gate, and so does a gated (not report-only) backend that is
absent from the run or has no completed cell: what was not computed cannot be verified.
With a baseline, every way it differs from the run (model, suites and their prompts, decoding,
dtype, engine, code version, device, hardware) is listed in `GateResult.mismatches`; a baseline of
another model or other suites fails the gate unless `allow_mismatch` (its metrics are not comparable).
Metric names, their worse direction and default tolerances come from `detaudit.analysis.metrics`.
Given a directory written by `detaudit align`, the gate applies the `alignment:` rules instead (a
gated backend missing from the alignment, or one with no token compared, fails).
`GateResult.results` holds every check made (passed ones too); `detaudit.analysis.gate_report` renders them.
Bad input (policy, run directory) raises DetauditError.
"""

from __future__ import annotations

import json
import math
import os
from dataclasses import asdict, dataclass, field
from importlib import resources
from pathlib import Path
from typing import Any

from detaudit.analysis.analyze import Analysis, analyze
from detaudit.analysis.metrics import MetricSpec, default_tolerances, gateable
from detaudit.errors import DetauditError
from detaudit.inputs.user_files import MAX_YAML_BYTES, decode, load_yaml, read_regular
from detaudit.runs.manifest import Manifest
from detaudit.runs.rundir import ALIGN_SUMMARY, is_alignment_dir, load_alignment

# the metrics a policy may name, their worse direction and default tolerances: detaudit.analysis.metrics
METRICS = gateable("summary")
ALIGN_METRICS = gateable("align")
TOP_KEYS = ("version", "description", "backends", "baseline_tolerance", "alignment")
RULE_KEYS = ("max", "min", "optional")
DEFAULT_POLICY = "default-policy.yaml"


# ---------------------------------------------------------------- policy


@dataclass(frozen=True)
class Rule:
    metric: str
    max: float | None = None
    min: float | None = None
    optional: bool = False

    def threshold(self) -> str:
        parts = ([f"<= {fmt_value(self.max)}"] if self.max is not None else []) + (
            [f">= {fmt_value(self.min)}"] if self.min is not None else []
        )
        return " and ".join(parts)

    def check(self, value: float) -> bool:
        return (self.max is None or value <= self.max) and (self.min is None or value >= self.min)


@dataclass(frozen=True)
class BackendPolicy:
    report_only: bool = False
    rules: tuple[Rule, ...] = ()
    baseline_tolerance: dict[str, float] | None = None


@dataclass(frozen=True)
class Policy:
    backends: dict[str, BackendPolicy]
    baseline_tolerance: dict[str, float]
    source: str
    alignment: dict[str, BackendPolicy] = field(default_factory=dict)

    def tolerance(self, backend: str) -> dict[str, float]:
        own = self.backends[backend].baseline_tolerance
        return own if own is not None else self.baseline_tolerance


def load_policy(path: str | os.PathLike | None = None) -> Policy:
    """The policy at `path`, or the shipped default."""
    if path is None:
        source = f"default ({DEFAULT_POLICY})"
        text = resources.files("detaudit").joinpath("data", DEFAULT_POLICY).read_text()
    else:
        source = str(path)
        raw = read_regular(Path(path), "policy file", MAX_YAML_BYTES)  # a FIFO or a huge file is refused unread
        text = decode(Path(path), raw, "policy file")
    obj = load_yaml(text, f"policy {source}")  # bounded: depth, aliases, integers, dates (one line each)
    return parse_policy(obj, source)


def parse_policy(obj: Any, source: str = "policy") -> Policy:
    def bad(msg: str) -> DetauditError:
        return DetauditError(f"policy {source}: {msg}")

    if obj is None:
        raise bad("is empty")
    if not isinstance(obj, dict):
        raise bad("must be a mapping with a `backends:` key")
    unknown = [k for k in obj if k not in TOP_KEYS]
    if unknown:
        raise bad(f"unknown key {unknown[0]!r} (known: {', '.join(TOP_KEYS)})")
    if obj.get("version", 1) != 1:
        raise bad(f"version {obj['version']!r} is not supported (this detaudit reads version 1)")
    backends = obj.get("backends")
    if not isinstance(backends, dict):
        raise bad("`backends:` must be a mapping backend -> rules")
    alignment = obj.get("alignment") or {}
    if not isinstance(alignment, dict):
        raise bad("`alignment:` must be a mapping backend -> rules")
    tol = obj.get("baseline_tolerance")
    tolerance = default_tolerances() if tol is None else _parse_tolerance(tol, "baseline_tolerance", bad)
    return Policy(
        backends=_parse_backends(backends, "backends", METRICS, bad),
        baseline_tolerance=dict(tolerance),
        source=source,
        alignment=_parse_backends(alignment, "alignment", ALIGN_METRICS, bad),
    )


def _parse_backends(backends: dict, section: str, metrics: dict[str, MetricSpec], bad) -> dict[str, BackendPolicy]:
    parsed = {}
    for backend, spec in backends.items():
        where = f"{section}.{backend}"
        if spec is None:
            spec = {}
        if not isinstance(spec, dict):
            raise bad(f"{where} must be a mapping (metric: {{max: X}} or report_only: true)")
        report_only = spec.get("report_only", False)
        if not isinstance(report_only, bool):
            raise bad(f"{where}.report_only must be true or false")
        tol = spec.get("baseline_tolerance")
        if tol is not None and metrics is not METRICS:
            raise bad(f"{where}.baseline_tolerance: baselines compare sweep runs only")
        rules = [
            _parse_rule(metric, rule, f"{where}.{metric}", bad, metrics)
            for metric, rule in spec.items()
            if metric not in ("report_only", "baseline_tolerance")
        ]
        parsed[str(backend)] = BackendPolicy(
            report_only=report_only,
            rules=tuple(rules),
            baseline_tolerance=None if tol is None else _parse_tolerance(tol, f"{where}.baseline_tolerance", bad),
        )
    return parsed


def _known_metric(metric: Any, where: str, bad, metrics: dict[str, MetricSpec] = METRICS) -> str:
    if metric not in metrics:
        raise bad(f"{where}: unknown metric {metric!r} (known: {', '.join(metrics)})")
    return metric


def _number(x: Any) -> bool:
    return isinstance(x, (int, float)) and not isinstance(x, bool) and not math.isnan(x)


def _parse_rule(metric: Any, rule: Any, where: str, bad, metrics: dict[str, MetricSpec] = METRICS) -> Rule:
    _known_metric(metric, where, bad, metrics)
    if not isinstance(rule, dict) or not rule:
        raise bad(f"{where} must be a mapping such as {{max: 0}} or {{min: 2}}")
    unknown = [k for k in rule if k not in RULE_KEYS]
    if unknown:
        raise bad(f"{where}: unknown key {unknown[0]!r} (known: {', '.join(RULE_KEYS)})")
    for key in ("max", "min"):
        if key in rule and not _number(rule[key]):
            raise bad(f"{where}.{key} must be a number (got {rule[key]!r})")
    if "max" not in rule and "min" not in rule:
        raise bad(f"{where} needs max or min")
    if not isinstance(rule.get("optional", False), bool):
        raise bad(f"{where}.optional must be true or false")
    return Rule(metric, max=rule.get("max"), min=rule.get("min"), optional=rule.get("optional", False))


def _parse_tolerance(tol: Any, where: str, bad) -> dict[str, float]:
    if not isinstance(tol, dict):
        raise bad(f"{where} must be a mapping metric -> allowed worsening")
    out = {}
    for metric, value in tol.items():
        _known_metric(metric, where, bad)
        if not _number(value) or value < 0:
            raise bad(f"{where}.{metric} must be a number >= 0 (got {value!r})")
        out[metric] = float(value)
    return out


# ---------------------------------------------------------------- result

PASS, FAIL, WARN, SKIP = "pass", "fail", "warn", "skip"


@dataclass(frozen=True)
class Check:
    """One check the gate made. `status`: pass; fail (a violation); warn (a breach on a report-only
    backend: reported, never failing); skip (an optional rule without a value)."""

    suite: str
    backend: str
    metric: str
    value: Any
    threshold: str
    reason: str
    status: str = FAIL
    cell: str | None = None  # the cell a cell-state check is about


@dataclass
class GateResult:
    results: list[Check]  # every check made, in order
    notes: list[str] = field(default_factory=list)
    mismatches: list[Mismatch] = field(default_factory=list)  # how a --baseline differs from the run
    policy: Policy | None = None
    analysis: Analysis | None = None
    baseline: Analysis | None = None
    run: str | None = None  # the directory gated (an alignment has no Analysis)

    @property
    def violations(self) -> list[Check]:
        return [c for c in self.results if c.status == FAIL]

    @property
    def warnings(self) -> list[Check]:  # breaches on report-only backends
        return [c for c in self.results if c.status == WARN]

    @property
    def passed(self) -> bool:
        return not self.violations

    @property
    def checks(self) -> int:
        return len(self.results)

    @property
    def run_dir(self) -> str | None:
        return str(self.analysis.run_dir) if self.analysis else self.run

    def to_dict(self) -> dict[str, Any]:
        """JSON-ready (NaN -> None), for `detaudit gate --json`."""

        def row(v: Check) -> dict[str, Any]:
            d = asdict(v)
            if isinstance(d["value"], float) and math.isnan(d["value"]):
                d["value"] = None
            return d

        return dict(
            passed=self.passed,
            checks=self.checks,
            violations=[row(v) for v in self.violations],
            warnings=[row(v) for v in self.warnings],
            results=[row(v) for v in self.results],
            notes=list(self.notes),
            policy=self.policy.source if self.policy else None,
            run=self.run_dir,
            baseline=str(self.baseline.run_dir) if self.baseline else None,
            mismatches=[asdict(m) for m in self.mismatches],
        )


# ---------------------------------------------------------------- gate


def gate(
    run_dir: str | os.PathLike,
    policy_path: str | os.PathLike | None = None,
    baseline_dir: str | os.PathLike | None = None,
    allow_mismatch: bool = False,
) -> GateResult:
    """Apply the policy (default: the shipped one) to the run, optionally against a baseline run.
    A baseline of another model or other suites fails the gate unless `allow_mismatch`; every
    difference from the baseline is listed in `GateResult.mismatches` either way."""
    policy = load_policy(policy_path)
    path = Path(run_dir)
    if is_alignment_dir(path):
        if baseline_dir is not None:
            raise DetauditError(f"{run_dir} holds alignment results: --baseline compares sweep runs only")
        return evaluate_alignment(policy, load_alignment(path), str(path))
    analysis = analyze(run_dir)
    baseline = analyze(baseline_dir) if baseline_dir is not None else None
    return evaluate(policy, analysis, baseline, allow_mismatch=allow_mismatch)


def evaluate_alignment(policy: Policy, results: dict[str, Any], run: str) -> GateResult:
    """The `alignment:` rules applied to `detaudit align`'s summary rows (one per backend)."""
    checks: list[Check] = []
    notes: list[str] = []
    rows = results.get("summary")
    if not isinstance(rows, list) or not all(isinstance(r, dict) and "backend" in r for r in rows):
        raise DetauditError(f"{run}/{ALIGN_SUMMARY} has no per-backend summary rows: rerun `detaudit align`")
    if not policy.alignment:
        raise DetauditError(f"policy {policy.source} has no `alignment:` rules to apply to {run}")
    meta = results.get("meta", {})
    pair = f"{meta.get('rollout', '?')} vs {meta.get('trainer', '?')}"
    present = {r["backend"]: r for r in rows}
    for backend, bp in policy.alignment.items():
        row = present.get(backend)
        if row is None:
            if not bp.report_only:
                reason = f"backend {backend} is gated by the policy but absent from the alignment"
                checks.append(Check(pair, backend, "backend", "absent", "present", reason))
            continue
        if not bp.report_only:
            compared = bool(row.get("tokens"))
            reason = (
                "sampled tokens compared" if compared else "no sampled token was compared: nothing could be checked"
            )
            checks.append(Check(pair, backend, "tokens", row.get("tokens", 0), ">= 1", reason, _status(compared)))
            if not compared:
                continue
        checks += _apply_rules(bp.rules, row, pair, backend, bp.report_only, notes)
    for backend in sorted(set(present) - set(policy.alignment)):
        notes.append(f"backend {backend} is not in the policy's alignment rules: not checked")
    return GateResult(checks, notes=notes, policy=policy, run=run)


def _status(ok: bool, report_only: bool = False) -> str:
    return PASS if ok else WARN if report_only else FAIL


def evaluate(
    policy: Policy, analysis: Analysis, baseline: Analysis | None = None, *, allow_mismatch: bool = False
) -> GateResult:
    checks: list[Check] = []
    notes: list[str] = list(analysis.notes)

    # 1. every cell must be complete, whatever the backend
    for c in analysis.per_cell.itertuples(index=False):
        done = c.state == "done"
        reason = f"cell {c.cell_id} is {c.state}" + ("" if done else f": {c.error or 'no reason recorded'}")
        checks.append(Check(str(c.suite), str(c.backend), "cell", c.state, "done", reason, _status(done), c.cell_id))

    summary = analysis.summary
    present = set(analysis.per_cell["backend"].dropna())
    suites = ", ".join(analysis.suites) or "*"
    for backend, bp in policy.backends.items():
        if backend not in present:
            if bp.report_only:
                notes.append(f"report-only backend {backend} is not in the run")
            else:
                reason = (
                    f"backend {backend} is gated by the policy but absent from the run: its invariance cannot be "
                    "verified"
                )
                checks.append(Check(suites, backend, "backend", "absent", "present", reason))
    for backend in sorted(present - set(policy.backends)):
        notes.append(f"backend {backend} is not in the policy: only its cells' states are checked")

    # 2. absolute rules
    for row in summary.to_dict("records"):
        backend, suite = row["backend"], row["suite"]
        bp = policy.backends.get(backend)
        if bp is None:
            continue
        if row["cells"] == 0:
            if not bp.report_only:
                checks.append(Check(suite, backend, "cells", 0, ">= 1", "no completed cell: nothing could be checked"))
            continue
        checks += _apply_rules(bp.rules, row, suite, backend, bp.report_only, notes)

    # 3. baseline
    mismatches: list[Mismatch] = []
    if baseline is not None:
        mismatches = baseline_mismatches(analysis.manifest, baseline.manifest)
        blocking = [m for m in mismatches if m.blocking]
        if blocking and not allow_mismatch:
            reason = (
                f"the baseline is another sweep ({'; '.join(str(m) for m in blocking)}): its metrics are not "
                "comparable; pass --allow-mismatch to compare anyway"
            )
            fields = ", ".join(m.field for m in blocking)
            checks.append(Check(suites, "*", "baseline", fields, "same model and suites", reason))
        else:
            checks += _compare_baseline(policy, summary, baseline.summary, notes)

    if (analysis.per_cell["tp_mode"] == "emulated").any():
        notes.append("some cells ran with emulated TP: native emulation cannot reproduce a ring all-reduce's order")
    return GateResult(checks, notes=notes, policy=policy, analysis=analysis, baseline=baseline, mismatches=mismatches)


def _compare_baseline(policy: Policy, summary, base_summary, notes: list[str]) -> list[Check]:
    """Gated backends' metrics against the baseline's, within the policy's tolerances."""
    checks: list[Check] = []
    base = {(r["suite"], r["backend"]): r for r in base_summary.to_dict("records")}
    for row in summary.to_dict("records"):
        suite, backend = row["suite"], row["backend"]
        bp = policy.backends.get(backend)
        if bp is None or bp.report_only or row["cells"] == 0:
            continue
        old = base.get((suite, backend))
        if old is None:
            notes.append(f"{suite}/{backend} is not in the baseline; not compared")
            continue
        for metric, tol in policy.tolerance(backend).items():
            value, ref = float(row[metric]), float(old[metric])
            if math.isnan(value) or math.isnan(ref):
                continue
            metric_spec = METRICS[metric]
            worse = metric_spec.worsening(value, ref) > tol
            change = "regressed" if worse else "went"
            reason = f"{metric} {change} from {fmt_value(ref)} to {fmt_value(value)} (tolerance {fmt_value(tol)})"
            threshold = f"baseline {fmt_value(ref)} {metric_spec.worse_sign} {fmt_value(tol)}"
            checks.append(Check(suite, backend, metric, value, threshold, reason, _status(not worse)))
    return checks


# ---------------------------------------------------------------- baseline identity


@dataclass(frozen=True)
class Mismatch:
    """One way the baseline is not the same sweep as the run. `blocking`: another model or other
    suites / prompts, which fails the gate unless mismatches are allowed."""

    field: str
    run: str
    baseline: str
    blocking: bool = False

    def __str__(self) -> str:
        return f"{self.field}: run {self.run}, baseline {self.baseline}"


def _short(v: Any) -> str:
    text = v if isinstance(v, str) else json.dumps(v, sort_keys=True, default=str)
    return text if len(text) <= 80 else text[:77] + "..."


def baseline_mismatches(run: Manifest, base: Manifest) -> list[Mismatch]:
    """Every difference between the run's and the baseline's identity (model, suites and their
    prompts, decoding, dtype, limit, engine, ...), code version, device and hardware."""
    out: list[Mismatch] = []
    ident, old = run.identity, base.identity
    checksums = "model_checksum" in ident and "model_checksum" in old
    if (ident["model_checksum"] != old["model_checksum"]) if checksums else run.model_name != base.model_name:
        out.append(
            Mismatch(
                "model",
                f"{run.model_name} ({str(ident.get('model_checksum', '?'))[:12]})",
                f"{base.model_name} ({str(old.get('model_checksum', '?'))[:12]})",
                True,
            )
        )
    suites, old_suites = list(run.config.get("suites") or []), list(base.config.get("suites") or [])
    if sorted(suites) != sorted(old_suites):
        out.append(Mismatch("suites", ", ".join(suites), ", ".join(old_suites), True))
    for key in ("suites", "prompt_hashes"):  # the prompts of a suite both runs have
        a, b = ident.get(key) or {}, old.get(key) or {}
        for suite in sorted(set(a) & set(b)):
            if a[suite] != b[suite] and not any(m.field == f"suite {suite}" for m in out):
                out.append(
                    Mismatch(f"suite {suite}", f"prompts {_short(a[suite])}", f"prompts {_short(b[suite])}", True)
                )
    for key in sorted(set(ident) | set(old)):
        if key not in ("model_checksum", "suites", "prompt_hashes") and ident.get(key) != old.get(key):
            out.append(Mismatch(key, _short(ident.get(key)), _short(old.get(key))))
    facts = (
        ("code version", run.code_version, base.code_version),
        ("git hash", run.git_hash, base.git_hash),
        ("device", run.config.get("device"), base.config.get("device")),
        ("hardware", run.hardware_key, base.hardware_key),
    )
    out += [Mismatch(name, _short(a), _short(b)) for name, a, b in facts if a != b]
    return out


def _apply_rules(rules, row: dict, where: str, backend: str, report_only: bool, notes: list[str]) -> list[Check]:
    """One summary row against a backend's rules, one check per rule. A metric that could not be
    computed (NaN / missing) breaks its rule unless the rule is optional."""
    checks: list[Check] = []
    for rule in rules:
        value = row.get(rule.metric)
        value = math.nan if value is None else float(value)
        if math.isnan(value):
            if rule.optional:
                notes.append(f"{where}/{backend}: {rule.metric} not computed (no data); optional rule skipped")
                reason, status = f"{rule.metric} not computed (no data): optional rule skipped", SKIP
            else:
                reason, status = (
                    f"{rule.metric} could not be computed (no comparable data)",
                    _status(False, report_only),
                )
        elif rule.check(value):
            reason, status = f"{rule.metric} = {fmt_value(value)} meets {rule.threshold()}", PASS
        else:
            detail = METRICS[rule.metric].detail if rule.metric in METRICS else None
            at = f": {row[detail]}" if detail and row.get(detail) else ""
            reason, status = (
                f"{rule.metric} = {fmt_value(value)} breaks {rule.threshold()}{at}",
                _status(False, report_only),
            )
        checks.append(Check(where, backend, rule.metric, value, rule.threshold(), reason, status))
    return checks


def fmt_value(x: Any) -> str:
    """A check's value or threshold number as printed: integers without a point, else 4 significant digits."""
    if isinstance(x, bool) or not isinstance(x, (int, float)):
        return str(x)
    if isinstance(x, float) and math.isnan(x):
        return "n/a"
    if float(x).is_integer():
        return str(int(x))
    return f"{x:.4g}"
