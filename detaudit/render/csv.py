"""CSV report: the analysis tables as numbers (no formatting), one file each."""

from __future__ import annotations

from pathlib import Path

import pandas as pd

from detaudit.analysis.analyze import Analysis
from detaudit.analysis.load_axis import load_table
from detaudit.analysis.spec_axis import speculative_summary, speculative_table
from detaudit.analysis.tp_axis import axis_table
from detaudit.render import published_frame, write_file


def agreement_long(analysis: Analysis) -> pd.DataFrame:
    rows = []
    for (suite, backend), m in analysis.agreement.items():
        for a in m.index:
            for b in m.columns:
                rows.append(dict(suite=suite, backend=backend, cell_a=a, cell_b=b, agreement=m.loc[a, b]))
    return pd.DataFrame(rows, columns=["suite", "backend", "cell_a", "cell_b", "agreement"])


def write_csv(analysis: Analysis, out_dir: str | Path) -> list[Path]:
    """unique_outputs.csv and maxprob_div_x1e-3.csv (published layout: suite, model, one column per
    backend), summary.csv, per_cell.csv, per_prompt.csv, agreement.csv, divergence_by_position.csv; for a
    run with more than one batch size or TP size axes.csv (each axis apart, `tp_axis`); for a
    server audit also load.csv (each load configuration against the sequential baseline); for a run with
    speculative cells speculative.csv (each against its plain cell) and speculative_summary.csv."""
    out = Path(out_dir)
    frames = {
        "unique_outputs.csv": published_frame(analysis, "unique_mean"),
        "maxprob_div_x1e-3.csv": published_frame(analysis, "maxprob_div_mean", scale=1e3),
        "summary.csv": analysis.summary,
        "per_cell.csv": analysis.per_cell,
        "per_prompt.csv": analysis.per_prompt,
        "agreement.csv": agreement_long(analysis),
        "divergence_by_position.csv": analysis.divergence_by_position,
    }
    axes = axis_table(analysis)
    if len(axes):
        frames["axes.csv"] = axes
    load = load_table(analysis)
    if len(load):
        frames["load.csv"] = load
    spec = speculative_table(analysis)
    if len(spec):
        frames["speculative.csv"] = spec
        frames["speculative_summary.csv"] = speculative_summary(analysis, spec)
    written = []
    for name, frame in frames.items():
        # floats as repr (shortest round-trip): a tiny divergence is never written as 0
        written.append(write_file(out / name, frame.to_csv(index=False)))
    return written
