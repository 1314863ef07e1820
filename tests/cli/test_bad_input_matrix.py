"""The bad-input matrix at the CLI, with the real embedded model where the case needs one: each case
prints one clear line, exits 2, shows no traceback, and loses nothing already written."""

from __future__ import annotations

import json
import os
import resource
import shutil
import signal
import subprocess
import sys

import pytest
from helpers import sweep_args
from typer.testing import CliRunner

from detaudit.cli import app

runner = CliRunner()


def small(batch_sizes: str = "1") -> list[str]:
    return sweep_args(limit=1, max_new_tokens=2, backends="bio", tp=1, batch_sizes=batch_sizes, no_analyze=True)


SMALL = small()


def _bad(result, message):
    assert result.exit_code == 2, result.output
    assert message in result.output, result.output
    assert "Traceback" not in result.output
    assert len([line for line in result.output.splitlines() if line.strip()]) <= 2


@pytest.fixture(scope="module")
def done_run(smollm, tmp_path_factory):
    out = tmp_path_factory.mktemp("done") / "run"
    res = runner.invoke(app, ["sweep", *SMALL, "--output-path", str(out)])
    assert res.exit_code == 0, res.output
    return out


def _copy(run, tmp_path):
    dst = tmp_path / "copy"
    shutil.copytree(run, dst)
    return dst


def test_malformed_suite_yaml_and_jsonl(tmp_path, smollm):
    y = tmp_path / "bad.yaml"
    y.write_text("task: bad\ndocs: [unclosed\n")
    _bad(runner.invoke(app, ["sweep", "--suites", str(y), "--output-path", str(tmp_path / "r")]), "bad.yaml")
    d = tmp_path / "mirror"
    d.mkdir()
    (d / "aime24.jsonl").write_text('{"id": 1, "problem": "x", "answer": "1"}\n{oops\n')
    _bad(
        runner.invoke(app, ["sweep", "--suites", "aime24", "--data-dir", str(d), "--output-path", str(tmp_path / "r")]),
        "line 2",
    )


def test_missing_data_dir(tmp_path):
    _bad(
        runner.invoke(
            app,
            ["sweep", "--suites", "aime24", "--data-dir", str(tmp_path / "nope"), "--output-path", str(tmp_path / "r")],
        ),
        "nope",
    )


def test_conflicting_flags(tmp_path):
    _bad(
        runner.invoke(app, ["sweep", "--greedy", "--temperature", "0.9", "--output-path", str(tmp_path / "r")]),
        "conflicting flags",
    )
    _bad(runner.invoke(app, ["sweep", "--shard", "3/2", "--output-path", str(tmp_path / "r")]), "--shard")


def test_model_directory_missing_files(tmp_path, smollm):
    broken = tmp_path / "model"
    shutil.copytree(smollm.path, broken)
    (broken / "model.safetensors").unlink()
    _bad(
        runner.invoke(app, ["sweep", *SMALL, "--model", str(broken), "--output-path", str(tmp_path / "r")]),
        "no *.safetensors",
    )


def test_prepared_model_checksum_mismatch(tmp_path, smollm, monkeypatch):
    home = tmp_path / "home"
    shutil.copytree(smollm.path, home / "models" / "smollm2-135m")
    with open(home / "models" / "smollm2-135m" / "tokenizer_config.json", "a") as f:
        f.write("\n")
    monkeypatch.setenv("DETAUDIT_HOME", str(home))
    _bad(
        runner.invoke(app, ["sweep", *SMALL, "--output-path", str(tmp_path / "r")]),
        "does not match its recorded size",
    )


def test_output_dir_holding_another_sweep(done_run, tmp_path):
    run = _copy(done_run, tmp_path)
    before = {p.name: p.read_bytes() for p in (run / "cells").iterdir()}
    _bad(runner.invoke(app, ["sweep", *SMALL, "--seed", "7", "--output-path", str(run)]), "different sweep")
    assert {p.name: p.read_bytes() for p in (run / "cells").iterdir()} == before


def test_truncated_cell_file(done_run, tmp_path):
    run = _copy(done_run, tmp_path)
    cell = next((run / "cells").glob("*.parquet"))
    cell.write_bytes(cell.read_bytes()[:100])
    _bad(runner.invoke(app, ["analyze", str(run)]), "unreadable or truncated")


def test_corrupt_manifest(done_run, tmp_path):
    run = _copy(done_run, tmp_path)
    (run / "manifest.json").write_text("{not json")
    _bad(runner.invoke(app, ["analyze", str(run)]), "corrupt")
    _bad(runner.invoke(app, ["gate", str(run)]), "corrupt")


def test_unwritable_output_path(tmp_path, smollm):
    if os.geteuid() == 0:
        target = "/proc/detaudit-run"  # root ignores file modes; /proc refuses new entries even to root
    else:
        ro = tmp_path / "ro"
        ro.mkdir()
        ro.chmod(0o500)
        target = str(ro / "run")
    _bad(runner.invoke(app, ["sweep", *SMALL, "--output-path", target]), "not writable")


def test_disk_full_while_writing_a_cell_loses_nothing(done_run, tmp_path):
    """A real write failure (RLIMIT_FSIZE: the kernel refuses to grow a file past 1 KiB) while the sweep
    adds a cell: one line, exit 2, and the completed cell is intact and still analyzable."""
    run = _copy(done_run, tmp_path)
    before = {p.name: p.read_bytes() for p in (run / "cells").iterdir()}

    def limit():
        signal.signal(signal.SIGXFSZ, signal.SIG_IGN)
        resource.setrlimit(resource.RLIMIT_FSIZE, (1024, 1024))

    proc = subprocess.run(
        [
            sys.executable,
            "-c",
            "from detaudit.cli import main; main()",
            "sweep",
            *small("1,2"),
            "--output-path",
            str(run),
        ],
        capture_output=True,
        text=True,
        preexec_fn=limit,
    )
    assert proc.returncode == 2, proc.stderr
    assert "cannot write" in proc.stderr and "Traceback" not in proc.stderr
    assert {p.name: p.read_bytes() for p in (run / "cells").iterdir() if p.suffix == ".parquet"} == {
        k: v for k, v in before.items() if k.endswith(".parquet")
    }
    assert runner.invoke(app, ["analyze", str(run)]).exit_code == 0
    json.loads((run / "manifest.json").read_text())  # never left half-written


# ---------------------------------------------------------------- the fast matrix: every command
# Each input is refused before any model work (the model resolver and the engine opener are replaced by
# a guard that fails the test if called: a real sweep would load the model there) and before anything is
# written: one line, exit 2, no traceback, the working directory and the run directory unchanged.
# {run} is a valid run directory, {file} a plain file, {tmp} an empty directory.

SWEEP = [
    ("--temperature nan", "--temperature must be >= 0 and finite"),
    ("--temperature inf", "--temperature must be >= 0 and finite"),
    ("--temperature -inf", "--temperature must be >= 0 and finite"),
    ("--temperature -1", "--temperature must be >= 0"),
    ("--temperature 0.001", "must be 0 (greedy) or >= 0.01"),
    ("--temperature 1e-300", "must be 0 (greedy) or >= 0.01"),
    ("--temperature warm", "Invalid value for '--temperature'"),
    ("--top-p nan", "--top-p must be in (0, 1]"),
    ("--top-p inf", "--top-p must be in (0, 1]"),
    ("--top-p 0", "--top-p must be in (0, 1]"),
    ("--top-p 1.5", "--top-p must be in (0, 1]"),
    ("--temperature 0 --top-p nan", "--top-p must be in (0, 1]"),
    ("--top-k -1", "--top-k must be between 0 and"),
    ("--top-k 2147483648", "--top-k must be between 0 and"),
    ("--top-k 99999999999999999999999", "--top-k must be between 0 and"),
    ("--top-k 2.5", "Invalid value for '--top-k'"),
    ("--seed -1", "--seed must be between 0 and 2**63 - 1"),
    ("--seed 9223372036854775808", "--seed must be between 0 and 2**63 - 1"),
    ("--seed 1180591620717411303424", "--seed must be between 0 and 2**63 - 1"),
    ("--seed 1e3", "Invalid value for '--seed'"),
    ("--logprobs 4", "--logprobs must be >= 5"),
    ("--logprobs 0", "--logprobs must be >= 5"),
    ("--logprobs 21", "--logprobs must be <= 20"),
    ("--logprobs 100000", "--logprobs must be <= 20"),
    ("--max-new-tokens 0", "--max-new-tokens must be between 1 and"),
    ("--max-new-tokens -3", "--max-new-tokens must be between 1 and"),
    ("--max-new-tokens 99999999999999999999", "--max-new-tokens must be between 1 and"),
    ("--device tpu", "--device 'tpu': must be cpu or cuda"),
    ("--device cuda:x", "must be cpu or cuda"),
    ("--device CPU", "must be cpu or cuda"),
    ("--device cuda:123", "must be cpu or cuda"),
    ("--device cpu,cuda", "must be cpu or cuda"),
    ("--tp 1,,2", "an item of the comma-separated list is empty"),
    ("--tp ,1", "an item of the comma-separated list is empty"),
    ("--tp 1,", "an item of the comma-separated list is empty"),
    ("--tp 1_0", "comma-separated integers"),
    ("--tp \u0663", "comma-separated integers"),
    ("--tp 0x2", "comma-separated integers"),
    ("--tp 1.0", "comma-separated integers"),
    ("--tp a,b", "comma-separated integers"),
    ("--tp 3", "TP size must be one of 1, 2, 4, 8"),
    ("--tp 0", "TP size must be one of 1, 2, 4, 8"),
    ("--tp -2", "TP size must be one of 1, 2, 4, 8"),
    ("--tp 16", "TP size must be one of 1, 2, 4, 8"),
    ("--tp 1,1", "lists a value twice"),
    ("--tp 99999999999999999999999999999999999", "comma-separated integers"),
    ("--backends bio,,bf16", "an item of the comma-separated list is empty"),
    ("--backends ,", "--backends is empty"),
    ("--backends nope", "unknown backend 'nope'"),
    ("--backends bio,bio", "lists a value twice"),
    ("--backends BIO", "unknown backend 'BIO'"),
    ("--suites smoke,,aime24", "an item of the comma-separated list is empty"),
    ("--suites ,", "--suites is empty"),
    ("--suites nope", "unknown suite"),
    ("--suites smoke,smoke", "lists a value twice"),
    ("--suites {tmp}/missing.yaml", "missing.yaml"),
    ("--batch-sizes 0", "batch size must be between 1 and"),
    ("--batch-sizes -4", "batch size must be between 1 and"),
    ("--batch-sizes 100001", "batch size must be between 1 and"),
    ("--batch-sizes 99999999999999999999", "batch size must be between 1 and"),
    ("--batch-sizes 1,,2", "an item of the comma-separated list is empty"),
    ("--batch-sizes 4,4", "lists a value twice"),
    ("--batch-sizes x", "comma-separated integers"),
    ("--batch-sizes 4 --concurrency 8", "--concurrency is an alias of --batch-sizes"),
    ("--concurrency 0", "batch size must be between 1 and"),
    ("--background-load -1", "--background-load -1: must be between 0 and"),
    ("--background-load 100001", "must be between 0 and"),
    ("--background-load 2", "apply to server engines"),
    ("--background-load 0,0", "lists a value twice"),
    ("--repeats 0", "--repeats must be between 1 and"),
    ("--repeats 2", "apply to server engines"),
    ("--repeats 100001", "--repeats must be between 1 and"),
    ("--limit 0", "--limit must be between 1 and"),
    ("--limit -1", "--limit must be between 1 and"),
    ("--limit 99999999999999999999999999", "--limit must be between 1 and"),
    ("--limit ten", "Invalid value for '--limit'"),
    ("--hang-timeout 0", "--hang-timeout must be > 0"),
    ("--hang-timeout -1", "--hang-timeout must be > 0"),
    ("--hang-timeout nan", "--hang-timeout must be > 0"),
    ("--hang-timeout inf", "--hang-timeout must be > 0"),
    ("--engine openai --base-url http://127.0.0.1:9/v1 --request-timeout nan", "--request-timeout must be > 0"),
    ("--engine openai --base-url http://127.0.0.1:9/v1 --request-timeout 0", "--request-timeout must be > 0"),
    ("--engine openai --api nope", "--api nope: must be one of"),
    ("--engine openai --prompt-format xml", "--prompt-format xml: must be one of"),
    ("--engine openai --server-kind tgi", "--server-kind tgi: must be one of"),
    ("--engine openai --background-prompts none", "--background-prompts none: must be one of"),
    ("--engine openai", "needs --base-url"),
    ("--engine openai --base-url ftp://x", "expected http(s)://HOST[:PORT]/v1"),
    ("--api-key-env KEY", "apply to server engines"),
    ("--server-model m", "apply to server engines"),
    ("--shard 0/0", "need 1 <= I <= N"),
    ("--shard 1/0", "need 1 <= I <= N"),
    ("--shard 3/2", "need 1 <= I <= N"),
    ("--shard a/b", "expected I/N"),
    ("--shard 1/2/3", "expected I/N"),
    ("--shard 99999999999999999999/99999999999999999999", "expected I/N"),
    ("--shard 13/13", "holds none"),
    ("--executor nope", "unknown executor 'nope'"),
    ("--max-retries 3", "apply to --executor ray only"),
    ("--ray-address 127.0.0.1:6379", "apply to --executor ray only"),
    ("--engine sglang", "unknown engine"),
    ("--engine vllm --tp-mode emulated", "runs TP mode real only"),
    ("--tp-mode fake", "Invalid value for '--tp-mode'"),
    ("--dtype float16", "Invalid value for '--dtype'"),
    ("--greedy --temperature 0.9", "conflicting flags"),
    ("--greedy --top-k 5", "conflicting flags"),
    ("--no-such-flag", "No such option: --no-such-flag"),
    ("--data-dir {tmp}/nope --suites aime24", "does not exist or is not a directory"),
    ("-o {file}", "is not a directory"),
    ("-o {file}/run", "is not writable"),
    ("-o /proc/detaudit-run", "is not writable"),
]
RUN_DIRS = [
    ("analyze {tmp}/none", "does not exist"),
    ("analyze {file}", "does not exist"),
    ("analyze {tmp}", "not a detaudit run directory"),
    ("analyze {run} --bogus", "No such option: --bogus"),
    ("analyze", "Missing argument"),
    ("report {tmp}/none", "does not exist"),
    ("report {run} --format pdf", "--format pdf: choose among"),
    ("report {run} --format md,,csv", "an item of the comma-separated list is empty"),
    ("report {run} --format ,", "--format is empty"),
    ("report {tmp}", "not a detaudit run directory"),
    ("gate {tmp}/none", "does not exist"),
    ("gate {run} --policy {tmp}/none.yaml", "does not exist"),
    ("gate {run} --policy {file}", "malformed YAML"),
    ("gate {run} --baseline {tmp}/none", "does not exist"),
    ("gate {run} --json=yes", "does not take a value"),
    ("gate", "Missing argument"),
    ("merge", "merge needs at least one run directory"),
    ("merge {run}", "merge needs --output-path"),
    ("merge {run} {run} -o {tmp}/m", "is given twice"),
    ("merge {run} {run}/. -o {tmp}/m", "is given twice"),
    ("merge {run} -o {run}/cells/sub", "lies inside the input run directory"),
    ("merge {run} -o {run}", "lies inside the input run directory"),
    ("merge {run} -o {file}", "already exists"),
    ("merge {tmp}/none -o {tmp}/m", "does not exist"),
    ("merge {tmp} -o {tmp}/../m", "not a detaudit run directory"),
    ("merge {tmp} -o {tmp}/m", "lies inside the input run directory"),
    ("diff {tmp}/none {run}", "does not exist"),
    ("diff {run} {tmp}/none", "does not exist"),
    ("diff {run} {file}", "does not exist"),
    ("diff {run}", "Missing argument"),
]
OTHERS = [
    ("bench engine --batch-size 0", "Invalid value for '--batch-size'"),
    ("bench engine --batch-size -1", "Invalid value for '--batch-size'"),
    ("bench engine --batch-size 100001", "Invalid value for '--batch-size'"),
    ("bench engine --max-new-tokens 0", "Invalid value for '--max-new-tokens'"),
    ("bench engine --backends bio,,bf16", "an item of the comma-separated list is empty"),
    ("bench engine --backends nope", "unknown backend 'nope'"),
    ("bench engine --suite nope", "unknown suite"),
    ("bench engine --save {tmp}/x.txt", "expected a .md or .csv file name"),
    ("bench engine --dtype half", "Invalid value for '--dtype'"),
    ("bench vllm --tp 3", "TP size must be one of 1, 2, 4, 8"),
    ("bench vllm --tp 1,,2", "an item of the comma-separated list is empty"),
    ("bench vllm --device tpu", "must be cpu or cuda"),
    ("bench vllm --backends nope", "unknown backend 'nope'"),
    ("bench vllm --batch-size 0", "Invalid value for '--batch-size'"),
    ("bench e2e --device tpu", "must be cpu or cuda"),
    ("bench e2e --device cpu --batch-sizes 0", "batch size must be between 1 and"),
    ("bench e2e --device cpu --tp 3", "TP size must be one of 1, 2, 4, 8"),
    ("bench e2e --device cpu --prompt-tokens 0", "Invalid value for '--prompt-tokens'"),
    ("bench e2e --device cpu --new-tokens 1", "Invalid value for '--new-tokens'"),
    ("bench e2e --device cpu --repeats 0", "Invalid value for '--repeats'"),
    ("bench e2e --device cpu --models ,", "--models is empty"),
    ("bench e2e --device cpu --backends nope", "unknown backend 'nope'"),
    ("bench e2e --device cpu --compare-graphs", "--compare-graphs needs a CUDA device"),
    ("bench e2e --device cpu --save {tmp}/x.json", "expected a .md or .csv file name"),
    ("bench kernels --device tpu", "must be cpu or cuda"),
    ("bench kernels --device cpu --m 0", "--m 0: must be between 1 and"),
    ("bench kernels --device cpu --m -1", "--m -1: must be between 1 and"),
    ("bench kernels --device cpu --m 8,,32", "an item of the comma-separated list is empty"),
    ("bench kernels --device cpu --kn 0x4", "--kn 0x4: K and N must be between 1 and"),
    ("bench kernels --device cpu --kn axb", "expected KxN pairs"),
    ("bench kernels --device cpu --kn 4096", "expected KxN pairs"),
    ("bench kernels --device cpu --kn 4x4x4", "expected KxN pairs"),
    ("bench attention --device cpu", "--device cuda only"),
    ("bench rows --device cpu", "--device cuda only"),
    ("bench rows --heads 32/5", "--heads '32/5': expected QUERY/KV"),
    ("bench rows --head-dim 100", "--head-dim 100: must be a power of two"),
    ("bench attention --heads 32/5", "--heads '32/5': expected QUERY/KV"),
    ("bench attention --heads 32", "--heads '32': expected QUERY/KV"),
    ("bench attention --heads 0/8", "--heads '0/8': expected QUERY/KV"),
    ("bench attention --variants 48x1", "--variants '48x1': expected ROWSxBLOCKS"),
    ("bench attention --variants 16x3", "--variants '16x3': expected ROWSxBLOCKS"),
    ("bench attention --variants 16", "--variants '16': expected ROWSxBLOCKS"),
    ("bench attention --head-dim 100", "--head-dim 100: must be a power of two"),
    ("bench attention --workloads both", "--workloads 'both': expected prefill or decode"),
    ("bench attention --tokens 0", "--tokens"),
    ("bench allreduce --device cpu --ranks 0", "--ranks 0: TP size must be one of"),
    ("bench allreduce --device cpu --ranks 3", "--ranks 3: TP size must be one of"),
    ("bench allreduce --device cpu --ranks 99999", "--ranks 99999: TP size must be one of"),
    ("bench allreduce --device tpu", "must be cpu or cuda"),
    ("bench allreduce --device cpu --tokens 0", "--tokens 0: must be between 1 and"),
    ("bench allreduce --device cpu --tokens 4294967296", "--tokens 4294967296: must be between 1 and"),
    ("bench allreduce --device cpu --hidden 0", "--hidden"),
    ("bench allreduce --device cpu --reps 0", "Invalid value for '--reps'"),
    ("bench nope", "No such command 'nope'"),
    ("align --batch-size 0", "--batch-size must be between 1 and"),
    ("align --batch-size 100001", "--batch-size must be between 1 and"),
    ("align --rollout builtin:3", "TP size must be one of 1, 2, 4, 8"),
    ("align --rollout nope:1", "unknown engine 'nope'"),
    ("align --rollout openai:1", "unknown engine 'openai'"),
    ("align --rollout builtin", "expected ENGINE:TP"),
    ("align --rollout builtin:99999999999999999999999999999", "expected ENGINE:TP"),
    ("align --trainer builtin:-1", "expected ENGINE:TP"),
    ("align --trainer :1", "unknown engine ''"),
    ("align --temperature nan", "--temperature must be >= 0 and finite"),
    ("align --seed -5", "--seed must be between 0 and"),
    ("align --device tpu", "must be cpu or cuda"),
    ("align --backends bio,,bf16", "an item of the comma-separated list is empty"),
    ("align --backends nope", "unknown backend 'nope'"),
    ("align --limit 0", "--limit must be between 1 and"),
    ("align --tp-mode fake", "Invalid value for '--tp-mode'"),
    ("align --max-new-tokens 0", "--max-new-tokens must be between 1 and"),
    ("models prepare nope", "unknown model 'nope'"),
    ("models prepare ../../etc", "unknown model '../../etc'"),
    ("models ls --bogus", "No such option: --bogus"),
    ("models nope", "No such command 'nope'"),
    ("suites show nope", "unknown suite 'nope'"),
    ("suites show smoke --limit 0", "--limit must be between 1 and"),
    ("suites show smoke --limit -4", "--limit must be between 1 and"),
    ("suites show smoke --limit 99999999999999999999", "--limit must be between 1 and"),
    ("suites show {tmp}/none.yaml", "none.yaml"),
    ("suites ls --bogus", "No such option: --bogus"),
    ("backends ls --bogus", "No such option: --bogus"),
    ("backends ls extra", "Got unexpected extra argument"),
    ("doctor --bogus", "No such option: --bogus"),
    ("doctor --json=1", "does not take a value"),
    ("nope", "No such command 'nope'"),
]


# ---------------------------------------------------------------- generated across every command and flag
# From the CLI itself (`typer.main.get_command(app)`): every option that takes a value, given none; every
# int / float / choice option, given a value of another type; every flag, given a value; the flag names of
# lm-eval and vLLM users type out of habit; and files that break a reader (suites, policies, data rows,
# mirrors: see `_bad_files`), through every command that reads them. Each is refused by click or by
# detaudit before any work: one line, exit 2.


def _commands():
    import typer.main

    def walk(cmd, path):
        if hasattr(cmd, "commands"):
            for name, sub in cmd.commands.items():
                yield from walk(sub, (*path, name))
        else:
            yield " ".join(path), cmd

    return list(walk(typer.main.get_command(app), ()))


# arguments a command needs before its options are looked at ({run}: a valid run directory)
ARGUMENTS = {"analyze": "{run}", "report": "{run}", "gate": "{run}", "diff": "{run} {run}", "merge": "{run}"}
WRONG_TYPE = {int: ("abc", "2.5", "0x10", "1e3"), float: ("abc", "1,5", "0.5.1")}
FOREIGN = ("--tasks", "--gen_kwargs", "--num_fewshot", "--tensor-parallel-size", "--model_args", "--max_gen_toks")


def _generated() -> list[tuple[str, str]]:
    from enum import Enum

    out = []
    for path, cmd in _commands():
        head = f"{path} {ARGUMENTS.get(path, '')}".strip()
        options = [p for p in cmd.params if p.param_type_name == "option" and "--help" not in p.opts]
        for p in options:
            name = p.opts[0]
            if p.is_flag:
                out += [(f"{head} {n}=1", f"Option '{n}' does not take a value") for n in (*p.opts, *p.secondary_opts)
                        if n.startswith("--")]  # fmt: skip
                continue
            out.append((f"{head} {name}", f"Option '{name}' requires an argument"))
            kind = p.bare_type()
            values = WRONG_TYPE.get(kind, ("nope",) if isinstance(kind, type) and issubclass(kind, Enum) else ())
            out += [(f"{head} {name} {v}", f"Invalid value for '{name}'") for v in values]
        out += [(f"{head} {flag} x", f"No such option: {flag}: that is") for flag in FOREIGN]
    return out


# files that break a reader, in {bad} (made by `_bad_files`), and the commands that read each kind
SUITE_FILES = {
    "date.yaml": "refused YAML at line 4, column 21: cannot read '2024-13-45' as a timestamp",
    "bigint.yaml": "an integer of 5000 digits (at most 4300)",
    "deep.yaml": "refused YAML: nested too deeply",
    "surrogate.yaml": "a string holds a lone surrogate",
    "big.yaml": "bytes, more than the 1048576 read",
    "fifo.yaml": "is not a regular file",
    "template.yaml": "its template is nested too deeply",
    "rows-bigint.yaml": "rows-bigint.jsonl, line 2: refused JSON: an integer of 5000 digits",
    "rows-deep.yaml": "rows-deep.jsonl, line 2: refused JSON: nested too deeply",
    "rows-surrogate.yaml": "rows-surrogate.jsonl, line 2: `doc_to_text` renders a lone surrogate",
    "array-bigint.yaml": "array-bigint.json: refused JSON: an integer of 5000 digits",
    "array-deep.yaml": "array-deep.json: refused JSON: nested too deeply",
    "glob-root.yaml": "resolves to /, outside the suite's directory",
    "glob-up.yaml": "outside the suite's directory",
    "mirror-only.yaml": "needs `dataset_kwargs.data_files`",
}
MIRRORS = {
    "mirror-bigint": "aime24.jsonl, line 1: refused JSON: an integer of 5000 digits",
    "mirror-deep": "aime24.jsonl, line 1: refused JSON: nested too deeply",
    "mirror-surrogate": "aime24.jsonl, line 1: `doc_to_text` renders a lone surrogate",
    "mirror-fifo": "is not a regular file",
}
POLICIES = {
    "date.yaml": "cannot read '2024-13-45' as a timestamp",
    "bigint.yaml": "an integer of 5000 digits",
    "deep.yaml": "nested too deeply",
    "surrogate.yaml": "lone surrogate",
    "big.yaml": "bytes, more than the 1048576 read",
    "fifo.yaml": "is not a regular file",
    "bomb.yaml": "aliases expand to",
}
# (bench vllm times random prompts: it reads no suite)
SUITE_READERS = ("sweep --suites", "suites show", "align --suite", "bench engine --suite")
FILES = [(f"{r} {{bad}}/{f}", m) for f, m in SUITE_FILES.items() for r in SUITE_READERS]
FILES += [(f"{r} aime24 --data-dir {{bad}}/{d}", m) for d, m in MIRRORS.items() for r in SUITE_READERS]
FILES += [(f"gate {{run}} --policy {{bad}}/policy/{f}", m) for f, m in POLICIES.items()]

MATRIX = [("sweep " + a, m) for a, m in SWEEP] + RUN_DIRS + OTHERS
MATRIX += [case for case in _generated() + FILES if case[0] not in {a for a, _ in MATRIX}]


def test_the_matrix_is_large_and_distinct():
    inputs = [a for a, _ in MATRIX]
    assert len(inputs) == len(set(inputs)) >= 400
    groups = ("bench", "models", "suites", "backends")
    commands = {" ".join(a.split()[:2]) if a.startswith(groups) else a.split()[0] for a in inputs}
    assert {"sweep", "analyze", "report", "gate", "merge", "diff", "align", "doctor", "backends ls"} <= commands
    benches = ("engine", "vllm", "e2e", "kernels", "allreduce", "attention")
    assert {f"bench {b}" for b in benches} <= commands
    assert {"models prepare", "models ls", "suites show", "suites ls"} <= commands


@pytest.fixture(scope="module")
def matrix_root(tmp_path_factory):
    from unit.test_analyze import invariant_cells, make_run

    root = tmp_path_factory.mktemp("matrix")
    make_run(root / "run", invariant_cells(), backends=("bio+tbik",))
    (root / "file").write_text("a plain file: [unclosed\n")
    (root / "empty").mkdir()
    (root / "cwd").mkdir()
    (root / "home").mkdir()
    _bad_files(root / "bad")
    return root


def _bad_files(bad):
    """The files of SUITE_FILES, MIRRORS and POLICIES."""
    # (300 levels: PyYAML's scanner takes a second over 20000 before the loader refuses the 101st; the
    # 20000-deep files of issue 54 are tests/security/test_file_readers.py's)
    big_int, deep = "9" * 5000, "[" * 300 + "]" * 300
    head = "task: t\ndocs: [{q: x}]\ndoc_to_text: q\n"
    rows = "task: t\ndataset_path: json\ndataset_kwargs: {data_files: %s}\ntest_split: train\ndoc_to_text: q\n"
    bad.mkdir()
    suites = {
        "date.yaml": head + "metadata: {version: 2024-13-45}\n",
        "bigint.yaml": head + f"metadata: {{version: {big_int}}}\n",
        "deep.yaml": head + f"metadata: {deep}\n",
        "surrogate.yaml": head + 'metadata: {description: "\\ud800"}\n',
        "big.yaml": head + "#" * (1 << 20) + "\n",
        "template.yaml": 'task: t\ndocs: [{q: x}]\ndoc_to_text: "{{ ' + "[" * 300 + "]" * 300 + ' }}"\n',
        "glob-root.yaml": rows % "'/**/x*.jsonl'",
        "glob-up.yaml": rows % "'../**/*.jsonl'",
        "mirror-only.yaml": "task: t\ndataset_path: json\ntest_split: train\nlocal_file: x.jsonl\ndoc_to_text: q\n",
    }
    bad_rows = {
        "bigint": f'{{"q": "a", "n": {big_int}}}',
        "deep": '{"q": "a", "n": ' + deep + "}",
        "surrogate": '{"q": "\\ud800"}',
    }
    for kind, row in bad_rows.items():
        (bad / f"rows-{kind}.jsonl").write_text('{"q": "fine"}\n' + row + "\n")
        suites[f"rows-{kind}.yaml"] = rows % f"rows-{kind}.jsonl"
        if kind != "surrogate":
            (bad / f"array-{kind}.json").write_text(f"[{row}]")
            suites[f"array-{kind}.yaml"] = rows % f"array-{kind}.json"
        (bad / f"mirror-{kind}").mkdir()
        (bad / f"mirror-{kind}" / "aime24.jsonl").write_text(row.replace('"q"', '"problem"') + "\n")
    for name, text in suites.items():
        (bad / name).write_text(text)
    os.mkfifo(bad / "fifo.yaml")
    (bad / "mirror-fifo").mkdir()
    os.mkfifo(bad / "mirror-fifo" / "aime24.jsonl")
    policy = bad / "policy"
    policy.mkdir()
    for name, text in {
        "date.yaml": "version: 2024-13-45\nbackends: {}\n",
        "bigint.yaml": f"version: {big_int}\nbackends: {{}}\n",
        "deep.yaml": f"backends: {{}}\ndescription: {deep}\n",
        "surrogate.yaml": 'backends: {}\ndescription: "\\ud800"\n',
        "big.yaml": "backends: {}\n" + "#" * (1 << 20) + "\n",
        "bomb.yaml": "backends: {}\ndescription: " + BOMB,
    }.items():
        (policy / name).write_text(text)
    os.mkfifo(policy / "fifo.yaml")


BOMB = (
    "&a ["
    + ", ".join(["x"] * 10)
    + "]\n"
    + "".join(f"b{i}: &b{i} [" + ", ".join([f"*{'a' if i == 0 else f'b{i - 1}'}"] * 10) + "]\n" for i in range(6))
)


@pytest.fixture(scope="module", autouse=False)
def fast_cli():
    from helpers import build_cli_once

    with build_cli_once(app):
        yield


def _tree(root):
    """Every path with its type, and a file's size and mtime: what a write changes. (A directory's mtime
    is left out: the sweep's writability probe creates and removes an empty directory.)"""
    tree = {}
    for p in root.rglob("*"):
        st = p.lstat()
        tree[str(p.relative_to(root))] = (st.st_mode,) if p.is_dir() else (st.st_mode, st.st_size, st.st_mtime_ns)
    return tree


@pytest.mark.parametrize("line, message", MATRIX, ids=[a for a, _ in MATRIX])
def test_bad_input_is_refused_before_any_work(matrix_root, fast_cli, monkeypatch, line, message):
    import shlex

    import detaudit.engines
    import detaudit.models

    def no_model_work(*args, **kwargs):
        raise AssertionError("model work started: the input should have been refused before it")

    monkeypatch.setattr(detaudit.models, "resolve_model", no_model_work)
    monkeypatch.setattr(detaudit.engines, "open_engine", no_model_work)
    monkeypatch.setenv("DETAUDIT_HOME", str(matrix_root / "home"))
    monkeypatch.chdir(matrix_root / "cwd")  # relative default outputs (runs/default) would land here
    args = [
        a.format(run=matrix_root / "run", file=matrix_root / "file", tmp=matrix_root / "empty", bad=matrix_root / "bad")
        for a in shlex.split(line)
    ]
    before = _tree(matrix_root)
    res = runner.invoke(app, args)
    assert res.exception is None or isinstance(res.exception, SystemExit), repr(res.exception)
    _bad(res, message)
    assert _tree(matrix_root) == before  # nothing written, anywhere
