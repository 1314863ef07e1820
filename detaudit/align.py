"""Rollout-vs-trainer alignment: sample rollouts on one engine/TP (incremental decode with a KV cache,
batched), re-score exactly those tokens on another (one full-sequence forward per sequence, as a
training step computes it), and compare the probabilities of the sampled tokens."""

from __future__ import annotations

import math
import re
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import pandas as pd

from detaudit.config import DecodingParams, ModelRef
from detaudit.errors import DetauditError


@dataclass(frozen=True)
class Side:
    engine: str
    tp: int

    @classmethod
    def parse(cls, text: str, option: str) -> "Side":
        engine, _, tp = text.partition(":")
        if not re.fullmatch(r"[0-9]{1,3}", tp):
            raise DetauditError(f"{option} {text!r}: expected ENGINE:TP, e.g. builtin:4")
        from detaudit.engines import ENGINES, get_engine

        local = [name for name, info in ENGINES.items() if not info.server]
        if engine not in local:
            raise DetauditError(
                f"{option} {text[:60]!r}: unknown engine {engine[:40]!r} (align runs the engines that load the "
                f"model themselves: {', '.join(local)})"
            )
        get_engine(engine)  # an engine whose extra is not installed fails here, naming it
        if int(tp) not in (1, 2, 4, 8):
            raise DetauditError(f"{option} {text!r}: TP size must be one of 1, 2, 4, 8")
        return cls(engine, int(tp))

    def __str__(self) -> str:
        return f"{self.engine}:{self.tp}"


def metrics(rollout_lp: np.ndarray, trainer_lp: np.ndarray) -> dict[str, float]:
    """Per-token comparison of the sampled tokens' log-probabilities (fp32 values as recorded).
    kl: the sample estimate of KL(rollout || trainer) = mean(log p_r - log p_t) over tokens sampled
    from the rollout policy."""
    r = np.asarray(rollout_lp, dtype=np.float64)
    t = np.asarray(trainer_lp, dtype=np.float64)
    if r.size == 0:
        return {
            "tokens": 0,
            "bitwise_equal_frac": math.nan,
            "dp_max": math.nan,
            "dp_mean": math.nan,
            "dp_std": math.nan,
            "pearson": math.nan,
            "kl": math.nan,
        }
    pr, pt = np.exp(r), np.exp(t)
    dp = np.abs(pr - pt)
    pearson = (
        float(np.corrcoef(pr, pt)[0, 1])
        if r.size > 1 and pr.std() > 0 and pt.std() > 0
        else (1.0 if np.array_equal(pr, pt) else math.nan)
    )
    return {
        "tokens": int(r.size),
        "bitwise_equal_frac": float(np.mean(np.asarray(rollout_lp, np.float32) == np.asarray(trainer_lp, np.float32))),
        "dp_max": float(dp.max()),
        "dp_mean": float(dp.mean()),
        "dp_std": float(dp.std()),
        "pearson": pearson,
        "kl": float(np.mean(r - t)),
    }


@dataclass(frozen=True)
class AlignConfig:
    rollout: Side
    trainer: Side
    backends: tuple[str, ...]
    model: str
    suite: str
    decoding: DecodingParams
    batch_size: int = 8
    limit: int | None = None
    tp_mode: str = "real"
    dtype: str = "bfloat16"
    device: str = "cpu"

    def __post_init__(self) -> None:
        from detaudit.backends import check_backends
        from detaudit.config import MAX_BATCH, check_limit

        check_backends(self.backends)
        if not 1 <= self.batch_size <= MAX_BATCH:
            raise DetauditError(f"--batch-size must be between 1 and {MAX_BATCH} (got {self.batch_size})")
        check_limit(self.limit)
        if self.tp_mode not in ("real", "emulated"):
            raise DetauditError(f"--tp-mode {self.tp_mode}: must be real or emulated")
        from detaudit.config import EngineSettings

        EngineSettings(dtype=self.dtype, device=self.device)  # refused here, before any model work


def align(
    cfg: AlignConfig, output_path: Path, *, data_dir: Path | None, command: str, console
) -> tuple[pd.DataFrame, list[Path]]:
    """The whole workflow: prompts, rollouts, re-scoring, summary, files. Returns (summary, files)."""
    from rich.progress import Progress

    from detaudit.engines import get_engine
    from detaudit.fingerprint import collect
    from detaudit.inputs import check_model, eos_ids, load_suites, tokenize, tokenizer_for
    from detaudit.models import resolve_model

    (suite,) = load_suites([cfg.suite], data_dir, cfg.limit)
    ref = resolve_model(cfg.model, auto_prepare=True, console=console)
    tok = tokenizer_for(ref.path)
    ps = tokenize(suite, tok)
    for side in (cfg.rollout, cfg.trainer):
        info = get_engine(side.engine)
        check_model(ref, [side.tp], info.checks_architecture, [ps], cfg.decoding.max_new_tokens, info.max_context)
    with Progress(console=console) as prog:  # rollout tokens sampled, over all backends
        task = prog.add_task(
            f"rollouts {cfg.rollout} -> trainer {cfg.trainer}",
            total=len(cfg.backends) * len(ps.ids) * cfg.decoding.max_new_tokens,
        )
        df = run_align(
            cfg,
            ref,
            ps.token_ids,
            ps.ids,
            tuple(eos_ids(ref, tok)),
            progress=lambda n: prog.advance(task, n),
        )
    summary = summarize(df)
    env = collect()
    meta = {
        "command": command,
        "model": ref.name,
        "model_checksum": ref.checksum,
        "suite": suite.name,
        "rollout": str(cfg.rollout),
        "trainer": str(cfg.trainer),
        "batch_size": cfg.batch_size,
        "decoding": cfg.decoding.to_dict(),
        "dtype": cfg.dtype,
        "tp_mode": cfg.tp_mode,
        "machine": env.get("hardware_key"),
        "versions": env.get("versions"),
    }
    return summary, write_alignment(df, summary, output_path, meta)


def run_align(
    cfg: AlignConfig,
    model: ModelRef,
    prompts: list[list[int]],
    prompt_ids: list[str],
    eos: tuple[int, ...],
    progress=None,
) -> pd.DataFrame:
    """One row per (backend, prompt, position)."""
    from detaudit.config import EngineOptions, EngineSettings
    from detaudit.engines import get_engine, open_engine

    rows = []
    for backend in cfg.backends:

        def _open(side: Side):
            tp_mode = cfg.tp_mode if cfg.tp_mode in get_engine(side.engine).tp_modes else "real"
            settings = EngineSettings(name=side.engine, dtype=cfg.dtype, device=cfg.device)
            options = EngineOptions(settings, model, backend, side.tp, tp_mode, eos, max_batch_size=cfg.batch_size)
            return open_engine(options)

        eng = _open(cfg.rollout)
        try:
            gens = eng.generate(prompts, prompt_ids, cfg.decoding, cfg.batch_size, progress=progress)
        finally:
            eng.close()
        eng = _open(cfg.trainer)
        try:
            scores = eng.score(prompts, [g.token_ids for g in gens], 1)  # one forward per sequence
        finally:
            eng.close()
        if scores is None:
            raise DetauditError(f"--trainer {cfg.trainer}: this engine cannot score given tokens")
        for pid, g, s in zip(prompt_ids, gens, scores):
            for i, (tok, lr, lt) in enumerate(zip(g.token_ids, g.token_logprobs, s)):
                rows.append(
                    {
                        "model": model.name,
                        "backend": backend,
                        "rollout": str(cfg.rollout),
                        "trainer": str(cfg.trainer),
                        "prompt_id": pid,
                        "position": i,
                        "token_id": tok,
                        "rollout_logprob": lr,
                        "trainer_logprob": lt,
                    }
                )
    return pd.DataFrame(rows)


def summarize(df: pd.DataFrame) -> pd.DataFrame:
    out = []
    for (backend, rollout, trainer), g in df.groupby(["backend", "rollout", "trainer"], sort=False):
        out.append(
            {
                "backend": backend,
                "rollout": rollout,
                "trainer": trainer,
                **metrics(g["rollout_logprob"].to_numpy(np.float32), g["trainer_logprob"].to_numpy(np.float32)),
            }
        )
    return pd.DataFrame(out)


def write_alignment(df: pd.DataFrame, summary: pd.DataFrame, out_dir: Path, meta: dict) -> list[Path]:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    from detaudit.runs import atomic_write_bytes, write_alignment_data

    files = write_alignment_data(out_dir, df, summary.to_dict(orient="records"), meta)
    p = out_dir / "alignment.csv"
    atomic_write_bytes(p, summary.to_csv(index=False).encode())
    files.append(p)
    md = [
        "# Rollout vs trainer alignment",
        "",
        f"Command: `{meta.get('command', '')}`",
        "",
        f"Model: {meta.get('model')}; rollout {meta.get('rollout')} (incremental decode, KV cache, batch "
        f"{meta.get('batch_size')}); trainer {meta.get('trainer')} (one full-sequence forward per sequence).",
        "",
        f"Machine: {meta.get('machine', 'not recorded')}.",
        "",
        summary.to_markdown(index=False, floatfmt=".3g"),
        "",
        "bitwise_equal_frac: share of sampled tokens whose fp32 log-probability is bitwise equal on both sides. "
        "dp = |p_rollout - p_trainer|. kl: sample estimate of KL(rollout || trainer) = mean(log p_r - log p_t).",
        "",
    ]
    fig, ax = plt.subplots(figsize=(8, 4))
    for backend, g in df.groupby("backend", sort=False):
        dp = (np.exp(g["rollout_logprob"]) - np.exp(g["trainer_logprob"])).abs()
        ax.scatter(g["position"], dp, s=4, label=backend, alpha=0.6)
    ax.set_xlabel("output position")
    ax.set_ylabel("|p_rollout - p_trainer|")
    ax.set_yscale("symlog", linthresh=1e-6)
    ax.legend()
    fig.tight_layout()
    p = out_dir / "alignment-dp.png"
    fig.savefig(p, dpi=110)
    plt.close(fig)
    files.append(p)
    md.append("![|dp| by position](alignment-dp.png)")
    p = out_dir / "alignment.md"
    atomic_write_bytes(p, ("\n".join(md) + "\n").encode())
    files.append(p)
    return files
