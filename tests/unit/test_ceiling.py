"""bench.ceiling: a reply replayed through the engine's lookup, each step priced by a
verification cost curve, bounds what drafting could make of it."""

import pytest

from bench.ceiling import ceilings, interpolate, replay, switch_ms

PROMPT = list(range(100, 400))  # no n-gram twice: a lookup finds one place only


def edited_copy() -> list[int]:
    """A hundred tokens of the prompt with three of them rewritten (an edit breaks the
    copy; the text after it goes on)."""
    reply = PROMPT[50:150]
    for at in (20, 45, 70):
        reply[at] = 7
    return reply


def test_a_verification_between_and_beyond_measured_sizes_is_on_the_line():
    cost = interpolate([(1, 10.0), (2, 16.0), (4, 28.0)])
    assert cost(1) == 10.0 and cost(2) == 16.0
    assert cost(3) == pytest.approx(22.0)
    assert cost(6) == pytest.approx(40.0)  # the last segment's 6 a token, on


def test_where_each_token_verified_costs_a_step_no_policy_gains():
    def cost(n: int) -> float:
        return float(n)
    reply = PROMPT[50:150]
    assert replay(PROMPT, reply, cost, None)["speedup"] == pytest.approx(1.0)
    for k in (1, 4, 8):
        assert replay(PROMPT, reply, cost, k)["speedup"] <= 1.0 + 1e-9


def test_a_reply_that_copies_nothing_drafts_nothing():
    reply = list(range(1000, 1100))
    out = replay(PROMPT, reply, lambda n: 1.0, None)
    assert out["speedup"] == pytest.approx(1.0)
    assert out["drafted_share"] == 0.0


def test_a_copy_where_drafts_cost_nothing_is_decoded_in_a_few_steps():
    reply = PROMPT[50:150]
    out = replay(PROMPT, reply, lambda n: 1.0, None, k_max=128)
    # the first token from the prefill, one lone step to find the copy, then one step
    assert out["speedup"] == pytest.approx(99 / 2)
    assert out["drafted_share"] == pytest.approx(97 / 99)
    # at most 64 drafts a step (the most speculative.lookup_draft_max allows): three
    assert replay(PROMPT, reply, lambda n: 1.0, None)["speedup"] == pytest.approx(99 / 3)


def test_foresight_bounds_every_fixed_length_on_an_edited_copy():
    cost = interpolate([(1, 9.0), (2, 15.0), (4, 27.0), (9, 57.0), (17, 104.0)])
    got = ceilings(PROMPT, edited_copy(), cost)
    fixed = [replay(PROMPT, edited_copy(), cost, k)["speedup"] for k in range(1, 9)]
    assert got["fixed"] == pytest.approx(max(fixed))
    assert got["best_k"] == 1 + fixed.index(max(fixed))
    assert got["foresight"] >= got["fixed"]
    # a rejected draft costs its share of a step: foresight, which drafts none, gains more
    assert got["foresight"] > got["fixed"] > 1.0


def test_a_step_of_another_size_pays_for_its_graph():
    # drafts cost a third of a step, and a step of another size than the last one's
    # half a step more: a copy broken by edits changes size at each break, and pays it
    cost = interpolate([(1, 3.0), (2, 4.0), (9, 11.0)])
    for k in (2, 4, 8):
        free = replay(PROMPT, edited_copy(), cost, k)["speedup"]
        assert replay(PROMPT, edited_copy(), cost, k, switch=1.5)["speedup"] < free
    # a reply that copies nothing never changes size: no graph is built anew
    own = list(range(1000, 1080))
    assert replay(PROMPT, own, cost, None, switch=1.5)["speedup"] == pytest.approx(1.0)


def test_what_a_graph_built_anew_costs_is_read_from_alternating_steps():
    curve = [{"tokens": 1, "ms": 10.0},
             {"tokens": 2, "ms": 14.0, "after_one_ms": 15.0, "one_after_ms": 11.0},
             {"tokens": 4, "ms": 25.0, "after_one_ms": 27.0, "one_after_ms": 12.0},
             {"tokens": 9, "ms": 50.0, "after_one_ms": 49.0, "one_after_ms": 10.0}]
    assert switch_ms(curve) == pytest.approx(1.0)  # the median of 1.0, 2.0 and -0.5
    assert switch_ms(curve[:1]) == 0.0
    assert switch_ms([curve[0], {**curve[3], "after_one_ms": 45.0}]) == 0.0
