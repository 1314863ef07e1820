"""vLLM on CUDA (skipped unless both vLLM and a CUDA device are present): the plugin's bio+tbik inside
vLLM, vLLM's own batch-invariant mode as the backend `vllm-bi`, and vLLM's bio+tbik against the built-in
engine's, through the CLI as a user runs them (the embedded model, greedy decoding).

- vLLM bio+tbik at TP 1 and TP 2 (two GPUs), batch 2 and 4, decode steps from CUDA graphs: every
  recorded number of every record is bitwise the same in all cells, and every rank's plugin marker
  shows the patched ops, detaudit's attention backend (CUSTOM) among them, and VLLM_BATCH_INVARIANT off;
- vLLM bio+tbik with whole-step decode graphs against eager vLLM: `detaudit diff` equal, cell by cell;
- vllm-bi at TP 1: recorded as vLLM's batch-invariant mode (VLLM_BATCH_INVARIANT=1 in the manifest and
  in the worker's marker, the attention backend vLLM chose, the vLLM version), no op patched;
- vLLM bio+tbik at TP 1 against the built-in engine's bio+tbik at TP 1 on the same prompts: `detaudit
  diff` says every cell is bitwise equal (exit 0).
"""

from __future__ import annotations

import importlib.util
import json

import pytest
import torch
from helpers import sweep_args
from typer.testing import CliRunner

from detaudit.cli import app

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.slow,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device"),
    pytest.mark.skipif(importlib.util.find_spec("vllm") is None, reason="needs vLLM (tools/vllm_bundle.py)"),
]
runner = CliRunner()
GRID = sweep_args(suites=None, limit=4, max_new_tokens=8, temperature=0, device="cuda")  # CUDA graphs on


def _sweep(out, *args):
    res = runner.invoke(app, ["sweep", *args, *GRID, "--output-path", str(out), "--no-analyze"])
    assert res.exit_code == 0, res.output
    return json.loads((out / "manifest.json").read_text())


def _analysis(out) -> dict:
    res = runner.invoke(app, ["analyze", str(out), "--json"])
    assert res.exit_code == 0, res.output
    return {r["backend"]: r for r in json.loads(res.stdout)}


@pytest.fixture(scope="module")
def prepared():
    from detaudit.models import resolve_model

    return resolve_model("smollm2-135m", auto_prepare=True)  # fails (never skips) when it cannot be prepared


@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="TP 2 needs two GPUs")
def test_plugin_bio_tbik_is_bitwise_across_tp_and_batch_inside_vllm(prepared, tmp_path):
    out = tmp_path / "tbik"
    manifest = _sweep(out, "--engine", "vllm", "--backends", "bio+tbik", "--tp", "1,2", "--batch-sizes", "2,4")
    row = _analysis(out)["bio+tbik"]
    assert row["cells"] == 4
    assert row["bitwise_diff_records"] == 0, row["bitwise_first_diff"]
    assert row["unique_mean"] == 1 and row["maxprob_div_mean"] == 0
    for key, desc in manifest["backends"].items():
        if key.count("@") != 2:
            continue
        tp = int(key.split("@")[1][2:])
        knobs = desc["knobs"]
        assert knobs["enforce_eager"] is False and knobs["attention_backend"] == "CUSTOM"
        assert "FULL_DECODE_ONLY" in knobs["cudagraph_mode"], knobs["cudagraph_mode"]
        assert knobs["compilation_mode"] in ("0", "CompilationMode.NONE"), knobs["compilation_mode"]
        assert desc["attention_backend"].startswith("CUSTOM ("), desc["attention_backend"]
        ranks = {m["tp_rank"]: m for m in desc["plugin_markers"] if m["ops"]}
        assert set(ranks) == set(range(tp)), (key, desc["plugin_markers"])
        want = {"linear", "rms_norm", "log_softmax", "attention", "rotary", "silu_and_mul", "tree_row_parallel"}
        assert all(want <= set(m["ops"]) and m["seen"]["VLLM_BATCH_INVARIANT"] == 0 for m in ranks.values())
        # every rank captured its decode steps (the worker's own resolved mode, not the engine's config)
        assert all(m["seen"].get("cuda_graph_captured") is True for m in ranks.values()), ranks


def test_plugin_decode_graphs_give_the_eager_bits(prepared, tmp_path):
    """bio+tbik's decode steps replayed from vLLM's whole-step CUDA graphs (the plugin's attention reads
    every length on the device) against eager vLLM: the same bits, cell by cell."""
    grid = ["--engine", "vllm", "--backends", "bio+tbik", "--tp", "1", "--batch-sizes", "3"]
    graphed = _sweep(tmp_path / "graphed", *grid)
    res = runner.invoke(
        app, ["sweep", *grid, *GRID, "--no-cuda-graphs", "--output-path", str(tmp_path / "eager"), "--no-analyze"]
    )
    assert res.exit_code == 0, res.output
    knobs = [d["knobs"] for k, d in graphed["backends"].items() if k.count("@") == 2]
    assert knobs and all("FULL_DECODE_ONLY" in k["cudagraph_mode"] for k in knobs), knobs
    res = runner.invoke(app, ["diff", str(tmp_path / "eager"), str(tmp_path / "graphed"), "--json"])
    report = json.loads(res.stdout)
    assert report["cells"] and all(c["status"] == "equal" for c in report["cells"]), report["cells"]
    assert res.exit_code == 0, res.output


def test_plugin_bio_tbik_sampled_is_bitwise_across_batch_inside_vllm(prepared, tmp_path):
    """Sampled decoding (the smoke suite's T 0.6, top-k 20, top-p 0.95) at batch 4 and 8: vLLM's own
    top-k / top-p filter is a PyTorch sort below 8 requests a step and a Triton kernel from 8, so the
    plugin must run its own (the marker shows `top_k_top_p`) for the cells to agree bit for bit."""
    out = tmp_path / "sampled"
    grid = sweep_args(suites="smoke", limit=8, max_new_tokens=48, no_cuda_graphs=True, device="cuda")
    res = runner.invoke(
        app,
        ["sweep", "--engine", "vllm", *grid, "--backends", "bio+tbik", "--tp", "1", "--batch-sizes", "4,8"]
        + ["--output-path", str(out), "--no-analyze"],
    )
    assert res.exit_code == 0, res.output
    row = _analysis(out)["bio+tbik"]
    assert row["cells"] == 2 and row["bitwise_diff_records"] == 0, row["bitwise_first_diff"]
    manifest = json.loads((out / "manifest.json").read_text())
    descs = [d for k, d in manifest["backends"].items() if k.count("@") == 2]
    # vLLM's V1 model runner (its V2 one scores and samples without the patched sampler)
    assert descs and all(d["knobs"]["model_runner"] == "v1" for d in descs), [d["knobs"] for d in descs]
    markers = [m for d in descs for m in d["plugin_markers"]]
    assert any({"top_k_top_p", "log_softmax"} <= set(m["ops"]) for m in markers), markers


def test_vllm_bi_is_recorded_as_vllms_own_batch_invariant_mode(prepared, tmp_path):
    out = tmp_path / "bi"
    manifest = _sweep(out, "--engine", "vllm", "--backends", "vllm-bi", "--tp", "1", "--batch-sizes", "2,4")
    descs = [d for k, d in manifest["backends"].items() if k.startswith("vllm-bi@") and k.count("@") == 2]
    assert descs
    for d in descs:
        assert d["backend"]["backend"] == "vllm-bi" and d["backend"]["VLLM_BATCH_INVARIANT"] == "1"
        assert d["vllm_version"] and d["plugin"].startswith("off (vLLM batch-invariant")
        assert d["knobs"]["env"].get("VLLM_BATCH_INVARIANT") == "1"
        assert d["attention_backend"] != "not recorded"
        assert d["plugin_markers"] and all(not m["ops"] for m in d["plugin_markers"])  # nothing patched
        assert all(m["seen"]["VLLM_BATCH_INVARIANT"] == 1 for m in d["plugin_markers"])
    row = _analysis(out)["vllm-bi"]
    print(
        f"\n[vllm-bi TP 1] batch 2 vs 4: bitwise_diff_records={row['bitwise_diff_records']}, {d['attention_backend']}, "
        f"first difference: {row['bitwise_first_diff']}"
    )


def test_vllm_bio_tbik_equals_the_builtin_engine_cell_by_cell(prepared, tmp_path):
    grid = ["--backends", "bio+tbik", "--tp", "1", "--batch-sizes", "4"]
    _sweep(tmp_path / "vllm", "--engine", "vllm", *grid)
    _sweep(tmp_path / "builtin", "--engine", "builtin", *grid)
    res = runner.invoke(app, ["diff", str(tmp_path / "builtin"), str(tmp_path / "vllm"), "--json"])
    report = json.loads(res.stdout)
    assert report["cells"] and all(c["status"] == "equal" for c in report["cells"]), report["cells"]
    assert res.exit_code == 0, res.output
