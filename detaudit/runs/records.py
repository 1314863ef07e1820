"""The record schema: one row per prompt per cell, identical for every engine.

Each cell is one Parquet file with these columns. Per-position lists are aligned with
`output_token_ids`: `token_logprobs[i]` is the log-probability of the generated token i, and
`topk_ids[i]` / `topk_logprobs[i]` the top-k tokens (descending) of the distribution it was drawn
from. Log-probabilities are of the model's raw distribution (temperature 1), in fp32.
"""

from __future__ import annotations

from dataclasses import dataclass
from dataclasses import field as dataclass_field
from typing import Callable, Iterator

import numpy as np
import pyarrow as pa

from detaudit.errors import DetauditError

ProgressFn = Callable[[int], None]  # an engine calls it with the number of tokens just produced


@dataclass
class Generation:
    """What an engine returns per prompt (the per-position lists of a record)."""

    token_ids: list[int]
    token_logprobs: list[float]
    topk_ids: list[list[int]]
    topk_logprobs: list[list[float]]
    finish_reason: str
    # MoE models in the built-in engine: per position, the routing of the forward that gave its
    # distribution, layer-major: expert ids and gates (L*k), and the margin between the k-th and the
    # (k+1)-th router probability (L)
    route_experts: list[list[int]] | None = None
    route_gates: list[list[float]] | None = None
    route_margins: list[list[float]] | None = None
    # speculative decoding (None without): draft tokens proposed to the verifier for this request, and how
    # many of them equalled the token the target drew at their position (accepted)
    drafted: int | None = None
    accepted: int | None = None


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
        # MoE models (null otherwise): the routing of each position (Generation.route_*), and of each
        # position of the reference continuation under teacher forcing
        ("route_experts", pa.list_(pa.list_(pa.int16()))),
        ("route_gates", pa.list_(pa.list_(pa.float32()))),
        ("route_margins", pa.list_(pa.list_(pa.float32()))),
        ("tf_route_experts", pa.list_(pa.list_(pa.int16()))),
        ("tf_route_gates", pa.list_(pa.list_(pa.float32()))),
        ("tf_route_margins", pa.list_(pa.list_(pa.float32()))),
        # speculative decoding: the cell's setting (`config.Speculative`: null / absent = off), and per
        # record the draft tokens proposed and accepted (null without speculation)
        ("speculative", pa.string()),
        ("spec_drafted", pa.int32()),
        ("spec_accepted", pa.int32()),
    ]
)

# log-softmax of fp32 logits is <= 0 exactly; a server computing it in lower precision can land a few
# ulps above 0 for a near-certain token, never more. What a record holds past it (or NaN, or an infinity)
# no engine computes: a cell file holding one is corrupt, a server answer holding one is refused.
LOGPROB_MAX = 1e-3
LOGPROB_COLUMNS = ("token_logprobs", "topk_logprobs", "tf_token_logprobs")

ROUTING_COLUMNS = tuple(f"{p}route_{x}" for p in ("", "tf_") for x in ("experts", "gates", "margins"))
SPECULATIVE_COLUMNS = ("speculative", "spec_drafted", "spec_accepted")
# newer than some cell files: not required when reading
OPTIONAL_COLUMNS = ("repeat", *ROUTING_COLUMNS, *SPECULATIVE_COLUMNS)
COLUMNS = [f.name for f in SCHEMA if f.name not in OPTIONAL_COLUMNS]


# ---------------------------------------------------------------- bitwise comparison of two cells' records

# Every numeric field of a record, in the order differences at one position are reported.
NUMERIC_FIELDS = (
    "output_token_ids",
    "token_logprobs",
    "topk_ids",
    "topk_logprobs",
    "tf_token_logprobs",
    *ROUTING_COLUMNS,
)


@dataclass(frozen=True)
class RecordDifference:
    """Where two records first differ. `field` is a NUMERIC_FIELDS name, or "record" when the prompt
    (and repeat) is in one cell only (`position` None). `position` is the output position (for
    tf_token_logprobs: the position in the reference continuation). `sampled`: the first difference
    is the chosen token and both records' top-k (ids and log-probabilities) are bitwise equal up to
    and at it, so the model gave the same distribution and the sampler picked another token (not
    compared: it describes the difference, it does not make another one)."""

    field: str
    prompt_id: str
    position: int | None
    repeat: int = 0
    sampled: bool = dataclass_field(default=False, compare=False)

    def __str__(self) -> str:
        prompt = f"prompt {self.prompt_id}" + (f" repeat {self.repeat}" if self.repeat else "")
        if self.field == "record":
            return f"{prompt} in one cell only"
        why = " (same top-k there: the sampler chose another token)" if self.sampled else ""
        return f"{self.field}, {prompt}, position {self.position}{why}"


def _bits(values: pa.Array) -> tuple[np.ndarray, np.ndarray]:
    """(the values as integers, floats by their bit patterns: a NaN equals the same NaN, 0.0 differs
    from -0.0; their validity). Null entries read as 0 and are told apart by the validity."""
    a = values.to_numpy(zero_copy_only=False)
    if a.dtype.kind == "f":
        a = a.view(np.dtype(f"u{a.dtype.itemsize}"))
    if values.null_count == 0:
        return a, np.ones(len(a), dtype=bool)
    valid = values.is_valid().to_numpy(zero_copy_only=False)
    return np.where(valid, a, 0), valid


def _layout(value: pa.Scalar) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """A list value as (number of values at each position, flat values, their validity): one per
    position for a list of numbers, the inner list's length for top-k (-1 for a null inner list)."""
    inner = value.values
    if isinstance(inner, pa.ListArray):
        valid = inner.is_valid().to_numpy(zero_copy_only=False)
        widths = np.where(valid, inner.value_lengths().fill_null(0).to_numpy(), -1).astype(np.int64)
        return (widths, *_bits(inner.flatten()))
    return (np.ones(len(inner), dtype=np.int64), *_bits(inner))


def first_position(a: pa.Scalar, b: pa.Scalar) -> int | None:
    """The first position at which two values of one list field differ bitwise (a null value differs
    from any list at position 0; a strict prefix where it ends), or None when they are equal."""
    if not a.is_valid or not b.is_valid:
        return None if a.is_valid == b.is_valid else 0
    (wa, va, ma), (wb, vb, mb) = _layout(a), _layout(b)
    n = min(len(wa), len(wb))
    split = np.flatnonzero(wa[:n] != wb[:n])
    same_shape = int(split[0]) if split.size else n  # positions before it hold as many values on both sides
    offsets = np.concatenate([[0], np.cumsum(np.maximum(wa[:same_shape], 0))])
    end = int(offsets[-1])
    diff = np.flatnonzero((va[:end] != vb[:end]) | (ma[:end] != mb[:end]))
    if diff.size:
        return int(np.searchsorted(offsets, diff[0], side="right") - 1)
    return same_shape if same_shape < n or len(wa) != len(wb) else None


def record_key(prompt_id: object, prompt_index: object, repeat: object) -> tuple[str, int]:
    """How the records of two cells are matched: prompt id (`#index` without one) and repeat."""
    return (f"#{prompt_index}" if prompt_id is None else str(prompt_id)), int(repeat or 0)


def records_by_key(table: pa.Table) -> dict[tuple[str, int], int]:
    """Record key -> row number, in (prompt index, repeat) order. Two records with one key make a
    corrupt cell: matching them to another cell's would hide one of them."""
    get = lambda c: table.column(c).to_pylist() if c in table.column_names else [None] * table.num_rows  # noqa: E731
    ids, index, repeat = get("prompt_id"), get("prompt_index"), get("repeat")
    keys = [record_key(*k) for k in zip(ids, index, repeat)]
    rows: dict[tuple[str, int], int] = {}
    for i in sorted(range(len(keys)), key=lambda i: (index[i] if index[i] is not None else -1, keys[i][1], i)):
        if keys[i] in rows:
            raise DetauditError(f"a cell holds two records of prompt {keys[i][0]} (repeat {keys[i][1]})")
        rows[keys[i]] = i
    return rows


def _column_bits(column: pa.ChunkedArray) -> list[np.ndarray]:
    """A whole list column as arrays that are equal for two columns exactly when every row is equal in
    the sense of `first_position`: each level's validity and lengths, then the values' bits."""
    arr = column.combine_chunks()
    out = []
    while isinstance(arr, pa.ListArray):
        out += [arr.is_valid().to_numpy(zero_copy_only=False), arr.value_lengths().fill_null(-1).to_numpy()]
        arr = arr.flatten()  # this level's slicing and null entries taken care of
    return out + list(_bits(arr))


def _column_equal(a: pa.ChunkedArray, b: pa.ChunkedArray) -> bool:
    bits_a, bits_b = _column_bits(a), _column_bits(b)
    return len(bits_a) == len(bits_b) and all(np.array_equal(x, y) for x, y in zip(bits_a, bits_b))


TOPK_FIELDS = ("topk_ids", "topk_logprobs")


def _topk_at(table: pa.Table, row: int, position: int) -> bool:
    """Whether the record holds a non-empty top-k (ids and log-probabilities) at `position`."""
    for f in TOPK_FIELDS:
        if f not in table.column_names:
            return False
        value = table.column(f)[row]
        if not value.is_valid or len(value) <= position or not value[position].is_valid or not len(value[position]):
            return False
    return True


def record_differences(
    a: pa.Table, b: pa.Table, fields: tuple[str, ...] = NUMERIC_FIELDS
) -> Iterator[RecordDifference]:
    """Each record that differs between two cells, bitwise in `fields`, with its first difference: the
    earliest position, the first of `fields` at that position. Records in `a`'s prompt order, then the
    ones only `b` holds."""
    rows_a, rows_b = records_by_key(a), records_by_key(b)
    cols = {f: (a.column(f), b.column(f)) for f in fields if f in a.column_names and f in b.column_names}
    missing = [f for f in fields if f not in cols and (f in a.column_names or f in b.column_names)]
    if list(rows_a.items()) == list(rows_b.items()):  # the same records in the same rows: whole columns first
        cols = {f: c for f, c in cols.items() if not _column_equal(*c)}  # (the common case: equal cells)
        if not cols and not missing:
            return
    for key, i in rows_a.items():
        j = rows_b.get(key)
        if j is None:
            yield RecordDifference("record", key[0], None, key[1])
            continue
        found = [(0, f) for f in missing]  # a field one cell records and the other does not
        for f, (ca, cb) in cols.items():
            pos = first_position(ca[i], cb[j])
            if pos is not None:
                found.append((pos, f))
        if found:
            pos, f = min(found, key=lambda pf: (pf[0], fields.index(pf[1])))
            # the chosen token first, and no top-k field differing at its position (an earlier one would
            # have come first): the same distribution there, another token drawn
            sampled = (
                f == "output_token_ids"
                and not any(p == pos for p, g in found if g in TOPK_FIELDS)
                and _topk_at(a, i, pos)
                and _topk_at(b, j, pos)
            )
            yield RecordDifference(f, key[0], pos, key[1], sampled=sampled)
    for key in (k for k in rows_b if k not in rows_a):
        yield RecordDifference("record", key[0], None, key[1])


def first_difference(a: pa.Table, b: pa.Table, fields: tuple[str, ...] = NUMERIC_FIELDS) -> RecordDifference | None:
    """The first place two cells' records differ bitwise (see `record_differences`), or None: equal."""
    return next(record_differences(a, b, fields), None)
