"""Step costs and the step-time target: the fitted decode step time and the prompt tokens a
target leaves beside the decodes (the scheduler applying it is in test_scheduler.py)."""

from __future__ import annotations

import pytest

from workers.step_time import StepCostModel, StepTimeTarget


def fitted(base_s: float, per_row_s: float) -> StepCostModel:
    """A model fitted on decode steps of 1-8 rows costing ``base_s + per_row_s * rows``."""
    model = StepCostModel()
    for rows in [1, 4, 2, 8, 3, 6] * 5:
        model.observe(rows, base_s + per_row_s * rows)
    return model


def test_cost_model_recovers_a_linear_step_time():
    model = fitted(0.050, 0.002)
    model.observe(4096, 9.0)  # a prefill step is not fitted
    assert model.per_row() == pytest.approx(0.002, rel=1e-6)
    assert model.time(5) == pytest.approx(0.060, rel=1e-6)


def test_target_leaves_what_the_decodes_do_not_take():
    target = StepTimeTarget(0.250, fitted(0.010, 0.001), lambda: 0.002, min_tokens=16)
    assert target.prompt_tokens(4) in (117, 118)  # decodes 14 ms; 236 ms left, 2 ms a token
    assert target.prompt_tokens(300) == 16  # decodes alone past the target: min_tokens


def test_target_waits_for_the_prompt_cost_and_counts_unmeasured_decodes_as_free():
    assert StepTimeTarget(0.25, fitted(0.01, 0.001), lambda: None, 16).prompt_tokens(4) is None
    assert StepTimeTarget(0.25, StepCostModel(), lambda: 0.002, 16).prompt_tokens(4) == 125


@pytest.mark.parametrize("seconds, min_tokens", [(0.0, 16), (-1.0, 16), (0.25, 0)])
def test_a_target_must_be_positive(seconds, min_tokens):
    with pytest.raises(ValueError):
        StepTimeTarget(seconds, StepCostModel(), lambda: None, min_tokens)
