#!/usr/bin/env python3
"""Where do vLLM-with-the-plugin and the built-in engine first part ways? One prompt, one forward each,
every intermediate compared bit for bit (issue 51: same greedy tokens on one H200, but the chosen-token
log-probability bits differ from output position 0, while on CPU the two engines agree bitwise).

    python3 tools/vllm_layer_diff.py --device cuda|cpu --backend bio+tbik [--model smollm2-135m]
        [--suite smoke --index 0 [--data-dir DIR] | --prompt-ids 1,2,3] [--all] [--save DIR]

Each engine runs in a child process of its own (as in a sweep, where they never share a process; vLLM
also binds threads and patches its classes process-wide), one prompt, one new token, greedy:

- vLLM: `detaudit.vllm.host.VllmHost` itself, with the environment of `host.engine_env` (in-process
  engine core, the plugin's backend, its marker directory, ...) and so `LLM(...)` with exactly the
  sweep's arguments (`VllmHost._llm`, the execution mode of `host.engine_mode` without CUDA graphs); the
  plugin loads through its `vllm.general_plugins` entry point, and the host's own check refuses a run
  where it did not. The model is reached in-process with `LLM.apply_model` (vLLM 0.25.1 and 0.32 alike)
  and observed with forward hooks on its modules; the sampler's log-softmax is wrapped where it is
  computed: `Sampler.compute_logprobs` (the V1 model runner; the plugin's `backend.log_softmax`), or
  Model Runner V2's `compute_topk_logprobs` (vLLM 0.25.1 picks that runner by default for dense models
  where Triton is there, i.e. on GPUs; the plugin does not patch it). The header names the runner.
- built-in: `detaudit.builtin.local.LocalEngine`, TP 1, no CUDA graphs; its decoder is not made of
  `nn.Module`s, so each block's callables (`qkv_proj`, `o_proj`, `gate_up_proj`, `down_proj`) and row ops
  (`add_norm`, `rope_store`, `silu_mul`) are wrapped per instance, and the model's `logits` and the
  backend's `log_softmax` likewise.

Nothing is recomputed here: every tensor is what the engine itself computed, copied to the host as it
was produced (the first call of each point only: the prefill). Points, in the order the math runs them
(vLLM and the built-in engine both defer each residual add into the next norm, so a layer's norm point
gives the normed rows and the residual sum it made):

    input_ids                    the token ids the forward received (shows the prefill is what was caught)
    embed                        token embeddings (vLLM: embed_tokens; built-in: layer 0's norm input)
    L attn_norm / resid_attn     input RMSNorm of layer L, and the residual sum it normed
    L qkv                        the merged q|k|v product (vLLM's QKVParallelLinear; built-in's q, k, v)
    L q_rot / k_rot              q and k after rotary (vLLM: the Attention module's inputs, its rotary
                                 module being shared by all layers; built-in: rope_store's q, and k read
                                 back from the cache it wrote)
    L attn_out                   attention output, o_proj's input [T, heads * head dim]
    L o_proj                     o_proj's output
    L mlp_norm / resid_mlp       post-attention RMSNorm and its residual sum
    L gate_up / silu_mul / mlp   gate|up product, SiLU(gate) * up (down_proj's input), down_proj's output
    final_norm / final_resid     the model's last norm and its residual sum
    lm_head_in / logits          the last prompt row's hidden state, its logits (compared in fp32: vLLM's
                                 are in the model dtype, the built-in engine's cast up, which is exact)
    logprobs                     the sampler's log-softmax of the last row (fp32)
    logprobs_at_ids              (Model Runner V2 only) its log-probabilities at the ids it returns (the
                                 chosen token, then the top k) against the built-in row at those ids
    reported                     the chosen token and its log-probability as each engine returned it

Prints one table (point, layer, shape, dtype, bitwise equal, differing elements, max abs diff, first
differing index; by default layer 0, the last layer and the first differing layer and the next are
printed in full and every other run of layers as one line, `--all` prints every row) and names the
first point that differs. Equality is bitwise: the integer bits of each element (so -0.0 differs from
0.0, and a NaN equals only the same NaN). Exit 0 once the table is printed, 1 when an
engine could not run (its error's last lines printed), 2 with one line on bad input.
"""

from __future__ import annotations

import argparse
import os
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:  # run as `python3 tools/vllm_layer_diff.py` from a checkout
    sys.path.insert(0, str(ROOT))

from detaudit.errors import DetauditError  # noqa: E402  (after the path fix above)

LAYER_POINTS = (
    "attn_norm",
    "resid_attn",
    "qkv",
    "q_rot",
    "k_rot",
    "attn_out",
    "o_proj",
    "mlp_norm",
    "resid_mlp",
    "gate_up",
    "silu_mul",
    "mlp",
)
TAIL_POINTS = ("final_resid", "final_norm", "lm_head_in", "logits", "logprobs", "logprobs_at_ids", "reported")
SIDES = ("builtin", "vllm")
# what computes each point, per engine (printed with the first difference: where to look)
WHERE = {
    "input_ids": "the token ids each engine's forward received (differing: not the same forward compared)",
    "embed": "F.embedding (built-in) / VocabParallelEmbedding (vLLM)",
    "attn_norm": "RMSNorm: built-in ops.add_norm (GPU FusedOps: kernels/fused.rms_norm); plugin "
    "patches.rms_forward (layer 0 without residual: backend.rms_norm; else row_ops add_norm)",
    "resid_attn": "the residual add inside the norm (ops.add_norm in both)",
    "qkv": "merged q|k|v product: built-in ColumnParallelLinear (backend.linear); plugin "
    "UnquantizedLinearMethod.apply (backend.linear)",
    "q_rot": "rotary: built-in ops.rope_store (GPU: kernels/fused.rope_store); plugin token_ops "
    "(Rotary.cos_sin once per pass + row_ops.rotary_rows)",
    "k_rot": "rotary of k and the cache store (as q_rot)",
    "attn_out": "attention: built-in backend.attention over its cache; plugin cpu_ops / gpu_attn "
    "(CPU: vLLM's paged cache gathered, backend.attention; GPU: backend.paged_attention over the pages)",
    "o_proj": "row-parallel product: backend.row_parallel / row_output (both)",
    "mlp_norm": "post-attention add + RMSNorm (as attn_norm)",
    "resid_mlp": "the residual add inside the norm",
    "gate_up": "merged gate|up product (backend.linear in both)",
    "silu_mul": "backend.silu_mul: built-in ops.silu_mul; plugin token_ops SiluAndMul",
    "mlp": "down_proj: backend.row_parallel / row_output (both)",
    "final_resid": "the last residual add (inside the final norm)",
    "final_norm": "the final RMSNorm (as attn_norm)",
    "lm_head_in": "the last prompt row picked for the logits",
    "logits": "lm_head: built-in Decoder.logits (backend.linear, .float()); plugin "
    "UnquantizedEmbeddingMethod.apply (backend.linear) in vLLM's LogitsProcessor",
    "logprobs": "log-softmax: backend.log_softmax (built-in generate; plugin Sampler.compute_logprobs)",
    "logprobs_at_ids": "log-softmax at vLLM's returned ids: built-in backend.log_softmax; vLLM Model Runner V2's "
    "compute_topk_logprobs (Triton, not patched by the plugin)",
    "reported": "what each engine returned (token id, fp32 log-probability)",
}


# ----------------------------------------------------------------------------- capture (both sides)


class Recorder:
    """The first value of each (point, layer), copied to the host as the engine produced it (later
    calls, such as decode steps, are ignored: the prefill is what is compared). `rows`: the prompt's
    length; a point over the prompt's tokens keeps its first `rows` rows (vLLM may pad the step's token
    count) and is ignored from a forward with fewer tokens (a warm-up, a decode step), so it cannot be
    taken for the prefill. The last-row points (`last=True`: lm_head_in, logits, logprobs) are kept whole
    as [rows, width]; `input_ids` (both sides) shows the forward recorded was the prompt's."""

    def __init__(self, rows: int) -> None:
        self.rows = rows
        self.armed = False
        self.data: dict[str, object] = {}

    def put(self, point: str, layer: int | None, t, last: bool = False) -> None:
        key = point if layer is None else f"{layer}.{point}"
        if not self.armed or key in self.data or t is None:
            return
        t = t.detach()
        t = t.reshape(1, -1) if t.dim() == 1 else t.reshape(-1, t.shape[-1])
        if not last:
            if point == "input_ids":  # [1, tokens]
                t = t[:, : self.rows] if t.shape[1] >= self.rows else None
            else:
                t = t[: self.rows] if t.shape[0] >= self.rows else None
            if t is None:
                return
        self.data[key] = t.to("cpu", copy=True)


def _first(o):
    """A module's main output: the tensor itself, or the first of a (tensor, bias / residual) tuple."""
    return o[0] if isinstance(o, (tuple, list)) else o


def _first_arg(args, kwargs):
    for a in list(args) + list(kwargs.values()):
        if hasattr(a, "shape"):
            return a
    return None


# ----------------------------------------------------------------------------- the vLLM side


def _vllm_model(llm):
    """The live model inside the in-process engine: `LLM.apply_model` (vLLM 0.25.1 and 0.32; with
    VLLM_ENABLE_V1_MULTIPROCESSING=0 and TP 1 it runs the function in this process and returns its
    result unpickled), else the executor's driver worker by attribute. (model, None) or (None, why)."""
    tried = []
    try:
        found = llm.apply_model(lambda m: m)
        model = found[0] if isinstance(found, list) else found
        if hasattr(model, "named_modules"):
            return _unwrap(model), None
        tried.append(f"apply_model gave {type(model).__name__}")
    except Exception as e:  # an older / newer vLLM without it, or one that pickles the result
        tried.append(f"apply_model: {type(e).__name__}: {str(e)[:120]}")
    engine = llm.llm_engine
    for path in (
        "model_executor.driver_worker.worker.model_runner.model",
        "model_executor.driver_worker.model_runner.model",
        "engine_core.engine_core.model_executor.driver_worker.worker.model_runner.model",
    ):
        obj = engine
        for name in path.split("."):
            obj = getattr(obj, name, None)
            if obj is None:
                break
        if obj is not None and hasattr(obj, "named_modules"):
            return _unwrap(obj), None
        tried.append(f"llm_engine.{path}: absent")
    return None, "; ".join(tried)


def _unwrap(model):
    """A model wrapped for CUDA graphs / compilation (not expected: the tool runs vLLM eager)."""
    for _ in range(4):
        if hasattr(model, "logits_processor"):
            return model
        inner = getattr(model, "runnable", None)
        if inner is None:
            return model
        model = inner
    return model


def _hook_vllm(model, rec: Recorder) -> list[str]:
    """Forward hooks on vLLM's decoder (Llama / Qwen2 / Qwen3 / Mistral module names). Returns the points
    it could not reach."""
    missing: list[str] = []
    inner = getattr(model, "model", model)
    layers = getattr(inner, "layers", None)
    if layers is None:
        return ["every layer point (no model.model.layers)"]

    seen: set[tuple[int, bool]] = set()

    def hook(module, name: str, fn, pre: bool = False) -> None:
        # a module shared by every layer (vLLM caches its rotary embeddings, `get_rope`) would record
        # layer 0's call under every layer's name: such a point is reported as not captured instead
        if module is None or (id(module), pre) in seen:
            missing.append(name if module is None else f"{name} (module shared across layers)")
            return
        seen.add((id(module), pre))
        if pre:
            module.register_forward_pre_hook(lambda m, a, k: fn(a, k), with_kwargs=True)
        else:
            module.register_forward_hook(lambda m, a, k, o: fn(a, k, o), with_kwargs=True)

    def norm_hook(point: str, resid: str, i: int | None):
        def fn(a, k, o):
            # layer 0's input norm runs without a residual: it returns the normed rows alone and the
            # residual is its input (the embeddings); every other norm returns (normed, residual sum)
            rec.put(point, i, _first(o))
            rec.put(resid, i, o[1] if isinstance(o, (tuple, list)) else _first_arg(a, k))

        return fn

    def embed(a, k, o):
        rec.put("input_ids", None, _first_arg(a, k))
        rec.put("embed", None, o)

    hook(getattr(inner, "embed_tokens", None), "embed", embed)
    for i, layer in enumerate(layers):
        attn, mlp = getattr(layer, "self_attn", None), getattr(layer, "mlp", None)

        def sub(parent, name):
            return getattr(parent, name, None) if parent is not None else None

        def rotary(a, k, i=i):
            # Attention.forward(query, key, value): q and k after rotary (vLLM's rotary module itself is
            # shared by the layers); the key is what the cache store writes
            rec.put("q_rot", i, a[0] if len(a) > 0 else k.get("query"))
            rec.put("k_rot", i, a[1] if len(a) > 1 else k.get("key"))

        hook(getattr(layer, "input_layernorm", None), f"{i}.attn_norm", norm_hook("attn_norm", "resid_attn", i))
        hook(sub(attn, "qkv_proj"), f"{i}.qkv", lambda a, k, o, i=i: rec.put("qkv", i, _first(o)))
        hook(sub(attn, "attn"), f"{i}.q_rot", rotary, True)
        hook(sub(attn, "o_proj"), f"{i}.attn_out", lambda a, k, i=i: rec.put("attn_out", i, _first_arg(a, k)), True)
        hook(sub(attn, "o_proj"), f"{i}.o_proj", lambda a, k, o, i=i: rec.put("o_proj", i, _first(o)))
        hook(getattr(layer, "post_attention_layernorm", None), f"{i}.mlp_norm", norm_hook("mlp_norm", "resid_mlp", i))
        hook(sub(mlp, "gate_up_proj"), f"{i}.gate_up", lambda a, k, o, i=i: rec.put("gate_up", i, _first(o)))
        hook(sub(mlp, "down_proj"), f"{i}.silu_mul", lambda a, k, i=i: rec.put("silu_mul", i, _first_arg(a, k)), True)
        hook(sub(mlp, "down_proj"), f"{i}.mlp", lambda a, k, o, i=i: rec.put("mlp", i, _first(o)))
    hook(getattr(inner, "norm", None), "final_norm", norm_hook("final_norm", "final_resid", None))

    def logits(a, k, o):
        # LogitsProcessor.forward(lm_head, hidden_states, ...): the rows sampled from (here: the last)
        rec.put("lm_head_in", None, a[1] if len(a) > 1 else k.get("hidden_states"), last=True)
        rec.put("logits", None, o, last=True)

    hook(getattr(model, "logits_processor", None), "logits", logits)
    return missing


def _wrap_vllm_logprobs(rec: Recorder) -> str | None:
    """The sampler's log-softmax (a staticmethod the plugin replaces; looked up on the class at each
    call, so wrapping it now catches the run)."""
    try:
        from vllm.v1.sample.sampler import Sampler
    except ImportError as e:
        return f"logprobs: {e}"
    inner = Sampler.compute_logprobs

    def compute_logprobs(logits):
        out = inner(logits)
        rec.put("logprobs", None, out, last=True)
        return out

    Sampler.compute_logprobs = staticmethod(compute_logprobs)
    return None


def _wrap_v2_logprobs(rec: Recorder) -> bool:
    """vLLM's Model Runner V2 (vLLM 0.25.1 on GPUs picks it by default for dense models) has a sampler of
    its own: log-probabilities from `compute_topk_logprobs` (a Triton log-softmax kernel evaluated at the
    sampled and top-k ids), never `Sampler.compute_logprobs`, which the plugin replaces. Wrapped where
    that runner is loaded (its module already imported), recording the ids and their values."""
    mod = sys.modules.get("vllm.v1.worker.gpu.sample.sampler")
    inner = getattr(mod, "compute_topk_logprobs", None)
    if inner is None:
        return False

    def compute_topk_logprobs(*args, **kwargs):
        out = inner(*args, **kwargs)
        rec.put("logprobs_v2_ids", None, out.logprob_token_ids, last=True)
        rec.put("logprobs_v2", None, out.logprobs, last=True)
        return out

    mod.compute_topk_logprobs = compute_topk_logprobs
    return True


def _runner_name(worker) -> str:
    """The model runner's class (run in the worker through `LLM.collective_rpc`)."""
    runner = getattr(worker, "model_runner", None) or getattr(getattr(worker, "worker", None), "model_runner", None)
    return "?" if runner is None else f"{type(runner).__module__}.{type(runner).__qualname__}"


def run_vllm(options, prompt: list[int], decoding, rec: Recorder) -> dict:
    from detaudit.vllm import host as vhost

    mdir = vhost.marker_dir()
    # what the sweep's host process gets (set before vLLM is imported: VllmHost imports it)
    os.environ.update(vhost.engine_env(options.backend, 1, options.settings.device, mdir))
    try:
        h = vhost.VllmHost(options)
        llm = h._engine(1)
        notes = []
        model, why = _vllm_model(llm)
        if model is None:
            notes.append(f"vLLM's model not reachable in-process ({why}): only logprobs / reported compared")
        else:
            missing = _hook_vllm(model, rec)
            if missing:
                notes.append(f"vLLM points not found: {', '.join(missing[:8])}")
        why = _wrap_vllm_logprobs(rec)
        if why:
            notes.append(why)
        v2 = _wrap_v2_logprobs(rec)
        try:
            runner = llm.collective_rpc(_runner_name)[0]
        except Exception as e:
            runner = f"? ({type(e).__name__}: {str(e)[:80]})"
        use_v2 = getattr(llm.llm_engine.vllm_config, "use_v2_model_runner", None)
        rec.armed = True
        (gen,) = h.generate([prompt], ["p0"], decoding, 1)
        rec.armed = False
        desc = h.describe()
        ops = sorted({op for m in desc.get("plugin_markers", []) for op in m.get("ops", [])})
        if "logprobs_v2" in rec.data:
            notes.append(
                "log-probabilities came from Model Runner V2's compute_topk_logprobs (its Triton kernel), not "
                "from Sampler.compute_logprobs, which the plugin replaces: the plugin's log_softmax did not run"
            )
        elif v2:
            notes.append("Model Runner V2's sampler is loaded but its compute_topk_logprobs was not called")
        info = {
            "engine": f"vLLM {desc['vllm_version']}, {desc['plugin']}",
            "detail": f"attention backend {desc['attention_backend']}; plugin ops run: {', '.join(ops) or 'none'}; "
            f"eager={desc['knobs'].get('enforce_eager')}; model runner {runner} (use_v2_model_runner={use_v2})",
            "notes": notes,
        }
        h.close()
        return {"gen": gen, **info}
    finally:
        shutil.rmtree(mdir, ignore_errors=True)


# ----------------------------------------------------------------------------- the built-in side


class _OpsSpy:
    """A block's row ops, recording what they return (the block's first add_norm is its input norm,
    the second its post-attention norm; the model's own `ops` is the final norm's)."""

    def __init__(self, ops, rec: Recorder, layer: int | None) -> None:
        self._ops, self._rec, self._layer, self._norms = ops, rec, layer, 0

    def __getattr__(self, name):
        return getattr(self._ops, name)

    def add_norm(self, x, delta, norm):
        y, s = self._ops.add_norm(x, delta, norm)
        if self._layer is None:
            self._rec.put("final_norm", None, y)
            self._rec.put("final_resid", None, s)
            return y, s
        if self._layer == 0 and delta is None:
            self._rec.put("embed", None, x)
        point, resid = ("attn_norm", "resid_attn") if self._norms % 2 == 0 else ("mlp_norm", "resid_mlp")
        self._norms += 1
        self._rec.put(point, self._layer, y)
        self._rec.put(resid, self._layer, s)
        return y, s

    def rope_store(self, q, k, v, step, cache, qk_norm):
        q = self._ops.rope_store(q, k, v, step, cache, qk_norm)  # [B, Hq, T, D]
        # batch row 0 (the only one) in vLLM's layout [T, heads * D]; k as stored in the cache [B, Hkv, L, D]
        self._rec.put("q_rot", self._layer, q[0].transpose(0, 1).reshape(step.T, -1))
        self._rec.put("k_rot", self._layer, cache[0][0, :, : step.T].transpose(0, 1).reshape(step.T, -1))
        return q

    def silu_mul(self, gate, up):
        out = self._ops.silu_mul(gate, up)
        self._rec.put("silu_mul", self._layer, out)
        return out


def _spy(fn, rec: Recorder, layer: int, out_point: str, in_point: str | None = None):
    def call(x):
        if in_point:
            rec.put(in_point, layer, x)
        out = fn(x)
        rec.put(out_point, layer, torch_cat(out) if isinstance(out, tuple) else out)
        return out

    return call


def torch_cat(parts):
    import torch

    return torch.cat(parts, dim=-1)  # q|k|v or gate|up, vLLM's merged layout


def run_builtin(options, prompt: list[int], decoding, rec: Recorder) -> dict:
    from detaudit.builtin.local import LocalEngine

    engine = LocalEngine(options)
    model = engine.model
    ops_name = type(model.ops).__name__  # before the spies replace them
    notes = []
    for i, block in enumerate(model.layers):
        block.ops = _OpsSpy(block.ops, rec, i)
        block.qkv_proj = _spy(block.qkv_proj, rec, i, "qkv")
        block.o_proj = _spy(block.o_proj, rec, i, "o_proj", "attn_out")
        if block.moe is None:
            block.gate_up_proj = _spy(block.gate_up_proj, rec, i, "gate_up")
            block.down_proj = _spy(block.down_proj, rec, i, "mlp")
        elif i == 0:
            notes.append("MoE layers: their MLP points are not recorded")
    model.ops = _OpsSpy(model.ops, rec, None)
    hidden_fn = model.hidden

    def hidden(ids, *args, **kwargs):
        rec.put("input_ids", None, ids[0])  # [B, T]: the one prompt's row
        return hidden_fn(ids, *args, **kwargs)

    model.hidden = hidden
    logits_fn = model.logits

    def logits(h):
        rec.put("lm_head_in", None, h, last=True)
        out = logits_fn(h)
        rec.put("logits", None, out, last=True)
        return out

    model.logits = logits
    backend = model.ctx.backend
    log_softmax = backend.log_softmax

    def spied_log_softmax(x):
        out = log_softmax(x)
        if x.shape[-1] == model.cfg.vocab_size:
            rec.put("logprobs", None, out, last=True)
        return out

    backend.log_softmax = spied_log_softmax
    rec.armed = True
    (gen,) = engine.generate([prompt], ["p0"], decoding, 1)
    rec.armed = False
    d = engine.describe()
    info = {
        "engine": f"built-in, {d['backend'].get('backend', options.backend)}",
        "detail": f"row ops {ops_name}; cuda_graphs={d['cuda_graphs']}; device {d['device']}",
        "notes": notes,
    }
    engine.close()
    return {"gen": gen, **info}


def run_side(args) -> None:
    """A child process: one engine, one prompt, one new token; its captures saved to --out."""
    import torch

    from detaudit.config import DecodingParams, EngineOptions, EngineSettings
    from detaudit.models import resolve_model

    ref = resolve_model(args.model)
    prompt = [int(t) for t in args.prompt_ids.split(",")]
    settings = EngineSettings(name=args.side, device=args.device, cuda_graphs=False)
    options = EngineOptions(settings=settings, model=ref, backend=args.backend, tp=1, max_batch_size=1)
    decoding = DecodingParams(temperature=0.0, greedy=True, max_new_tokens=1, logprobs=10)
    rec = Recorder(len(prompt))
    out = (run_vllm if args.side == "vllm" else run_builtin)(options, prompt, decoding, rec)
    gen = out.pop("gen")
    # the reported pair as a tensor: the token id and the fp32 bits of its log-probability
    token, lp = int(gen.token_ids[0]), float(gen.token_logprobs[0])
    rec.data["reported"] = torch.tensor([token, lp], dtype=torch.float64)
    torch.save({"points": rec.data, **out, "token": token, "logprob": lp}, args.out)


# ----------------------------------------------------------------------------- compare and print


def _bits(t):
    import torch

    ints = {2: torch.int16, 4: torch.int32, 8: torch.int64}
    if t.is_floating_point() and t.element_size() in ints:
        return t.contiguous().view(ints[t.element_size()])
    return t


def compare(a, b) -> dict:
    """Bitwise comparison of two captures of one point (dtypes differing: both cast to the wider float
    first, exact for bf16 -> fp32)."""
    import torch

    row = {"shape": "x".join(map(str, a.shape)), "dtype": str(a.dtype).replace("torch.", "")}
    if a.shape != b.shape:
        row.update(shape=f"{tuple(a.shape)} vs {tuple(b.shape)}", equal=False, n_diff="-", max_abs="-", first="-")
        return row
    if a.dtype != b.dtype:
        row["dtype"] += "/" + str(b.dtype).replace("torch.", "")
        if not (a.is_floating_point() or b.is_floating_point()):
            wide = torch.int64  # token ids: int64 (built-in) against int32 (vLLM)
        else:
            wide = torch.float64 if torch.float64 in (a.dtype, b.dtype) else torch.float32
        a, b = a.to(wide), b.to(wide)
    diff = _bits(a) != _bits(b)
    n = int(diff.sum())
    row.update(equal=n == 0, n_diff=n, max_abs=0.0, first="")
    if n:
        gap = (a.double() - b.double()).abs()[diff]
        idx = tuple(diff.nonzero()[0].tolist())
        row.update(
            max_abs=float(gap.nan_to_num(nan=float("inf")).max()),
            first=str(list(idx)),
            at=(float(a[idx]), float(b[idx])),
        )
    return row


def order(n_layers: int) -> list[tuple[str, int | None]]:
    head = [("input_ids", None), ("embed", None)]
    return head + [(p, i) for i in range(n_layers) for p in LAYER_POINTS] + [(p, None) for p in TAIL_POINTS]


def _print_row(row: dict) -> None:
    layer = "" if row["layer"] is None else str(row["layer"])
    if "missing" in row:
        print(f"{row['point']:12s} {layer:>5s} {'not captured by ' + row['missing']:>39s}")
        return
    max_abs = f"{row['max_abs']:.3g}" if isinstance(row["max_abs"], float) else row["max_abs"]
    print(
        f"{row['point']:12s} {layer:>5s} {row['shape']:>14s} {row['dtype']:>17s} "
        f"{'yes' if row['equal'] else 'NO':>5s} {row['n_diff']!s:>8s} {max_abs:>10s}  {row['first']}"
    )


def _print_run(run: list[dict]) -> None:
    """One line for consecutive layers left out of the compact table."""
    if not run:
        return
    layers = sorted({r["layer"] for r in run})
    flat = [r for r in run if "missing" not in r]
    differ = [r for r in flat if not r["equal"]]
    what = f"layers {layers[0]}..{layers[-1]}" if len(layers) > 1 else f"layer {layers[0]}"
    if not differ:
        text = f"all {len(flat)} points bitwise equal"
    else:
        worst = max(differ, key=lambda r: r["max_abs"] if isinstance(r["max_abs"], float) else 0.0)
        text = f"{len(differ)} of {len(flat)} points differ (largest gap {worst['max_abs']:.3g}: layer "
        text += f"{worst['layer']} {worst['point']})"
    gaps = len(run) - len(flat)
    print(f"  ... {what}: {text}" + (f", {gaps} not captured" if gaps else "") + "  [--all prints them]")


def report(sides: dict, show_all: bool) -> None:
    a, b = sides["builtin"]["points"], sides["vllm"]["points"]
    if "logprobs_v2" in b and "logprobs" in a:
        # Model Runner V2 returns log-probabilities only at its ids (the sampled token, then the top k):
        # the built-in engine's full row read at the same ids
        ids = b["logprobs_v2_ids"][0].long()
        a["logprobs_at_ids"], b["logprobs_at_ids"] = a["logprobs"][:1, ids], b["logprobs_v2"][:1]
    n_layers = 1 + max((int(k.split(".")[0]) for k in list(a) + list(b) if "." in k), default=-1)
    rows, first = [], None
    for point, layer in order(n_layers):
        key = point if layer is None else f"{layer}.{point}"
        if key not in a and key not in b:
            continue  # a point neither engine has (logprobs_at_ids without Model Runner V2)
        if key not in a or key not in b:
            rows.append({"point": point, "layer": layer, "missing": "builtin" if key not in a else "vllm"})
            continue
        row = {"point": point, "layer": layer, **compare(a[key], b[key])}
        rows.append(row)
        if first is None and not row["equal"]:
            first = row
    for s in SIDES:
        print(f"{s:8s} {sides[s]['engine']} ({sides[s]['detail']})")
        for note in sides[s]["notes"]:
            print(f"         note: {note}")
    tok = {s: (sides[s]["token"], sides[s]["logprob"]) for s in SIDES}
    print(f"reported token / log-probability: builtin {tok['builtin']}, vllm {tok['vllm']}")
    print()
    header = f"{'point':12s} {'layer':>5s} {'shape':>14s} {'dtype':>17s} {'equal':>5s} {'n_diff':>8s} "
    print(header + f"{'max_abs':>10s}  first_diff")
    # compact: layer 0, the last layer, and the first differing layer and the next in full; every other
    # run of layers one line (all equal, or how many points differ and the largest gap)
    full = {0, n_layers - 1}
    if first is not None and first["layer"] is not None:
        full |= {first["layer"], first["layer"] + 1}
    run: list[dict] = []
    for row in rows:
        layer = row["layer"]
        if not show_all and layer is not None and layer not in full:
            run.append(row)
            continue
        _print_run(run)
        run = []
        _print_row(row)
    _print_run(run)
    print()
    compared = [r for r in rows if "missing" not in r]
    if first is None:
        print(f"ALL {len(compared)} captured points are bitwise equal (builtin vs vLLM).")
        return
    where = "" if first["layer"] is None else f"layer {first['layer']} "
    at = first.get("at")
    print(
        f"FIRST DIFFERENCE: {where}{first['point']} ({first['shape']}, {first['dtype']}): {first['n_diff']} "
        f"elements differ, first at {first['first']}"
        + (f" (builtin {at[0]!r}, vllm {at[1]!r})" if at else "")
        + "; every point before it is bitwise equal."
    )
    print(f"  computed by: {WHERE.get(first['point'], '?')}")
    if sides["vllm"]["engine"].find("detaudit plugin") < 0:
        print("  (the plugin patches nothing for this backend: vLLM's side is vLLM's own kernel)")


# ----------------------------------------------------------------------------- driver


def prompt_ids(args, ref) -> list[int]:
    if args.prompt_ids:
        try:
            ids = [int(t) for t in args.prompt_ids.split(",") if t.strip()]
        except ValueError:
            raise DetauditError(f"--prompt-ids {args.prompt_ids[:60]!r}: comma-separated token ids") from None
        vocab = int(ref.config.get("vocab_size", 0) or 0)
        if not ids or any(not 0 <= t < (vocab or 2**31) for t in ids):
            raise DetauditError(f"--prompt-ids: need at least one id, each in [0, {vocab}) for {ref.name}")
        return ids
    from detaudit.inputs.prepare import load_suites, tokenize, tokenizer_for

    if args.index < 0:
        raise DetauditError(f"--index {args.index}: must be >= 0")
    (suite,) = load_suites([args.suite], Path(args.data_dir) if args.data_dir else None, args.index + 1)
    if len(suite.prompts) <= args.index:
        raise DetauditError(f"--index {args.index}: suite {suite.name} has {len(suite.prompts)} prompts")
    ps = tokenize(suite, tokenizer_for(ref.path))  # the suite's own chat-template choice, as a sweep's
    print(f"prompt: suite {suite.name}, #{args.index} ({ps.ids[args.index]}), {len(ps.token_ids[args.index])} tokens")
    return list(ps.token_ids[args.index])


def check(args) -> None:
    from detaudit.backends import available

    if args.device not in ("cpu", "cuda"):
        raise DetauditError(f"--device {args.device}: cpu or cuda")
    if args.backend == "vllm-bi":
        raise DetauditError("--backend vllm-bi: vLLM's own batch-invariant mode has no built-in counterpart")
    if args.backend not in available():
        raise DetauditError(f"--backend {args.backend}: not a detaudit backend ({', '.join(available())})")
    import importlib.util

    if importlib.util.find_spec("vllm") is None:
        from detaudit.vllm import INSTALL_HINT

        raise DetauditError(f"vLLM is not installed: {INSTALL_HINT}")
    if args.device == "cuda":
        import torch

        if not torch.cuda.is_available():
            raise DetauditError("--device cuda: no CUDA device here")


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--device", default="cpu", help="cpu or cuda")
    p.add_argument("--backend", default="bio+tbik", help="a detaudit backend both engines run (bf16, bio, bio+tbik)")
    p.add_argument("--model", default="smollm2-135m")
    p.add_argument("--suite", default="smoke", help="the prompt's suite (name or YAML), its --index-th prompt")
    p.add_argument("--index", type=int, default=0)
    p.add_argument("--data-dir", default=None, help="the suites mirror (aime24 / amc23)")
    p.add_argument("--prompt-ids", default=None, help="comma-separated token ids instead of a suite prompt")
    p.add_argument("--all", action="store_true", help="print every layer's rows")
    p.add_argument("--save", default=None, help="keep each side's captures (.pt, tens of MB) and log in this directory")
    p.add_argument("--timeout", type=float, default=280.0, help="seconds per engine (both within a 10-minute call)")
    p.add_argument("--side", choices=SIDES, help=argparse.SUPPRESS)  # a child process's engine
    p.add_argument("--out", help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    try:
        if args.side:
            run_side(args)
            return 0
        check(args)
        from detaudit.models import resolve_model

        ref = resolve_model(args.model, auto_prepare=True)
        ids = prompt_ids(args, ref)
    except DetauditError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    work = Path(args.save) if args.save else Path(tempfile.mkdtemp(prefix="vllm-layer-diff-"))
    work.mkdir(parents=True, exist_ok=True)
    sides, failed = {}, []
    try:
        for side in SIDES:
            out, log = work / f"{side}.pt", work / f"{side}.log"
            cmd = [sys.executable, str(Path(__file__).resolve()), "--side", side, "--out", str(out)]
            cmd += ["--device", args.device, "--backend", args.backend, "--model", args.model]
            cmd += ["--prompt-ids", ",".join(map(str, ids))]
            print(f"running {side} ...", flush=True)
            with open(log, "w") as f:
                try:
                    rc = subprocess.run(cmd, stdout=f, stderr=subprocess.STDOUT, timeout=args.timeout).returncode
                except subprocess.TimeoutExpired:
                    rc = "timeout"
            if rc != 0 or not out.exists():
                tail = log.read_text(errors="replace").strip().splitlines()[-15:]
                failed.append(side)
                print(f"{side} engine failed ({rc}); the last lines of its log:\n  " + "\n  ".join(tail))
                continue
            import torch

            sides[side] = torch.load(out, weights_only=True)
        if failed:
            return 1
        report(sides, args.all)
        return 0
    finally:
        if not args.save:
            shutil.rmtree(work, ignore_errors=True)


if __name__ == "__main__":
    sys.exit(main())
