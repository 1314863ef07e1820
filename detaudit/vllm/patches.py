"""What the plugin installs into vLLM for `bio` / `bio+tbik`, and what it records for `bf16` / `vllm-bi`
(see `detaudit.vllm.plugin`)."""

from __future__ import annotations

import torch

from detaudit.backends import get_backend

_installed: str | None = None

# the backends vLLM computes with its own kernels: the plugin patches nothing for them and only records
# what vLLM chose (its attention backend) and checks vLLM's batch-invariant switch
NATIVE = {
    "bf16": (False, "vLLM's own kernels"),
    "vllm-bi": (True, "vLLM's own batch-invariant kernels (VLLM_BATCH_INVARIANT=1)"),
}
BI_ENV = "VLLM_BATCH_INVARIANT"


def install(backend_name: str, marker_cls) -> None:
    global _installed
    if _installed is not None:  # vLLM may load plugins more than once per process
        return
    import vllm.envs as envs
    from vllm.platforms import current_platform

    bi = bool(envs.VLLM_BATCH_INVARIANT)
    if backend_name in NATIVE:
        want, mode = NATIVE[backend_name]
        if bi != want:  # detaudit's engines set it per backend; anything else is a mislabelled run
            raise RuntimeError(
                f"detaudit {backend_name}: {BI_ENV}={int(bi)} in this vLLM process, but backend {backend_name} "
                f"runs with {BI_ENV}={int(want)}"
            )
        marker = marker_cls(backend_name, mode)
        marker.note(BI_ENV, int(bi))
        _observe_attention(marker)
        _installed = backend_name
        return
    if bi:
        raise RuntimeError(
            f"detaudit {backend_name}: {BI_ENV}=1 is set, which swaps vLLM's own batch-invariant kernels into the "
            f"layers the plugin computes; that mode is the backend vllm-bi (unset {BI_ENV} for {backend_name})"
        )
    backend = get_backend(backend_name)
    marker = marker_cls(backend_name, "detaudit ops")
    marker.note(BI_ENV, 0)
    _install_bio(backend, marker)
    from detaudit.vllm import token_ops

    token_ops.install(backend, marker, _tp_rank)
    if current_platform.is_cpu():
        from detaudit.vllm import cpu_ops

        cpu_ops.install(backend, marker, _tp_rank)
    elif current_platform.is_cuda():
        from detaudit.vllm import gpu_attn

        gpu_attn.register(backend, marker, _tp_rank)
    else:
        raise RuntimeError(
            f"detaudit {backend_name}: the plugin runs on vLLM's CPU and CUDA platforms, "
            f"not {current_platform.device_name}"
        )
    _install_row_parallel(backend, marker, "tree_row_parallel" if backend_name == "bio+tbik" else "row_parallel")
    _refuse_moe(backend_name)
    _observe_attention(marker)
    _installed = backend_name


def _observe_attention(marker) -> None:
    """Record which attention backend vLLM selects in this process (its name and class), changing nothing:
    vLLM's selector is wrapped, its answer passed on as it is."""
    try:
        from vllm.v1.attention import selector
    except ImportError:
        return
    chosen = selector._cached_get_attn_backend

    def observed(*args, **kwargs):
        cls = chosen(*args, **kwargs)
        try:
            marker.note("attention_backend", f"{cls.get_name()} ({cls.__module__}.{cls.__qualname__})")
        except Exception:
            pass
        return cls

    selector._cached_get_attn_backend = observed


def _refuse_moe(backend_name: str) -> None:
    """vLLM's fused mixture-of-experts layer is not routed through the backend: building one under a
    detaudit backend fails, naming it, instead of running the experts on vLLM's own kernels unseen."""
    import importlib

    def refuse(self, *args, **kwargs):
        raise NotImplementedError(
            f"detaudit {backend_name}: vLLM's fused MoE layer is not covered by the detaudit plugin "
            "(mixture-of-experts models run under --engine builtin, or under vLLM with --backends bf16)"
        )

    # the class every MoE model builds, by vLLM version: the runner (0.32), the layer (earlier releases)
    for module, name in (
        ("vllm.model_executor.layers.fused_moe.runner.moe_runner", "MoERunner"),
        ("vllm.model_executor.layers.fused_moe.layer", "FusedMoE"),
    ):
        try:
            cls = getattr(importlib.import_module(module), name)
        except (ImportError, AttributeError):
            continue
        cls.__init__ = refuse


def _tp_rank() -> int | None:
    try:
        from vllm.distributed.parallel_state import get_tp_group

        return get_tp_group().rank_in_group
    except Exception:
        return None


def _install_bio(backend, marker) -> None:
    from vllm.model_executor.layers import layernorm, linear, vocab_parallel_embedding
    from vllm.v1.sample import sampler

    from detaudit.vllm import token_ops

    def keep_weight(self, layer):  # no oneDNN / SGL prepacking, the bf16 weight stays
        pass

    def apply(self, layer, x, bias=None):
        marker.op("linear", _tp_rank())
        with backend.activate():
            y = backend.linear(x, layer.weight)
        return y if bias is None else y + bias

    for cls in (linear.UnquantizedLinearMethod, vocab_parallel_embedding.UnquantizedEmbeddingMethod):
        cls.process_weights_after_loading = keep_weight
        cls.apply = apply

    def rms_forward(self, x, residual=None):
        if self.variance_size_override is not None:
            raise NotImplementedError(f"detaudit {backend.name}: RMSNorm with var_hidden_size is not supported")
        marker.op("rms_norm", _tp_rank())
        w = self.weight.data if self.has_weight else torch.ones(x.shape[-1], dtype=x.dtype, device=x.device)
        with backend.activate():
            if residual is None:
                return backend.rms_norm(x, w, self.variance_epsilon)
            # the built-in engine's add + RMSNorm (`row_ops.add_norm`, on GPU one fused kernel): the sum
            # residual + x rounded once to the model dtype, then the backend's RMSNorm of it
            y, s = token_ops.row_ops(backend, x.device).add_norm(residual, x, _Norm(w, self.variance_epsilon))
            return y.view(x.shape), s.view(x.shape)

    layernorm.RMSNorm.forward = rms_forward

    def compute_logprobs(logits):
        marker.op("log_softmax", _tp_rank())
        with backend.activate():
            return backend.log_softmax(logits.float())

    sampler.Sampler.compute_logprobs = staticmethod(compute_logprobs)
    _install_top_k_top_p(marker)


def _install_top_k_top_p(marker) -> None:
    """Sampled decoding's top-k / top-p filter through detaudit's (`backends.sampling.top_k_top_p`): vLLM's
    own takes a Triton kernel from 8 requests a step on GPUs and a PyTorch sort below, which keep other
    tokens at tied probabilities, so a request's token depended on its company (one H200: AIME24 prompt
    89 at batch 8 against 16 and 32, under bio+tbik and under vllm-bi alike; reports/gpu/vllm). Replaced
    in vLLM's module and in every module already holding it (the rejection sampler binds it at import;
    modules imported later bind this one)."""
    import sys

    from vllm.v1.sample.ops import topk_topp_sampler

    from detaudit.backends.sampling import top_k_top_p

    original = topk_topp_sampler.apply_top_k_top_p

    def filtered(logits, k, p):
        if k is not None or p is not None:
            marker.op("top_k_top_p", _tp_rank())
        return top_k_top_p(logits, k, p)

    for module in list(sys.modules.values()):
        # the module's own dict, not getattr: a lazy module __getattr__ must not import anything here
        names = getattr(module, "__dict__", None)
        if isinstance(names, dict) and names.get("apply_top_k_top_p") is original:
            module.apply_top_k_top_p = filtered


def _install_row_parallel(backend, marker, op: str) -> None:
    """o_proj / down_proj through the backend (`row_group`): this rank's fp32 partial, then the backend's
    all-reduce over vLLM's TP group (on GPUs in a prefill each slice owner's rows are copied to it while
    the next are computed: `vllm_tp_group`'s peer transport). bio: rank-order sum (with vLLM's own CPU
    all-reduce, bio outputs differed between batch 4 and 8 at TP 4 on the CI CPU; with this one they
    agree); bio+tbik: tree matmul + tree all-reduce."""
    from vllm.model_executor.custom_op import PluggableLayer
    from vllm.model_executor.layers.linear import RowParallelLinear

    class DetauditRowParallelLinear(RowParallelLinear):
        def forward(self, input_):
            if self.input_is_parallel:
                x = input_
            else:
                x = input_.chunk(self.tp_size, dim=-1)[self.tp_rank].contiguous()
            if self.tp_size > 1 and not self.reduce_results:
                raise NotImplementedError(
                    f"detaudit {backend.name}: {self.prefix} defers its all-reduce (reduce_results=False)"
                )
            marker.op(op, self.tp_rank)
            with backend.activate():
                if self.tp_size > 1:
                    out = backend.row_group(x, self.weight, vllm_tp_group(), x.dtype, name=self.prefix)
                else:
                    out = backend.row_output(x, self.weight, x.dtype, name=self.prefix)
            if self.bias is not None and not self.skip_bias_add:
                out = out + self.bias
            if not self.return_bias:
                return out
            return out, (self.bias if self.skip_bias_add else None)

    PluggableLayer.register_oot(DetauditRowParallelLinear, name="RowParallelLinear")


_GROUPS: dict[int, object] = {}  # vLLM's TP device group (by id) -> its TorchGroup, one per process


def vllm_tp_group():
    """Inside a vLLM worker: vLLM's TP group (gloo on CPU, NCCL on GPU) with the collectives the
    backends need, made once per process: on GPUs it carries detaudit's peer-memory transport
    (`backends/peer.py`), whose buffers live as long as the group; a prefill's row-parallel layer then
    copies each slice to its owner while the next is computed (`row_group`), and where symmetric memory
    does not run the transport says None and the partials go through NCCL, with the same bits."""
    from vllm.distributed.parallel_state import get_tp_group

    from detaudit.builtin.dist import TorchGroup

    g = get_tp_group()
    group = _GROUPS.get(id(g.device_group))
    if group is None:
        group = _GROUPS[id(g.device_group)] = TorchGroup(g.rank_in_group, g.world_size, g.device_group)
    return group


class _Norm:
    """An RMSNorm's weight and epsilon, as the row ops read them (`builtin.layers.RMSNorm`'s fields)."""

    def __init__(self, weight, eps: float) -> None:
        self.weight, self.eps = weight, eps
