"""Rollout-vs-trainer alignment: sample rollouts on one engine/TP (incremental decode with a KV cache,
batched), re-score exactly those tokens on another (one full-sequence forward per sequence, as a
training step computes it), and compare the probabilities of the sampled tokens.

Mixture-of-experts models, where both sides record routing (the built-in engine): per sampled token,
the MoE layers whose expert set differs between the rollout's forward and the trainer's, and routing
replay: the trainer re-scores the same tokens with the rollout's expert choices forced, and the replayed
log-probabilities are compared with the rollout's like the plain trainer's. What replay leaves is the
mismatch that routing does not explain."""

from __future__ import annotations

import math
import re
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import pandas as pd

from detaudit.analysis.analyze import routers_differ
from detaudit.analysis.metrics import ALIGN_ROUTING_COLUMNS, specs
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


def routing_metrics(g: pd.DataFrame) -> dict[str, float]:
    """The routing columns of one backend's summary row (NaN where no token has routing on both sides):
    routers (token x MoE layer) and tokens with a differing expert set, and the replayed trainer's
    log-probabilities against the rollout's."""
    out = dict.fromkeys(ALIGN_ROUTING_COLUMNS, math.nan)
    routed = g[g["routers"].notna()] if "routers" in g else g.iloc[:0]
    if len(routed) and routed["routers"].sum():
        out["router_disagree_frac"] = float(routed["routers_disagree"].sum() / routed["routers"].sum())
        out["tokens_router_disagree_frac"] = float((routed["routers_disagree"] > 0).mean())
    replayed = g[g["replay_logprob"].notna()] if "replay_logprob" in g else g.iloc[:0]
    if len(replayed):
        m = metrics(replayed["rollout_logprob"].to_numpy(np.float32), replayed["replay_logprob"].to_numpy(np.float32))
        out.update({f"replay_{k}": m[k] for k in ("bitwise_equal_frac", "dp_max", "dp_mean", "kl")})
    return out


def shown_columns(summary: pd.DataFrame) -> list[str]:
    """The summary's columns less the routing ones no backend has (dense models, engines without routing)."""
    return [c for c in summary.columns if c not in ALIGN_ROUTING_COLUMNS or summary[c].notna().any()]


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
    from detaudit.inputs.prepare import check_model, eos_ids, load_suites, tokenize, tokenizer_for
    from detaudit.models import resolve_model
    from detaudit.runs.fingerprint import collect
    from detaudit.runs.rundir import check_output_dir

    check_output_dir(output_path)  # before the model runs: a path it cannot write is refused first
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
    """One row per (backend, prompt, position). MoE models with routing on both sides: the rollout's and
    the trainer's expert ids (layer-major), the MoE layers (`routers`) and how many of them chose another
    expert set (`routers_disagree`), and the trainer's log-probability under routing replay; empty
    (None / NaN) otherwise."""
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
        replay = None
        try:
            conts = [g.token_ids for g in gens]
            scores = eng.score(prompts, conts, 1)  # one forward per sequence
            routes = getattr(eng, "last_score_routing", None) if scores is not None else None
            routed = routes is not None and all(g.route_experts is not None for g in gens)
            if routed:  # routing replay: the same forwards with the rollout's expert choices
                replay = eng.score(prompts, conts, 1, forced_routing=[g.route_experts for g in gens])
        finally:
            eng.close()
        if scores is None:
            raise DetauditError(f"--trainer {cfg.trainer}: this engine cannot score given tokens")
        for k, (pid, g, s) in enumerate(zip(prompt_ids, gens, scores)):
            routing = _token_routing(g, routes[k]) if routed else None
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
                        "rollout_experts": g.route_experts[i] if routing is not None else None,
                        "trainer_experts": routes[k][0][i] if routing is not None else None,
                        "routers": routing.shape[1] if routing is not None else None,
                        "routers_disagree": int(routing[i].sum()) if routing is not None else None,
                        "replay_logprob": replay[k][i] if replay is not None else math.nan,
                    }
                )
    return pd.DataFrame(rows)


def _token_routing(g, trainer_route: tuple) -> np.ndarray:
    """[positions, MoE layers] bool: whether the trainer's forward chose another expert set than the
    rollout's for a sampled token (`trainer_route`: the trainer's (experts, gates, margins) of the
    sequence)."""
    if not g.route_experts:  # nothing sampled
        return np.zeros((0, 0), dtype=bool)
    rollout = np.asarray(g.route_experts, dtype=np.int64)
    trainer = np.asarray(trainer_route[0], dtype=np.int64)
    if rollout.shape != trainer.shape:
        raise DetauditError(
            f"the rollout and the trainer routed {rollout.shape} and {trainer.shape} (positions x expert ids): "
            "not the same model"
        )
    return routers_differ([rollout, trainer], len(g.route_margins[0]), len(rollout))


def summarize(df: pd.DataFrame) -> pd.DataFrame:
    out = []
    for (backend, rollout, trainer), g in df.groupby(["backend", "rollout", "trainer"], sort=False):
        out.append(
            {
                "backend": backend,
                "rollout": rollout,
                "trainer": trainer,
                **metrics(g["rollout_logprob"].to_numpy(np.float32), g["trainer_logprob"].to_numpy(np.float32)),
                **routing_metrics(g),
            }
        )
    return pd.DataFrame(out)


def write_alignment(df: pd.DataFrame, summary: pd.DataFrame, out_dir: Path, meta: dict) -> list[Path]:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    from detaudit.runs.rundir import atomic_write_bytes, write_alignment_data

    files = write_alignment_data(out_dir, df, summary.to_dict(orient="records"), meta)
    p = out_dir / "alignment.csv"
    atomic_write_bytes(p, summary.to_csv(index=False).encode())
    files.append(p)
    shown = shown_columns(summary)
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
        summary[shown].to_markdown(index=False, floatfmt=".3g"),
        "",
        "bitwise_equal_frac: share of sampled tokens whose fp32 log-probability is bitwise equal on both sides. "
        "dp = |p_rollout - p_trainer|. kl: sample estimate of KL(rollout || trainer) = mean(log p_r - log p_t).",
        "",
    ]
    routing = [s for s in specs("align") if s.name in shown and s.name in ALIGN_ROUTING_COLUMNS]
    md += [f"{s.name}: {s.definition}." for s in routing if s.definition] + ([""] if routing else [])
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
