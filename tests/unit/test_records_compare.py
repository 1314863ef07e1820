"""records.first_difference: two cells' records compared bit for bit, field by field."""

from __future__ import annotations

import math

import numpy as np
import pyarrow as pa
import pytest

from detaudit.errors import DetauditError
from detaudit.runs.records import (
    COLUMNS,
    NUMERIC_FIELDS,
    SCHEMA,
    RecordDifference,
    first_difference,
    record_differences,
)

from .record_flips import CELLS3, FLIPS, LAST, moe_cells3
from .test_analyze import rec


def table(*rows: dict) -> pa.Table:
    return pa.Table.from_pylist([{**{c: None for c in COLUMNS}, **r} for r in rows], schema=SCHEMA)


def ulp(x: float) -> float:
    """The next float32 after x, towards zero: a 1-ulp change that survives the float32 column."""
    return float(np.nextafter(np.float32(x), np.float32(0)))


def records() -> list[dict]:
    return [rec(0, [5, 6, 7], tf=[0.5, 0.25]), rec(1, [8, 9, 10, 11], tf=[0.5, 0.5, 0.25])]


def test_equal_records_have_no_difference():
    assert first_difference(table(*records()), table(*records())) is None


def test_one_ulp_in_one_log_probability_is_found_at_its_position():
    b = records()
    b[1]["token_logprobs"][2] = ulp(b[1]["token_logprobs"][2])
    assert first_difference(table(*records()), table(*b)) == RecordDifference("token_logprobs", "p1", 2)


@pytest.mark.parametrize(
    "field, change, position",
    [
        ("topk_logprobs", lambda r: r["topk_logprobs"][1].__setitem__(3, ulp(r["topk_logprobs"][1][3])), 1),
        ("topk_ids", lambda r: r["topk_ids"][2].__setitem__(5, 99), 2),
        ("topk_logprobs", lambda r: r["topk_logprobs"][2].pop(), 2),  # a shorter top-k row
        ("tf_token_logprobs", lambda r: r["tf_token_logprobs"].__setitem__(1, ulp(r["tf_token_logprobs"][1])), 1),
        ("tf_token_logprobs", lambda r: r.__setitem__("tf_token_logprobs", None), 0),  # not scored in one run
        ("output_token_ids", lambda r: r["output_token_ids"].__setitem__(1, 99), 1),
    ],
)
def test_each_numeric_field_is_compared(field, change, position):
    b = records()
    change(b[0])
    assert first_difference(table(*records()), table(*b)) == RecordDifference(field, "p0", position)


def test_floats_are_compared_by_bit_pattern():
    a, b = records(), records()
    a[0]["token_logprobs"][0] = b[0]["token_logprobs"][0] = math.nan
    assert first_difference(table(*a), table(*b)) is None  # the same NaN: equal
    a[0]["token_logprobs"][1], b[0]["token_logprobs"][1] = 0.0, -0.0
    assert first_difference(table(*a), table(*b)) == RecordDifference("token_logprobs", "p0", 1)


def test_a_strict_prefix_differs_where_it_ends_and_ids_are_named_first():
    b = records()
    for f in ("output_token_ids", "token_logprobs", "topk_ids", "topk_logprobs"):
        b[1][f] = b[1][f][:2]
    assert first_difference(table(*records()), table(*b)) == RecordDifference("output_token_ids", "p1", 2)


def test_the_earliest_position_wins_over_field_order():
    b = records()
    b[0]["output_token_ids"][2] = 99
    b[0]["topk_logprobs"][0][0] = ulp(b[0]["topk_logprobs"][0][0])
    assert first_difference(table(*records()), table(*b)) == RecordDifference("topk_logprobs", "p0", 0)


def test_records_are_matched_by_prompt_not_row_order():
    a = records()
    assert first_difference(table(*a), table(*reversed(a))) is None
    extra = rec(2, [1])
    diffs = list(record_differences(table(*a), table(*a, extra)))
    assert diffs == [RecordDifference("record", "p2", None)]


def test_two_records_of_one_prompt_are_a_corrupt_cell():
    a = records()
    with pytest.raises(DetauditError, match="two records of prompt p0"):
        first_difference(table(*a, a[0]), table(*a))


def test_the_flips_name_every_numeric_field():
    """The gate and diff tests flip one number of each field in `FLIPS`: a field added to the records must
    get a flip there too."""
    assert {f.field for f in FLIPS} == set(NUMERIC_FIELDS)


@pytest.mark.parametrize("flip", FLIPS, ids=[f.id for f in FLIPS])
def test_one_changed_number_of_any_numeric_field_is_found(flip):
    """Routing included: expert ids (layer-major, 3 layers of top 2), gates and margins, generated and
    teacher-forced."""
    a, b = moe_cells3()[CELLS3[1]], moe_cells3()[LAST]
    assert first_difference(table(*a), table(*b)) is None
    flip.change(b[1])
    assert first_difference(table(*a), table(*b)) == RecordDifference(flip.field, "p1", flip.position)
    # a record holding the field against one that does not: the field's position 0
    b[1] = dict(a[1], **{flip.field: None})
    assert first_difference(table(*a), table(*b)) == RecordDifference(flip.field, "p1", 0)


def test_another_token_from_the_same_top_k_is_named_a_sampling_difference():
    b = records()
    b[1]["output_token_ids"][2] = 99  # the same distribution at position 2, another token drawn
    d = first_difference(table(*records()), table(*b))
    assert d == RecordDifference("output_token_ids", "p1", 2) and d.sampled
    assert str(d).endswith("(same top-k there: the sampler chose another token)")


def test_a_token_whose_top_k_also_differs_is_not_a_sampling_difference():
    b = records()
    b[1]["output_token_ids"][2] = 99
    b[1]["topk_logprobs"][2][0] = ulp(b[1]["topk_logprobs"][2][0])  # the distribution moved there too
    d = first_difference(table(*records()), table(*b))
    assert d == RecordDifference("output_token_ids", "p1", 2) and not d.sampled
    assert "sampler" not in str(d)


def test_without_top_k_a_token_difference_is_not_called_a_sampling_one():
    a, b = records(), records()
    for r in (*a, *b):
        r["topk_ids"] = r["topk_logprobs"] = None
    b[0]["output_token_ids"][1] = 99
    d = first_difference(table(*a), table(*b))
    assert d == RecordDifference("output_token_ids", "p0", 1) and not d.sampled
