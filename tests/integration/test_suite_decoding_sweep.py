"""A task file's generation_kwargs and prompt form through a real sweep (the embedded model, built-in
engine): its stop string ends a row where lm-eval would, the manifest records each suite's effective
decoding and prompt form, `prompts.parquet` holds the prompts as the model read them, a command-line
flag overrides the file (and says so), and a data file outside the YAML's directory is read only with
--trust-suite-paths, which the manifest records. Nothing is written outside the run directory."""

from __future__ import annotations

import json
from pathlib import Path

import pyarrow.parquet as pq
import pytest
from typer.testing import CliRunner

from detaudit.cli import app
from detaudit.decoding import cut_at_stop

pytestmark = pytest.mark.slow  # the real embedded model

ROWS = [{"question": "What is 2+3?", "answer": "5"}, {"question": "Name a colour.", "answer": "red"}]


def _task(folder: Path, until: list[str], data: str = "data/test.jsonl") -> Path:
    gen = {"max_gen_toks": 12, "do_sample": False, "until": until}
    path = folder / "task.yaml"
    path.write_text(
        "task: qa\ndataset_path: json\n"
        f"dataset_kwargs: {{data_files: {{test: {data}}}}}\ntest_split: test\n"
        'doc_to_text: "Question: {{question}}\\nAnswer:"\ndoc_to_target: answer\n'
        f"generation_kwargs: {json.dumps(gen)}\n"
    )
    return path


def _sweep(task: Path, out: Path, *extra: str):
    args = ["sweep", "--suites", str(task), "--backends", "bio", "--tp", "1", "--batch-sizes", "2"]
    return CliRunner().invoke(app, [*args, "--output-path", str(out), "--no-analyze", *extra])


def _records(out: Path) -> list[dict]:
    return pq.read_table(out / "cells" / "qa__bio__tp1__bs2.parquet").to_pylist()


def _files(root: Path, skip: tuple[Path, ...]) -> set[str]:
    return {str(p) for p in root.rglob("*") if not any(p.is_relative_to(s) for s in skip)}


def test_generation_kwargs_and_prompt_form_through_a_sweep(smollm, tmp_path, monkeypatch):
    import datasets
    from transformers import AutoTokenizer

    monkeypatch.setattr(datasets.config, "HF_DATASETS_CACHE", tmp_path / "hf-cache")
    tok = AutoTokenizer.from_pretrained(str(smollm.path))
    evals = tmp_path / "evals"
    (evals / "data").mkdir(parents=True)
    (evals / "data" / "test.jsonl").write_text("".join(json.dumps(r) + "\n" for r in ROWS))
    outs = [tmp_path / f"run{i}" for i in range(4)]
    before = _files(tmp_path, tuple(outs)) | {str(evals / "task.yaml")}  # (the test rewrites the task file)

    # 1. no stop string (`until: []`; without `until` lm-eval would stop at "\n\n"): greedy, 12 tokens, plain
    # text (lm-eval's default for a task file)
    res = _sweep(_task(evals, []), outs[0])
    assert res.exit_code == 0, res.output
    assert "suite qa: plain text; greedy, max 12 new tokens (the file: do_sample false, max_gen_toks 12, until [])" in (
        " ".join(res.output.split())
    )
    free = _records(outs[0])
    ids = free[0]["output_token_ids"]
    assert 6 < len(ids) <= 12
    stop = tok.decode(ids[4:6])  # a stop string the model is known to produce

    # 2. the same task with `until`: row 0 ends at the token completing it, as lm-eval ends it
    res = _sweep(_task(evals, [stop]), outs[1])
    assert res.exit_code == 0, res.output
    first = next(k for k in range(len(ids)) if stop in tok.decode(ids[: k + 1], skip_special_tokens=False))
    row = _records(outs[1])[0]
    assert row["finish_reason"] == "stop" and row["output_token_ids"] == ids[: first + 1]
    text = tok.decode(ids[: first + 1], skip_special_tokens=True)
    assert row["output_text"] == cut_at_stop(text, [stop]) == text.split(stop)[0] and stop not in row["output_text"]
    manifest = json.loads((outs[1] / "manifest.json").read_text())
    suite = manifest["suites"]["qa"]
    assert suite["decoding"]["stop"] == [stop] and suite["decoding"]["greedy"] is True
    assert suite["decoding"]["max_new_tokens"] == 12 and suite["chat_template"] is False
    assert manifest["comparable"]["suite_decoding"]["qa"]["stop"] == [stop]
    prompts = pq.read_table(outs[1] / "prompts.parquet").to_pylist()
    texts = [f"Question: {r['question']}\nAnswer:" for r in ROWS]
    assert [p["text"] for p in prompts] == texts and not any(p["chat_template"] for p in prompts)
    assert [p["token_ids"] for p in prompts] == [tok(t)["input_ids"] for t in texts]

    # 3. the command line wins over the file and says so; the chat template on request
    res = _sweep(_task(evals, [stop]), outs[2], "--max-new-tokens", "3", "--apply-chat-template")
    assert res.exit_code == 0, res.output
    assert "the command line overrides its generation_kwargs: max_gen_toks: 12 -> --max-new-tokens 3" in res.output
    suite = json.loads((outs[2] / "manifest.json").read_text())["suites"]["qa"]
    assert suite["decoding"]["max_new_tokens"] == 3 and suite["chat_template"] is True
    prompts = pq.read_table(outs[2] / "prompts.parquet").to_pylist()
    chat = [
        tok.apply_chat_template([{"role": "user", "content": t}], add_generation_prompt=True, tokenize=False)
        for t in texts
    ]
    assert [p["token_ids"] for p in prompts] == [tok(c, add_special_tokens=False)["input_ids"] for c in chat]
    assert prompts[0]["chat_template"] and prompts[0]["prompt_text"] == chat[0]
    assert all(len(r["output_token_ids"]) <= 3 for r in _records(outs[2]))

    # 4. rows outside the YAML's directory: refused (nothing written), then read with the flag (recorded)
    (tmp_path / "shared").mkdir()
    (tmp_path / "shared" / "test.jsonl").write_text((evals / "data" / "test.jsonl").read_text())
    before |= {str(tmp_path / "shared"), str(tmp_path / "shared" / "test.jsonl")}
    task = _task(evals, [stop], data="../shared/test.jsonl")
    res = _sweep(task, outs[3])
    assert res.exit_code == 2 and "--trust-suite-paths" in res.output and not outs[3].exists(), res.output
    res = _sweep(task, outs[3], "--trust-suite-paths")
    assert res.exit_code == 0, res.output
    assert json.loads((outs[3] / "manifest.json").read_text())["config"]["trust_suite_paths"] is True
    assert _files(tmp_path, tuple(outs)) == before  # nothing outside the run directories (no datasets cache)
