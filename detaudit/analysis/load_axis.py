"""The load axis of a server audit (`--engine openai`, `--engine vllm-server`).

A server cell is one load configuration: its concurrency (audited requests in flight: the cell's batch
size), its background load (other requests kept in flight the whole time; the cell id ends in `__bgN`)
and the background's pattern, with every prompt sent `repeats` times. Each configuration is compared
with the sequential baseline -- concurrency 1 without background load, else the least loaded done
cell -- request by request: a request's completion against the baseline's first send of its prompt.

Per configuration (one row of `load_table`; the baseline's own first sends are the reference, not
compared with themselves):

- distinct: per prompt, the number of distinct completions among the configuration's requests; the
  largest over prompts (1: every repeat agreed).
- identical: requests bitwise identical to the baseline's (token ids, their log-probabilities and the
  top-5 probabilities); differ: requests whose completion (token ids) is not the baseline's.
- first divergence: the first output position at which such a completion leaves the baseline's (where
  one is a prefix of the other: where the shorter ends); min and median over the differing requests.
- max-prob divergence: per request, the published definition on the pair (the top-5 probabilities'
  largest spread at each position both reach, mean over positions); `maxprob_div_mean` averages it over
  the requests, `maxprob_div_max` is the largest value at any single position.
- max |Δ logprob|: the largest difference of a generated token's log-probability from the baseline's,
  over the positions before the first divergence (the tokens are the same there).

The headline (after Thinking Machines' "1000 requests, 80 distinct completions"): over every
configuration of a (suite, backend), the number of requests and of distinct completions, summed over
prompts.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

import numpy as np
import pandas as pd

from detaudit.analysis.analyze import Analysis, first_divergence, maxprob_divergence_by_position, unique_count
from detaudit.config import background_of, describe_key
from detaudit.engines import ENGINES
from detaudit.runs.manifest import Manifest

LOAD_COLUMNS = [
    "suite",
    "backend",
    "cell_id",
    "label",
    "baseline",
    "concurrency",
    "background",
    "pattern",
    "repeats",
    "requests",
    "prompts",
    "distinct_max",
    "compared",
    "identical",
    "differ",
    "first_div_min",
    "first_div_median",
    "maxprob_div_mean",
    "maxprob_div_max",
    "logprob_diff_max",
]


def is_server_run(manifest: Manifest) -> bool:
    info = ENGINES.get(str(manifest.config.get("engine")))
    return bool(info is not None and info.server)


@dataclass(frozen=True)
class Load:
    concurrency: int
    background: int
    pattern: str | None  # the background's pattern (None without background)

    @property
    def label(self) -> str:
        """`c16/bg16 prefix`: unique per cell of one (suite, backend, TP)."""
        text = f"c{self.concurrency}/bg{self.background}"
        return f"{text} {self.pattern}" if self.background and self.pattern else text


def cell_load(manifest: Manifest, cell_id: str, backend: Any, tp: Any, batch_size: Any) -> Load:
    """A cell's load as recorded: the pattern from the engine's description of that cell, else the run's
    configured one."""
    bg = background_of(cell_id)
    pattern = None
    if bg:
        d = manifest.backends.get(describe_key(backend, tp, batch_size, bg)) or {}
        load = d.get("load") if isinstance(d.get("load"), dict) else {}
        server = manifest.config.get("server") if isinstance(manifest.config.get("server"), dict) else {}
        pattern = load.get("background_prompts") or server.get("background_prompts")
    return Load(int(batch_size), bg, pattern if isinstance(pattern, str) else None)


def cell_loads(analysis: Analysis) -> dict[str, Load]:
    """Every cell's load (empty when the run is not a server audit)."""
    if not is_server_run(analysis.manifest):
        return {}
    return {
        r["cell_id"]: cell_load(analysis.manifest, r["cell_id"], r["backend"], r["tp"], r["batch_size"])
        for r in analysis.per_cell.to_dict("records")
    }


def repeats(manifest: Manifest) -> int:
    r = manifest.config.get("repeats", 1)
    return r if isinstance(r, int) and r > 0 else 1


def _key(r: dict) -> str:
    pid = r.get("prompt_id")
    return str(pid) if isinstance(pid, str) else f"#{r.get('prompt_index')}"


def _repeat(r: dict) -> int:
    v = r.get("repeat")
    return 0 if v is None or (isinstance(v, float) and math.isnan(v)) else int(v)


def _compare(base: dict, r: dict) -> dict[str, Any]:
    """One request against the baseline's record of its prompt."""
    a, b = np.asarray(base["output_token_ids"], np.int64), np.asarray(r["output_token_ids"], np.int64)
    fd = first_divergence([a, b])
    n = min(len(a), len(b))
    by_pos = maxprob_divergence_by_position([base["top5"][:n], r["top5"][:n]]) if n else np.zeros(0)
    same = n if fd is None else fd
    la = np.asarray(base["token_logprobs"], np.float64)[:same]
    lb = np.asarray(r["token_logprobs"], np.float64)[:same]
    identical = (
        fd is None
        and np.array_equal(np.asarray(base["token_logprobs"]), np.asarray(r["token_logprobs"]))
        and np.array_equal(base["top5"], r["top5"])
    )
    return dict(
        identical=identical,
        first_div=fd,
        maxprob=float(by_pos.mean()) if by_pos.size else math.nan,
        maxprob_peak=float(by_pos.max()) if by_pos.size else math.nan,
        logprob_diff=float(np.abs(la - lb).max()) if same else math.nan,
    )


def _nanmax(values: list[float]) -> float:
    v = [x for x in values if not math.isnan(x)]
    return max(v) if v else math.nan


def _nanmean(values: list[float]) -> float:
    v = [x for x in values if not math.isnan(x)]
    return float(np.mean(v)) if v else math.nan


def load_table(analysis: Analysis) -> pd.DataFrame:
    """One row per done cell of a server audit (see the module docstring); empty for other runs."""
    loads = cell_loads(analysis)
    rec = analysis.records
    if not loads or rec is None or not len(rec):
        return pd.DataFrame(columns=LOAD_COLUMNS)
    records = {cid: sub.to_dict("records") for cid, sub in rec.groupby("cell_id", sort=False)}
    rows = []
    for (suite, backend), cells in analysis.per_cell.groupby(["suite", "backend"], sort=False):
        done = [c for c in cells["cell_id"] if c in records]
        if not done:
            continue
        base = min(done, key=lambda c: (loads[c].background, loads[c].concurrency, done.index(c)))
        reference = {_key(r): r for r in records[base] if _repeat(r) == 0}
        for cid in done:
            by_prompt: dict[str, list] = {}
            compared = []
            for r in records[cid]:
                by_prompt.setdefault(_key(r), []).append(r["output_token_ids"])
                ref = reference.get(_key(r))
                if ref is not None and ref is not r:
                    compared.append(_compare(ref, r))
            diverged = sorted(c["first_div"] for c in compared if c["first_div"] is not None)
            load = loads[cid]
            rows.append(
                dict(
                    suite=suite,
                    backend=backend,
                    cell_id=cid,
                    label=load.label,
                    baseline=cid == base,
                    concurrency=load.concurrency,
                    background=load.background,
                    pattern=load.pattern,
                    repeats=repeats(analysis.manifest),
                    requests=len(records[cid]),
                    prompts=len(by_prompt),
                    distinct_max=max(unique_count(s) for s in by_prompt.values()),
                    compared=len(compared),
                    identical=sum(c["identical"] for c in compared),
                    differ=len(diverged),
                    first_div_min=diverged[0] if diverged else None,
                    first_div_median=float(np.median(diverged)) if diverged else math.nan,
                    maxprob_div_mean=_nanmean([c["maxprob"] for c in compared]),
                    maxprob_div_max=_nanmax([c["maxprob_peak"] for c in compared]),
                    logprob_diff_max=_nanmax([c["logprob_diff"] for c in compared]),
                )
            )
    table = pd.DataFrame(rows, columns=LOAD_COLUMNS)
    table["first_div_min"] = table["first_div_min"].astype("Int64")
    return table


def headlines(analysis: Analysis) -> list[dict[str, Any]]:
    """Per (suite, backend) of a server audit: requests, prompts, configurations, distinct completions
    (summed over prompts) and the most for one prompt, and the sentence that says it."""
    loads = cell_loads(analysis)
    rec = analysis.records
    if not loads or rec is None or not len(rec):
        return []
    out = []
    for (suite, backend), sub in rec.groupby(["suite", "backend"], sort=False):
        per_prompt = {}
        for r in sub.to_dict("records"):
            per_prompt.setdefault(_key(r), []).append(r["output_token_ids"])
        distinct = {k: unique_count(v) for k, v in per_prompt.items()}
        n, k, configs = len(sub), sum(distinct.values()), sub["cell_id"].nunique()
        text = f"{n} requests, {k} distinct completion{'s' if k != 1 else ''}"
        if len(per_prompt) > 1:
            text += f" ({len(per_prompt)} prompts; at most {max(distinct.values())} for one prompt)"
        text += f" over {configs} load configuration{'s' if configs != 1 else ''}"
        out.append(
            dict(
                suite=suite,
                backend=backend,
                requests=n,
                prompts=len(per_prompt),
                configurations=configs,
                distinct=k,
                distinct_max=max(distinct.values()),
                text=text,
            )
        )
    return out
