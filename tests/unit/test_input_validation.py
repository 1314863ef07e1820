"""Properties of the validators every command shares: any input gives a valid value or one DetauditError,
never another exception, and a value that passes is within the documented bounds. Hypothesis runs
derandomized (the same examples every run) and small, so this stays in the fast loop."""

from __future__ import annotations

import json
import math

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from detaudit.config import (
    MAX_LOGPROBS,
    MAX_NEW_TOKENS,
    MAX_SEED,
    MAX_TOP_K,
    MIN_TEMPERATURE,
    Cell,
    DecodingParams,
    parse_int_list,
    parse_str_list,
)
from detaudit.errors import DetauditError
from detaudit.runs.manifest import Manifest

FAST = settings(max_examples=60, derandomize=True, deadline=None)
LIST_TEXT = st.one_of(
    st.text(max_size=30),
    st.lists(
        st.one_of(st.integers(-(10**25), 10**25).map(str), st.sampled_from(["", " ", "1_0", "٣", "x"])), max_size=5
    ).map(",".join),
)


@FAST
@given(LIST_TEXT)
def test_int_lists_are_ascii_integers_without_empty_items(text):
    try:
        values = parse_int_list(text, "--x", 1, 100)
    except DetauditError as e:
        assert str(e).startswith("--x")
        return
    items = [x.strip() for x in text.split(",")]
    assert all(items) and all(x.lstrip("-").isascii() and x.lstrip("-").isdigit() for x in items)
    assert values == tuple(int(x) for x in items) and all(1 <= v <= 100 for v in values)


@FAST
@given(LIST_TEXT)
def test_str_lists_have_no_empty_items(text):
    try:
        values = parse_str_list(text, "--x")
    except DetauditError:
        return
    assert values and all(v and v == v.strip() for v in values)


NUMBERS = st.one_of(
    st.floats(allow_nan=True, allow_infinity=True),
    st.integers(-(2**70), 2**70),
    st.sampled_from([0, 1e-300, 0.009, 0.01, 1, 5, 20, 21, 2**31, 2**63, -1]),
)


@FAST
@given(
    temperature=NUMBERS,
    top_p=NUMBERS,
    top_k=st.integers(-(2**40), 2**40),
    seed=st.integers(-(2**70), 2**70),
    logprobs=st.integers(-50, 10**6),
    max_new_tokens=st.integers(-5, 2**30),
)
def test_decoding_params_are_in_range_or_refused(temperature, top_p, top_k, seed, logprobs, max_new_tokens):
    try:
        d = DecodingParams(
            temperature=temperature,
            top_p=top_p,
            top_k=top_k,
            seed=seed,
            logprobs=logprobs,
            max_new_tokens=max_new_tokens,
        )
    except DetauditError as e:
        assert str(e).startswith("--")
        return
    assert math.isfinite(d.temperature) and (d.temperature == 0 or d.temperature >= MIN_TEMPERATURE)
    assert 0 < d.top_p <= 1 and 0 <= d.top_k <= MAX_TOP_K and 0 <= d.seed <= MAX_SEED
    assert 5 <= d.logprobs <= MAX_LOGPROBS and 1 <= d.max_new_tokens <= MAX_NEW_TOKENS
    json.dumps(d.to_dict(), allow_nan=False)  # the manifest stays strict JSON


# ---- Manifest.from_dict on arbitrary JSON values: a Manifest or one DetauditError

JSON = st.recursive(
    st.one_of(st.none(), st.booleans(), st.integers(-(10**30), 10**30), st.floats(), st.text(max_size=8)),
    lambda inner: st.one_of(st.lists(inner, max_size=3), st.dictionaries(st.text(max_size=8), inner, max_size=3)),
    max_leaves=12,
)
CELL = "smoke__bio__tp1__bs1"


def _valid() -> dict:
    return {
        "config": {"suites": ["smoke"], "backends": ["bio"], "tp": [1], "batch_sizes": [1], "engine": "builtin"},
        "cells": {CELL: {"backend": "bio", "tp": 1, "batch_size": 1, "suite": "smoke", "state": "done"}},
    }


def test_the_valid_manifest_is_valid():
    m = Manifest.from_dict(_valid())
    assert m.grid() == {CELL: Cell("bio", 1, 1, "smoke")}


@FAST
@given(st.sampled_from(["config", "cells", f"cells.{CELL}", "model", "suites", "backends", "comparable"]), JSON)
def test_any_value_anywhere_is_a_manifest_or_one_error(where, value):
    d = _valid()
    node, *path = where.split(".")
    if path:
        d[node][path[0]] = value
    else:
        d[node] = value
    try:
        Manifest.from_dict(d)
    except DetauditError as e:
        assert "\n" not in str(e).strip() or len(str(e)) < 2000


@FAST
@given(
    backend=st.sampled_from(["bio", "bf16", "nope", "bio+tbik", ""]),
    tp=st.one_of(st.integers(-2, 9), st.integers(10**20, 10**21)),
    batch_size=st.integers(-2, 3),
    suite=st.sampled_from(["smoke", "other", "../x", ""]),
)
def test_a_cell_is_accepted_only_as_the_cell_its_id_names(backend, tp, batch_size, suite):
    d = _valid()
    d["cells"][CELL].update(backend=backend, tp=tp, batch_size=batch_size, suite=suite)
    ok = (backend, tp, batch_size, suite) == ("bio", 1, 1, "smoke")
    if ok:
        Manifest.from_dict(d)
    else:
        with pytest.raises(DetauditError, match=CELL):
            Manifest.from_dict(d)
