"""The vLLM side of `--engine vllm`: one child process per (backend, TP) hosts vLLM's offline engine
(`LLM`, in-process engine core) and serves `generate` / `score` over the same pipe protocol as the
built-in TP workers (`detaudit.builtin.worker`), so crashes, hangs and Ctrl-C are handled the same way.

The suite is submitted in chunks of the batch size and each chunk runs as one batch: vLLM's
`max_num_seqs` is the largest batch size of the sweep's (backend, TP) group, so one engine serves every
batch size of the group (it is rebuilt only for a larger one), and the scheduler always takes the whole
chunk at once (prefill of all of it, then decode of all of it). Every knob that can change the
computation order is fixed here and recorded: the execution mode (`engine_mode`: eager on CPU and with
--no-cuda-graphs, else CUDA graphs, under the plugin whole-step decode graphs without compilation;
detaudit's attention backend under the plugin on CUDA),
VLLM_BATCH_INVARIANT (per backend), prefix caching off, chunked prefill off, custom all-reduce off,
thread binds, the CPU attention KV split, and which detaudit plugin patches are active.
"""

from __future__ import annotations

import importlib.util
import os
from pathlib import Path
from typing import Any, Sequence

from detaudit.builtin.local import chunks, cpu_core_ids
from detaudit.config import NGRAM_MAX, DecodingParams, Speculative, request_seed
from detaudit.errors import CellFailed, DetauditError
from detaudit.runs.records import Generation, ProgressFn
from detaudit.vllm import MAX_MODEL_LEN

BACKEND_ENV = "DETAUDIT_VLLM_BACKEND"  # read by detaudit.vllm.plugin in every vLLM process
MARKER_ENV = "DETAUDIT_VLLM_MARKER_DIR"  # each process the plugin patches writes a marker here


def thread_binds(tp: int, cores: Sequence[int]) -> str:
    """VLLM_CPU_OMP_THREADS_BIND: ranks get disjoint core sets while there are enough cores, and
    share them round-robin when TP exceeds the core count (2 cores, TP 4: `0|1|0|1`)."""
    cores = sorted(cores)
    per = max(1, len(cores) // tp)
    groups = []
    for r in range(tp):
        start = (r * per) % len(cores)
        groups.append(",".join(str(c) for c in cores[start : start + per]))
    return "|".join(groups)


NATIVE_BACKENDS = ("bf16", "vllm-bi")  # computed by vLLM's own kernels (the plugin only records)
FLASHINFER_SAMPLER_ENV = "VLLM_USE_FLASHINFER_SAMPLER"
V2_RUNNER_ENV = "VLLM_USE_V2_MODEL_RUNNER"
BI_ENV = "VLLM_BATCH_INVARIANT"  # vLLM's own batch-invariant mode: on for vllm-bi only, off (cleared) otherwise


def engine_env(backend: str, tp: int, device: str, marker_dir: str) -> dict[str, str]:
    """Environment for the host process, set before vLLM is imported (workers inherit it). An inherited
    VLLM_BATCH_INVARIANT never reaches vLLM: it is set per backend (1 for vllm-bi, 0 for the others,
    whose kernels it would otherwise replace: bf16 would silently become vllm-bi, and under bio /
    bio+tbik vLLM's kernels would stand in for the plugin's)."""
    cuda = device.startswith("cuda")
    env = {
        "VLLM_ENABLE_V1_MULTIPROCESSING": "0",  # in-process engine core: batch composition as submitted
        BACKEND_ENV: backend,
        MARKER_ENV: marker_dir,
        BI_ENV: "1" if backend == "vllm-bi" else "0",
        "VLLM_NO_USAGE_STATS": "1",
        "VLLM_LOGGING_LEVEL": os.environ.get("VLLM_LOGGING_LEVEL", "WARNING"),
    }
    if cuda and importlib.util.find_spec("flashinfer") is None:
        # vLLM 0.25.1's GPU sampler imports FlashInfer unless this says no: on a machine without it
        # every cell of the plugin's backends failed with "No module named 'flashinfer'" (H200, this
        # round); with it off, the sampler is vLLM's PyTorch one. A value the user set is kept.
        env[FLASHINFER_SAMPLER_ENV] = os.environ.get(FLASHINFER_SAMPLER_ENV, "0")
    if cuda and backend not in NATIVE_BACKENDS:
        # vLLM 0.25.1 runs dense models on GPUs with its "model runner V2", whose sampler computes the
        # log-probabilities in a Triton kernel of its own and never calls the sampler the plugin
        # patches: under bio+tbik on an H200 every log-probability then differed from the built-in
        # engine's (the plugin's markers showed no `log_softmax`). The V1 runner, vLLM's runner on CPU,
        # samples through the patched sampler. bf16 / vllm-bi keep vLLM's choice (what users run).
        env[V2_RUNNER_ENV] = "0"
    if not cuda:
        cores = cpu_core_ids()
        env["VLLM_CPU_OMP_THREADS_BIND"] = os.environ.get("VLLM_CPU_OMP_THREADS_BIND") or thread_binds(tp, cores)
        env["VLLM_CPU_KVCACHE_SPACE"] = os.environ.get("VLLM_CPU_KVCACHE_SPACE", "2")
        env["OMP_NUM_THREADS"] = str(max(1, len(cores) // tp))
        if backend not in NATIVE_BACKENDS:
            # vLLM's CPU attention splits the KV sequence across threads depending on the batch's
            # load; off, every query walks its KV blocks in one fixed order
            env["VLLM_CPU_ATTN_SPLIT_KV"] = "0"
    return env


# the plugin's CUDA graphs: whole decode steps (its attention reads every length on the device), no
# torch.compile (inductor would fuse the plugin's row ops into kernels that round elsewhere)
PLUGIN_GRAPHS = {"mode": 0, "cudagraph_mode": "FULL_DECODE_ONLY"}


def engine_mode(backend: str, device: str, cuda_graphs: bool) -> dict[str, Any]:
    """How vLLM runs a backend: its execution mode and, under the plugin on CUDA, detaudit's attention
    backend. bf16 / vllm-bi follow --cuda-graphs on CUDA (vLLM's default: compiled, CUDA graphs). The
    plugin's bio / bio+tbik with --cuda-graphs replay whole decode steps from CUDA graphs without
    compilation (`PLUGIN_GRAPHS`; prefill eager). Everything runs eager on CPU and with --no-cuda-graphs;
    the reason is recorded."""
    cuda = device.startswith("cuda")
    if not cuda:
        return {"enforce_eager": True, "enforce_eager_reason": "CPU"}
    mode: dict[str, Any] = {}
    if backend not in NATIVE_BACKENDS:
        mode["attention_backend"] = "CUSTOM"  # detaudit.vllm.gpu_attn, registered by the plugin
    if not cuda_graphs:
        return {**mode, "enforce_eager": True, "enforce_eager_reason": "--no-cuda-graphs"}
    if backend in NATIVE_BACKENDS:
        return {"enforce_eager": False, "enforce_eager_reason": "--cuda-graphs: vLLM's torch.compile + CUDA graphs"}
    return {
        **mode,
        "enforce_eager": False,
        "compilation_config": dict(PLUGIN_GRAPHS),
        "enforce_eager_reason": "--cuda-graphs: decode steps replayed from whole-step CUDA graphs, no torch.compile",
    }


def plugin_missing(backend: str, markers: list[dict], ran: bool) -> str | None:
    """Why the markers show the plugin did not do its part in this engine's vLLM processes, or None.
    detaudit's plugin reaches vLLM only through its entry point (`vllm.general_plugins`): detaudit run
    from a source tree without being installed (PYTHONPATH alone) has none, and vLLM would then run its
    own kernels under a bio / bio+tbik label."""
    hint = (
        "detaudit's vLLM plugin did not load in vLLM's processes: its entry point (vllm.general_plugins) "
        "is missing; install detaudit (pip install -e . or a wheel), not only PYTHONPATH"
    )
    if not markers:
        return hint
    if ran and backend not in NATIVE_BACKENDS and not any(m.get("ops") for m in markers):
        return f"{hint} (markers without patched ops: {len(markers)})"
    return None


def marker_dir() -> str:
    """Where the plugin in each vLLM process writes its marker (one fresh directory per engine)."""
    import tempfile

    return tempfile.mkdtemp(prefix="detaudit-vllm-")


def read_markers(path: str) -> list[dict]:
    import json

    out = []
    for f in sorted(Path(path).glob("*.json")):
        try:
            out.append(json.loads(f.read_text()))
        except (OSError, ValueError):
            pass
    return out


def recorded_env() -> dict[str, str]:
    """The knobs recorded with the engine: the allow-list of `detaudit.runs.fingerprint.knob_env` (secrets
    redacted, everything else left out)."""
    from detaudit.runs.fingerprint import knob_env

    return knob_env()


def executor_backend(tp: int, device: str, multi_node: bool) -> str | None:
    """vLLM's distributed executor: none for TP 1; `ray` where the Ray executor asks this engine to place
    its own ranks on the cluster (`EngineOptions.multi_node`: TP exceeds one node's GPUs; this process is
    connected to that cluster), or where TP exceeds this machine's GPUs; `mp` (ranks on this machine)
    otherwise."""
    if tp == 1:
        return None
    if multi_node:
        return "ray"
    if device.startswith("cuda"):
        import torch

        if tp > torch.cuda.device_count():
            return "ray"
    return "mp"


class VllmHost:
    def __init__(self, options) -> None:
        import vllm

        s = options.settings
        self.model_path, self.backend, self.tp = Path(options.model.path), options.backend, options.tp
        self.dtype, self.device, self.eos = s.dtype, s.device, list(options.eos_ids)
        self.executor = executor_backend(options.tp, s.device, options.multi_node)
        self.version = vllm.__version__
        self.llm: Any = None
        self.max_batch_size = options.max_batch_size
        self.max_num_seqs = 0
        self.speculative: Speculative | None = None  # the setting the engine was built with
        self.knobs: dict[str, Any] = {}
        self.mode = engine_mode(self.backend, self.device, s.cuda_graphs)
        self.checked = False
        self.trace_dir = options.trace_dir
        self.last_profile: dict | None = None  # of the last generate call made with profile=True

    def _engine(self, batch_size: int, speculative: Speculative | None = None):
        """The engine for a batch of `batch_size` (built for the group's largest batch; rebuilt only for a
        larger one, or for another speculative setting: vLLM fixes it when the engine is built)."""
        spec = speculative if speculative is not None and speculative.on else None
        if self.llm is None or batch_size > self.max_num_seqs or spec != self.speculative:
            self._build(max(batch_size, self.max_batch_size), spec)
        self.knobs["batch_size"] = batch_size
        return self.llm

    def _build(self, seqs: int, spec: Speculative | None = None) -> None:
        self._shutdown()
        from vllm import LLM

        extra = speculative_args(spec)
        try:
            self.llm = self._llm(LLM, seqs, extra)
        except (ValueError, NotImplementedError, TypeError) as e:
            if spec is None:
                raise
            first = (str(e).strip().splitlines() or [type(e).__name__])[0][:200]
            raise CellFailed(f"vLLM {self.version} cannot run --speculative {spec} here: {first}") from None
        self.speculative = spec
        self.max_num_seqs = seqs
        self._knobs(extra)

    def _llm(self, LLM, seqs: int, extra: dict):
        return LLM(
            model=str(self.model_path),
            tokenizer=str(self.model_path),
            tensor_parallel_size=self.tp,
            dtype=self.dtype,
            max_num_seqs=seqs,
            max_model_len=MAX_MODEL_LEN,
            max_num_batched_tokens=seqs * MAX_MODEL_LEN,
            enable_prefix_caching=False,
            **{k: v for k, v in self.mode.items() if not k.endswith("_reason")},
            enable_chunked_prefill=False,
            disable_custom_all_reduce=True,
            distributed_executor_backend=self.executor,
            seed=0,
            **extra,
            **self._profiler(),
        )

    def _profiler(self) -> dict:
        """vLLM's torch profiler in its workers, where traces were asked for: created at the first
        `start_profile`, idle until then; no stacks, no CUDA summary table (`trace.self_times` reads the
        trace; on CPU vLLM still writes its own CPU-time table beside it)."""
        if self.trace_dir is None:
            return {}
        config = {"profiler": "torch", "torch_profiler_dir": str(Path(self.trace_dir).resolve())}
        config.update(torch_profiler_with_stack=False, torch_profiler_dump_cuda_time_total=False)
        return {"profiler_config": config}

    def _knobs(self, extra: dict) -> None:
        config = self.llm.llm_engine.vllm_config
        sched, cache, comp = config.scheduler_config, config.cache_config, config.compilation_config
        self.knobs = {
            "max_num_seqs": sched.max_num_seqs,
            "max_num_batched_tokens": sched.max_num_batched_tokens,
            "enable_chunked_prefill": sched.enable_chunked_prefill,
            "async_scheduling": sched.async_scheduling,
            "enable_prefix_caching": cache.enable_prefix_caching,
            **self.mode,
            "compilation_mode": str(getattr(comp, "mode", "")),
            # vLLM's GPU model runner: V2 samples and scores without the plugin's sampler (engine_env)
            "model_runner": {True: "v2", False: "v1"}.get(getattr(config, "use_v2_model_runner", None), "unknown"),
            "cudagraph_mode": str(getattr(comp, "cudagraph_mode", "")),
            "disable_custom_all_reduce": True,
            "env": recorded_env(),
            "distributed_executor_backend": self.executor,
        }
        if "speculative_config" in extra:
            self.knobs["speculative_config"] = extra["speculative_config"]

    def generate(
        self,
        prompts,
        prompt_ids,
        decoding: DecodingParams,
        batch_size: int,
        progress: ProgressFn | None = None,
        speculative: Speculative | None = None,
        profile: bool = False,
        **load,
    ) -> list[Generation]:
        """`speculative`: vLLM's own speculative decoding (`speculative_args`), the engine rebuilt for it.
        `profile`: the call runs under vLLM's profiler (the engine built with `trace_dir`) and
        `last_profile` holds TP rank 0's self time per op (`trace.self_times`)."""
        from vllm import SamplingParams

        llm = self._engine(batch_size, speculative)
        if profile:
            again = (prompts, prompt_ids, decoding, batch_size, progress, speculative)
            return self._profiled(llm, lambda: self.generate(*again, **load))
        out: list[Generation] = []
        for r in chunks(len(prompts), batch_size):
            params = [
                SamplingParams(
                    temperature=0.0 if decoding.greedy else decoding.temperature,
                    top_p=1.0 if decoding.greedy else decoding.top_p,
                    top_k=0 if decoding.greedy else decoding.top_k,
                    seed=None if decoding.greedy else request_seed(decoding.seed, prompt_ids[i]),
                    max_tokens=decoding.max_new_tokens,
                    logprobs=decoding.logprobs,
                    stop_token_ids=self.eos,
                    ignore_eos=not self.eos,
                    stop=list(decoding.stop) or None,  # checked on the detokenized text, as lm-eval's vLLM backend
                    detokenize=bool(decoding.stop),
                )
                for i in r
            ]
            res = llm.generate([{"prompt_token_ids": list(prompts[i])} for i in r], params, use_tqdm=False)
            for o in res:
                out.append(_generation(o.outputs[0], decoding.logprobs))
            self._check_plugin()
            if progress:
                progress(sum(len(o.outputs[0].token_ids) for o in res))
        return out

    def _profiled(self, llm, call) -> list[Generation]:
        from detaudit.vllm import trace

        if self.trace_dir is None:
            raise DetauditError("generate(profile=True) under vLLM needs the engine opened with a trace_dir")
        directory = Path(self.trace_dir)
        directory.mkdir(parents=True, exist_ok=True)
        before = set(directory.iterdir())
        llm.start_profile()
        try:
            out = call()
        finally:
            llm.stop_profile()  # the workers write their traces before this returns
        path = trace.newest_rank0(directory, before)
        if path is None:
            raise CellFailed(f"vLLM {self.version} wrote no profiler trace into {directory}")
        self.last_profile = trace.self_times(path, self.device.startswith("cuda"))
        return out

    def score(self, prompts, continuations, batch_size: int) -> list[list[float]]:
        """Teacher forcing: prompt log-probabilities of prompt + continuation (one prefill per sequence)."""
        from vllm import SamplingParams

        # the engine as the cell's generate built it (its speculative setting too: prompt log-probabilities
        # come from one forward, and rebuilding vLLM's CPU engine in one process fails in vLLM 0.32)
        llm = self._engine(batch_size, self.speculative)
        out: list[list[float]] = []
        params = SamplingParams(max_tokens=1, prompt_logprobs=0, detokenize=False, temperature=0.0)
        for r in chunks(len(prompts), batch_size):
            seqs = [list(prompts[i]) + list(continuations[i]) for i in r]
            res = llm.generate([{"prompt_token_ids": s} for s in seqs], [params] * len(seqs), use_tqdm=False)
            for i, o in zip(r, res):
                n = len(prompts[i])
                out.append([o.prompt_logprobs[n + j][t].logprob for j, t in enumerate(continuations[i])])
        return out

    def _markers(self) -> list[dict]:
        return read_markers(os.environ.get(MARKER_ENV, "")) if os.environ.get(MARKER_ENV) else []

    def _check_plugin(self) -> None:
        """Once, after the first batch: the plugin ran in vLLM's processes (else the labels would lie)."""
        if self.checked or not os.environ.get(MARKER_ENV):
            return
        why = plugin_missing(self.backend, self._markers(), ran=True)
        if why:
            raise DetauditError(f"--engine vllm, backend {self.backend}: {why}")
        self.checked = True

    def describe(self) -> dict:
        markers = self._markers()
        return {
            "engine": "vllm",
            "vllm_version": self.version,
            "tp": self.tp,
            "tp_mode": "real",
            "device": self.device,
            "backend": backend_description(self.backend, self.version),
            "plugin": plugin_label(self.backend),
            "attention_backend": attention_backends(markers),
            "plugin_markers": markers,
            "knobs": self.knobs or {"env": recorded_env(), **self.mode},
        }

    def _shutdown(self) -> None:
        if self.llm is None:
            return
        try:
            self.llm.llm_engine.engine_core.shutdown()
        except Exception:
            pass
        self.llm = None
        import gc

        gc.collect()

    def close(self) -> None:
        self._shutdown()


def backend_description(backend: str, version: str) -> dict:
    """What computes a backend's numbers under vLLM (the manifest's `backends` entry)."""
    from detaudit.backends import get_backend

    if backend == "bf16":
        return {
            "backend": "bf16",
            "kernels": "vLLM's own (CPU: oneDNN / SGL / F.linear GEMMs, vLLM CPU attention with KV split, vLLM's "
            "all-reduce; GPU: cuBLAS, the attention backend vLLM selects (recorded), NCCL)",
            BI_ENV: "0",
        }
    if backend == "vllm-bi":
        return {
            "backend": "vllm-bi",
            "kernels": f"vLLM {version}'s own batch-invariant mode ({BI_ENV}=1): its Triton persistent matmul / "
            "log-softmax / mean overrides of aten ops (Hopper: cuBLASLt without split-K), its batch-invariant "
            "RMSNorm, an attention backend that declares batch invariance (recorded), NCCL with its "
            "determinism settings; the detaudit plugin patches nothing",
            BI_ENV: "1",
        }
    return {**get_backend(backend).describe(), BI_ENV: "0 (cleared: detaudit's plugin computes these layers)"}


def plugin_label(backend: str) -> str:
    if backend in NATIVE_BACKENDS:
        return f"off ({'vLLM batch-invariant' if backend == 'vllm-bi' else 'native vLLM'} kernels; records only)"
    return f"detaudit plugin: {backend}"


def attention_backends(markers: list[dict]) -> str:
    """The attention backend(s) vLLM selected in this engine's processes, as the plugin saw them."""
    seen = sorted({str(m["seen"]["attention_backend"]) for m in markers if m.get("seen", {}).get("attention_backend")})
    return ", ".join(seen) if seen else "not recorded"


def speculative_args(spec: Speculative | None) -> dict:
    """The `LLM(...)` arguments of a speculative setting: vLLM's `speculative_config` (n-gram: prompt
    lookup of up to NGRAM_MAX tokens, as the built-in engine's; a draft model: its directory), and
    per-request acceptance counts where this vLLM has them (`per_request_spec_decode_metrics`, 0.32+).
    (A vLLM without the method was refused before any work: `detaudit.vllm.check_speculative`.)"""
    if spec is None:
        return {}
    if spec.kind == "ngram":
        config = {
            "method": "ngram",
            "num_speculative_tokens": spec.k,
            "prompt_lookup_max": NGRAM_MAX,
            "prompt_lookup_min": 1,
        }
    else:
        assert spec.model is not None
        config = {"method": "draft_model", "model": str(spec.model.path), "num_speculative_tokens": spec.k}
    extra: dict[str, Any] = {"speculative_config": config}
    if _engine_arg("per_request_spec_decode_metrics"):
        extra["per_request_spec_decode_metrics"] = "summary"
    return extra


def _engine_arg(name: str) -> bool:
    import dataclasses

    from vllm.engine.arg_utils import EngineArgs

    return any(f.name == name for f in dataclasses.fields(EngineArgs))


def _generation(c, k: int) -> Generation:
    token_logprobs, topk_ids, topk_lps = [], [], []
    for tok, lp in zip(c.token_ids, c.logprobs):
        token_logprobs.append(float(lp[tok].logprob))
        ranked = sorted((v.rank, t, v.logprob) for t, v in lp.items() if v.rank is not None and v.rank <= k)
        topk_ids.append([t for _, t, _ in ranked])
        topk_lps.append([float(x) for _, _, x in ranked])
    drafted = accepted = None
    metrics = getattr(c, "spec_decode_metrics", None)  # vLLM 0.32+, per_request_spec_decode_metrics on
    if metrics is not None:
        drafted = int(metrics.num_draft_tokens)
        accepted = sum(j * n for j, n in enumerate(metrics.histogram))
    return Generation(
        list(c.token_ids),
        token_logprobs,
        topk_ids,
        topk_lps,
        "stop" if c.finish_reason == "stop" else "length",
        drafted=drafted,
        accepted=accepted,
    )


def main() -> None:
    """The vLLM engine process (`detaudit.workers.WorkerPool` runs `python -m detaudit.vllm.host`)."""
    from detaudit.workers import exit_now, serve, worker_args

    rank, _, _, conn, _ = worker_args()
    if serve(rank, conn, lambda options, extra: VllmHost(options)):
        exit_now()


if __name__ == "__main__":
    main()
