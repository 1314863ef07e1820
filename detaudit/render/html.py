"""HTML report: one self-contained file (inline CSS, plots as inline base64 PNG drawn with
matplotlib's Agg canvas; no pyplot global state, no network)."""

from __future__ import annotations

import base64
import io
import math
from pathlib import Path

import jinja2
import numpy as np
from matplotlib.figure import Figure
from matplotlib.ticker import MaxNLocator

from detaudit import __version__
from detaudit.analysis.analyze import Analysis
from detaudit.analysis.load_axis import load_table
from detaudit.analysis.metrics import MIN_CELLS, definitions, spec
from detaudit.analysis.spec_axis import speculative_summary, speculative_table
from detaudit.analysis.tp_axis import axis_table
from detaudit.render import (
    AXIS_NOTE,
    EMULATED_NOTE,
    LOAD_NOTE,
    SPECULATIVE_NOTE,
    axis_rows,
    cell_labels,
    cell_rows,
    command,
    headline_lines,
    is_text,
    load_rows,
    published_table,
    row_status,
    speculative_rows,
    speculative_summary_rows,
    summary_rows,
    warnings,
    write_file,
    yaml_dump,
)

COLORS = {"bf16": "#d62728", "bio": "#ff7f0e", "bio+tbik": "#2ca02c"}
PALETTE = ["#1f77b4", "#9467bd", "#8c564b", "#e377c2", "#7f7f7f", "#bcbd22", "#17becf"]


def color(backend: str, i: int) -> str:
    return COLORS.get(backend, PALETTE[i % len(PALETTE)])


def png(fig: Figure) -> str:
    buf = io.BytesIO()
    fig.savefig(buf, format="png", dpi=100, bbox_inches="tight")
    return base64.b64encode(buf.getvalue()).decode()


# ---------------------------------------------------------------- plots


def agreement_figure(analysis: Analysis, suite: str) -> Figure | None:
    mats = [
        (b, analysis.agreement[(suite, b)])
        for b in analysis.backends  # a 1x1 matrix compares nothing
        if (suite, b) in analysis.agreement and len(analysis.agreement[(suite, b)]) >= MIN_CELLS
    ]
    if not mats:
        return None
    n = max(len(m) for _, m in mats)
    side = 1.2 + 0.42 * n
    # constrained: each panel's tick labels and title keep clear of its neighbours and of the colour bar
    fig = Figure(figsize=(side * len(mats) + 0.8, side + 0.4), layout="constrained")
    axes = fig.subplots(1, len(mats), squeeze=False)[0]
    labels = cell_labels(analysis)
    image = None
    rows = {(r["suite"], r["backend"]): r for r in analysis.summary.to_dict("records")}
    for ax, (backend, m) in zip(axes, mats):
        ticks = [labels.get(c, c) for c in m.index]
        image = ax.imshow(m.to_numpy(dtype=float), vmin=0, vmax=1, cmap="viridis")
        ax.set_xticks(range(len(ticks)), ticks, rotation=90, fontsize=8)
        ax.set_yticks(range(len(ticks)), ticks, fontsize=8)
        unique = spec("unique_mean").render(rows[(suite, backend)])
        ax.set_title(f"{backend}  (unique {unique})", fontsize=10)
        if len(m) <= 16:
            for i in range(len(m)):
                for j in range(len(m)):
                    v = m.iat[i, j]
                    if not math.isnan(v):
                        ax.text(
                            j,
                            i,
                            f"{v:.2f}".rstrip("0").rstrip(".") if v not in (0, 1) else f"{v:.0f}",
                            ha="center",
                            va="center",
                            fontsize=7,
                            color="white" if v < 0.6 else "black",
                        )
    cbar = fig.colorbar(image, ax=list(axes), shrink=0.8, pad=0.02)
    cbar.ax.tick_params(labelsize=8)
    return fig


def divergence_figure(analysis: Analysis, suite: str) -> Figure | None:
    pos = analysis.divergence_by_position
    pos = pos[(pos["suite"] == suite) & (pos["prompts"] > 0)]  # positions some prompt compared
    if not len(pos):
        return None
    full = analysis.divergence_by_position
    fig = Figure(figsize=(9, 5.2))
    top, bottom = fig.subplots(2, 1, sharex=True)
    for i, backend in enumerate(analysis.backends):
        has = pos[pos["backend"] == backend]
        if not len(has):
            continue
        p = full[(full["suite"] == suite) & (full["backend"] == backend)]
        c = color(backend, i)
        top.plot(has["position"], has["maxprob_div_mean"] * 1e3, color=c, lw=1.2, label=backend)
        bottom.step(p["position"], p["diverged_frac"] * 100, where="post", color=c, lw=1.5, label=backend)
    top.set_ylabel("max-prob div ×1e-3\n(mean over prompts)")
    top.set_title(f"{suite}: divergence by output position", fontsize=11, pad=22)
    top.legend(fontsize=8, loc="lower center", bbox_to_anchor=(0.5, 1.0), ncol=8, frameon=False)
    top.grid(alpha=0.3)
    top.set_ylim(bottom=0)
    bottom.set_ylabel("prompts diverged (%)")
    bottom.set_xlabel("output position (tokens)")
    bottom.set_ylim(-3, 103)
    bottom.grid(alpha=0.3)
    fig.align_ylabels()
    return fig


def compared_prompts(analysis: Analysis, suite: str):
    """The per-prompt rows of the suite that compare two or more cells."""
    pp = analysis.per_prompt
    return pp[(pp["suite"] == suite) & (pp["cells"] >= MIN_CELLS)]


def first_div_figure(analysis: Analysis, suite: str) -> Figure | None:
    """None where no prompt diverged (the page says so: an empty axis would say nothing)."""
    pp = compared_prompts(analysis, suite)
    fd = pp["first_div"].dropna().astype(float)
    if not len(fd):
        return None
    hi = max(float(fd.max()) if len(fd) else 0.0, 1.0)
    bins = np.linspace(0, hi + 1, min(40, int(hi) + 2))
    fig = Figure(figsize=(9, 3.0))
    ax = fig.subplots()
    for i, backend in enumerate(analysis.backends):
        sub = pp[pp["backend"] == backend]
        if not len(sub):
            continue
        values = sub["first_div"].dropna().astype(float)
        label = f"{backend}: {len(values)}/{len(sub)} prompts diverged"
        if len(values):
            ax.hist(
                values,
                bins=bins,
                color=color(backend, i),
                alpha=0.45,
                label=label,
                histtype="stepfilled",
                edgecolor=color(backend, i),
            )
        else:
            ax.plot([], [], color=color(backend, i), lw=6, alpha=0.45, label=label)
    ax.set_xlabel("first divergence position (tokens)")
    ax.set_ylabel("prompts")
    ax.yaxis.set_major_locator(MaxNLocator(integer=True))
    ax.set_title(f"{suite}: first divergence", fontsize=11)
    ax.legend(fontsize=8)
    ax.grid(alpha=0.3)
    return fig


def accuracy_figure(analysis: Analysis, suite: str) -> Figure | None:
    pc = analysis.per_cell[analysis.per_cell["suite"] == suite]
    if not len(pc) or pc["acc"].isna().all():
        return None
    names = cell_labels(analysis)
    labels = list(dict.fromkeys(names[c] for c in pc["cell_id"]))
    backends = [b for b in analysis.backends if b in set(pc["backend"])]
    width = 0.8 / max(len(backends), 1)
    fig = Figure(figsize=(max(6.0, 0.55 * len(labels) * max(len(backends), 1) / 1.5 + 2), 3.2))
    ax = fig.subplots()
    failed_marked = False
    for i, backend in enumerate(backends):
        sub = pc[pc["backend"] == backend]
        xs = np.array([labels.index(names[c]) for c in sub["cell_id"]]) + (i - (len(backends) - 1) / 2) * width
        acc = sub["acc"].to_numpy(dtype=float) * 100
        ok = ~np.isnan(acc)
        ax.bar(xs[ok], acc[ok], width=width, color=color(backend, i), label=backend)
        bad = (sub["state"] != "done").to_numpy()
        if bad.any():
            ax.scatter(
                xs[bad],
                np.full(bad.sum(), 4.0),
                marker="x",
                color=color(backend, i),
                s=40,
                linewidths=2,
                zorder=3,
                clip_on=False,
            )
            failed_marked = True
    ax.set_xticks(range(len(labels)), labels, rotation=45, ha="right", fontsize=8)
    ax.set_ylabel("accuracy (%)")
    ax.set_ylim(0, 100)
    ax.set_title(
        f"{suite}: accuracy per cell" + ("  (× = cell not done)" if failed_marked else ""), fontsize=11, pad=22
    )
    ax.legend(fontsize=8, loc="lower center", bbox_to_anchor=(0.5, 1.0), ncol=8, frameon=False)
    ax.grid(alpha=0.3, axis="y")
    return fig


def load_figure(analysis: Analysis, suite: str, table=None) -> Figure | None:
    """A server audit's load configurations against the sequential baseline: share of requests whose
    completion differs, and the max-prob divergence (mean and largest), one group of bars per backend."""
    t = load_table(analysis) if table is None else table
    t = t[(t["suite"] == suite)]
    if not len(t):
        return None
    labels = list(dict.fromkeys(t["label"]))
    backends = [b for b in analysis.backends if b in set(t["backend"])]
    width = 0.8 / max(len(backends), 1)
    fig = Figure(figsize=(max(6.5, 1.1 * len(labels) * max(len(backends), 1) + 2), 5.4))
    top, bottom = fig.subplots(2, 1, sharex=True)
    for i, backend in enumerate(backends):
        sub = t[t["backend"] == backend]
        xs = np.array([labels.index(x) for x in sub["label"]]) + (i - (len(backends) - 1) / 2) * width
        share = [100 * d / c if c else np.nan for d, c in zip(sub["differ"], sub["compared"])]
        c = color(backend, i)
        top.bar(xs, share, width=width, color=c, label=backend)
        bottom.bar(xs, sub["maxprob_div_mean"].astype(float) * 1e3, width=width, color=c, alpha=0.55)
        bottom.scatter(xs, sub["maxprob_div_max"].astype(float) * 1e3, color=c, marker="_", s=260, linewidths=2)
        for x, d in zip(xs, sub["distinct_max"]):
            top.annotate(f"{d} distinct", (x, 0), xytext=(0, 3), textcoords="offset points", ha="center", fontsize=7)
    base = t[t["baseline"]]["label"]
    title = f"{suite}: load against the sequential baseline ({base.iloc[0] if len(base) else '?'})"
    top.set_title(title, fontsize=11, pad=22)
    top.set_ylabel("requests differing\nfrom the baseline (%)")
    top.set_ylim(0, 105)
    top.legend(fontsize=8, loc="lower center", bbox_to_anchor=(0.5, 1.0), ncol=8, frameon=False)
    bottom.set_ylabel("max-prob div ×1e-3\n(bar: mean, tick: max)")
    bottom.set_xticks(range(len(labels)), labels, rotation=30, ha="right", fontsize=8)
    bottom.set_xlabel("load configuration (concurrency / background load, pattern)")
    for ax in (top, bottom):
        ax.grid(alpha=0.3, axis="y")
    fig.align_ylabels()
    return fig


# ---------------------------------------------------------------- page

TEMPLATE = """<!DOCTYPE html>
<html lang="en"><head><meta charset="utf-8">
<meta name="viewport" content="width=device-width, initial-scale=1">
<title>detaudit report: {{ model }}</title>
<style>
body { font: 14px/1.45 -apple-system, "Segoe UI", Roboto, "Helvetica Neue", Arial, sans-serif;
       color: #1d2327; margin: 0; background: #f6f7f9; }
main { max-width: 1180px; margin: 0 auto; padding: 24px 28px 48px; background: #fff; }
h1 { font-size: 24px; margin: 0 0 4px; }
h2 { font-size: 19px; margin: 32px 0 10px; padding-bottom: 4px; border-bottom: 1px solid #e3e6ea; }
h3 { font-size: 15px; margin: 18px 0 6px; }
.meta { color: #555; margin: 0 0 14px; }
code, pre { font-family: ui-monospace, SFMono-Regular, Menlo, Consolas, monospace; font-size: 12.5px; }
pre { background: #f3f4f6; padding: 10px 12px; border-radius: 6px; overflow-x: auto; white-space: pre-wrap; }
.warn { border-left: 5px solid #d97706; background: #fff7e6; padding: 8px 12px; margin: 8px 0; border-radius: 4px; }
.warn.hw { border-color: #b91c1c; background: #fdecec; font-size: 15px; }
table { border-collapse: collapse; margin: 6px 0 12px; font-size: 13px; }
th, td { padding: 4px 10px; border-bottom: 1px solid #e5e7eb; text-align: right; white-space: nowrap; }
th { background: #f3f4f6; font-weight: 600; white-space: normal; vertical-align: bottom; }
td.l, th.l { text-align: left; }
td.wrap { white-space: normal; max-width: 380px; }
tr.bad td { background: #fdecec; color: #8b1111; }
tr.good td { background: #eefbf0; }
.pub { display: flex; flex-wrap: wrap; gap: 8px 36px; }
.pub table td { min-width: 64px; }
.scroll { overflow-x: auto; }
figure { margin: 10px 0 18px; }
figure img { max-width: 100%; height: auto; display: block; }
figcaption { color: #555; font-size: 12.5px; margin-top: 2px; }
.muted { color: #666; }
dl.defs dt { font-weight: 600; float: left; clear: left; width: 110px; }
dl.defs dd { margin: 0 0 4px 120px; }
.badge { display: inline-block; font-size: 11px; padding: 0 5px; border-radius: 3px; background: #e0e7ff; color: #3730a3; }
</style></head>
<body><main>
{% macro table(header, rows, classes=None) -%}
<div class="scroll"><table>
<tr>{% for h in header %}<th class="{{ 'l' if is_text(h) }}">{{ h }}</th>{% endfor %}</tr>
{% for row in rows %}{% set rc = classes[loop.index0] if classes else '' %}<tr class="{{ rc }}">
{% for c in row %}<td class="{{ 'l' if is_text(header[loop.index0]) }}{{ ' wrap' if c|length > 40 }}">{% if c == 'emulated' %}<span class="badge">emulated</span>{% else %}{{ c }}{% endif %}</td>{% endfor %}</tr>
{% endfor %}</table></div>
{%- endmacro %}
<h1>detaudit report: {{ model }}</h1>
<p class="meta">{{ cells_done }} of {{ cells_total }} cells done · suites: {{ suites|join(', ') }} ·
backends: {{ backends|join(', ') }}{% if created %} · created {{ created }}{% endif %} · detaudit {{ version }}</p>
{% for w in warns %}<div class="warn{{ ' hw' if w.startswith('MIXED') }}">{% set head, rest = w.split(': ', 1) %}<b>{{ head }}</b>: {{ rest }}</div>
{% endfor %}
{% if load %}<h2>Load</h2>
{% for h in load.headlines %}<p><b>{{ h }}</b></p>{% endfor %}
<p class="muted">{{ load.note }}</p>
{% for suite, t, fig in load.tables %}<h3>{{ suite }}</h3>{{ table(t[0], t[1]) }}
{% if fig %}<figure><img alt="load {{ suite }}" src="data:image/png;base64,{{ fig }}">
<figcaption>Per load configuration (concurrency / background load, pattern): top, the share of requests whose completion differs from the sequential baseline's (and the most distinct completions of one prompt); bottom, the max-prob divergence from the baseline.</figcaption></figure>{% endif %}
{% endfor %}{% endif %}
<h2>Unique outputs per prompt</h2>
<p class="muted">Mean over prompts of the number of distinct outputs across the cells (1 = every configuration
agreed on every prompt).</p>
<div class="pub">{% for suite, t in unique_tables %}<div><h3>{{ suite }}</h3>{{ table(t[0], t[1]) }}</div>{% endfor %}</div>
<h2>Average max probability divergence (×1e-3)</h2>
<p class="muted">Top-5 probabilities, largest spread across the cells, mean over positions then prompts.
<code>0</code> means exactly zero.</p>
<div class="pub">{% for suite, t in div_tables %}<div><h3>{{ suite }}</h3>{{ table(t[0], t[1]) }}</div>{% endfor %}</div>
<h2>Summary</h2>
{{ table(summary[0], summary[1], classes=summary_classes) }}
<dl class="defs">{% for k, v in definitions %}<dt>{{ k }}</dt><dd>{{ v }}</dd>{% endfor %}</dl>
{% if axes %}<h2>Batch and TP axes</h2>
<p class="muted">{{ axes.note }}</p>
{{ table(axes.rows[0], axes.rows[1]) }}{% endif %}
{% if speculative %}<h2>Speculative decoding</h2>
<p class="muted">{{ speculative.note }}</p>
{{ table(speculative.summary[0], speculative.summary[1]) }}
<h3>Per cell</h3>
{{ table(speculative.cells[0], speculative.cells[1]) }}{% endif %}
{% for s in suite_figs %}
<h2>{{ s.suite }}</h2>
{% if not (s.agreement or s.divergence or s.first_div) %}<p class="muted">Nothing to compare in this suite (fewer than two done cells per backend): agreement and divergence not plotted.</p>{% endif %}
{% if s.agreement %}<figure><img alt="agreement matrix {{ s.suite }}" src="data:image/png;base64,{{ s.agreement }}">
<figcaption>Cell × cell agreement ({{ cell_axis }}): fraction of prompts for which two cells produced identical tokens.</figcaption></figure>{% endif %}
{% if s.divergence %}<figure><img alt="divergence by position {{ s.suite }}" src="data:image/png;base64,{{ s.divergence }}">
<figcaption>Top: max-prob divergence at each output position, mean over the prompts whose outputs all reach it.
Bottom: share of prompts whose outputs have diverged at or before the position.</figcaption></figure>{% endif %}
{% if s.first_div %}<figure><img alt="first divergence {{ s.suite }}" src="data:image/png;base64,{{ s.first_div }}">
<figcaption>First position at which two cells differ, over the prompts that diverge.</figcaption></figure>
{% elif s.compared %}<p class="muted">First divergence: none. No prompt diverged: each of the {{ s.compared }} prompt{{ 's' if s.compared != 1 }} compared got the same output tokens in every cell of its backend, so there is no position to plot.</p>{% endif %}
{% if s.accuracy %}<figure><img alt="accuracy per cell {{ s.suite }}" src="data:image/png;base64,{{ s.accuracy }}">
<figcaption>Answer accuracy of each cell ({{ cell_axis }}).</figcaption></figure>
{% else %}<p class="muted">No graded answers in this suite: accuracy not plotted.</p>{% endif %}
{% endfor %}
<h2>Cells</h2>
{{ table(cells[0], cells[1], classes=cell_classes) }}
{% if emulated %}<p class="muted"><span class="badge">emulated</span> {{ emulated_note }}</p>{% endif %}
<h2>How this run was made</h2>
<p>Command{% if not recorded %} <span class="muted">(reconstructed from the manifest)</span>{% endif %}:</p>
<pre>{{ command }}</pre>
<h3>Configuration</h3><pre>{{ config }}</pre>
{% if model_info %}<h3>Model</h3><pre>{{ model_info }}</pre>{% endif %}
<h3>Environment</h3><pre>{{ environment }}</pre>
</main></body></html>
"""


def render_html(analysis: Analysis) -> str:
    m = analysis.manifest
    cmd, recorded = command(m)
    suite_figs = []
    for suite in analysis.suites:
        figs = {}
        for key, make in (
            ("agreement", agreement_figure),
            ("divergence", divergence_figure),
            ("first_div", first_div_figure),
            ("accuracy", accuracy_figure),
        ):
            fig = make(analysis, suite)
            figs[key] = png(fig) if fig is not None else None
        compared = compared_prompts(analysis, suite)["prompt_id"].nunique()
        suite_figs.append(dict(suite=suite, compared=compared, **figs))
    pc = analysis.per_cell
    summary_classes = [row_status(r) for r in analysis.summary.to_dict("records")]
    heads = headline_lines(analysis)
    load = None
    if heads:
        table = load_table(analysis)
        figs = [load_figure(analysis, suite, table) for suite in analysis.suites]
        load = dict(
            headlines=heads,
            note=LOAD_NOTE,
            tables=[
                (suite, load_rows(analysis, suite, table), png(f) if f is not None else None)
                for suite, f in zip(analysis.suites, figs)
            ],
        )
    spec_table = speculative_table(analysis)
    speculative = None
    if len(spec_table):
        speculative = dict(
            note=SPECULATIVE_NOTE,
            summary=speculative_summary_rows(analysis, speculative_summary(analysis, spec_table)),
            cells=speculative_rows(analysis, spec_table),
        )
    axis = axis_table(analysis)
    axes = dict(note=AXIS_NOTE, rows=axis_rows(analysis, axis)) if len(axis) else None
    env = jinja2.Environment(autoescape=True, undefined=jinja2.StrictUndefined)
    return env.from_string(TEMPLATE).render(
        is_text=is_text,
        model=analysis.model,
        version=__version__,
        created=m.created,
        cells_done=int((pc["state"] == "done").sum()),
        cells_total=len(pc),
        suites=analysis.suites,
        backends=analysis.backends,
        warns=warnings(analysis),
        load=load,
        speculative=speculative,
        axes=axes,
        cell_axis="concurrency / background load" if heads else "TP size / batch size",
        unique_tables=[(s, published_table(analysis, s, "unique_mean")) for s in analysis.suites],
        div_tables=[(s, published_table(analysis, s, "maxprob_div_mean")) for s in analysis.suites],
        summary=summary_rows(analysis),
        summary_classes=summary_classes,
        definitions=definitions(analysis.summary.to_dict("records")),
        suite_figs=suite_figs,
        cells=cell_rows(analysis),
        cell_classes=["bad" if s != "done" else "" for s in pc["state"]],
        emulated=bool((pc["tp_mode"] == "emulated").any()),
        emulated_note=EMULATED_NOTE,
        command=cmd,
        recorded=recorded,
        config=yaml_dump(m.config),
        model_info=yaml_dump(m.model) if m.model else "",
        environment=yaml_dump(m.environment),
    )


def write_html(analysis: Analysis, path: str | Path) -> Path:
    return write_file(path, render_html(analysis))


__all__ = ["render_html", "write_html"]
