"""Speculative decoding, the parts that need no model: the n-gram proposer, the verification walk (and
that it draws exactly what plain sampling draws), the `--speculative` setting, cell ids and the
manifest's grid."""

from __future__ import annotations

import random

import pytest
import torch

from detaudit.builtin.speculative import ngram_propose, verify
from detaudit.config import (
    MAX_SPEC_K,
    NGRAM_MAX,
    Cell,
    Speculative,
    SweepConfig,
    parse_speculative,
    parse_speculative_list,
    plain_cell_id,
    speculative_of,
)
from detaudit.errors import DetauditError
from detaudit.runs.manifest import CELL_ID_RE, _grid, speculative_conflicts, widen_grid

# ---------------------------------------------------------------- the n-gram proposer


def _lookup(ctx: list[int], k: int, max_n: int) -> list[int]:
    """Prompt lookup written plainly, as a reference: the longest n <= max_n whose suffix recurs, its first
    occurrence, what followed it."""
    for n in range(min(max_n, len(ctx) - 1), 0, -1):
        for s in range(len(ctx) - n):  # (s + n <= len(ctx) - 1: a token follows, the suffix excluded)
            if ctx[s : s + n] == ctx[-n:]:
                return ctx[s + n : s + n + k]
    return []


def test_ngram_longest_suffix_first_occurrence():
    # suffix (7, 8, 9) occurs at 0 (then 1, 2) and at 5 (then 3, 4): the first occurrence wins, which in a
    # copy task is the text being copied, not a later repeat of it
    ctx = [7, 8, 9, 1, 2, 7, 8, 9, 3, 4, 5, 7, 8, 9]
    assert ngram_propose(ctx, 2) == [1, 2]
    assert ngram_propose([7, 8, 9, 1, 2, 7, 8, 9], 10) == [1, 2, 7, 8, 9]  # up to k, fewer at the end
    # a longer suffix beats an earlier shorter one: (5, 6, 9) occurs once before, 9 alone earlier
    ctx = [9, 2, 5, 6, 9, 1, 5, 6, 9]
    assert ngram_propose(ctx, 1) == [1]
    assert ngram_propose(ctx, 1, max_n=1) == [2]


def test_ngram_looks_up_suffixes_of_five_tokens():
    """Code repeats short runs (`    for x in`) with other continuations: the 5-token suffix finds the
    occurrence the answer is copying where the 3-token one finds the first loop."""
    # two lines (1, 10, 2, 3, 4, 11) and (1, 20, 2, 3, 4, 21) share (2, 3, 4); the answer is copying the second
    ctx = [1, 10, 2, 3, 4, 11, 1, 20, 2, 3, 4, 21, 1, 20, 2, 3, 4]
    assert ngram_propose(ctx, 2) == [21, 1]  # (20, 2, 3, 4) recurs in the second line only
    assert ngram_propose(ctx, 2, max_n=3) == [11, 1]  # (2, 3, 4) first in the first line


def test_ngram_falls_back_to_shorter_suffixes_and_may_find_none():
    assert ngram_propose([1, 2, 3, 4, 3], 2) == [4, 3]  # only the 1-token suffix (3) recurs
    assert ngram_propose([1, 2, 3, 4], 3) == []  # nothing recurs
    assert ngram_propose([5], 3) == [] and ngram_propose([], 3) == []
    assert ngram_propose([4, 4], 3) == [4]  # the match at 0 is followed by the last token
    assert ngram_propose([1, 2, 1, 2], 0) == []


def test_ngram_never_matches_the_suffix_itself_and_equals_the_plain_lookup():
    # the context's own suffix is not an earlier occurrence: a repeated run proposes what followed it
    assert ngram_propose([9, 9, 9, 9], 4) == [9]  # (9, 9, 9) at 0, followed by the last token
    rng = random.Random(0)
    for _ in range(500):
        ctx = [rng.randrange(4) for _ in range(rng.randrange(0, 40))]
        k, max_n = rng.randrange(0, 6), rng.randrange(1, 7)
        assert ngram_propose(ctx, k, max_n) == (_lookup(ctx, k, max_n) if k else [])


# ---------------------------------------------------------------- the verification walk


def _walk(draws, drafts, stop_at=None):
    calls = []

    def draw(j):
        calls.append(j)
        return draws[j]

    emitted, accepted = verify(draw, drafts, lambda t: t == stop_at)
    return emitted, accepted, calls


def test_verify_accepts_while_drawn_equals_draft():
    assert _walk([5, 6, 7, 8], [5, 6, 7]) == ([5, 6, 7, 8], 3, [0, 1, 2, 3])  # all accepted, the bonus drawn
    assert _walk([5, 9, 7, 8], [5, 6, 7]) == ([5, 9], 1, [0, 1])  # stops at the first mismatch, emits it
    assert _walk([4, 6, 7, 8], [5, 6, 7]) == ([4], 0, [0])
    assert _walk([3], []) == ([3], 0, [0])  # no draft: one plain step


def test_verify_stops_where_the_request_ends():
    # an accepted end-of-sequence token ends the walk: nothing after it is drawn
    assert _walk([5, 2, 7, 8], [5, 2, 7], stop_at=2) == ([5, 2], 2, [0, 1])
    assert _walk([2, 6], [5], stop_at=2) == ([2], 0, [0])


class ToyModel:
    """A deterministic distribution over 6 tokens for every context (a hash of it), standing in for the
    target: the walk must draw, per emitted token, exactly what plain sampling draws after the same
    context with the same generator."""

    def probs(self, context: list[int]) -> torch.Tensor:
        g = torch.Generator().manual_seed(hash(tuple(context)) % (2**31))
        p = torch.rand(6, generator=g) ** 3
        return p / p.sum()


def _plain(model, prompt, n, seed):
    gen = torch.Generator().manual_seed(seed)
    ctx = list(prompt)
    for _ in range(n):
        ctx.append(int(torch.multinomial(model.probs(ctx), 1, generator=gen)))
    return ctx[len(prompt) :]


def _speculative(model, prompt, n, seed, propose):
    gen = torch.Generator().manual_seed(seed)
    ctx = list(prompt)
    drafted = accepted = 0
    while len(ctx) - len(prompt) < n:
        left = n - (len(ctx) - len(prompt))
        drafts = propose(ctx)[: left - 1]
        rows = [ctx + drafts[:j] for j in range(len(drafts) + 1)]  # row j: the context after j drafts

        def draw(j):
            return int(torch.multinomial(model.probs(rows[j]), 1, generator=gen))

        emitted, acc = verify(draw, drafts, lambda t: False)
        ctx += emitted
        drafted, accepted = drafted + len(drafts), accepted + acc
    return ctx[len(prompt) :], drafted, accepted


@pytest.mark.parametrize("kind", ["oracle", "ngram", "random", "wrong"])
def test_verification_draws_what_plain_sampling_draws(kind):
    """Whatever the drafts (the true continuation, prompt lookup, random tokens, always wrong), the
    output is plain sampling's with the same seed; acceptance only decides how many steps it takes."""
    model = ToyModel()
    rng = random.Random(1)
    for seed in range(20):
        prompt = [rng.randrange(6) for _ in range(5)]
        plain = _plain(model, prompt, 24, seed)
        proposers = {
            "oracle": lambda ctx: plain[len(ctx) - len(prompt) : len(ctx) - len(prompt) + 4],
            "ngram": lambda ctx: ngram_propose(ctx, 4),
            "random": lambda ctx: [rng.randrange(6) for _ in range(rng.randrange(5))],
            "wrong": lambda ctx: [6, 6, 6],  # a token the model never draws
        }
        got, drafted, accepted = _speculative(model, prompt, 24, seed, proposers[kind])
        assert got == plain
        if kind == "oracle":
            assert accepted == drafted > 0
        if kind == "wrong":
            assert accepted == 0 and drafted > 0


# ---------------------------------------------------------------- the setting


def test_parse_speculative_settings():
    assert parse_speculative("off") == Speculative()
    assert parse_speculative(" ngram:4 ") == Speculative("ngram", 4)
    d = parse_speculative("draft:/models/my_draft/:3")
    assert (d.kind, d.k, d.draft) == ("draft", 3, "/models/my_draft/")
    assert d.label == "draft3-my-draft" and str(d) == "draft:/models/my_draft/:3"
    assert parse_speculative("draft:a:b/c:2").draft == "a:b/c"  # K is after the last colon
    assert parse_speculative("ngram:4").label == "ngram4" and Speculative().label == ""
    assert (
        parse_speculative("draft:/m/__x__/:1").label == "draft1-x"
        and parse_speculative("draft:___:1").label == "draft1-draft"
    )
    assert parse_speculative(f"ngram:{MAX_SPEC_K}").k == MAX_SPEC_K


@pytest.mark.parametrize(
    "text, message",
    [
        ("ngram:0", "between 1 and"),
        (f"ngram:{MAX_SPEC_K + 1}", "between 1 and"),
        ("ngram:x", "between 1 and"),
        ("ngram", "between 1 and"),
        ("ngram:-1", "between 1 and"),
        ("draft:m:0", "between 1 and"),
        ("eagle:4", "unknown kind"),
        ("on", "unknown kind"),
        ("draft::4", "draft:MODEL:K"),
        ("draft:4", "draft:MODEL:K"),
    ],
)
def test_bad_settings_are_refused_in_one_line(text, message):
    with pytest.raises(DetauditError, match=message) as e:
        parse_speculative(text)
    assert "\n" not in str(e.value)


def test_setting_lists():
    assert parse_speculative_list("off,ngram:4,draft:d:4") == ("off", "ngram:4", "draft:d:4")
    for bad, message in (
        ("off,off", "twice"),
        ("ngram:4, ngram:4", "twice"),
        ("draft:/a/d:4,draft:/b/d:4", "two draft models of one name"),
        ("off,,ngram:2", "empty"),
    ):
        with pytest.raises(DetauditError, match=message):
            parse_speculative_list(bad)
    with pytest.raises(DetauditError, match="--speculative is empty"):
        SweepConfig(model="m", suites=("s",), speculative=())


# ---------------------------------------------------------------- cell ids and the grid


def test_cell_ids_off_unchanged_others_suffixed():
    assert Cell("bio+tbik", 2, 8, "smoke").id == "smoke__bio-tbik__tp2__bs8"  # the id runs always had
    assert Cell("bio+tbik", 2, 8, "smoke", speculative="ngram4").id == "smoke__bio-tbik__tp2__bs8__ngram4"
    assert Cell("bf16", 1, 1, "s", 3, "draft2-d.v1").id == "s__bf16__tp1__bs1__draft2-d.v1__bg3"
    for cell in (
        Cell("bio+tbik", 2, 8, "smoke"),
        Cell("bio+tbik", 2, 8, "smoke", speculative="ngram4"),
        Cell("bf16", 1, 16, "aime24", 4, "draft4-smollm2-135m-draft"),
    ):
        assert CELL_ID_RE.fullmatch(cell.id)
        assert Cell.recorded(cell.id, cell.backend, cell.tp, cell.batch_size, cell.suite) == cell
        assert speculative_of(cell.id) == cell.speculative
        assert plain_cell_id(cell.id) == Cell(cell.backend, cell.tp, cell.batch_size, cell.suite, cell.background).id
    # a suite name that looks like a setting is still the suite
    assert speculative_of("x__ngram4__bf16__tp1__bs1") == ""
    assert plain_cell_id("x__ngram4__bf16__tp1__bs1__ngram4") == "x__ngram4__bf16__tp1__bs1"


def test_sweep_grid_orders_settings_inside_batch_sizes():
    cfg = SweepConfig(
        model="m", suites=("s",), backends=("bio",), tp=(1,), batch_sizes=(1, 4), speculative=("off", "ngram:4")
    )
    assert [c.id for c in cfg.cells()] == [
        "s__bio__tp1__bs1",
        "s__bio__tp1__bs1__ngram4",
        "s__bio__tp1__bs4",
        "s__bio__tp1__bs4__ngram4",
    ]
    assert cfg.setting_of(cfg.cells()[1]) == Speculative("ngram", 4)
    assert cfg.to_dict()["speculative"] == ("off", "ngram:4")


def test_manifest_grid_reads_the_axis_and_old_configs():
    cfg = SweepConfig(model="m", suites=("s",), backends=("bio",), tp=(1,), batch_sizes=(1,))
    old = cfg.to_dict()
    old.pop("speculative")  # a manifest written before the axis existed
    assert list(_grid(old, "test")) == ["s__bio__tp1__bs1"]
    new = SweepConfig(**{**cfg.__dict__, "speculative": ("off", "draft:/x/d:2")}).to_dict()
    assert list(_grid(new, "test")) == ["s__bio__tp1__bs1", "s__bio__tp1__bs1__draft2-d"]
    with pytest.raises(DetauditError, match="corrupt or hand-edited"):
        _grid({**new, "speculative": ["ngram:99"]}, "test")
    # widening an old run keeps its plain cells; one draft given by two paths is one setting
    widened = dict(old)
    widen_grid(widened, new, {**new, "speculative": ["draft:/elsewhere/d:2", "ngram:3"]})
    assert widened["speculative"] == ["off", "draft:/x/d:2", "ngram:3"]
    assert len(_grid(widened, "test")) == 3


def test_speculative_conflicts_compare_draft_checksums_and_ngram_lookups():
    a = {"draft2-d": {"checksum": "aaa"}, "ngram4": {"setting": "ngram:4", "ngram_max": 5}}
    assert speculative_conflicts(a, {"draft2-d": {"checksum": "aaa"}, "ngram3": {}}) == []
    (clash,) = speculative_conflicts(a, {"draft2-d": {"checksum": "bbb"}})
    assert "draft2-d" in clash and "aaa" in clash and "bbb" in clash
    # an n-gram setting recorded by a detaudit that looked up other suffix lengths
    assert speculative_conflicts(a, {"ngram4": {"setting": "ngram:4", "ngram_max": 5}}) == []
    (clash,) = speculative_conflicts(a, {"ngram4": {"setting": "ngram:4", "ngram_max": 3}})
    assert clash == "ngram4 (n-gram lookup of up to 5 vs 3 tokens)"
    assert Speculative("ngram", 4).describe()["ngram_max"] == NGRAM_MAX
