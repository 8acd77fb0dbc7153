"""The adaptive draft length: expected committed tokens, the cost fit, and the choice of k
(including turning speculation off where it does not pay and probing again later)."""

from __future__ import annotations

import pytest

from contract.request import SpecUsage
from workers.speculative.controller import DraftLengthController


def usage_with(acceptance: list[float], trials: int = 1000) -> SpecUsage:
    """The engine's per-position counts after ``trials`` verifications of
    ``len(acceptance)`` drafts each, with conditional acceptance ``acceptance[i]`` at position
    i: every position is verified each time; a draft is committed only after all before it."""
    usage = SpecUsage(verification_steps=trials)
    survival = 1.0
    for alpha in acceptance:
        survival *= alpha
        usage.proposed_by_position.append(trials)
        usage.accepted_by_position.append(round(trials * survival))
    return usage


def trained(step_s: float, per_row_s: float, k_max: int = 4) -> DraftLengthController:
    controller = DraftLengthController(k_max)
    for rows in [1, 2, 3, 5, 1, 4, 2, 5] * 3:
        controller.steps.observe(rows, step_s + per_row_s * (rows - 1))
    controller.observe_draft(0.0)
    return controller


def test_expected_tokens_is_leviathan_eq1_per_position():
    controller = DraftLengthController(4)
    usage = usage_with([0.8, 0.5, 0.5, 0.5], trials=100_000)
    assert controller.expected_tokens(usage, 0) == 1.0
    assert controller.expected_tokens(usage, 1) == pytest.approx(1.8, abs=1e-3)
    assert controller.expected_tokens(usage, 3) == pytest.approx(1 + .8 + .4 + .2, abs=1e-3)
    # constant alpha: (1 - alpha^(k+1)) / (1 - alpha)
    flat = usage_with([0.6] * 4, trials=100_000)
    assert controller.expected_tokens(flat, 4) == pytest.approx((1 - .6 ** 5) / .4, abs=2e-3)


def test_high_acceptance_and_cheap_rows_draft_the_most():
    controller = trained(step_s=0.05, per_row_s=0.001)
    assert controller.choose("a", usage_with([0.9] * 4), 1) == 4


def test_speculation_turns_off_when_rows_cost_more_than_acceptance_saves():
    # each extra row costs 60% of a step; at alpha 0.3 nothing beats plain decoding
    controller = trained(step_s=0.05, per_row_s=0.03)
    usage = usage_with([0.3] * 4)
    assert controller.choose("a", usage, 1) == 0
    # the same acceptance pays when rows are nearly free
    assert trained(step_s=0.05, per_row_s=0.0005).choose("a", usage, 1) > 0


def test_drafts_that_pay_alone_do_not_pay_for_fifteen_other_decodes():
    """The objective is the step's committed tokens per second: at 16 decodes, four draft
    rows at acceptance 0.5 delay fifteen sequences for about half a token more."""
    controller = trained(step_s=0.05, per_row_s=0.004)
    usage = usage_with([0.5] * 4)
    assert controller.choose("a", usage, 1) > 0
    assert controller.choose("a", usage, 16) == 0
    # a request that copies its prompt still drafts in the batch
    assert controller.choose("a", usage_with([0.95] * 4), 16) == 4


def test_draft_cost_counts_not_only_acceptance():
    usage = usage_with([0.5] * 4)
    cheap = trained(step_s=0.05, per_row_s=0.002)
    assert cheap.choose("a", usage, 1) > 0
    slow = trained(step_s=0.05, per_row_s=0.002)
    for _ in range(50):
        slow.observe_draft(0.2)  # drafting costs four steps
    assert slow.choose("a", usage, 1) == 0


def test_an_off_request_probes_again_with_growing_intervals():
    controller = trained(step_s=0.05, per_row_s=0.03)
    controller.probe_interval = 3
    usage = usage_with([0.2] * 4)
    choices = [controller.choose("a", usage, 1) for _ in range(14)]
    # off for 3 steps, probe with k_max; then off for 6, probe again
    assert choices == [0, 0, 0, 4, 0, 0, 0, 0, 0, 0, 4, 0, 0, 0]
    controller.forget("a")
    assert [controller.choose("a", usage, 1) for _ in range(4)] == [0, 0, 0, 4]


def test_an_unmeasured_request_probes_at_once_and_a_probe_without_draft_is_no_failure():
    """Regression: a request shorter than the probe interval was never measured once the
    engine's costs said the prior does not pay (a 32-token request in CI never speculated)."""
    controller = trained(step_s=0.05, per_row_s=0.03)
    controller.probe_interval = 3
    fresh = SpecUsage()
    assert controller.choose("a", fresh, 1) == 4
    for _ in range(2):
        controller.no_draft("a")  # the proposer had nothing: the interval does not double
        assert [controller.choose("a", fresh, 1) for _ in range(4)] == [0, 0, 0, 4]
    # this probe drafted and failed: the interval doubles
    assert [controller.choose("a", usage_with([0.2] * 4), 1) for _ in range(7)] == [0] * 6 + [4]


def test_measured_engine_counts_give_the_committed_length():
    """Regression: the engine's counts are already survivals; multiplying them again made
    E(k) collapse and the controller draft 1 token where 4 paid (copy-heavy prompts)."""
    controller = trained(step_s=0.09, per_row_s=0.004)
    usage = SpecUsage(proposed_by_position=[354, 354, 354, 354],
                      accepted_by_position=[265, 227, 201, 177])  # a k=4 run, 0.75 first
    assert controller.expected_tokens(usage, 4) == pytest.approx(
        1 + (265 + 1) / 356 + (227 + .75) / 356 + (201 + .64) / 356 + (177 + .57) / 356,
        abs=1e-2)
    assert controller.choose("a", usage, 1) == 4


def test_not_adaptive_or_unmeasured_always_drafts_k_max():
    assert DraftLengthController(3, adaptive=False).choose("a", usage_with([0.0]), 1) == 3
    assert DraftLengthController(3).choose("a", usage_with([0.0]), 1) == 3
