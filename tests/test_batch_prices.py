"""A batch's step kinds priced from the calibration before they run, then chosen by what they measure."""

from __future__ import annotations

import math
from dataclasses import replace

import pytest

from layerskip.drafts.builder import MAX_ACCEPTANCE
from layerskip.drafts.drafters.auto import StepPrices
from layerskip.drafts.rules.costs import end_move, expected_tokens
from layerskip.engine.step_kinds import EXPLORE_AFTER, EXPLORE_FIRST, StepKinds, price, priced


def _prices(acceptance: float = 0.8) -> StepPrices:
    # One row's verify costs 10 ms plus 1 ms a position; a plain batched step 20 ms at 1 row and
    # 40 ms at 4; a batched draft step 5 ms at 1 row and 10 ms at 4 (the calibration's head), and
    # 4 ms at 1 row with the batch's head.
    return StepPrices(
        plain={1: 0.020, 4: 0.040},
        draft_rows={1: 0.005, 4: 0.010},
        verify=lambda n: 0.010 + 0.001 * n,
        draft_step=0.004,
        acceptance=acceptance,
        max_draft=6,
    )


def test_a_batch_step_is_priced_from_the_calibrated_curves() -> None:
    prices = _prices()
    assert price(prices, "plain", 4) == pytest.approx((4.0, 0.040))
    assert price(prices, "lookup", 4) == price(prices, "plain", 4)  # a row without a match verifies one token
    # 4 rows of 4 positions: the plain step of 4 rows grown as one row's verify grows from 4 to 16 positions.
    assert prices.verify_rows(4, 4) == pytest.approx(0.040 * 0.026 / 0.014)
    assert prices.draft_rows_step(4) == pytest.approx(0.004 * 2)  # the rows curve doubles from 1 to 4 rows
    assert prices.verify_rows(2, 1) == pytest.approx(0.020 + (0.040 - 0.020) / 3)  # interpolated rows
    # Four level rows: the batch's end moves by a position only where all four keep it.
    tokens, seconds = price(prices, "skip:3", 4)
    assert tokens == pytest.approx(4 * expected_tokens(0.8**4, 3))
    assert seconds == pytest.approx(3 * 0.008 + prices.verify_rows(4, 4))
    # One row three tokens behind the others: only its own draft moves the end.
    tokens, _ = price(prices, "skip:3", 4, gaps=(0, 3, 3, 3))
    assert tokens == pytest.approx(4 * expected_tokens(0.8, 3))
    # Rows' own drafters, one after another, at their best length.
    tokens, seconds = price(prices, "draft", 2)
    best = max((2 * expected_tokens(0.8**2, g)) / (2 * g * 0.004 + prices.verify_rows(2, g + 1)) for g in range(1, 7))
    assert tokens / seconds == pytest.approx(best)
    assert price(prices, "something else", 4) is None
    assert set(priced(prices, ("plain", "skip:3", "unknown"), 4)) == {"plain", "skip:3"}


def test_a_timed_wide_verify_prices_every_width_on_one_line() -> None:
    # 4 rows: 40 ms at width 1, 70 ms at width 4 (WIDE_BLOCK): 10 ms a position beyond the first.
    prices = replace(_prices(), wide={1: 0.025, 4: 0.070})
    assert prices.verify_rows(4, 1) == pytest.approx(0.040)
    assert prices.verify_rows(4, 4) == pytest.approx(0.070)
    assert prices.verify_rows(4, 7) == pytest.approx(0.100)  # skip:6's verify, past the timed width
    # A wide step timed below the plain one (noise) never prices a wide verify below a plain one.
    prices = replace(_prices(), wide={1: 0.010, 4: 0.030})
    assert prices.verify_rows(4, 4) == pytest.approx(0.040)
    # A row that reads every logit adds the full head's seconds for every position of the block.
    prices = replace(_prices(), wide={1: 0.025, 4: 0.070}, dense=lambda positions: 0.001 * positions)
    assert prices.verify_rows(4, 4) == pytest.approx(0.070 + 0.016)


def test_a_draft_that_is_rarely_right_is_priced_below_a_plain_step() -> None:
    rate = {kind: tokens / seconds for kind, (tokens, seconds) in priced(_prices(0.05), ("plain", "skip:6"), 4).items()}
    assert rate["plain"] > rate["skip:6"]
    rate = {kind: tokens / seconds for kind, (tokens, seconds) in priced(_prices(0.97), ("plain", "skip:6"), 4).items()}
    assert rate["skip:6"] > rate["plain"]


def test_a_draft_moves_the_batch_end_as_far_as_the_rows_furthest_behind_keep_it() -> None:
    assert end_move(0.7, 3, (0,)) == pytest.approx(expected_tokens(0.7, 3))  # one row
    assert end_move(0.7, 3, (0, 0, 0)) == pytest.approx(expected_tokens(0.7**3, 3))  # level rows
    assert end_move(0.7, 3, (0, 4, 9)) == pytest.approx(expected_tokens(0.7, 3))  # the others far ahead
    # A row one token ahead needs one token fewer: 1 + 0.7 * 1 + 0.7**2 * 0.7 + 0.7**3 * 0.7**2.
    assert end_move(0.7, 3, (0, 1)) == pytest.approx(1 + 0.7 + 0.7**3 + 0.7**5)
    assert end_move(1.0, 6, (0,) * 16) == pytest.approx(7.0)


def test_sixteen_level_rows_drafts_are_priced_at_the_batch_end_they_move() -> None:
    """Sixteen level rows move the batch's end by a drafted token only where all sixteen keep it:
    where a verify of four positions costs over two plain steps, no draft could pay even with every
    token accepted, and none is tried; a row left far behind makes its draft worth a trial."""
    prices = replace(_prices(0.9), plain={1: 0.020, 16: 0.100}, wide={1: 0.025, 16: 0.220})
    menu = ("plain", "skip:3", "skip:6")
    kinds = StepKinds(menu, prices=priced(prices, menu, 16), pricer=prices, rows=16)
    assert kinds.hopeless("skip:3") and kinds.hopeless("skip:6")
    for _ in range(300):
        kinds.observe(kinds.choose(), 16, 0.100, wall=0.100)
    assert set(kinds.steps) == {"plain"}
    kinds.gaps = (0, *[6] * 15)  # one row six tokens behind the rest
    assert not kinds.hopeless("skip:3")
    assert kinds.price_rate("skip:3") > kinds.price_rate("plain")


def test_priced_kinds_start_from_the_best_price_and_are_explored_by_their_priced_seconds() -> None:
    kinds = StepKinds(("plain", "lookup", "skip:3"), prices={"plain": (4.0, 0.04), "skip:3": (10.0, 0.05)})
    assert kinds.choose() == "lookup"  # unpriced: measured once first
    kinds.observe("lookup", 4, 0.04)
    assert kinds.choose() == "skip:3"  # priced best: no trial of the plain step first
    kinds.observe("skip:3", 4, 0.05)  # measured far below its price: the measurement counts from now on
    assert kinds.rate("skip:3") == pytest.approx(80.0)
    assert kinds.choose() in ("plain", "lookup")  # both rate 100 tokens/s; skip:3 measured 80
    # The plain step, never run, is tried once EXPLORE_FIRST times its priced seconds have passed: a
    # price alone is too rough a guess to keep a kind waiting long.
    kinds = StepKinds(("plain", "skip:3"), prices={"plain": (4.0, 0.041), "skip:3": (10.0, 0.05)})
    step = {"plain": (4, 0.041), "skip:3": (10, 0.05)}
    while "plain" not in kinds.recent:
        kinds.observe(kind := kinds.choose(), *step[kind])
    assert kinds.steps["skip:3"] == math.floor(EXPLORE_FIRST * 0.041 / 0.05) + 1
    # Measured, it waits EXPLORE_AFTER times its last trial's seconds, times how far it is behind:
    # skip:3 rates 200 tokens/s, the plain step 4 / 0.041.
    before = kinds.steps["skip:3"]
    while kinds.steps["plain"] == 1:
        kinds.observe(kind := kinds.choose(), *step[kind])
    behind = 200.0 / (4.0 / 0.041)
    assert kinds.steps["skip:3"] - before == math.floor(EXPLORE_AFTER * 0.041 * behind / 0.05) + 1


def test_without_prices_every_kind_is_tried_once_the_plain_step_first() -> None:
    kinds = StepKinds(("plain", "lookup"))
    assert kinds.choose() == "plain"
    kinds.observe("plain", 2, 0.02)
    assert kinds.choose() == "lookup"


def test_under_a_pricer_steps_cost_their_shape_and_a_hopeless_draft_is_never_explored() -> None:
    # A verify whose cost follows its positions only (many rows on a CPU): 4 rows of 7 positions
    # cost 7 plain steps, more than six drafted tokens could repay even if all were accepted.
    prices = replace(_prices(), verify=lambda n: 0.001 * n)
    kinds = StepKinds(("plain", "skip:3", "skip:6"), prices=priced(prices, ("plain", "skip:3", "skip:6"), 4))
    kinds.pricer, kinds.rows = prices, 4
    assert kinds.step_seconds(9.9, 7, 6, 0) == pytest.approx(prices.step_seconds(4, 7, 6, 0))  # not the clock's
    assert kinds.step_seconds(9.9, 1, 0, 0) == pytest.approx(0.040)
    assert kinds.hopeless("skip:6") and kinds.hopeless("skip:3") and not kinds.hopeless("plain")
    for _ in range(400):
        kinds.observe(kinds.choose(), 4, 0.040)
    assert set(kinds.steps) == {"plain"}
    # Without the pricer the same kinds are tried now and then.
    timed = StepKinds(("plain", "skip:6"), prices=priced(prices, ("plain", "skip:6"), 4))
    for _ in range(1000):  # once 25 times its priced 0.328 s, times how far it is behind, have passed
        timed.observe(timed.choose(), 4, 0.040)
    assert "skip:6" in timed.steps


def test_a_kind_that_runs_dearer_than_priced_next_to_the_plain_step_is_rated_so() -> None:
    prices = _prices()
    kinds = StepKinds(("plain", "skip:3"), prices=priced(prices, ("plain", "skip:3"), 4), pricer=prices, rows=4)
    kinds.observe("plain", 4, 0.04, wall=0.08)  # a busy spell: twice the price
    kinds.observe("skip:3", 10, 0.05, wall=0.20)  # four times its price: twice as dear as the plain step
    assert kinds.misprice("plain") == 1.0
    assert kinds.misprice("skip:3") == pytest.approx(2.0)
    assert kinds.rate("skip:3") == pytest.approx(10 / 0.10)
    assert kinds.rate("plain") == pytest.approx(4 / 0.04)  # the busy spell cancels


def test_a_near_tie_goes_to_the_plain_step() -> None:
    kinds = StepKinds(("plain", "skip:3"), prices={"plain": (4.0, 0.040), "skip:3": (10.3, 0.100)})
    assert kinds.choose() == "plain"  # 103 tokens/s against 100: within DRAFT_MARGIN
    kinds = StepKinds(("plain", "skip:3"), prices={"plain": (4.0, 0.040), "skip:3": (11.0, 0.100)})
    assert kinds.choose() == "skip:3"


def test_a_lookup_step_keeps_only_the_positions_that_pay_for_every_rows_verify() -> None:
    from layerskip.engine.step import paying_width

    # 4 rows: a plain step 40 ms, each position more 10 ms for all rows; a token is worth 10 ms.
    prices = replace(_prices(), wide={1: 0.025, 4: 0.070})
    halves = [0.5**k for k in range(1, 7)]
    level = [100, 100, 100, 100]  # tokens each row has left
    one_long = [(list(range(6)), halves), ([], []), ([], []), ([], [])]
    assert paying_width(one_long, level, prices) == 1  # one row's unlikely run: a plain step
    sure = [0.95**k for k in range(1, 7)]
    everyone = [(list(range(6)), sure)] * 4
    # Every row's likely run: most of it (the end moves as far as all four keep, 0.95 ** 4 a token).
    assert paying_width(everyone, level, prices) == 5
    assert paying_width(one_long, level, None) == 7  # without prices: the longest match whole
    assert paying_width([([], [])] * 4, level, prices) == 1
    # A likely run of one row among rows without a match pays only where that row is the one
    # furthest behind, and the others far enough ahead that their own next tokens do.
    alone = [(list(range(6)), sure), ([], []), ([], []), ([], [])]
    assert paying_width(alone, level, prices) == 1
    assert paying_width(alone, [100, 94, 94, 94], prices) == 7
    assert paying_width(alone, [100, 98, 98, 98], prices) == 3


def test_a_longer_batched_draft_is_tried_only_after_the_shorter_one_ran_near_the_best() -> None:
    step = {"plain": (4, 0.040), "skip:3": (6, 0.100), "skip:6": (8, 0.150)}  # both drafts lose to plain
    prices = {"plain": (4.0, 0.040), "skip:3": (5.0, 0.060), "skip:6": (6.0, 0.090)}
    kinds = StepKinds(("plain", "skip:3", "skip:6"), prices=dict(prices))
    for _ in range(300):
        kinds.observe(kind := kinds.choose(), *step[kind])
    assert kinds.steps.get("skip:3", 0) >= 2 and "skip:6" not in kinds.steps
    # The shorter draft near the best rate: the longer one gets its trial.
    step["skip:3"] = (9, 0.100)
    kinds = StepKinds(("plain", "skip:3", "skip:6"), prices=dict(prices))
    for _ in range(300):
        kinds.observe(kind := kinds.choose(), *step[kind])
    assert "skip:6" in kinds.steps


def test_a_verify_counts_for_the_thread_tuner_as_its_width_in_plain_steps() -> None:
    """A lookup step's wider verify is more work, not a slower thread count: the tuner's unit is
    the verify's price over the plain step's (1 per step without a pricer)."""
    prices = replace(_prices(), wide={1: 0.025, 4: 0.070})
    kinds = StepKinds(("plain", "lookup"))
    assert kinds.verify_units(4) == 1.0
    kinds.pricer, kinds.rows = prices, 4
    assert kinds.verify_units(1) == pytest.approx(1.0)
    assert kinds.verify_units(4) == pytest.approx(0.070 / 0.040)


def test_a_batched_draft_not_yet_run_is_priced_as_dear_as_the_one_that_ran() -> None:
    """The calibration's short context underprices many rows' draft forwards at a long one: once
    skip:3 ran at twice its price beside the plain step, skip:6 is taken to run so too, and a
    skip:6 that could not win even so is never tried (before, a hopeless skip:3 released it)."""
    prices = _prices()
    menu = ("plain", "skip:3", "skip:6")
    kinds = StepKinds(menu, prices=priced(prices, menu, 4), pricer=prices, rows=4)
    assert kinds.misprice("skip:6") == 1.0 and kinds.timed_like("skip:6") is None
    kinds.observe("plain", 4, 0.04, wall=0.04)
    kinds.observe("skip:3", 10, 0.05, wall=0.10)
    assert kinds.timed_like("skip:6") == "skip:3" and kinds.timed_like("plain") == "plain"
    assert kinds.misprice("skip:6") == pytest.approx(2.0)
    best_case = price(prices, "skip:6", 4, acceptance=MAX_ACCEPTANCE)
    # At its price skip:6 beats both kinds that ran; at twice its price, neither.
    assert best_case[0] / best_case[1] > max(kinds.rate("plain"), kinds.rate("skip:3"))
    assert best_case[0] / (2 * best_case[1]) < max(kinds.rate("plain"), kinds.rate("skip:3"))
    assert kinds.hopeless("skip:6")
    # Ten times dearer than priced: neither draft could win, and skip:6 is never tried.
    kinds = StepKinds(menu, prices=priced(prices, menu, 4), pricer=prices, rows=4)
    kinds.observe("plain", 4, 0.04, wall=0.04)
    kinds.observe("skip:3", 10, 0.05, wall=0.5)
    assert kinds.hopeless("skip:3") and kinds.hopeless("skip:6")
    for _ in range(300):
        kinds.observe(kinds.choose(), 4, 0.04, wall=0.04)
    assert "skip:6" not in kinds.steps


def test_a_draft_run_before_any_plain_step_is_judged_by_its_own_clock() -> None:
    """A fresh batch starts with the kind priced best; where that draft runs far dearer than its
    price, it is found hopeless at once (the plain step taken to run at its price until it has
    run), not after a run of losing steps."""
    prices = _prices(0.97)
    menu = ("plain", "skip:3", "skip:6")
    kinds = StepKinds(menu, prices=priced(prices, menu, 4), pricer=prices, rows=4)
    first = kinds.choose()
    assert first != "plain"  # priced best
    tokens, seconds = price(prices, first, 4)
    kinds.observe(first, tokens, seconds, wall=3 * seconds)
    assert kinds.misprice(first) == pytest.approx(3.0)
    assert kinds.hopeless("skip:3") and kinds.hopeless("skip:6")
    assert kinds.choose() == "plain"
    # The plain step measured at twice its price: the draft is dearer by 1.5 only.
    kinds.observe("plain", 4, 0.04, wall=0.08)
    assert kinds.misprice(first) == pytest.approx(1.5)


def test_a_menu_of_fewer_rows_starts_from_what_the_batch_measured() -> None:
    """Rows leave and the batch takes the menu of the rows left: where that menu has run no kind
    yet, it starts from the batch's measurements (scaled by its own prices), not from prices alone,
    which would open with the draft priced best that the batch had measured losing."""
    prices = _prices(0.97)
    kinds = ("plain", "skip:3")

    def menu(rows: int) -> StepKinds:
        return StepKinds(kinds, prices=priced(prices, kinds, rows), pricer=prices, rows=rows)

    four = menu(4)
    assert four.choose() == "skip:3"  # priced best
    four.observe("skip:3", 4.0, 4 * prices.plain_step(4)[1], wall=0.2)  # ran at a quarter of its price's rate
    four.observe("plain", 4.0, prices.plain_step(4)[1], wall=0.04)
    three = menu(3)
    assert three.choose() == "skip:3"  # alone, its prices say draft
    three.carry(four)
    assert three.choose() == "plain"
    scale = (
        three.prices["skip:3"][0] / four.prices["skip:3"][0] / (three.prices["skip:3"][1] / four.prices["skip:3"][1])
    )
    assert three.rate("skip:3") == pytest.approx(four.rate("skip:3") * scale)
    assert three.wall["skip:3"] == four.wall["skip:3"]
    measured = menu(3)  # a menu that ran a kind keeps its own figures
    measured.observe("skip:3", 9.0, 0.01)
    measured.carry(four)
    assert measured.recent["skip:3"] == [(9.0, 0.01)]
    two, eight = menu(2), menu(8)  # many more rows drafted for another batch end: nothing carried
    eight.observe("skip:3", 1.0, 1.0)
    two.carry(eight)
    assert "skip:3" not in two.recent


def test_a_batched_draft_not_yet_run_is_rated_as_its_sibling_delivered() -> None:
    """Until it runs, a batched draft's price counts for what the nearest length that ran delivered
    of its own price: sixteen rows' 3-token draft at a quarter of its price does not leave the
    6-token one rated best by its price alone."""
    prices = _prices(0.9)
    kinds = ("plain", "skip:3", "skip:6")
    menu = StepKinds(kinds, prices=priced(prices, kinds, 4), pricer=prices, rows=4)
    priced_six = menu.rate("skip:6")
    assert priced_six == pytest.approx(menu.prices["skip:6"][0] / menu.prices["skip:6"][1])
    tokens, seconds = menu.prices["skip:3"]
    menu.observe("skip:3", tokens / 4, seconds)  # a quarter of what its price said
    assert menu.rate("skip:6") == pytest.approx(priced_six / 4)
    assert menu.choose() == "plain"
    assert menu.rate("plain") == pytest.approx(menu.prices["plain"][0] / menu.prices["plain"][1])
