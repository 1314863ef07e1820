"""`detaudit bench ...`: speed targets live here, not in tests."""

from __future__ import annotations

import re
from pathlib import Path
from typing import Annotated, Optional

import typer

from detaudit.cli.common import (
    ALL_BACKENDS,
    DEFAULT_MODEL,
    App,
    BackendsOpt,
    DataDirOpt,
    DeviceOpt,
    Dtype,
    DtypeOpt,
    JsonOpt,
    ModelOpt,
    SaveOpt,
    TpMode,
    TpModeOpt,
    command_line,
    err,
    handle_errors,
    print_json,
    print_rows,
)
from detaudit.config import MAX_BATCH, MAX_NEW_TOKENS
from detaudit.errors import DetauditError
from detaudit.progress import steps

MAX_DIM = 1 << 20  # a matrix dimension, payload or token count past this is a typo, not a benchmark
bench_app = App(no_args_is_help=True, help="Benchmarks (speed targets live here, not in tests).")
SuiteOpt = Annotated[str, typer.Option("--suite", help="Suite name or lm-eval task YAML path.")]
BatchOpt = Annotated[int, typer.Option("--batch-size", min=1, max=MAX_BATCH)]
NewTokOpt = Annotated[int, typer.Option("--max-new-tokens", min=1, max=MAX_NEW_TOKENS)]
CudaOpt = Annotated[str, typer.Option("--device", help="cuda (the target) or cpu.")]


def _check_save(save: Optional[Path]) -> None:
    """--save is checked before any work: the table is written as .md or .csv, nothing else."""
    if save is not None and save.suffix not in (".md", ".csv"):
        raise DetauditError(f"--save {str(save)[:80]}: expected a .md or .csv file name")


def _print_bench(df, title: str, json_: bool, save: Optional[Path]) -> None:
    if json_:
        print_json({"meta": df.attrs, "rows": df.to_dict(orient="records")})
    else:
        rows = [
            {k: (f"{v:.4g}" if isinstance(v, float) else v) for k, v in r.items()} for r in df.to_dict(orient="records")
        ]
        print_rows(rows, list(df.columns), title=f"{title} {df.attrs}")
    if save:
        _save_bench(df, title, save)


def _save_bench(df, title: str, save: Path) -> None:
    """The table as markdown (with the command, machine and settings) or CSV, by the file's suffix."""
    from detaudit.runs.rundir import atomic_write_bytes

    if save.suffix == ".md":
        from detaudit.runs.fingerprint import collect

        env = collect()
        head = [
            f"# {title}",
            "",
            f"Command: `{command_line()}`",
            "",
            f"Machine: {env.get('hardware_key')}; torch {env['versions'].get('torch')}, "
            f"triton {env['versions'].get('triton', '-')}, "
            f"CPU capability {env.get('torch_build', {}).get('cpu_capability')}",
            "",
            *([f"Settings: {', '.join(f'{k} {v}' for k, v in df.attrs.items())}", ""] if df.attrs else []),
        ]
        text = "\n".join(head) + df.to_markdown(index=False, floatfmt=".4g") + "\n"
    else:
        text = df.to_csv(index=False)
    atomic_write_bytes(save, text.encode())
    err.print(f"wrote {save}")


def _print_with_profile(df, prof_rows: list, name: str, profile: int, device: str, json_: bool, save) -> None:
    """A bench's table and, where `profile` asked for one, its profile table (`--save X.md`: X-profile.md)."""
    if not profile:
        _print_bench(df, name, json_, save)
        return
    import pandas as pd

    prof = pd.DataFrame(prof_rows)
    per = "workload (its whole call)" if name == "vllm" else "phase"
    prof.attrs = {"ops": f"top {profile} per {per} by self {'device' if device.startswith('cuda') else 'CPU'} time"}
    if json_:  # one JSON document: the rows and the profile
        print_json({"meta": df.attrs, "rows": df.to_dict(orient="records"), "profile": prof_rows})
    else:
        _print_bench(df, name, False, None)
        _print_bench(prof, f"{name} profile", False, None)
    if save:
        _save_bench(df, name, save)
        _save_bench(prof, f"{name} profile", save.with_name(f"{save.stem}-profile{save.suffix}"))


def _bench_prompts(model: str, suite: str, data_dir: Optional[Path]):
    """The model (prepared if needed) and the suite's prompts as chat-templated token ids; the suite is
    read first (a bad suite is refused before the model is prepared)."""
    from detaudit import paths
    from detaudit.inputs.prepare import load_suites, tokenize, tokenizer_for
    from detaudit.models import resolve_model

    (s,) = load_suites([suite], paths.data_dir(data_dir), None)
    ref = resolve_model(model, auto_prepare=True, console=err)
    return ref, tokenize(s, tokenizer_for(ref.path)).token_ids


def _heads(heads: str, head_dim: int) -> tuple[int, int]:
    """--heads QUERY/KV and --head-dim of the attention-shaped benches, checked: (query heads, KV heads)."""
    match = re.fullmatch(r"([0-9]{1,4})/([0-9]{1,4})", heads.strip())
    if not match or int(match[2]) < 1 or int(match[1]) < 1 or int(match[1]) % int(match[2]):
        raise DetauditError(f"--heads {heads[:20]!r}: expected QUERY/KV with KV dividing QUERY, e.g. 32/8")
    if head_dim not in (16, 32, 64, 128, 256):
        raise DetauditError(f"--head-dim {head_dim}: must be a power of two from 16 to 256")
    return int(match[1]), int(match[2])


@bench_app.command("engine")
@handle_errors
def bench_engine_cmd(
    model: ModelOpt = DEFAULT_MODEL,
    suite: SuiteOpt = "smoke",
    data_dir: DataDirOpt = None,
    batch_size: BatchOpt = 8,
    max_new_tokens: NewTokOpt = 32,
    dtype: DtypeOpt = Dtype.bfloat16,
    backends: BackendsOpt = ALL_BACKENDS,
    json_: JsonOpt = False,
    save: SaveOpt = None,
):
    """Built-in engine tokens/s vs transformers' generate (same prompts, batch size, dtype, threads)."""
    from detaudit.backends import check_backends
    from detaudit.bench.engine import bench_engine
    from detaudit.config import parse_str_list

    bl = check_backends(parse_str_list(backends, "--backends"))
    _check_save(save)
    ref, prompts = _bench_prompts(model, suite, data_dir)
    df = bench_engine(
        ref, prompts, batch_size=batch_size, max_new_tokens=max_new_tokens, dtype=dtype.value, backends=bl
    )
    _print_bench(df, "engine", json_, save)


@bench_app.command("vllm")
@handle_errors
def bench_vllm_cmd(
    model: ModelOpt = DEFAULT_MODEL,
    backends: Annotated[
        Optional[str],
        typer.Option(
            "--backends",
            help="Comma-separated: bf16, vllm-bi (CUDA), bio, bio+tbik (default: all that run on the device).",
        ),
    ] = None,
    tp: Annotated[str, typer.Option("--tp")] = "1,2",
    batch_size: BatchOpt = 16,
    prompt_tokens: Annotated[
        int, typer.Option("--prompt-tokens", min=1, max=4000, help="The prefill workload's random prompt length.")
    ] = 1024,
    new_tokens: Annotated[
        int, typer.Option("--new-tokens", min=2, max=4000, help="The decode workload's new tokens per request.")
    ] = 128,
    workloads: Annotated[str, typer.Option("--workloads", help="prefill, decode or both.")] = "prefill,decode",
    cuda_graphs: Annotated[
        bool,
        typer.Option(
            "--cuda-graphs/--no-cuda-graphs",
            help="CUDA: decode steps from CUDA graphs for every backend (bf16 / vllm-bi: vLLM's torch.compile + "
            "graphs; bio / bio+tbik: whole-step decode graphs, no compilation); --no-cuda-graphs: all eager.",
        ),
    ] = True,
    repeats: Annotated[int, typer.Option("--repeats", min=1, max=100, help="Timed calls per workload (best).")] = 2,
    profile: Annotated[
        int,
        typer.Option(
            "--profile",
            min=0,
            max=1000,
            help="Also run each workload once under vLLM's profiler (its workers' torch.profiler trace, TP rank 0) "
            "and list its top N ops by self time, device time on CUDA (0: off). With --save X.md the list is also "
            "written to X-profile.md.",
        ),
    ] = 0,
    dtype: DtypeOpt = Dtype.bfloat16,
    device: DeviceOpt = "cpu",
    json_: JsonOpt = False,
    save: SaveOpt = None,
):
    """vLLM tokens/s of bf16 (vLLM's kernels), vllm-bi (its batch-invariant mode), bio / bio+tbik (detaudit's
    plugin), per TP size, on a prefill-heavy and a decode-heavy workload; ratios to bf16 from the same run."""
    from detaudit.backends import check_backends
    from detaudit.bench.vllm import WORKLOADS, bench_vllm
    from detaudit.config import EngineSettings, SweepConfig, check_device, check_tp_size, parse_int_list, parse_str_list
    from detaudit.engines import check_engine_backends, get_engine, native_backend_names
    from detaudit.inputs.prepare import tokenizer_for
    from detaudit.models import resolve_model
    from detaudit.sweep import validate_devices
    from detaudit.vllm import MAX_MODEL_LEN, require_vllm

    check_device(device)
    cuda = device.startswith("cuda")
    default = "bf16,vllm-bi,bio,bio+tbik" if cuda else "bf16,bio,bio+tbik"
    bl = check_backends(parse_str_list(backends or default, "--backends"), native=native_backend_names())
    tps = parse_int_list(tp, "--tp")
    for t in tps:
        check_tp_size(t)
    wl = parse_str_list(workloads, "--workloads")
    for w in wl:
        if w not in WORKLOADS:
            raise DetauditError(f"--workloads {w[:20]!r}: expected {' or '.join(WORKLOADS)}")
    if prompt_tokens + 2 > MAX_MODEL_LEN or new_tokens + 32 > MAX_MODEL_LEN:
        raise DetauditError(f"--prompt-tokens / --new-tokens: a request must fit vLLM's {MAX_MODEL_LEN} tokens")
    _check_save(save)
    require_vllm()
    info = get_engine("vllm")
    check_engine_backends(info, bl)
    cfg = SweepConfig(
        model="-", suites=("-",), backends=bl, tp=tps, batch_sizes=(batch_size,), engine=EngineSettings(device=device)
    )
    info.check(cfg)  # vllm-bi: CUDA only
    validate_devices(cfg)
    ref = resolve_model(model, auto_prepare=True, console=err)
    vocab = min(int(ref.config.get("vocab_size") or 32000), len(tokenizer_for(ref.path)))
    with steps(err, "vLLM engines", len(bl) * len(tps)) as advance:
        df = bench_vllm(
            ref,
            backends=bl,
            tps=tps,
            vocab=vocab,
            batch_size=batch_size,
            prompt_tokens=prompt_tokens,
            new_tokens=new_tokens,
            workloads=wl,
            dtype=dtype.value,
            device=device,
            cuda_graphs=cuda_graphs,
            repeats=repeats,
            progress=advance,
            profile=profile,
            profile_rows=(prof_rows := []),
        )
    _print_with_profile(df, prof_rows, "vllm", profile, device, json_, save)


@bench_app.command("e2e")
@handle_errors
def bench_e2e_cmd(
    models: Annotated[
        str, typer.Option("--models", help="Comma-separated named models or checkpoint directories.")
    ] = "smollm2-135m,qwen3-8b-shaped",
    backends: BackendsOpt = ALL_BACKENDS,
    tp: Annotated[str, typer.Option("--tp", help="Comma-separated TP sizes (real TP: one GPU per rank).")] = "1",
    batch_sizes: Annotated[str, typer.Option("--batch-sizes")] = "8,32,64",
    prompt_tokens: Annotated[
        int, typer.Option("--prompt-tokens", min=1, max=MAX_DIM, help="Random prompt ids per request (seeded).")
    ] = 512,
    new_tokens: Annotated[
        int, typer.Option("--new-tokens", min=2, max=MAX_NEW_TOKENS, help="Decode steps timed per request.")
    ] = 64,
    device: CudaOpt = "cuda",
    tp_mode: TpModeOpt = TpMode.real,
    cuda_graphs: Annotated[bool, typer.Option("--cuda-graphs/--no-cuda-graphs")] = True,
    compare_graphs: Annotated[
        bool,
        typer.Option(
            "--compare-graphs",
            help="Time every configuration eagerly and from CUDA graphs on the same device "
            "(overrides --cuda-graphs); adds graphed_speedup = eager / graphed ms per step.",
        ),
    ] = False,
    repeats: Annotated[
        int,
        typer.Option(
            "--repeats",
            min=1,
            max=MAX_BATCH,
            help="Timed calls per configuration; rows report the median call by ms per step and the median "
            "prefill rate, each with its min and max.",
        ),
    ] = 1,
    profile: Annotated[
        int,
        typer.Option(
            "--profile",
            min=0,
            max=1000,
            help="Also profile each configuration (torch.profiler; real TP: rank 0, its collectives included) "
            "and list its top N ops by self device time, prefill and decode apart (0: off). With --save X.md "
            "the list is also written to X-profile.md.",
        ),
    ] = 0,
    speculative: Annotated[
        Optional[str],
        typer.Option(
            "--speculative",
            help="Comma-separated speculative settings (ngram:K, draft:MODEL:K): decode tokens/s of each against plain "
            "decoding, acceptance and whether the bits stayed, on --suite's prompts (greedy, no EOS).",
        ),
    ] = None,
    suite: Annotated[
        str, typer.Option("--suite", help="With --speculative: the prompts (default: quote, answers that repeat them).")
    ] = "quote",
    data_dir: DataDirOpt = None,
    json_: JsonOpt = False,
    save: SaveOpt = None,
):
    """End to end: prefill and decode throughput of bf16, bio and bio+tbik, ratios to bf16 in the same run; with
    --speculative, decode throughput with and without speculative decoding."""
    from detaudit.backends import check_backends
    from detaudit.bench.e2e import bench_e2e
    from detaudit.config import EngineSettings, SweepConfig, parse_int_list, parse_str_list
    from detaudit.models import resolve_model
    from detaudit.sweep import validate_devices

    if compare_graphs and not device.startswith("cuda"):
        raise DetauditError("--compare-graphs needs a CUDA device (CUDA graphs are GPU only)")
    if speculative is not None and (compare_graphs or profile):
        raise DetauditError("--speculative times plain and speculative decoding: drop --compare-graphs / --profile")
    tps, bss = parse_int_list(tp, "--tp"), parse_int_list(batch_sizes, "--batch-sizes")
    bl = check_backends(parse_str_list(backends, "--backends"))
    names = parse_str_list(models, "--models")
    _check_save(save)
    cfg = SweepConfig(
        model="-",
        suites=("-",),
        backends=bl,
        tp=tps,
        batch_sizes=bss,
        tp_mode=tp_mode.value,
        engine=EngineSettings(device=device),
    )
    validate_devices(cfg)  # TP sizes, batch sizes, modes and GPU count checked as a sweep's are
    refs = [resolve_model(m, auto_prepare=True, console=err) for m in names]
    if speculative is not None:
        df = _bench_speculative(refs, cfg, speculative, suite, data_dir, new_tokens, cuda_graphs, repeats)
        _print_bench(df, "e2e speculative", json_, save)
        return
    with steps(err, "e2e", len(refs) * len(tps) * len(bl) * len(bss) * (2 if compare_graphs else 1)) as advance:
        df = bench_e2e(
            refs,
            bl,
            tps,
            bss,
            prompt_tokens=prompt_tokens,
            new_tokens=new_tokens,
            device=device,
            tp_mode=tp_mode.value,
            cuda_graphs="both" if compare_graphs else cuda_graphs,
            progress=advance,
            repeats=repeats,
            profile=profile,
            profile_rows=(prof_rows := []),
        )
    _print_with_profile(df, prof_rows, "e2e", profile, device, json_, save)


def _bench_speculative(refs, cfg, speculative: str, suite: str, data_dir, new_tokens, cuda_graphs, repeats):
    """`bench e2e --speculative`: the settings checked (draft models resolved, their vocabulary each
    model's), the suite tokenized per model, then `bench.speculative.bench_speculative`."""
    from detaudit import paths
    from detaudit.bench.speculative import bench_speculative
    from detaudit.config import check_speculative, parse_speculative_list
    from detaudit.inputs.prepare import load_suites, resolve_speculative, tokenize, tokenizer_for

    settings = check_speculative(parse_speculative_list(speculative))
    if not all(s.on for s in settings):
        raise DetauditError("--speculative: list the settings to time against plain decoding (off is always timed)")
    (loaded,) = load_suites([suite], paths.data_dir(data_dir), None)
    prompts, specs = {}, {}
    for ref in refs:
        tokenizer = tokenizer_for(ref.path)
        specs[ref.name] = resolve_speculative(settings, ref, tokenizer, True, console=err)
        ps = tokenize(loaded, tokenizer)
        prompts[ref.name] = (ps.token_ids, ps.ids)
    resolved = list(specs[refs[0].name].values())
    if any(list(v.values()) != resolved for v in specs.values()):  # (the same drafts for every model)
        raise DetauditError("--speculative with several --models: each draft must resolve alike for every model")
    calls = len(cfg.tp) * len(cfg.backends) * len(cfg.batch_sizes) * (1 + len(resolved))
    with steps(err, "e2e", len(refs) * calls) as advance:
        return bench_speculative(
            refs,
            cfg.backends,
            cfg.tp,
            cfg.batch_sizes,
            resolved,
            prompts,
            new_tokens=new_tokens,
            device=cfg.engine.device,
            tp_mode=cfg.tp_mode,
            cuda_graphs=cuda_graphs,
            repeats=repeats,
            progress=advance,
        )


@bench_app.command("kernels")
@handle_errors
def bench_kernels_cmd(
    device: CudaOpt = "cuda",
    dtype: DtypeOpt = Dtype.bfloat16,
    m: Annotated[str, typer.Option("--m", help="Comma-separated M values.")] = "8,32,256,2048,8192",
    kn: Annotated[str, typer.Option("--kn", help="Comma-separated KxN shapes (K: a rank's K at --tp).")] = (
        "4096x4096,6144x2048"
    ),
    tp: Annotated[
        str,
        typer.Option(
            "--tp",
            help="Comma-separated TP sizes: the tree runs a rank's 8/TP leaves and, at TP > 1, bio and the tree "
            "write the fp32 partial the all-reduce takes (at TP 1: the product rounded in the store).",
        ),
    ] = "1",
    json_: JsonOpt = False,
    save: SaveOpt = None,
):
    """bio matmul and TBIK tree matmul vs the native GEMM (cuBLAS / MKL) in the same run, plus accuracy vs fp64."""
    import torch

    from detaudit.bench.kernels import bench_kernels
    from detaudit.config import check_device, parse_int_list, parse_str_list

    if check_device(device).startswith("cuda") and not torch.cuda.is_available():
        raise DetauditError("--device cuda: no CUDA device is visible (use --device cpu)")
    shapes = []
    for pair in parse_str_list(kn, "--kn"):
        match = re.fullmatch(r"([0-9]{1,9})[xX]([0-9]{1,9})", pair)
        if not match:
            raise DetauditError(f"--kn {pair[:40]!r}: expected KxN pairs such as 4096x4096,6144x2048")
        shape = (int(match[1]), int(match[2]))
        if not all(1 <= v <= MAX_DIM for v in shape):
            raise DetauditError(f"--kn {pair}: K and N must be between 1 and {MAX_DIM}")
        shapes.append(shape)
    ms = parse_int_list(m, "--m", 1, MAX_DIM)
    tps = parse_int_list(tp, "--tp", 1, 8)
    _check_save(save)
    with steps(err, "kernels", len(ms) * len(shapes) * len(tps), transient=True) as advance:
        df = bench_kernels(device, getattr(torch, dtype.value), ms, shapes, progress=advance, tp_values=tps)
    _print_bench(df, f"kernels ({device}, {dtype.value})", json_, save)


@bench_app.command("attention")
@handle_errors
def bench_attention_cmd(
    device: Annotated[str, typer.Option("--device", help="cuda (the Triton kernels' target; no CPU timing).")] = "cuda",
    batch: Annotated[int, typer.Option("--batch", min=1, max=MAX_BATCH, help="Requests.")] = 16,
    tokens: Annotated[
        int, typer.Option("--tokens", min=1, max=65536, help="Prefill: each request's positions; decode: cached keys.")
    ] = 1024,
    heads: Annotated[str, typer.Option("--heads", help="Query heads / KV heads (Qwen3-8B: 32/8).")] = "32/8",
    head_dim: Annotated[int, typer.Option("--head-dim", help="A power of two, 16 to 256.")] = 128,
    variants: Annotated[
        str,
        typer.Option(
            "--variants",
            help="Comma-separated ROWSxBLOCKS: query rows a block (16, 32, 64, 128) x blocks a program sharing "
            "each chunk's loads (1, 2, 4); the backends run 32x1 in 16-bit prefill, else 16x1.",
        ),
    ] = "16x1,16x2,16x4,32x1,32x2,64x1,128x1",
    workloads: Annotated[str, typer.Option("--workloads", help="prefill, decode or both.")] = "prefill,decode",
    dtype: DtypeOpt = Dtype.bfloat16,
    json_: JsonOpt = False,
    save: SaveOpt = None,
):
    """bio's GPU attention kernels (the built-in engine's contiguous one, the vLLM plugin's paged one) against
    PyTorch's SDPA, per layout of a program's query rows, with whether each keeps the default's bits."""
    import torch

    from detaudit.bench.attention import BLOCK_RS, SUBS, WORKLOADS, bench_attention
    from detaudit.config import check_device, parse_str_list

    if not check_device(device).startswith("cuda"):
        raise DetauditError("bench attention times the Triton attention kernels: --device cuda only")
    hq, hkv = _heads(heads, head_dim)
    vs = []
    for item in parse_str_list(variants, "--variants"):
        found = re.fullmatch(r"([0-9]{1,4})[xX]([0-9]{1,2})", item)
        if not found or int(found[1]) not in BLOCK_RS or int(found[2]) not in SUBS:
            raise DetauditError(
                f"--variants {item[:20]!r}: expected ROWSxBLOCKS, rows one of {', '.join(map(str, BLOCK_RS))}, "
                f"blocks one of {', '.join(map(str, SUBS))} (e.g. 16x2)"
            )
        vs.append((int(found[1]), int(found[2])))
    wl = parse_str_list(workloads, "--workloads")
    for w in wl:
        if w not in WORKLOADS:
            raise DetauditError(f"--workloads {w[:20]!r}: expected {' or '.join(WORKLOADS)}")
    _check_save(save)
    if not torch.cuda.is_available():
        raise DetauditError("--device cuda: no CUDA device is visible")
    with steps(err, "attention", len(vs) * len(wl), transient=True) as advance:
        df = bench_attention(
            batch,
            tokens,
            (hq, hkv),
            head_dim,
            vs,
            wl,
            getattr(torch, dtype.value),
            progress=advance,
            device=device,
        )
    _print_bench(df, f"attention ({device}, {dtype.value})", json_, save)


@bench_app.command("rows")
@handle_errors
def bench_rows_cmd(
    device: Annotated[str, typer.Option("--device", help="cuda (the Triton kernels' target; no CPU timing).")] = "cuda",
    tokens: Annotated[int, typer.Option("--tokens", min=1, max=1 << 20, help="Rows: a prefill's tokens.")] = 16384,
    hidden: Annotated[int, typer.Option("--hidden", min=16, max=65536, help="Hidden size.")] = 4096,
    heads: Annotated[str, typer.Option("--heads", help="Query heads / KV heads (Qwen3-8B: 32/8).")] = "32/8",
    head_dim: Annotated[int, typer.Option("--head-dim", help="A power of two, 16 to 256.")] = 128,
    intermediate: Annotated[int, typer.Option("--intermediate", min=1, max=131072, help="MLP width.")] = 12288,
    dtype: DtypeOpt = Dtype.bfloat16,
    json_: JsonOpt = False,
    save: SaveOpt = None,
):
    """The GPU backends' per-token kernels (add + RMSNorm, q / k head norms, rotary, silu * up) per launch
    layout, against a device copy of the same bytes, with whether each layout keeps the default's bits."""
    import torch

    from detaudit.bench.rows import ROWS, bench_rows
    from detaudit.config import check_device

    if not check_device(device).startswith("cuda"):
        raise DetauditError("bench rows times the Triton row kernels: --device cuda only")
    hq, hkv = _heads(heads, head_dim)
    _check_save(save)
    if not torch.cuda.is_available():
        raise DetauditError("--device cuda: no CUDA device is visible")
    with steps(err, "row kernels", ROWS, transient=True) as advance:
        df = bench_rows(
            tokens,
            hidden,
            (hq, hkv),
            head_dim,
            intermediate,
            getattr(torch, dtype.value),
            device=device,
            progress=advance,
        )
    _print_bench(df, f"row kernels ({device}, {dtype.value}, {tokens} tokens)", json_, save)


@bench_app.command("allreduce")
@handle_errors
def bench_allreduce_cmd(
    ranks: Annotated[str, typer.Option("--ranks", help="Comma-separated rank counts (one process per rank).")] = "2",
    device: Annotated[str, typer.Option("--device", help="cuda (NCCL) or cpu (gloo).")] = "cuda",
    tokens: Annotated[
        str,
        typer.Option("--tokens", help="Comma-separated row counts of the partial (decode batches, prefill chunks)."),
    ] = "8,32,512,4096,16384",
    hidden: Annotated[
        int, typer.Option("--hidden", min=8, max=1 << 16, help="Columns of the partial (the model's hidden size).")
    ] = 4096,
    reps: Annotated[int, typer.Option("--reps", min=1, max=MAX_BATCH)] = 20,
    layer_k: Annotated[
        int,
        typer.Option(
            "--layer-k",
            min=0,
            max=1 << 17,
            help="Also time the row-parallel layer (matmul of a rank's K columns and its all-reduce) per backend, "
            "as the engine runs it (0: off).",
        ),
    ] = 0,
    json_: JsonOpt = False,
    save: SaveOpt = None,
):
    """bio / bio+tbik all-reduce (fp32 partials in, bf16 out; each transport) vs the bf16 library all-reduce."""
    import pandas as pd
    import torch

    from detaudit.bench.allreduce import bench_allreduce
    from detaudit.config import check_device, check_tp_size, parse_int_list

    worlds = parse_int_list(ranks, "--ranks")
    for w in worlds:
        check_tp_size(w, "--ranks")  # one process per rank, as a TP group runs
    rows = parse_int_list(tokens, "--tokens", 1, 1 << 20)
    if layer_k % 8:
        raise DetauditError(f"--layer-k {layer_k}: a multiple of 8 (bio+tbik cuts K into 8 tree blocks)")
    _check_save(save)
    if check_device(device).startswith("cuda") and max(worlds) > torch.cuda.device_count():
        raise DetauditError(f"--ranks {max(worlds)} needs {max(worlds)} GPUs; {torch.cuda.device_count()} visible")
    df = pd.concat(
        [
            bench_allreduce(w, "cuda" if device.startswith("cuda") else "cpu", rows, hidden, reps, layer_k=layer_k)
            for w in worlds
        ]
    )
    _print_bench(df, f"allreduce ({device})", json_, save)
