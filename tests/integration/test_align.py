"""`detaudit align` on the embedded model: rollouts sampled at TP 2 (real gloo workers, KV-cache decode,
batched) re-scored by a TP 1 trainer (one full forward per sequence). bio+tbik gives bitwise-equal
log-probabilities for every sampled token; bf16 does not."""

from __future__ import annotations

import pytest
from helpers import cli_json
from typer.testing import CliRunner

from detaudit.cli import app

pytestmark = pytest.mark.slow  # the real embedded model and/or worker processes

runner = CliRunner()


def test_align_tbik_is_bitwise_and_bf16_is_not(smollm, tmp_path):
    out = tmp_path / "align"
    res = runner.invoke(
        app,
        [
            "align",
            "--rollout",
            "builtin:2",
            "--trainer",
            "builtin:1",
            "--backends",
            "bf16,bio+tbik",
            "--suite",
            "smoke",
            "--limit",
            "3",
            "--batch-size",
            "3",
            "--max-new-tokens",
            "8",
            "--output-path",
            str(out),
            "--json",
        ],
    )
    assert res.exit_code == 0, res.output
    rows = {r["backend"]: r for r in cli_json(res)}
    assert rows["bio+tbik"]["bitwise_equal_frac"] == 1.0 and rows["bio+tbik"]["dp_max"] == 0.0
    assert rows["bio+tbik"]["tokens"] > 0 and rows["bf16"]["tokens"] > 0
    assert rows["bf16"]["bitwise_equal_frac"] < 1.0 and rows["bf16"]["dp_max"] > 0.0
    for name in ("alignment.md", "alignment.csv", "alignment.json"):
        assert (out / name).exists()


def test_align_bad_side(tmp_path):
    res = runner.invoke(app, ["align", "--rollout", "sglang:4", "--output-path", str(tmp_path / "a")])
    assert res.exit_code == 2 and "Traceback" not in res.output
