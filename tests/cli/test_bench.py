"""Benchmarks run end to end on CPU at tiny sizes (their speed targets are GPU figures, measured on the
lent machines and committed under reports/; here only that they run and their tables are well formed)."""

from __future__ import annotations

import json

import pytest
from typer.testing import CliRunner

from detaudit.cli import app

runner = CliRunner()


@pytest.mark.slow  # three engines on a checkpoint
def test_bench_e2e_on_cpu_times_replayed_steps_in_every_call(tiny_llama):
    """A CPU engine records its decode step once a batch size has run enough steps: the warm-up decodes as
    the timed calls do, so every timed call's steps are replayed (none eager among them)."""
    from detaudit.builtin.generate import REPLAY_AFTER_STEPS

    tokens = REPLAY_AFTER_STEPS // 2 + 1  # (the warm-up's steps and the first timed call's reach the threshold)
    args = ["bench", "e2e", "--models", str(tiny_llama), "--device", "cpu", "--batch-sizes", "2"]
    args += ["--prompt-tokens", "8", "--new-tokens", str(tokens), "--repeats", "2", "--backends", "bio", "--json"]
    res = runner.invoke(app, args)
    assert res.exit_code == 0, res.output
    (row,) = json.loads(res.stdout)["rows"]
    assert row["cpu_replayed_calls"] == 2, row


def test_bench_e2e_on_cpu(tiny_llama):
    """One row per backend, bf16's ratios are 1, bad TP input is one line."""
    res = runner.invoke(
        app,
        [
            "bench",
            "e2e",
            "--models",
            str(tiny_llama),
            "--device",
            "cpu",
            "--batch-sizes",
            "2",
            "--prompt-tokens",
            "8",
            "--new-tokens",
            "3",
            "--json",
        ],
    )
    assert res.exit_code == 0, res.output
    out = json.loads(res.stdout)
    rows = out["rows"]
    assert [r["backend"] for r in rows] == ["bf16", "bio", "bio+tbik"]
    from detaudit.backends import describe_machine

    assert out["meta"]["cpu_gemm"] == describe_machine()["cpu_gemm"]  # the title names the CPU path
    for r in rows:  # what was asked, and columns derived from one measured call, consistently
        assert (r["tp"], r["batch"], r["prompt_tokens"], r["new_tokens"]) == (1, 2, 8, 3), r
        assert not r["cuda_graphs"] and r["workers"] == 0, r  # CPU: eager, in process
        assert r["decode_tok_s"] > 0 and r["prefill_tok_s"] > 0 and r["host_ms_per_step"] > 0, r
        # the prefill's launches are issued within its time, and on a CPU the host does the work itself
        prefill_ms = 1e3 * r["batch"] * r["prompt_tokens"] / r["prefill_tok_s"]
        assert 0.5 * prefill_ms < r["prefill_host_ms"] <= prefill_ms, r
        # decode_tok_s = batch * steps / decode_s and ms_per_step = 1e3 * decode_s / steps
        assert r["decode_tok_s"] * r["ms_per_step"] == pytest.approx(1e3 * r["batch"], rel=1e-9), r
        assert r["decode_vs_bf16"] == pytest.approx(r["decode_tok_s"] / rows[0]["decode_tok_s"], rel=1e-12)
        assert r["prefill_vs_bf16"] == pytest.approx(r["prefill_tok_s"] / rows[0]["prefill_tok_s"], rel=1e-12)
    assert rows[0]["decode_vs_bf16"] == 1.0 and rows[0]["prefill_vs_bf16"] == 1.0
    res = runner.invoke(app, ["bench", "e2e", "--models", str(tiny_llama), "--device", "cpu", "--tp", "3"])
    assert res.exit_code == 2 and "TP size" in res.output


@pytest.mark.slow  # two engines and transformers on a checkpoint
def test_bench_engine_splits_prefill_and_decode(tiny_sweep_model, monkeypatch):
    """Each row's call splits into its prefill and its decode; ratios are to detaudit's bf16 in the run,
    and the title names the CPU product path and how each backend's decode steps ran. A batch larger than
    the suite (smoke: 8 prompts) repeats them."""
    from detaudit.builtin import generate

    monkeypatch.setattr(generate, "REPLAY_AFTER_STEPS", 0)  # (CPU: bio's steps recorded though the calls are short)
    args = ["bench", "engine", "--model", str(tiny_sweep_model), "--batch-size", "10", "--max-new-tokens", "4"]
    res = runner.invoke(app, [*args, "--backends", "bf16,bio", "--json"])
    assert res.exit_code == 0, res.output
    out = json.loads(res.stdout)
    rows = {r["engine"]: r for r in out["rows"]}
    assert list(rows) == ["detaudit (bf16)", "detaudit (bio)", "transformers generate"]
    assert out["meta"]["batch_size"] == 10 and out["meta"]["prompts"] == "8 distinct, repeated to fill the batch of 10"
    for r in rows.values():
        assert r["tokens"] == 40 and 0 < r["prefill_s"] < r["seconds"] and r["decode_tokens_per_s"] > 0, r
        assert r["decode_vs_bf16"] == pytest.approx(
            r["decode_tokens_per_s"] / rows["detaudit (bf16)"]["decode_tokens_per_s"], rel=1e-12
        )
        assert r["prefill_vs_bf16"] == pytest.approx(rows["detaudit (bf16)"]["prefill_s"] / r["prefill_s"], rel=1e-12)
    assert rows["detaudit (bf16)"]["vs_bf16"] == 1.0
    from detaudit.backends import describe_machine

    assert out["meta"]["cpu_gemm"] == describe_machine()["cpu_gemm"]
    assert out["meta"]["decode_steps"] == "bf16 eager, bio replayed"  # (CPU: bio's steps from a recording)


@pytest.mark.slow  # engines on a checkpoint, several timed calls
def test_bench_e2e_repeats_report_the_median_call(tiny_llama):
    """With --repeats the row is the median timed call (and the median prefill), bracketed by the min and
    max; bad counts and --compare-graphs without a GPU are one line, exit 2."""
    res = runner.invoke(
        app,
        [
            "bench",
            "e2e",
            "--models",
            str(tiny_llama),
            "--device",
            "cpu",
            "--batch-sizes",
            "2",
            "--backends",
            "bio",
            "--prompt-tokens",
            "8",
            "--new-tokens",
            "3",
            "--repeats",
            "3",
            "--json",
        ],
    )
    assert res.exit_code == 0, res.output
    (row,) = json.loads(res.stdout)["rows"]
    assert row["repeats"] == 3 and row["ms_per_step_min"] <= row["ms_per_step"] <= row["ms_per_step_max"]
    assert row["prefill_tok_s_min"] <= row["prefill_tok_s"] <= row["prefill_tok_s_max"]  # the median prefill
    for bad, says in ((["--repeats", "0"], "--repeats"), (["--compare-graphs"], "CUDA device")):
        res = runner.invoke(app, ["bench", "e2e", "--models", str(tiny_llama), "--device", "cpu", *bad])
        assert res.exit_code == 2 and says in res.output, res.output


def test_bench_kernels_on_cpu_names_the_product_path():
    """CPU kernels bench at a tiny shape: accuracy columns against fp64 and, in the meta, the CPU product
    path bio and the tree ran (the one `bio`'s description records)."""
    from detaudit.backends import get_backend

    res = runner.invoke(app, ["bench", "kernels", "--device", "cpu", "--m", "8", "--kn", "64x128", "--json"])
    assert res.exit_code == 0, res.output
    out = json.loads(res.stdout)
    assert out["meta"]["cpu_gemm"] == get_backend("bio").describe()["cpu_gemm"]
    (row,) = out["rows"]
    assert (row["M"], row["K"], row["N"]) == (8, 64, 128)
    assert 0 < row["bio_fp32_relerr"] < 1e-5 and 0 < row["tree_fp32_relerr"] < 1e-5  # fp32 sums of exact products
    assert row["bio_relerr"] < 1e-2 and row["tree_relerr"] < 1e-2  # then rounded once to bf16


def test_bench_kernels_tp_runs_a_ranks_leaf_plan():
    """--tp 1,4: one row per TP size; K is the rank's K, so K = 64 at TP 4 is 2 leaves of 32 (its partial
    is a subtree: fp32, not rounded, close to fp64); a K the 8-leaf tree cannot cut is refused by name
    before any timing."""
    args = ["bench", "kernels", "--device", "cpu", "--m", "8", "--kn", "64x32", "--tp", "1,4", "--json"]
    res = runner.invoke(app, args)
    assert res.exit_code == 0, res.output
    rows = json.loads(res.stdout)["rows"]
    assert [r["tp"] for r in rows] == [1, 4]
    assert all(0 < r["tree_fp32_relerr"] < 1e-5 for r in rows)
    res = runner.invoke(app, ["bench", "kernels", "--device", "cpu", "--m", "8", "--kn", "6x32", "--tp", "2"])
    assert res.exit_code == 2 and "--kn 6x32 at --tp 2" in res.output and "multiple of 8" in res.output, res.output


def test_saved_markdown_names_the_cpu_product_path(tmp_path):
    """A table saved with --save FILE.md keeps the settings the printed title shows (on CPU, the product
    path bio and the tree took), so a committed report says which path it measured."""
    from detaudit.backends import get_backend

    out = tmp_path / "k.md"
    res = runner.invoke(app, ["bench", "kernels", "--device", "cpu", "--m", "8", "--kn", "64x128", "--save", str(out)])
    assert res.exit_code == 0, res.output
    settings = [line for line in out.read_text().splitlines() if line.startswith("Settings: ")]
    assert settings and f"cpu_gemm {get_backend('bio').describe()['cpu_gemm']}" in settings[0]


@pytest.mark.slow  # engines on a checkpoint, profiled, then real TP 2 in worker processes
def test_bench_e2e_profile_lists_each_phase(tiny_llama, tmp_path):
    """--profile N: per configuration and phase (prefill, decode) the top N ops by self time, ranked, with
    shares of the phase that add up to at most 1, in the JSON document and in X-profile.md beside
    --save X.md; under real TP the profile is rank 0's, taken in its worker process."""
    save = tmp_path / "e2e.md"
    args = ["bench", "e2e", "--models", str(tiny_llama), "--device", "cpu", "--batch-sizes", "2"]
    args += ["--prompt-tokens", "8", "--new-tokens", "3", "--profile", "4", "--json"]

    def check(doc, backends, tp):
        assert [(r["backend"], r["tp"]) for r in doc["rows"]] == [(b, tp) for b in backends]
        for backend in backends:
            for phase in ("prefill", "decode"):
                mine = [p for p in doc["profile"] if (p["backend"], p["phase"], p["tp"]) == (backend, phase, tp)]
                assert [p["rank"] for p in mine] == [1, 2, 3, 4], (backend, phase, mine)
                assert all(p["self_ms"] > 0 and p["calls"] > 0 for p in mine), mine
                ms = [p["self_ms"] for p in mine]
                assert ms == sorted(ms, reverse=True) and 0 < sum(p["share"] for p in mine) <= 1 + 1e-9, mine

    res = runner.invoke(app, [*args, "--backends", "bf16,bio+tbik", "--save", str(save)])
    assert res.exit_code == 0, res.output
    check(json.loads(res.stdout), ["bf16", "bio+tbik"], 1)
    assert "rank" in (tmp_path / "e2e-profile.md").read_text() and save.exists()
    res = runner.invoke(app, [*args, "--backends", "bio+tbik", "--tp", "2"])
    assert res.exit_code == 0, res.output
    doc = json.loads(res.stdout)
    assert doc["rows"][0]["workers"] == 2
    check(doc, ["bio+tbik"], 2)


def test_bench_allreduce_refuses_a_layer_k_the_tree_cannot_cut():
    res = runner.invoke(app, ["bench", "allreduce", "--device", "cpu", "--layer-k", "12"])
    assert res.exit_code == 2 and "--layer-k 12" in res.output and "multiple of 8" in res.output, res.output


@pytest.mark.slow  # two gloo ranks in worker processes
def test_bench_allreduce_on_cpu():
    """Every CPU transport (no peer memory on gloo) gives the gather's bits, and each ratio is its time over
    the library all-reduce's; with --layer-k the row-parallel layer too (bits against its partial's gather
    all-reduce, ratios over bf16's layer)."""
    args = ["bench", "allreduce", "--device", "cpu", "--ranks", "2", "--tokens", "8,64", "--reps", "2"]
    res = runner.invoke(app, [*args, "--layer-k", "64", "--json"])
    assert res.exit_code == 0, res.output
    rows = json.loads(res.stdout)["rows"]
    assert [r["tokens"] for r in rows] == [8, 64]
    for r in rows:
        assert r["bio_same_bits"] and r["bio+tbik_same_bits"], r
        assert "bio_peer_us" not in r  # gloo: no peer-memory transport
        for b in ("bio", "bio+tbik"):
            for m in ("gather", "scatter", "auto"):
                assert r[f"{b}_{m}_x"] == pytest.approx(r[f"{b}_{m}_us"] / r["library_us"]), (b, m)
            assert r[f"{b}_layer_same_bits"], (b, r)
            assert r[f"{b}_layer_x"] == pytest.approx(r[f"{b}_layer_us"] / r["bf16_layer_us"]), b
        assert r["layer_k"] == 64 and r["bf16_layer_us"] > 0


def test_bench_e2e_reports_the_median_prefill_not_the_median_calls(monkeypatch):
    """The prefill rate is the median of the calls' own prefill rates (one eager prefill a call is one
    sample), not the prefill of the median decode call. An engine stand-in with set timings: a real
    engine's timings cannot be set."""
    from pathlib import Path

    import detaudit.builtin as builtin
    from detaudit.bench import e2e
    from detaudit.builtin.arch import ModelConfig
    from detaudit.config import ModelRef

    # (prefill_s, decode_s) per call: the warm-up, then three timed calls. By decode the median call is the
    # first timed one (2.0 s), whose prefill (1.0 s: 100 tok/s) is the fastest; the median prefill is 50.
    calls = iter([(9.0, 9.0), (1.0, 2.0), (3.0, 1.0), (2.0, 3.0)])

    class Engine:
        last_timings: dict = {}

        def generate(self, prompts, ids, decoding, batch, profile=False):
            prefill_s, decode_s = next(calls)
            self.last_timings = dict(
                prompt_tokens=100,
                prefill_s=prefill_s,
                prefill_issue_s=prefill_s / 2,
                decode_s=decode_s,
                decode_steps=10,
                issue_s=0.1,
                capture_s=0.0,
            )

        def describe(self):
            return {}

        def close(self):
            pass

    monkeypatch.setattr(builtin, "start", lambda options: Engine())
    monkeypatch.setattr(ModelConfig, "of", classmethod(lambda cls, model: type("Config", (), {"vocab_size": 50})))
    model = ModelRef(name="stand-in", path=Path("."), architecture="LlamaForCausalLM", checksum="0")
    (row,) = e2e.bench_e2e([model], ["bf16"], [1], [2], new_tokens=3, device="cpu", repeats=3).to_dict("records")
    assert row["ms_per_step"] == pytest.approx(200.0)  # the median call by decode
    assert row["prefill_tok_s"] == pytest.approx(50.0)  # the median prefill, from another call
    assert row["prefill_host_ms"] == pytest.approx(1e3)  # that call's host time (its prefill 2.0 s, issued in 1.0)
    assert (row["prefill_tok_s_min"], row["prefill_tok_s_max"]) == (pytest.approx(100 / 3), pytest.approx(100.0))
