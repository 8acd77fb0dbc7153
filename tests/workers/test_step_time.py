"""Step costs and step-time limits: the fitted decode step time, the fitted prompt-token cost
by depth, and the seconds a target or cap leaves for prompt chunks (the scheduler applying
them is in test_scheduler.py)."""

from __future__ import annotations

import pytest
from helpers import fitted_decode_costs, fitted_prompt_costs

from workers.step_time import PromptCostModel, StepCostModel, StepTimeTarget


def test_cost_model_recovers_a_linear_step_time():
    model = fitted_decode_costs(0.050, 0.002)
    model.observe(4096, 9.0)  # a prefill step is not fitted
    assert model.per_row() == pytest.approx(0.002, rel=1e-6)
    assert model.time(5) == pytest.approx(0.060, rel=1e-6)


def test_prompt_cost_model_recovers_a_cost_growing_with_depth():
    model = fitted_prompt_costs(0.001, 1e-7)
    # 512 tokens from 6,000: 512 * (0.001 + 1e-7 * 6,256) s, past the depths it was fitted on
    assert model.seconds(6000, 512) == pytest.approx(512 * 0.0016256, rel=1e-6)
    assert model.seconds(6000, 512) > 1.5 * model.seconds(0, 512)
    for start in (0, 3000, 7000):
        seconds = model.seconds(start, 300)
        assert model.tokens_within(seconds * 1.0001, start) == 300
        assert model.tokens_within(seconds * 0.999, start) == 299
    assert model.tokens_within(0.0, 0) == model.tokens_within(-1.0, 0) == 0


def test_prompt_cost_without_spread_in_depth_is_flat():
    model = PromptCostModel()
    model.observe([(100, 16)], 0.016, 16)
    assert model.known and model.slope() == 0.0
    assert model.tokens_within(0.1, 5000) == 100
    model.observe([], 1.0, 4)  # a step of no prompt chunk tells nothing of their cost
    assert model.observations == 1 and model.seconds(0, 10) == pytest.approx(0.010)


def test_target_leaves_what_the_decodes_do_not_take():
    target = StepTimeTarget(0.250, None, fitted_decode_costs(0.010, 0.001),
                            fitted_prompt_costs(0.002), 16)
    assert target.seconds_left(4) == (pytest.approx(0.236), None)  # decodes take 14 ms
    assert target.seconds_left(300)[0] < 0  # decodes alone past the target
    assert target.seconds_left(0) == (None, None)  # no decodes and no cap: tokens alone


def test_the_cap_applies_to_every_step_beside_the_target():
    decode = fitted_decode_costs(0.010, 0.001)
    capped = StepTimeTarget(None, 1.0, decode, fitted_prompt_costs(0.002), 16)
    assert capped.seconds_left(0) == (None, 1.0)
    assert capped.seconds_left(4) == (None, pytest.approx(0.986))
    both = StepTimeTarget(0.25, 1.0, decode, fitted_prompt_costs(0.002), 16)
    assert both.seconds_left(0) == (None, 1.0)
    assert both.seconds_left(4) == (pytest.approx(0.236), pytest.approx(0.986))


def test_limits_wait_for_the_prompt_cost_and_count_unmeasured_decodes_as_free():
    unmeasured = StepTimeTarget(0.25, 1.0, fitted_decode_costs(0.01, 0.001), PromptCostModel(), 16)
    assert unmeasured.seconds_left(4) == unmeasured.seconds_left(0) == (None, None)
    fresh = StepTimeTarget(0.25, 1.0, StepCostModel(), fitted_prompt_costs(0.002), 16)
    assert fresh.seconds_left(4) == (0.25, 1.0)


@pytest.mark.parametrize("seconds, cap_s, min_tokens",
                         [(0.0, None, 16), (-1.0, 1.0, 16), (0.25, 0.0, 16), (None, None, 16),
                          (0.25, None, 0)])
def test_limits_must_be_positive(seconds, cap_s, min_tokens):
    with pytest.raises(ValueError):
        StepTimeTarget(seconds, cap_s, StepCostModel(), PromptCostModel(), min_tokens)
