"""Run a sweep: expand the grid, hand each (engine, backend, TP) group to an executor, write one
Parquet file per finished cell.

One engine per (backend, TP) serves every suite and batch size of it. A failed cell (worker crash or
hang) is recorded with its reason and the sweep goes on; completed cells are never recomputed.
The driver alone writes the run directory (`runs.RunDir`), whichever executor ran the cell.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field, replace
from itertools import groupby
from pathlib import Path

from rich.console import Console
from rich.markup import escape

from detaudit.config import Cell, DecodingParams, EngineOptions, ModelRef, Speculative, SweepConfig
from detaudit.engines import EngineInfo, check_engine_backends, check_tp_mode, get_engine, native_backend_names
from detaudit.errors import DetauditError
from detaudit.executors import CellGroup, CellJob, CellOutput, get_executor
from detaudit.inputs.prepare import (
    PromptSet,
    check_model,
    eos_ids,
    load_suites,
    resolve_speculative,
    tokenize,
    tokenizer_for,
)
from detaudit.progress import CellProgress
from detaudit.runs import fingerprint
from detaudit.runs.manifest import MAX_CELL_ID, CellMeta, Manifest, check_cell_id, numerics_conflicts
from detaudit.runs.rundir import LOGS, RunDir, now


@dataclass
class SweepResult:
    run_dir: Path
    done: list[str] = field(default_factory=list)
    skipped: list[str] = field(default_factory=list)
    failed: dict[str, str] = field(default_factory=dict)
    timings: dict[str, dict[str, float]] = field(default_factory=dict)


def validate_devices(cfg: SweepConfig) -> None:
    if cfg.engine.cuda and cfg.executor == "local":  # on Ray the cluster's nodes hold the GPUs
        import torch

        n = torch.cuda.device_count()
        if n == 0:
            raise DetauditError("--device cuda: no CUDA device is visible")
        if cfg.tp_mode == "real" and max(cfg.tp) > n:
            raise DetauditError(
                f"--tp {max(cfg.tp)} needs {max(cfg.tp)} GPUs in real TP mode but {n} are visible "
                "(use --tp-mode emulated to audit it on fewer)"
            )


def validate(cfg: SweepConfig) -> EngineInfo:
    """Everything about the grid that can be refused before any work; the engine's registry entry."""
    from detaudit.backends import check_backends

    check_backends(cfg.backends, native=native_backend_names())
    info = get_engine(cfg.engine.name)
    check_engine_backends(info, cfg.backends)
    check_tp_mode(info, cfg.tp_mode)
    if not info.server and (cfg.repeats != 1 or any(cfg.background_load) or cfg.engine.server):
        raise DetauditError(
            f"--repeats, --background-load and the server options (--base-url, --api, ...) apply to server "
            f"engines (openai, vllm-server), not --engine {info.name}"
        )
    unsupported = [str(s) for s in cfg.speculative_settings() if s.on and s.kind not in info.speculative]
    if unsupported:
        can = f"only {', '.join(info.speculative)}" if info.speculative else "none"
        raise DetauditError(
            f"--speculative {','.join(unsupported)}: --engine {info.name} runs {can} (speculative decoding happens "
            "inside an engine: audit a server started with it through its own settings)"
        )
    if info.check is not None:
        info.check(cfg)
    validate_devices(cfg)
    return info


def parse_shard(text: str | None) -> tuple[int, int] | None:
    if not text:
        return None
    match = re.fullmatch(r"([0-9]{1,6})/([0-9]{1,6})", text.strip())
    if not match:
        raise DetauditError(f"--shard {text[:40]!r}: expected I/N, e.g. 2/4")
    i, n = int(match.group(1)), int(match.group(2))
    if n < 1 or not 1 <= i <= n:
        raise DetauditError(f"--shard {text!r}: need 1 <= I <= N")
    return i, n


def shard_cells(cfg: SweepConfig, shard: tuple[int, int] | None) -> list[Cell]:
    """Shard I of N takes every N-th cell of the grid (grid order), plus the teacher-forcing
    reference cell of each (backend, suite) it touches, so it can score against it."""
    cells = cfg.cells()
    if shard is None:
        return cells
    i, n = shard
    mine = [c for k, c in enumerate(cells) if k % n == i - 1]
    if not mine:
        raise DetauditError(f"--shard {i}/{n}: the grid has {len(cells)} cells, so shard {i} holds none")
    refs = {cfg.reference(c) for c in mine}
    return [c for c in cells if c in mine or c in refs]


def check_cell_ids(cfg: SweepConfig) -> None:
    """Cell ids name the run's files and are checked on every read (`manifest.check_cell_id`): a suite
    whose task name would make an id no reader accepts (too long) is refused here, by its name, before the
    run directory exists."""
    for cell in cfg.cells():
        try:
            check_cell_id(cell.id, "cell id")
        except DetauditError:
            raise DetauditError(
                f"suite {cell.suite[:40]!r}{'...' if len(cell.suite) > 40 else ''}: its task name ({len(cell.suite)} "
                f"characters) makes cell ids of {len(cell.id)}; a cell id is at most {MAX_CELL_ID} characters "
                "(it names the cell's file): shorten `task:`"
            ) from None


def build_manifest(
    cfg: SweepConfig,
    model,
    prompts: dict[str, PromptSet],
    env: dict,
    command: str,
    cells: list[Cell],
    shard: tuple[int, int] | None = None,
    spec: dict[str, Speculative] | None = None,
) -> Manifest:
    """`spec`: label -> the speculative setting, its draft model resolved (`inputs.resolve_speculative`)."""
    spec = spec or {}
    identity = {
        "model_checksum": model.checksum,
        "suites": {s: p.checksum for s, p in prompts.items()},
        "prompt_hashes": {s: p.digest() for s, p in prompts.items()},
        "decoding": cfg.decoding.to_dict(),
        "dtype": cfg.engine.dtype,
        "limit": cfg.limit,
        "engine": cfg.engine.name,
    }
    if any(_decoding(cfg, p) != cfg.decoding for p in prompts.values()):  # a suite's generation_kwargs
        identity["suite_decoding"] = {s: _decoding(cfg, p).to_dict() for s, p in prompts.items()}
    if cfg.engine.cuda:  # graphs change bf16's attention shapes (not bio's bits)
        identity["cuda_graphs"] = cfg.engine.cuda_graphs
    labels = {cell.speculative for cell in cells}
    return Manifest(
        command=command,
        config={**cfg.to_dict(), "shard": list(shard) if shard else None},
        identity=identity,
        code_version=env["versions"]["detaudit"],
        git_hash=env.get("git_hash"),
        model={
            "name": model.name,
            "path": str(model.path),
            "architecture": model.architecture,
            "checksum": model.checksum,
        },
        suites={
            s: {
                "checksum": p.checksum,
                "source": p.source,
                "prompts": len(p.ids),
                "ungraded": len(p.ungraded),
                "ignored_keys": list(p.ignored_keys),
                "chat_template": p.chat_template,
                "decoding": _decoding(cfg, p).to_dict(),
            }
            for s, p in prompts.items()
        },
        environment=env,
        hardware_key=env["hardware_key"],
        speculative={label: s.describe() for label, s in spec.items() if s.on and label in labels},
        cells={
            c.id: CellMeta(
                c.backend,
                c.tp,
                c.batch_size,
                c.suite,
                tp_mode=cfg.tp_mode_of(c.tp),
                engine=cfg.engine.name,
                prompts=len(prompts[c.suite].ids) * cfg.repeats,  # records: one per prompt and repeat
            )
            for c in cells
        },
    )


def prepare(cfg: SweepConfig, data_dir: Path | None, console: Console, notes: list[str] | None = None):
    """Suites, model and prompts, checked before any engine starts (bad input fails fast). Each suite gets
    its own decoding (its `generation_kwargs` under the command line's flags) and prompt form, described by
    a line per suite: printed once the checks pass, or added to `notes` for the caller to print once its
    own checks pass (refused input stays one line)."""
    from detaudit.decoding import decoding_sources, describe, suite_decoding
    from detaudit.inputs.prepare import MAX_CHARS_PER_TOKEN, chat_form
    from detaudit.inputs.prompt_limits import model_context_len
    from detaudit.models import resolve_model

    suites = load_suites(cfg.suites, data_dir, cfg.limit, cfg.trust_suite_paths)
    model = resolve_model(cfg.model, auto_prepare=True, console=console)
    info = get_engine(cfg.engine.name)
    if info.check_model is not None:
        info.check_model(model, cfg)
    check_model(model, cfg.tp, info.checks_architecture)  # an unsupported architecture first, by name
    max_chars = model_context_len(model, cap=info.max_context) * MAX_CHARS_PER_TOKEN
    tokenizer = tokenizer_for(model.path)
    prompts, lines = {}, []
    for s in suites:
        decoding, overrides = suite_decoding(cfg.decoding, s.generation, cfg.decoding_flags)
        chat = chat_form(s, tokenizer, cfg.apply_chat_template)
        if not chat and cfg.engine.server is not None and cfg.engine.server.api == "chat":
            raise DetauditError(
                f"--api chat has the server apply its chat template, but suite {s.name}'s prompts are plain text "
                "(lm-eval's default for task files); pass --apply-chat-template or use --api completions"
            )
        prompts[s.name] = tokenize(s, tokenizer, chat, max_chars, decoding)
        form = "chat template" if chat else "plain text"
        sources = decoding_sources(cfg.decoding, s.generation, cfg.decoding_flags)  # file, lm-eval, flags, ours
        origin = "; ".join(f"{where}: {', '.join(values)}" for where, values in sources.items())
        lines.append(f"[dim]suite {escape(s.name)}: {form}; {escape(describe(decoding))} ({escape(origin)})[/]")
        if overrides:
            lines.append(
                f"[yellow]note:[/] suite {escape(s.name)}: the command line overrides its generation_kwargs: "
                f"{escape('; '.join(overrides))}"
            )
    check_model(
        model,
        cfg.tp,
        info.checks_architecture,
        list(prompts.values()),
        cfg.decoding.max_new_tokens,
        info.max_context,
    )
    spec = resolve_speculative(cfg.speculative_settings(), model, tokenizer, info.checks_architecture, console)
    if notes is None:
        for line in lines:
            console.print(line, highlight=False, soft_wrap=True)
    else:
        notes += lines
    for ps in prompts.values():
        if ps.ignored_keys:
            console.print(
                f"[dim]suite {escape(ps.suite)}: ignored lm-eval keys (detaudit does not use them): "
                f"{escape(', '.join(ps.ignored_keys))}[/]"
            )
        if ps.ungraded:
            shown = ", ".join(ps.ungraded[:5]) + (", ..." if len(ps.ungraded) > 5 else "")
            console.print(
                f"[yellow]warning:[/] suite {escape(ps.suite)}: {len(ps.ungraded)} row(s) have no answer "
                f"and are kept ungraded: {escape(shown)}"
            )
    return suites, model, tokenizer, prompts, spec


def _decoding(cfg: SweepConfig, ps: PromptSet) -> DecodingParams:
    return ps.decoding if ps.decoding is not None else cfg.decoding


def _prompt_rows(prompts: dict[str, PromptSet], tokenizer) -> list[dict]:
    """`prompts.parquet`: every prompt once, as rendered and as the model read it."""
    return [
        {
            "suite": ps.suite,
            "prompt_index": i,
            "prompt_id": pid,
            "prompt_hash": ps.hashes[i],
            "text": ps.texts[i],
            "prompt_text": tokenizer.decode(ps.token_ids[i], skip_special_tokens=False),
            "token_ids": ps.token_ids[i],
            "chat_template": ps.chat_template,
            "reference_answer": ps.answers[i],
        }
        for ps in prompts.values()
        for i, pid in enumerate(ps.ids)
    ]


def run_sweep(
    cfg: SweepConfig,
    output_path: Path,
    *,
    data_dir: Path | None = None,
    console: Console | None = None,
    command: str = "",
    shard: tuple[int, int] | None = None,
    executor_options: dict | None = None,
) -> SweepResult:
    console = console or Console(stderr=True)
    info = validate(cfg)
    executor = get_executor(cfg.executor, **(executor_options or {}))  # a missing extra fails before any work
    shard_cells(cfg, shard)  # an empty shard too
    RunDir(output_path).preflight()  # and an unusable output path
    notes: list[str] = []
    suites, model, tokenizer, prompts, spec = prepare(cfg, data_dir, console, notes)
    cfg = replace(cfg, suites=tuple(prompts))  # YAML paths -> task names: cells are named by the task
    check_cell_ids(cfg)
    env = fingerprint.collect()
    run = RunDir(output_path)
    result = SweepResult(run_dir=run.path)
    # everything that can still refuse the sweep (a server that does not answer its probe) before the run
    # directory is made
    cells = shard_cells(cfg, shard)
    manifest = build_manifest(cfg, model, prompts, env, command, cells, shard, spec)
    manifest.executor = executor.describe()
    _engine_identity(info, cfg, manifest, model)
    with run.locked():
        done = set(run.init_or_check(manifest))
        for line in notes:  # each suite's decoding, once the run directory took the sweep
            console.print(line, highlight=False, soft_wrap=True)
        run.write_prompts(_prompt_rows(prompts, tokenizer))
        result.skipped = [c.id for c in cells if c.id in done]
        todo = [c for c in cells if c.id not in done]
        if result.skipped:
            console.print(f"[dim]{len(result.skipped)} completed cell(s) found in {run.path}; skipping them[/]")
        if info.numerics is not None:  # numerics known before any engine opens: refuse a mixed run early
            check_numerics(run, {f"{b}@tp{tp}": info.numerics(b) for b, tp in {(c.backend, c.tp) for c in todo}})
        eos = tuple(eos_ids(model, tokenizer))
        groups = [
            _group(cfg, model, eos, prompts, key[0], key[1], list(g), run.path / LOGS, spec)
            for key, g in groupby(_engine_order(info, cfg, todo), key=lambda c: _engine_key(info, c))
        ]
        by_id = {c.id: c for c in cells}
        scrub = info.scrub(cfg) if info.scrub is not None else None
        with CellProgress(
            console,
            total=len(cells),
            done=len(result.skipped),
            tokens={
                c.id: len(prompts[c.suite].ids) * cfg.repeats * _decoding(cfg, prompts[c.suite]).max_new_tokens
                for c in todo
            },
        ) as progress:

            def on_output(out: CellOutput) -> None:
                cell = by_id[out.cell_id]
                _record(info, run, model, tokenizer, prompts[cell.suite], cfg, cell, out, result, progress, scrub)

            executor.run(groups, lambda ref_id: _reference_outputs(run, ref_id), on_output, progress.event)
    return result


def _engine_key(info: EngineInfo, cell: Cell) -> tuple:
    """The cells one engine serves: a (backend, TP) group, and one speculative setting for engines that
    fix it when they start (`EngineInfo.engine_per_speculative`)."""
    return (cell.backend, cell.tp, cell.speculative) if info.engine_per_speculative else (cell.backend, cell.tp)


def _engine_order(info: EngineInfo, cfg: SweepConfig, cells: list[Cell]) -> list[Cell]:
    """Grid order, with each engine's cells consecutive."""
    if not info.engine_per_speculative:
        return cells
    labels = [s.label for s in cfg.speculative_settings()]
    return sorted(cells, key=lambda c: (cfg.backends.index(c.backend), cfg.tp.index(c.tp), labels.index(c.speculative)))


def _group(
    cfg: SweepConfig,
    model: ModelRef,
    eos: tuple[int, ...],
    prompts: dict[str, PromptSet],
    backend: str,
    tp: int,
    cells: list[Cell],
    log_dir: Path,
    spec: dict[str, Speculative] | None = None,
) -> CellGroup:
    """`spec`: label -> speculative setting with its draft model resolved (absent: off)."""
    spec = spec or {}
    options = EngineOptions(
        settings=cfg.engine,
        model=model,
        backend=backend,
        tp=tp,
        tp_mode=cfg.tp_mode_of(tp),
        eos_ids=eos,
        max_batch_size=max(c.batch_size for c in cells),
        max_background=max(cfg.background_load),
        log_dir=log_dir,
    )
    r = cfg.repeats  # server engines: every prompt sent r times (rows: repeat-major)
    jobs = [
        CellJob(
            c.id,
            c.batch_size,
            prompts[c.suite].ids * r,
            prompts[c.suite].token_ids * r,
            cfg.reference(c).id,
            _decoding(cfg, prompts[c.suite]),
            texts=prompts[c.suite].texts * r,
            background=c.background,
            speculative=spec.get(c.speculative) if c.speculative else None,
        )
        for c in cells
    ]
    return CellGroup(options, jobs)


def _record(
    info: EngineInfo,
    run: RunDir,
    model,
    tokenizer,
    ps: PromptSet,
    cfg: SweepConfig,
    cell: Cell,
    out: CellOutput,
    result: SweepResult,
    progress: CellProgress,
    scrub=None,
) -> None:
    assert run.manifest is not None
    if out.error is not None:
        result.failed[cell.id] = out.error
        run.mark(cell.id, "failed", error=out.error, finished=now())
        progress.failed(cell.id, out.error)
        return
    check_numerics(run, {f"{cell.backend}@tp{cell.tp}": out.describe})  # (any engine: before the cell is written)
    run.manifest.backends[f"{cell.backend}@tp{cell.tp}"] = out.describe
    if info.describes_per_cell:  # vLLM: knobs of the engine that ran this batch size (servers: and load)
        run.manifest.backends[cell.describe_key] = out.describe
    rows = _rows(cfg, cell, model, tokenizer, ps, out, scrub)
    meta = {**out.timing, "finished": now(), "tp_mode": "emulated" if out.emulated else "real"}
    if out.placement:
        meta["placement"] = out.placement
    run.write_cell(cell.id, rows, meta)
    result.done.append(cell.id)
    result.timings[cell.id] = out.timing


def check_numerics(run: RunDir, describes: dict[str, dict]) -> None:
    """Refuse to add cells computed otherwise than the run's earlier cells of the same backend and TP size
    (a resumed run directory made by a detaudit whose kernels compute differently): the run would mix two
    definitions and report the mix as (non-)determinism."""
    assert run.manifest is not None
    clash = numerics_conflicts(run.manifest.backends, describes)
    if clash:
        raise DetauditError(
            f"{run.path} holds cells computed with other numerics than this detaudit's "
            f"(differing: {'; '.join(clash)}); resuming would mix them; use another --output-path"
        )


def _engine_identity(info: EngineInfo, cfg: SweepConfig, manifest: Manifest, model: ModelRef) -> None:
    """An engine that audits something other than the local checkpoint (a running server) identifies it
    its own way; load options that change what a cell holds (repeats, the background's pattern) join the
    identity."""
    if info.identity is not None:
        manifest.identity.pop("model_checksum", None)
        manifest.identity.update(info.identity(EngineOptions(settings=cfg.engine, model=model, backend="")))
    if info.server and cfg.repeats > 1:
        manifest.identity["repeats"] = cfg.repeats
    if info.server and any(cfg.background_load) and cfg.engine.server:
        manifest.identity["load_pattern"] = cfg.engine.server.background_prompts


def _reference_outputs(run: RunDir, ref_id: str) -> list[list[int]] | None:
    assert run.manifest is not None
    meta = run.manifest.cells.get(ref_id)
    if meta is None or meta.state != "done":
        return None
    table = run.read_table(ref_id, ["cell_id", "output_token_ids"])
    return [list(map(int, x)) for x in table.column("output_token_ids").to_pylist()]


def _tf_routing(routes: list | None, k: int) -> dict:
    """The teacher-forced routing columns of record k (null for dense models and engines without it)."""
    experts, gates, margins = routes[k] if routes else (None, None, None)
    return {"tf_route_experts": experts, "tf_route_gates": gates, "tf_route_margins": margins}


def _rows(cfg: SweepConfig, cell: Cell, model, tokenizer, ps: PromptSet, out: CellOutput, scrub=None) -> list[dict]:
    from detaudit.decoding import cut_at_stop
    from detaudit.inputs.grading import extract_answer, is_correct

    assert out.generations is not None
    tf = out.scores
    rows = []
    n = len(ps.ids)
    stops = _decoding(cfg, ps).stop
    for k, g in enumerate(out.generations):
        i, repeat = k % n, (k // n if cfg.repeats > 1 else None)  # --repeats: rows are repeat-major
        text = cut_at_stop(tokenizer.decode(g.token_ids, skip_special_tokens=True), stops)
        text = scrub(text) if scrub is not None else text  # a server's API key, spelled out in its tokens
        answer = ps.answers[i]
        rows.append(
            {
                "cell_id": cell.id,
                "model": model.name,
                "suite": cell.suite,
                "backend": cell.backend,
                "tp": cell.tp,
                "batch_size": cell.batch_size,
                "tp_mode": cfg.tp_mode_of(cell.tp),
                "engine": cfg.engine.name,
                "prompt_index": i,
                "prompt_id": ps.ids[i],
                "prompt_hash": ps.hashes[i],
                "prompt_tokens": len(ps.token_ids[i]),
                "output_token_ids": g.token_ids,
                "output_text": text,
                "finish_reason": g.finish_reason,
                "token_logprobs": g.token_logprobs,
                "topk_ids": g.topk_ids,
                "topk_logprobs": g.topk_logprobs,
                "reference_answer": answer,
                "predicted_answer": extract_answer(text),
                "correct": is_correct(text, answer) if answer is not None else None,
                "tf_reference_cell": out.reference_id,
                "tf_token_logprobs": tf[k] if tf is not None else None,
                "repeat": repeat,
                "route_experts": g.route_experts,
                "route_gates": g.route_gates,
                "route_margins": g.route_margins,
                "speculative": str(cfg.setting_of(cell)) if cell.speculative else None,
                "spec_drafted": g.drafted,
                "spec_accepted": g.accepted,
                **_tf_routing(out.score_routing if tf is not None else None, k),
            }
        )
    return rows
