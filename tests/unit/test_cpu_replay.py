"""A CPU decode step recorded once and replayed (`kernels/cpu_replay.py`, `graphs.replayed_step`): the
replay makes the eager step's bits (fp32 logits and log-probabilities, the cache it writes) at every step
and position, on the compiled kernels and on the PyTorch ops; what a capture cannot redo is refused."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from detaudit.backends.kernels import cpu_gemm, cpu_replay
from detaudit.builtin import generate
from detaudit.config import DecodingParams
from detaudit.errors import DetauditError


def _twice(x: torch.Tensor, out: np.ndarray) -> None:  # stands in for a compiled kernel writing `out`
    out[:] = x.numpy() * 2


@torch.library.custom_op("detaudit_test::twice", mutates_args=())
def _twice_op(x: torch.Tensor) -> torch.Tensor:  # an op outside ATen (as a collective is)
    return x * 2


@cpu_replay.unit
def _unit_sum(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    return torch.stack([a, b]).sum(0)


@pytest.mark.parametrize("out_overloads", [True, False], ids=["out-overloads", "made-then-copied"])
def test_a_replay_redoes_ops_units_and_calls_on_new_inputs(out_overloads, monkeypatch):
    """Each kind of record: a new tensor (made into the captured one by its out= overload, as a cast's
    copy, or made and copied in: every op so where out= overloads are not looked up, as for an op without
    one), an op writing its argument, a
    view (not made), an empty buffer filled by a call, a unit returning a tensor; then new inputs written in
    place give what a fresh eager run gives."""
    if not out_overloads:
        monkeypatch.setattr(cpu_replay, "_out_overload", lambda func: None)
    x = torch.arange(6, dtype=torch.float32).reshape(2, 3)

    def forward():
        y = x.double().float() * 3 + 1
        y.add_(x)
        view = y.t()
        buf = torch.empty(2, 3)
        cpu_replay.call(_twice, x, buf.numpy())
        return _unit_sum(view.t(), buf).exp2() + torch.arange(3, dtype=torch.float32) * x[0, 0]

    first = forward().clone()
    replay = cpu_replay.capture(forward)
    assert torch.equal(replay.out, first) and torch.equal(replay.run(), first)
    for seed in range(3):
        x.copy_(torch.randn(2, 3, generator=torch.Generator().manual_seed(seed)))
        assert torch.equal(replay.run(), forward())


@pytest.mark.parametrize(
    "step, named",
    [
        (lambda x: x if bool(x.sum() > 0) else -x, "value into Python"),
        (lambda x: x * x.max().item(), "value into Python"),
        (lambda x: cpu_gemm.run_jobs([0], lambda j: x.sum()), "worker threads"),
        (lambda x: _twice_op(x) + 1, "detaudit_test.twice"),
    ],
)
def test_what_a_replay_cannot_redo_is_refused(step, named):
    x = torch.ones(4)
    with pytest.raises(cpu_replay.ReplayUnsupported, match=named):
        cpu_replay.capture(lambda: step(x))
    assert not cpu_replay.recording()  # a refused capture leaves nothing behind


def test_the_setting_is_read_strictly(monkeypatch):
    monkeypatch.setenv(cpu_replay.ENV, "fast")
    with pytest.raises(DetauditError, match="DETAUDIT_CPU_REPLAY='fast'"):
        cpu_replay.wanted("cpu", True, 1, False)
    monkeypatch.setenv(cpu_replay.ENV, "off")
    assert not cpu_replay.wanted("cpu", True, 1, False)
    monkeypatch.setenv(cpu_replay.ENV, "auto")
    assert cpu_replay.wanted("cpu", True, 1, False)
    refused = (("cuda", True, 1, False), ("cpu", False, 1, False), ("cpu", True, 2, False), ("cpu", True, 1, True))
    assert not any(cpu_replay.wanted(*args) for args in refused)


def _prefilled(eng, prompts):
    """A cache of 40 slots with `prompts` prefilled (right padded), and each row's next position."""
    m = eng.model
    cache = m.new_cache(len(prompts), 40)
    width = max(map(len, prompts))
    ids = torch.zeros(len(prompts), width, dtype=torch.long)
    for i, p in enumerate(prompts):
        ids[i, : len(p)] = torch.tensor(p)
    m.hidden(ids, torch.arange(width).expand(len(prompts), width), cache, kv_len=width)
    return cache, torch.tensor([len(p) for p in prompts])


@pytest.mark.parametrize("backend", ["bio", "bio+tbik"])
@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_a_replayed_step_gives_the_eager_steps_bits(tiny_qwen3, cpu_kernels, backend, dtype):
    """Rows at different positions, six steps: every step's fp32 logits and log-probabilities and the
    cache it wrote, replayed against eager on a copy of the same cache, bit for bit (Qwen3: per-head q / k
    norms in the step too)."""
    from helpers import local_engine

    from detaudit.builtin.graphs import eager_step, replayed_step

    eng = local_engine(tiny_qwen3, backend, dtype=dtype)
    prompts = [[1, 2, 3], [4, 5, 6, 7, 8, 9, 10], [11]]
    with torch.inference_mode(), eng.backend.activate():
        cache, pos = _prefilled(eng, prompts)
        twin = [(k.clone(), v.clone()) for k, v in cache]
        replayed = replayed_step(eng.model, cache, len(prompts), pad_id=0)
        eager = eager_step(eng.model, twin)
        tokens = torch.tensor([5, 6, 7])
        for step in range(6):
            got, want = replayed(tokens, pos, int(pos.max()) + 1), eager(tokens, pos, int(pos.max()) + 1)
            assert torch.equal(got[0], want[0]) and torch.equal(got[1], want[1]), f"step {step}"
            assert got[0].dtype == torch.float32
            tokens, pos = want[0].argmax(-1), pos + 1
        for (k, v), (k2, v2) in zip(cache, twin):  # (the pad K / V of warm-up and capture sits in slot 39)
            assert torch.equal(k[:, :, :39], k2[:, :, :39]) and torch.equal(v[:, :, :39], v2[:, :, :39])
    assert len(replayed.replay.steps) > 0


@pytest.mark.parametrize("backend", ["bio", "bio+tbik"])
def test_the_engine_replays_its_cpu_decode_and_outputs_do_not_change(tiny_llama, backend, monkeypatch):
    """The engine's default on CPU: generations (sampled, top-k log-probabilities) with replayed steps equal
    those with DETAUDIT_CPU_REPLAY=off bit for bit; the engine and each call say which ran; a call under
    the profiler decodes eagerly, as does an engine whose capture is refused, and bf16 (whose library
    attention would see the masked slots)."""
    from helpers import generation_difference, local_engine

    monkeypatch.setattr(generate, "REPLAY_AFTER_STEPS", 0)  # (recorded at once: short calls)
    prompts, ids = [[1, 2, 3], [4, 5, 6, 7], [8, 9], [3, 1]], ["a", "b", "c", "d"]
    decoding = DecodingParams(temperature=0.8, top_p=0.95, max_new_tokens=10, logprobs=5)
    runs = {}
    for setting in ("off", "auto"):
        monkeypatch.setenv(cpu_replay.ENV, setting)
        eng = local_engine(tiny_llama, backend, dtype="bfloat16")
        runs[setting] = eng.generate(prompts, ids, decoding, batch_size=4)
        assert eng.describe()["cpu_replay"] == eng.last_timings["cpu_replay"] == (setting == "auto")
    assert generation_difference(runs["auto"], runs["off"]) is None
    profiled = eng.generate(prompts, ids, decoding, batch_size=4, profile=True)  # (a profiler: eager steps)
    assert eng.last_timings["cpu_replay"] is False and generation_difference(profiled, runs["off"]) is None

    def refused(*a, **k):
        raise cpu_replay.ReplayUnsupported("a step this recorder cannot redo")

    monkeypatch.setattr("detaudit.builtin.generate.replayed_step", refused)
    eng = local_engine(tiny_llama, backend, dtype="bfloat16")  # a capture refused: eager steps, same outputs
    assert generation_difference(eng.generate(prompts, ids, decoding, batch_size=4), runs["off"]) is None
    assert eng.last_timings["cpu_replay"] is False
    monkeypatch.setenv(cpu_replay.ENV, "auto")
    assert local_engine(tiny_llama, "bf16", dtype="bfloat16").describe()["cpu_replay"] is False


def test_the_engine_keeps_one_recorded_batch_size(tiny_llama, monkeypatch):
    """A CPU engine keeps the cache and recording of the batch size it decoded last only (each is a KV
    cache's worth of host memory); a batch size met again is recorded again, with the same outputs."""
    from helpers import generation_difference, local_engine

    monkeypatch.setattr(generate, "REPLAY_AFTER_STEPS", 0)
    eng = local_engine(tiny_llama, "bio", dtype="bfloat16")
    prompts, ids = [[1, 2, 3], [4, 5], [6, 7, 8, 9]], ["a", "b", "c"]
    decoding = DecodingParams(greedy=True, max_new_tokens=5)
    first = eng.generate(prompts, ids, decoding, batch_size=3)
    assert list(eng.generator._graphs) == [3]
    eng.generate(prompts[:2], ids[:2], decoding, batch_size=2)
    assert list(eng.generator._graphs) == [2]
    assert generation_difference(eng.generate(prompts, ids, decoding, batch_size=3), first) is None


def test_out_overloads_only_for_ops_with_kernels_of_their_own():
    """A composite op's out= overload may decompose otherwise than the op (`linear`, `matmul`): such ops are
    made again and copied in; an op with a kernel of its own writes the captured tensor (`mul.out`)."""
    aten = torch.ops.aten
    assert cpu_replay._out_overload(aten.mul.Tensor) == (aten.mul.out, ["out"])
    assert cpu_replay._out_overload(aten.linear.default) is None
    assert cpu_replay._out_overload(aten.matmul.default) is None


def test_a_batch_size_is_recorded_once_it_has_run_enough_steps(tiny_llama):
    """The capture costs several eager steps: a batch size's calls decode eagerly until it has run
    `REPLAY_AFTER_STEPS` decode steps (the call's own included), then its steps are replayed; each batch
    size counts its own, and a call long enough is recorded at once. The outputs never change."""
    from helpers import generation_difference, local_engine

    n = generate.REPLAY_AFTER_STEPS
    eng = local_engine(tiny_llama, "bio", dtype="bfloat16")
    prompts, ids = [[1, 2, 3], [4, 5], [6, 7, 8, 9]], ["a", "b", "c"]
    short = DecodingParams(greedy=True, max_new_tokens=n // 2)  # n / 2 - 1 decode steps a call
    seen, first = [], None
    for _ in range(3):
        out = eng.generate(prompts, ids, short, batch_size=3)
        seen.append(eng.last_timings["cpu_replay"])
        assert first is None or generation_difference(out, first) is None
        first = first or out
    assert seen == [False, False, True], seen  # n - 2 steps run eagerly, then the third call's reach n
    eng.generate(prompts[:2], ids[:2], short, batch_size=2)
    assert eng.last_timings["cpu_replay"] is False  # batch 2 counts from nothing
    long = DecodingParams(greedy=True, max_new_tokens=n + 1)
    eng = local_engine(tiny_llama, "bio", dtype="bfloat16")
    out = eng.generate(prompts, ids, long, batch_size=3)
    assert eng.last_timings["cpu_replay"] is True  # n decode steps in one call: recorded at once
    for a, b in zip(out, first):  # greedy: the short calls' tokens are the long one's first, bit for bit
        k = len(b.token_ids)
        assert a.token_ids[:k] == b.token_ids and a.token_logprobs[:k] == b.token_logprobs
        assert a.topk_logprobs[:k] == b.topk_logprobs
