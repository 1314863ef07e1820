"""Three bio+tbik configurations (TP 1, 2, 4) of a mixture-of-experts run that agree bit for bit, and one
change of one recorded number per numeric record field (`records.NUMERIC_FIELDS`, routing included): a
1-ulp step of a float32, another id for an integer, a swap where only the order changes. The change goes
into the third configuration, so a check that compares only the second configuration with the first
misses it; the routing has 3 MoE layers of top 2 (layers != top-k). Used by the records, gate and diff
tests (`FLIPS` must name every numeric field: test_records_compare checks it)."""

from __future__ import annotations

import copy
from dataclasses import dataclass
from typing import Callable

import numpy as np

from .test_analyze import rec

TP3 = (1, 2, 4)
CELLS3 = {tp: f"smoke__bio-tbik__tp{tp}__bs1" for tp in TP3}
LAST = CELLS3[4]  # where every flip goes
ROUTE = [3, 1, 0, 5, 2, 7]  # layer-major: layer 0 chose {1, 3}, layer 1 {0, 5}, layer 2 {2, 7}
GATES = [0.625, 0.375, 0.5625, 0.4375, 0.75, 0.25]
MARGINS = [0.25, 0.5, 0.125]


def ulp(x: float) -> float:
    """The next float32 after x, towards zero: a 1-ulp change that survives the float32 column."""
    return float(np.nextafter(np.float32(x), np.float32(0)))


def moe_record(prompt: int) -> dict:
    """`rec` with every routing column: 3 generated and 3 teacher-forced positions."""
    r = rec(prompt, [10 + prompt, 11, 12], tf=[0.5, 0.25, 0.125], correct=prompt % 2 == 0, tf_ref=CELLS3[1])
    for prefix in ("", "tf_"):
        r[f"{prefix}route_experts"] = [list(ROUTE) for _ in range(3)]
        r[f"{prefix}route_gates"] = [list(GATES) for _ in range(3)]
        r[f"{prefix}route_margins"] = [list(MARGINS) for _ in range(3)]
    return r


def moe_cells3(n_prompts: int = 3) -> dict[str, list[dict]]:
    """The three configurations' records, bitwise equal, sharing no list."""
    rows = [moe_record(p) for p in range(n_prompts)]
    return {cell: copy.deepcopy(rows) for cell in CELLS3.values()}


def _at(field: str, position: int, index: int | None, change: Callable) -> Callable[[dict], None]:
    """A change of `record[field][position]` (or of its entry `index`)."""

    def apply(r: dict) -> None:
        row = r[field]
        if index is None:
            row[position] = change(row[position])
        else:
            row[position][index] = change(row[position][index])

    return apply


def _swap(field: str, position: int, i: int, j: int) -> Callable[[dict], None]:
    def apply(r: dict) -> None:
        row = r[field][position]
        row[i], row[j] = row[j], row[i]

    return apply


@dataclass(frozen=True)
class Flip:
    field: str
    change: Callable[[dict], None]  # applied to record p1 of the LAST cell
    position: int  # where `records.first_difference` must find it
    also: frozenset[str] = frozenset()  # default-policy metrics other than bitwise_diff_records that see it

    @property
    def id(self) -> str:
        return f"{self.field}@{self.position}" + ("+" + "+".join(sorted(self.also)) if self.also else "")


_up = lambda t: t + 1  # noqa: E731
FLIPS = [
    Flip("output_token_ids", _at("output_token_ids", 2, None, _up), 2, frozenset({"unique_mean"})),
    Flip("token_logprobs", _at("token_logprobs", 1, None, ulp), 1),
    Flip("topk_ids", _swap("topk_ids", 2, 3, 4), 2),
    Flip("topk_logprobs", _at("topk_logprobs", 1, 5, ulp), 1),  # rank 6: outside the top 5
    Flip("topk_logprobs", _at("topk_logprobs", 0, 0, ulp), 0, frozenset({"maxprob_div_mean", "prefix_div_mean"})),
    Flip("tf_token_logprobs", _at("tf_token_logprobs", 2, None, ulp), 2, frozenset({"teacher_forced_div_max"})),
    Flip("route_experts", _swap("route_experts", 1, 4, 5), 1),  # the same set, in another order
    Flip("route_experts", _at("route_experts", 2, 3, _up), 2, frozenset({"routing_div"})),  # layer 1: {0, 6}
    Flip("route_gates", _at("route_gates", 1, 2, ulp), 1),
    Flip("route_margins", _at("route_margins", 2, 1, ulp), 2),
    Flip("tf_route_experts", _at("tf_route_experts", 0, 1, _up), 0),
    Flip("tf_route_gates", _at("tf_route_gates", 2, 5, ulp), 2),
    Flip("tf_route_margins", _at("tf_route_margins", 1, 2, ulp), 1),
]
