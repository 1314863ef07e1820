"""Run a sweep: expand the grid, run every pending cell, write one Parquet file per cell.

One engine per (backend, TP), reused across suites and batch sizes. A failed cell (worker crash or
hang) is recorded with its reason and the sweep goes on; completed cells are never recomputed.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from itertools import groupby
from pathlib import Path
from typing import Any

from rich.console import Console
from rich.markup import escape
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn, TimeRemainingColumn

from detaudit import fingerprint
from detaudit.config import Cell, SweepConfig
from detaudit.errors import CellFailed, DetauditError
from detaudit.store import RunDir, now

ENGINES = ("builtin", "vllm")


@dataclass
class PromptSet:
    suite: str
    ids: list[str]
    token_ids: list[list[int]]
    hashes: list[str]
    answers: list[str | None]
    checksum: str
    source: str


@dataclass
class SweepResult:
    run_dir: Path
    done: list[str] = field(default_factory=list)
    skipped: list[str] = field(default_factory=list)
    failed: dict[str, str] = field(default_factory=dict)
    timings: dict[str, dict[str, float]] = field(default_factory=dict)


def validate_devices(cfg: SweepConfig) -> None:
    if cfg.device.startswith("cuda"):
        import torch

        n = torch.cuda.device_count()
        if n == 0:
            raise DetauditError("--device cuda: no CUDA device is visible")
        if cfg.tp_mode == "real" and max(cfg.tp) > n:
            raise DetauditError(f"--tp {max(cfg.tp)} needs {max(cfg.tp)} GPUs in real TP mode but {n} are visible "
                                "(use --tp-mode emulated to audit it on fewer)")


def tokenizer_for(model_path: Path):
    from transformers import AutoTokenizer

    try:
        return AutoTokenizer.from_pretrained(str(model_path))
    except Exception as e:
        raise DetauditError(f"cannot load the tokenizer of {model_path}: {e}") from None


def eos_ids(model_path: Path, tokenizer) -> list[int]:
    import json

    ids: set[int] = set()
    for fname in ("generation_config.json", "config.json"):
        f = model_path / fname
        if f.exists():
            v = json.loads(f.read_text()).get("eos_token_id")
            ids.update(v if isinstance(v, list) else [v] if v is not None else [])
    if tokenizer.eos_token_id is not None:
        ids.add(tokenizer.eos_token_id)
    return sorted(ids)


def load_suites(cfg: SweepConfig, data_dir: Path | None) -> list:
    from detaudit.suites import load_suite

    suites = [load_suite(name, data_dir=data_dir, limit=cfg.limit) for name in cfg.suites]
    for s, name in zip(suites, cfg.suites):
        if s.name != name:
            raise DetauditError(f"--suites {name}: name suites by their task name ({s.name!r}), "
                                "or keep the YAML file name equal to its task")
    return suites


def tokenize_suites(suites: list, tokenizer) -> dict[str, PromptSet]:
    from detaudit.suites import prompt_hash, prompt_token_ids

    out = {}
    for suite in suites:
        name = suite.name
        toks = [prompt_token_ids(tokenizer, p) for p in suite.prompts]
        out[name] = PromptSet(
            suite=suite.name,
            ids=[p.id for p in suite.prompts],
            token_ids=toks,
            hashes=[prompt_hash(t) for t in toks],
            answers=[p.answer for p in suite.prompts],
            checksum=suite.checksum,
            source=suite.source,
        )
    return out


def parse_shard(text: str | None) -> tuple[int, int] | None:
    if not text:
        return None
    try:
        i, n = (int(x) for x in text.split("/"))
    except ValueError:
        raise DetauditError(f"--shard {text!r}: expected I/N, e.g. 2/4") from None
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
    refs = {reference_cell(cfg, c) for c in mine}
    return [c for c in cells if c in mine or c in refs]


def build_manifest(cfg: SweepConfig, model, prompts: dict[str, PromptSet], env: dict, command: str,
                   cells_sel: list[Cell] | None = None, shard: tuple[int, int] | None = None) -> dict[str, Any]:
    import hashlib
    import json

    comparable = {
        "model_checksum": model.checksum,
        "suites": {s: p.checksum for s, p in prompts.items()},
        "prompt_hashes": {s: hashlib.sha256("".join(p.hashes).encode()).hexdigest()[:16] for s, p in prompts.items()},
        "decoding": cfg.decoding.to_dict(),
        "dtype": cfg.dtype,
        "limit": cfg.limit,
        "engine": cfg.engine,
    }
    if cfg.device.startswith("cuda"):  # graphs change bf16's attention shapes (not bio's bits)
        comparable["cuda_graphs"] = cfg.cuda_graphs
    cells = {
        c.id: {"backend": c.backend, "tp": c.tp, "batch_size": c.batch_size, "suite": c.suite,
               "tp_mode": "emulated" if (cfg.tp_mode == "emulated" and c.tp > 1) else "real",
               "engine": cfg.engine, "state": "pending", "prompts": len(prompts[c.suite].ids)}
        for c in (cells_sel if cells_sel is not None else cfg.cells())
    }
    return {
        "command": command,
        "config": {**cfg.to_dict(), "shard": list(shard) if shard else None},
        "comparable": comparable,
        "comparable_key": hashlib.sha256(json.dumps(comparable, sort_keys=True).encode()).hexdigest()[:16],
        "code_version": env["versions"]["detaudit"],
        "git_hash": env.get("git_hash"),
        "model": {"name": model.name, "path": str(model.path), "architecture": model.architecture, "checksum": model.checksum},
        "suites": {s: {"checksum": p.checksum, "source": p.source, "prompts": len(p.ids)} for s, p in prompts.items()},
        "environment": env,
        "hardware_key": env["hardware_key"],
        "cells": cells,
        "backends": {},
    }


def reference_cell(cfg: SweepConfig, cell: Cell) -> Cell:
    """Teacher forcing: every cell of a (backend, suite) scores the first such cell's outputs."""
    return next(c for c in cfg.cells() if c.backend == cell.backend and c.suite == cell.suite)


def run_sweep(cfg: SweepConfig, output_path: Path, *, data_dir: Path | None = None, console: Console | None = None,
              command: str = "", hang_timeout: float = 300.0, shard: tuple[int, int] | None = None) -> SweepResult:
    from detaudit.backends import available

    console = console or Console(stderr=True)
    known = available()
    for b in cfg.backends:
        if b not in known:
            raise DetauditError(f"unknown backend {b!r}; known backends: {', '.join(known)}")
    if cfg.engine not in ENGINES:
        raise DetauditError(f"unknown engine {cfg.engine!r} (available: {', '.join(ENGINES)})")
    if cfg.engine == "vllm":
        from detaudit.vllm import require_vllm

        require_vllm()
        if cfg.tp_mode != "real":
            raise DetauditError("--engine vllm runs real TP only (drop --tp-mode emulated)")
    validate_devices(cfg)
    suites = load_suites(cfg, data_dir)  # bad suites fail before any model work
    from detaudit.models import resolve_model

    model = resolve_model(cfg.model, auto_prepare=True, console=console)
    from detaudit.engine.model import ModelConfig

    mcfg = ModelConfig.from_dir(model.path)
    for tp in cfg.tp:
        mcfg.check_tp(tp)
    tokenizer = tokenizer_for(model.path)
    prompts = tokenize_suites(suites, tokenizer)
    env = fingerprint.collect()
    run = RunDir(output_path)
    result = SweepResult(run_dir=run.path)
    with run.locked():
        cells = shard_cells(cfg, shard)
        done = set(run.init_or_check(build_manifest(cfg, model, prompts, env, command, cells, shard)))
        result.skipped = [c.id for c in cells if c.id in done]
        todo = [c for c in cells if c.id not in done]
        if result.skipped:
            console.print(f"[dim]{len(result.skipped)} completed cell(s) found in {run.path}; skipping them[/]")
        eos = eos_ids(model.path, tokenizer)
        progress = Progress(TextColumn("{task.description}"), BarColumn(), MofNCompleteColumn(),
                            TimeElapsedColumn(), TimeRemainingColumn(), console=console, transient=False)
        with progress:
            overall = progress.add_task("cells", total=len(cells), completed=len(result.skipped))
            for (backend, tp), group in groupby(todo, key=lambda c: (c.backend, c.tp)):
                _run_engine_cells(cfg, run, model, tokenizer, prompts, eos, backend, tp, list(group),
                                  progress, overall, result, hang_timeout)
    return result


def _run_engine_cells(cfg, run, model, tokenizer, prompts, eos, backend, tp, cells, progress, overall, result, hang_timeout):
    from detaudit.engine import open_engine

    engine = None
    load_s = 0.0
    try:
        for cell in cells:
            ps = prompts[cell.suite]
            task = progress.add_task(f"{cell.id}", total=len(ps.ids) * cfg.decoding.max_new_tokens)
            t0 = time.monotonic()
            try:
                if engine is None:
                    progress.update(task, description=f"{cell.id} [dim](starting engine)[/]")
                    engine = open_engine(model.path, backend, tp, cfg.tp_mode, dtype=cfg.dtype, device=cfg.device,
                                         eos_ids=eos, hang_timeout=hang_timeout, engine=cfg.engine,
                                         max_batch_size=max(c.batch_size for c in cells), cuda_graphs=cfg.cuda_graphs)
                    load_s = time.monotonic() - t0
                    run.manifest["backends"][f"{backend}@tp{tp}"] = engine.describe()
                    progress.update(task, description=cell.id)
                t1 = time.monotonic()
                gens = engine.generate(ps.token_ids, ps.ids, cfg.decoding, cell.batch_size,
                                       progress=lambda n: progress.advance(task, n))
                gen_s = time.monotonic() - t1
                ref = reference_cell(cfg, cell)
                if ref.id == cell.id:
                    continuations = [g.token_ids for g in gens]
                else:
                    continuations = _reference_outputs(run, ref)
                tf = engine.score(ps.token_ids, continuations, cell.batch_size) if continuations is not None else None
                rows = _rows(cfg, cell, model, tokenizer, ps, gens, tf, ref.id if tf is not None else None)
                wall = time.monotonic() - t0
                timing = {"wall_s": round(wall, 3), "engine_start_s": round(load_s, 3), "generate_s": round(gen_s, 3)}
                if cfg.engine != "builtin":  # vLLM: knobs of the engine that ran this batch size
                    run.manifest["backends"][f"{backend}@tp{tp}@bs{cell.batch_size}"] = engine.describe()
                run.write_cell(cell.id, rows, {**timing, "finished": now(), "tp_mode": "emulated" if engine_emulated(engine) else "real"})
                result.done.append(cell.id)
                result.timings[cell.id] = timing
                load_s = 0.0
            except CellFailed as e:
                result.failed[cell.id] = str(e)
                run.mark(cell.id, "failed", error=str(e), finished=now())
                progress.console.print(f"[red]cell {cell.id} failed:[/] {escape(str(e))}")
                if engine is not None:
                    engine.close()
                    engine = None
            finally:
                progress.remove_task(task)
                progress.advance(overall)
    finally:
        if engine is not None:
            engine.close()


def engine_emulated(engine) -> bool:
    return bool(getattr(engine, "emulated", False)) and getattr(engine, "tp", 1) > 1


def _reference_outputs(run: RunDir, ref: Cell) -> list[list[int]] | None:
    meta = run.manifest["cells"].get(ref.id, {})
    if meta.get("state") != "done":
        return None
    df = run.read_cell(ref.id)
    return [list(map(int, x)) for x in df["output_token_ids"]]


def _rows(cfg, cell, model, tokenizer, ps: PromptSet, gens, tf, ref_id) -> list[dict]:
    from detaudit.grading import extract_answer, is_correct

    rows = []
    for i, g in enumerate(gens):
        text = tokenizer.decode(g.token_ids, skip_special_tokens=True)
        answer = ps.answers[i]
        rows.append({
            "cell_id": cell.id, "model": model.name, "suite": cell.suite, "backend": cell.backend,
            "tp": cell.tp, "batch_size": cell.batch_size,
            "tp_mode": "emulated" if (cfg.tp_mode == "emulated" and cell.tp > 1) else "real",
            "engine": cfg.engine, "prompt_index": i, "prompt_id": ps.ids[i], "prompt_hash": ps.hashes[i],
            "prompt_tokens": len(ps.token_ids[i]), "output_token_ids": g.token_ids, "output_text": text,
            "finish_reason": g.finish_reason, "token_logprobs": g.token_logprobs, "topk_ids": g.topk_ids,
            "topk_logprobs": g.topk_logprobs, "reference_answer": answer,
            "predicted_answer": extract_answer(text),
            "correct": is_correct(text, answer) if answer is not None else None,
            "tf_reference_cell": ref_id, "tf_token_logprobs": tf[i] if tf is not None else None,
        })
    return rows
