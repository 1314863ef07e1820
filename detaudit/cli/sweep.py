"""`detaudit sweep`: run the grid."""

from __future__ import annotations

from pathlib import Path
from typing import Annotated, Optional

import typer

from detaudit.cli.common import (
    ALL_BACKENDS,
    DEFAULT_MODEL,
    SAMPLING,
    BackendsOpt,
    DataDirOpt,
    DeviceOpt,
    Dtype,
    DtypeOpt,
    GreedyOpt,
    LimitOpt,
    MaxNewTokensOpt,
    ModelOpt,
    SeedOpt,
    TemperatureOpt,
    TopKOpt,
    TopPOpt,
    TpMode,
    TpModeOpt,
    TrustSuitePathsOpt,
    command_line,
    decoding,
    err,
    handle_errors,
    out_path,
    print_json,
)
from detaudit.cli.results import analyze_and_report

QUICK_TP, QUICK_BATCH_SIZES = "1,2", "4,8"  # the quick default grid (a few minutes on 2 cores)
RAY_MAX_RETRIES = 2


def _given(ctx: typer.Context, names: tuple[str, ...]) -> tuple[str, ...]:
    """The options among `names` set on the command line (or through the environment), not defaulted: a
    decoding flag given wins over a suite's generation_kwargs."""
    sources = {n: getattr(ctx.get_parameter_source(n), "name", "DEFAULT") for n in names}
    return tuple(n for n in names if sources[n] in ("COMMANDLINE", "ENVIRONMENT", "PROMPT"))


@handle_errors
def sweep(
    ctx: typer.Context,
    model: ModelOpt = DEFAULT_MODEL,
    suites: Annotated[
        str,
        typer.Option(
            "--suites",
            "-s",
            help="Comma-separated suite names or lm-eval task YAML paths (cells are named by the task).",
            rich_help_panel="model and suites",
        ),
    ] = "smoke",
    data_dir: DataDirOpt = None,
    limit: LimitOpt = None,
    apply_chat_template: Annotated[
        Optional[bool],
        typer.Option(
            "--apply-chat-template/--no-apply-chat-template",
            help=(
                "Prompts as one user turn in the model's chat template, or as plain text. Default: each suite's own "
                "(`apply_chat_template:` in its YAML: the built-in suites use the template; lm-eval task files "
                "plain text, as lm-eval does)."
            ),
            rich_help_panel="model and suites",
            show_default=False,
        ),
    ] = None,
    trust_suite_paths: TrustSuitePathsOpt = False,
    backends: BackendsOpt = ALL_BACKENDS,
    tp: Annotated[
        str,
        typer.Option(
            "--tp",
            help=(
                "Comma-separated TP sizes from 1, 2, 4, 8 (the published grid: 1,2,4,8; the default keeps the quick "
                "sweep to a few minutes on 2 cores)."
            ),
            rich_help_panel="grid",
        ),
    ] = QUICK_TP,
    batch_sizes: Annotated[
        str,
        typer.Option(
            "--batch-sizes",
            help=(
                "Comma-separated batch sizes (the published grid: 8,16,32, which needs a suite of more than 16 prompts"
                " to form different batches; smoke has 8)."
            ),
            rich_help_panel="grid",
        ),
    ] = QUICK_BATCH_SIZES,
    tp_mode: TpModeOpt = TpMode.real,
    speculative: Annotated[
        str,
        typer.Option(
            "--speculative",
            help=(
                "Comma-separated speculative-decoding settings (a grid axis): off (plain decoding), ngram:K (K prompt-"
                "lookup drafts a step), draft:MODEL:K (K greedy tokens of a draft model: a directory or a named model "
                "sharing the target's tokenizer, e.g. smollm2-135m-draft); cell ids get __ngramK / __draftK-NAME."
            ),
            rich_help_panel="grid",
        ),
    ] = "off",
    max_new_tokens: MaxNewTokensOpt = 16,
    temperature: TemperatureOpt = SAMPLING.temperature,
    top_p: TopPOpt = SAMPLING.top_p,
    top_k: TopKOpt = SAMPLING.top_k,
    seed: SeedOpt = SAMPLING.seed,
    greedy: GreedyOpt = False,
    logprobs: Annotated[
        int,
        typer.Option(
            "--logprobs", help="Top-k log-probabilities recorded per position (>= 5).", rich_help_panel="decoding"
        ),
    ] = SAMPLING.logprobs,
    dtype: DtypeOpt = Dtype.bfloat16,
    device: DeviceOpt = "cpu",
    engine: Annotated[
        str,
        typer.Option(
            "--engine",
            help=(
                "builtin (detaudit's own engine), vllm (vLLM's offline engine), openai (a running OpenAI-compatible "
                "server: vLLM, SGLang, ...) or vllm-server (a vLLM server detaudit starts); `detaudit doctor` "
                "shows which extras are installed."
            ),
            rich_help_panel="engine",
        ),
    ] = "builtin",
    cuda_graphs: Annotated[
        bool,
        typer.Option(
            "--cuda-graphs/--no-cuda-graphs",
            help=(
                "Built-in engine on a GPU: replay decode steps from CUDA graphs (same bits for bio / bio+tbik; bf16's "
                "attention then sees the whole cache, masked)."
            ),
            rich_help_panel="engine",
        ),
    ] = True,
    hang_timeout: Annotated[
        float,
        typer.Option(
            "--hang-timeout",
            help="Seconds without progress before a TP worker is declared hung (> 0; a kernel compile has 600 s).",
            rich_help_panel="engine",
        ),
    ] = 300.0,
    output_path: Annotated[
        Path,
        typer.Option(
            "--output-path",
            "-o",
            help="Run directory (resumed if it holds the same sweep).",
            rich_help_panel="data and output",
            parser=out_path,
            metavar="DIR",
        ),
    ] = Path("runs/default"),
    shard: Annotated[
        Optional[str],
        typer.Option(
            "--shard",
            help="I/N: run only every N-th cell of the grid (merge the shards with `detaudit merge`).",
            rich_help_panel="data and output",
        ),
    ] = None,
    executor: Annotated[
        str,
        typer.Option(
            "--executor",
            help=(
                "local (this machine) or ray (a Ray actor per (backend, TP) group on a Ray cluster; needs the ray "
                "extra)."
            ),
            rich_help_panel="executor",
        ),
    ] = "local",
    ray_address: Annotated[
        Optional[str],
        typer.Option(
            "--ray-address",
            help=(
                "--executor ray: the cluster to join (HEAD:6379, ray://HEAD:10001); default: start a private Ray "
                "runtime on 127.0.0.1."
            ),
            rich_help_panel="executor",
        ),
    ] = None,
    max_retries: Annotated[
        int,
        typer.Option(
            "--max-retries",
            help=(
                "--executor ray: times a group's unfinished cells are retried on a new actor after its actor or node "
                "is lost (>= 0)."
            ),
            rich_help_panel="executor",
        ),
    ] = RAY_MAX_RETRIES,
    base_url: Annotated[
        Optional[str],
        typer.Option(
            "--base-url",
            help=(
                "--engine openai: the server's OpenAI API root, e.g. http://127.0.0.1:8000/v1 (credentials and query "
                "are never recorded)."
            ),
            rich_help_panel="server",
        ),
    ] = None,
    api: Annotated[
        str,
        typer.Option(
            "--api",
            help=(
                "Server engines: completions (/v1/completions, detaudit's chat-templated token ids) or chat "
                "(/v1/chat/completions, the server's template)."
            ),
            rich_help_panel="server",
        ),
    ] = "completions",
    prompt_format: Annotated[
        str,
        typer.Option(
            "--prompt-format",
            help=(
                "--api completions: send the prompt as token ids (vLLM, SGLang) or as text (decoded; the server re-"
                "tokenizes it)."
            ),
            rich_help_panel="server",
        ),
    ] = "ids",
    api_key_env: Annotated[
        Optional[str],
        typer.Option(
            "--api-key-env",
            help="Name of the environment variable holding the server's API key (the key itself is never recorded).",
            rich_help_panel="server",
        ),
    ] = None,
    server_model: Annotated[
        Optional[str],
        typer.Option(
            "--server-model",
            help=(
                "--engine openai: the server's model id to audit (default: the one matching --model, whose tokenizer "
                "is used)."
            ),
            rich_help_panel="server",
        ),
    ] = None,
    server_kind: Annotated[
        str,
        typer.Option(
            "--server-kind",
            help="auto (from /v1/models' owned_by), vllm, sglang or generic: which request extras are sent.",
            rich_help_panel="server",
        ),
    ] = "auto",
    concurrency: Annotated[
        Optional[str],
        typer.Option(
            "--concurrency",
            help=(
                "Server engines: comma-separated numbers of audited requests in flight (the batch axis; alias of "
                "--batch-sizes)."
            ),
            rich_help_panel="server",
        ),
    ] = None,
    background_load: Annotated[
        str,
        typer.Option(
            "--background-load",
            help=(
                "Server engines: comma-separated numbers of concurrent background requests while each cell runs (a "
                "grid axis; cell ids get __bgN)."
            ),
            rich_help_panel="server",
        ),
    ] = "0",
    background_prompts: Annotated[
        str,
        typer.Option(
            "--background-prompts",
            help=(
                "Load pattern of the background requests: suite (the cell's other prompts), random (random token "
                "prompts of the suite's lengths), mixed (short and long prompts together) or prefix (the prompts cut "
                "at several prefix lengths, random order: prefix caching and chunked prefill in play)."
            ),
            rich_help_panel="server",
        ),
    ] = "suite",
    repeats: Annotated[
        int,
        typer.Option(
            "--repeats",
            help=(
                "Server engines: send every prompt this many times per cell (unique completions are counted across "
                "repeats and cells)."
            ),
            rich_help_panel="server",
        ),
    ] = 1,
    request_timeout: Annotated[
        float,
        typer.Option(
            "--request-timeout",
            help=(
                "Server engines: deadline in seconds for one whole request, every byte of its answer included (> 0)."
            ),
            rich_help_panel="server",
        ),
    ] = 300.0,
    analyze_after: Annotated[
        bool,
        typer.Option(
            "--analyze/--no-analyze",
            help="Print the summary table and write report files at the end.",
            rich_help_panel="data and output",
        ),
    ] = True,
    json_: Annotated[
        bool,
        typer.Option(
            "--json",
            help="Print the outcome as JSON on stdout (cells done, skipped, failed; the summary rows unless "
            "--no-analyze); the log stays on stderr.",
            rich_help_panel="data and output",
        ),
    ] = False,
):
    """Run every cell of the grid (backend x TP x batch size x speculative setting x suite) and store the
    records."""
    from detaudit import paths
    from detaudit.config import (
        EngineSettings,
        ServerConfig,
        SweepConfig,
        parse_int_list,
        parse_speculative_list,
        parse_str_list,
    )
    from detaudit.engines import get_engine
    from detaudit.errors import DetauditError
    from detaudit.sweep import parse_shard, run_sweep

    if concurrency is not None:
        if batch_sizes != QUICK_BATCH_SIZES:
            raise DetauditError("--concurrency is an alias of --batch-sizes: give one of them")
        batch_sizes = concurrency
    info = get_engine(engine)
    backends = info.defaults.get("backends", backends) if backends == ALL_BACKENDS else backends
    tp = info.defaults.get("tp", tp) if tp == QUICK_TP else tp
    server = ServerConfig(
        base_url=base_url,
        api=api,
        prompt_format=prompt_format,
        api_key_env=api_key_env,
        server_model=server_model,
        server_kind=server_kind,
        background_prompts=background_prompts,
        request_timeout=request_timeout,
    )
    settings = EngineSettings(
        name=engine,
        dtype=dtype.value,
        device=device,
        cuda_graphs=cuda_graphs,
        hang_timeout=hang_timeout,
        # server options given to another engine are refused by the sweep, not dropped here
        server=server if info.server or server != ServerConfig() else None,
    )
    cfg = SweepConfig(
        model=model,
        suites=parse_str_list(suites, "--suites"),
        backends=parse_str_list(backends, "--backends"),
        tp=parse_int_list(tp, "--tp"),
        batch_sizes=parse_int_list(batch_sizes, "--batch-sizes"),
        decoding=decoding(temperature, top_p, top_k, seed, max_new_tokens, greedy, logprobs),
        limit=limit,
        tp_mode=tp_mode.value,
        engine=settings,
        executor=executor,
        background_load=parse_int_list(background_load, "--background-load"),
        repeats=repeats,
        speculative=parse_speculative_list(speculative),
        decoding_flags=_given(ctx, ("max_new_tokens", "temperature", "top_p", "top_k", "greedy")),
        apply_chat_template=apply_chat_template,
        trust_suite_paths=trust_suite_paths,
    )
    if executor != "ray" and (ray_address is not None or max_retries != RAY_MAX_RETRIES):
        raise DetauditError("--ray-address and --max-retries apply to --executor ray only")
    result = run_sweep(
        cfg,
        output_path,
        data_dir=paths.data_dir(data_dir),
        console=err,
        command=command_line(),
        shard=parse_shard(shard),
        executor_options={"address": ray_address, "max_retries": max_retries} if executor == "ray" else {},
    )
    err.print(
        f"{len(result.done)} cell(s) computed, {len(result.skipped)} skipped (already complete), "
        f"{len(result.failed)} failed -> {result.run_dir}"
    )
    analysis = analyze_and_report(result.run_dir, ("md", "csv"), json_=False, show=not json_) if analyze_after else None
    if json_:
        print_json(
            {
                "run_dir": str(result.run_dir),
                "done": result.done,
                "skipped": result.skipped,
                "failed": result.failed,
                "timings": result.timings,
                "summary": None if analysis is None else analysis.summary.to_dict(orient="records"),
            }
        )
    if result.failed:
        raise typer.Exit(1)
