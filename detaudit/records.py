"""The record schema: one row per prompt per cell, identical for every engine.

Each cell is one Parquet file with these columns. Per-position lists are aligned with
`output_token_ids`: `token_logprobs[i]` is the log-probability of the generated token i, and
`topk_ids[i]` / `topk_logprobs[i]` the top-k tokens (descending) of the distribution it was drawn
from. Log-probabilities are of the model's raw distribution (temperature 1), in fp32.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

import pyarrow as pa

ProgressFn = Callable[[int], None]  # an engine calls it with the number of tokens just produced


@dataclass
class Generation:
    """What an engine returns per prompt (the per-position lists of a record)."""

    token_ids: list[int]
    token_logprobs: list[float]
    topk_ids: list[list[int]]
    topk_logprobs: list[list[float]]
    finish_reason: str


SCHEMA = pa.schema(
    [
        ("cell_id", pa.string()),
        ("model", pa.string()),
        ("suite", pa.string()),
        ("backend", pa.string()),
        ("tp", pa.int32()),
        ("batch_size", pa.int32()),
        ("tp_mode", pa.string()),
        ("engine", pa.string()),
        ("prompt_index", pa.int32()),
        ("prompt_id", pa.string()),
        ("prompt_hash", pa.string()),
        ("prompt_tokens", pa.int32()),
        ("output_token_ids", pa.list_(pa.int32())),
        ("output_text", pa.string()),
        ("finish_reason", pa.string()),
        ("token_logprobs", pa.list_(pa.float32())),
        ("topk_ids", pa.list_(pa.list_(pa.int32()))),
        ("topk_logprobs", pa.list_(pa.list_(pa.float32()))),
        ("reference_answer", pa.string()),
        ("predicted_answer", pa.string()),
        ("correct", pa.bool_()),
        # teacher forcing: this cell's log-probabilities of the reference continuation's tokens
        # (the reference is the first cell of the same backend and suite, in grid order)
        ("tf_reference_cell", pa.string()),
        ("tf_token_logprobs", pa.list_(pa.float32())),
        # server engines with --repeats R: which of the R sends of the prompt (0-based); null / absent
        # (files written before it) reads as repeat 0
        ("repeat", pa.int32()),
    ]
)

OPTIONAL_COLUMNS = ("repeat",)  # newer than some cell files: not required when reading
COLUMNS = [f.name for f in SCHEMA if f.name not in OPTIONAL_COLUMNS]
