"""`detaudit.vllm.trace`: self time per op from the chrome traces vLLM's profiler writes (the real trace is
read by tests/integration/test_vllm.py's `bench vllm --profile` on CPU; here small traces with known
nesting, so each answer can be checked by hand)."""

from __future__ import annotations

import gzip
import json

import pytest

from detaudit.vllm import trace


def _write(path, events):
    body = json.dumps({"traceEvents": events})
    if path.name.endswith(".gz"):
        with gzip.open(path, "wt") as f:
            f.write(body)
    else:
        path.write_text(body)
    return path


def _op(name, ts, dur, tid=1, cat="cpu_op"):
    return {"ph": "X", "cat": cat, "name": name, "ts": ts, "dur": dur, "pid": 7, "tid": tid}


def test_cpu_self_time_is_an_ops_time_less_its_direct_childrens(tmp_path):
    events = [
        _op("outer", 0, 100),
        _op("mid", 10, 50),  # within outer
        _op("leaf", 20, 10),  # within mid
        _op("leaf", 40, 5),  # within mid
        _op("after", 70, 20),  # within outer, after mid
        _op("outer", 200, 30),  # a second call, no children
        _op("other_thread", 5, 80, tid=2),  # another thread's op is nobody's child
        _op("detaudit::cpu_attention", 300, 40, cat="user_annotation"),  # a named range (record_function)
        _op("aten::empty", 310, 4),  # ...and an op within it
        {"ph": "i", "cat": "cpu_op", "name": "instant", "ts": 1, "pid": 7, "tid": 1},  # no duration: skipped
        _op("kernel_on_cpu_trace", 0, 999, cat="kernel"),  # device events do not count on CPU
    ]
    got = trace.self_times(_write(tmp_path / "t.pt.trace.json", events), cuda=False)
    assert got == {
        "outer": (2, (100 - 50 - 20 + 30) / 1e3),
        "mid": (1, (50 - 10 - 5) / 1e3),
        "leaf": (2, 15 / 1e3),
        "after": (1, 20 / 1e3),
        "other_thread": (1, 80 / 1e3),
        "detaudit::cpu_attention": (1, 36 / 1e3),
        "aten::empty": (1, 4 / 1e3),
    }


def test_cuda_counts_the_devices_own_events_whole(tmp_path):
    events = [
        _op("aten::mm", 0, 500),  # host side: not device time
        _op("gemm_kernel", 10, 40, cat="kernel"),
        _op("gemm_kernel", 60, 40, cat="kernel"),
        _op("Memcpy DtoD", 100, 3, cat="gpu_memcpy"),
        _op("Memset", 110, 1, cat="gpu_memset"),
        _op("cudaLaunchKernel", 5, 2, cat="cuda_runtime"),
    ]
    got = trace.self_times(_write(tmp_path / "t.pt.trace.json.gz", events), cuda=True)
    assert got == {"gemm_kernel": (2, 0.08), "Memcpy DtoD": (1, 0.003), "Memset": (1, 0.001)}


def test_the_new_trace_of_rank_0_is_picked(tmp_path):
    old = _write(tmp_path / "dp0_pp0_tp0_dcp0_ep0_rank0.1.pt.trace.json.gz", [])
    before = set(tmp_path.iterdir())
    assert trace.newest_rank0(tmp_path, before) is None  # nothing new
    r1 = _write(tmp_path / "dp0_pp0_tp1_dcp0_ep0_rank1.2.pt.trace.json.gz", [])
    assert trace.newest_rank0(tmp_path, before) == r1  # one new trace: it, whatever its name
    r0 = _write(tmp_path / "dp0_pp0_tp0_dcp0_ep0_rank0.2.pt.trace.json.gz", [])
    _write(tmp_path / "dp0_pp0_tp10_dcp0_ep0_rank10.2.pt.trace.json.gz", [])  # not rank 0
    (tmp_path / "profiler_out_0.txt").write_text("a table")
    assert trace.newest_rank0(tmp_path, before) == r0 != old


@pytest.mark.parametrize("cuda", [False, True])
def test_an_empty_trace_has_no_ops(tmp_path, cuda):
    assert trace.self_times(_write(tmp_path / "e.json", []), cuda) == {}
