"""TrainingPlan arithmetic: a step is an optimizer update, per-process shards are ceil(batches / N)."""

from __future__ import annotations

import pytest

from toolkit.train.plan import TrainingPlan


def test_epochs_become_updates_with_sharding_and_accumulation():
    plan = TrainingPlan.create(samples=171, batches=43, processes=2, gradient_accumulation=5, steps=None, epochs=6)
    assert plan.micro_batches_per_epoch == 22  # ceil(43 / 2)
    assert plan.updates_per_epoch == 5  # ceil(22 / 5): the trailing partial window still updates
    assert plan.total_updates == 30 and plan.epochs == 6


def test_steps_win_over_epochs_and_the_plan_says_so():
    plan = TrainingPlan.create(samples=8, batches=4, processes=1, gradient_accumulation=1, steps=10, epochs=1)
    assert plan.total_updates == 10 and plan.epochs == 3
    assert "train.steps (10) wins over train.epochs (1)" in plan.describe()


def test_warmup_ratio_and_too_long_warmup():
    plan = TrainingPlan.create(8, 4, 1, 1, steps=100, epochs=None, warmup_ratio=0.1)
    assert plan.warmup_updates == 10
    with pytest.raises(ValueError, match="warmup"):
        TrainingPlan.create(8, 4, 1, 2, steps=None, epochs=1, warmup_steps=2)


def test_a_plan_for_another_epoch_length():
    plan = TrainingPlan.create(8, 4, 1, 1, steps=None, epochs=2)
    assert plan.with_micro_batches(5).total_updates == 10


def test_an_update_ends_every_accumulation_window_and_each_epoch():
    """11 micro-batches per epoch, accumulation 4: windows 0-3, 4-7 and the short 8-10 end an update each."""
    plan = TrainingPlan.create(11, 11, 1, 4, steps=None, epochs=2)
    assert [m for m in range(11) if plan.ends_update(m)] == [3, 7, 10] and plan.updates_per_epoch == 3
    assert [m for m in range(11) if TrainingPlan.create(11, 11, 1, 1, 5, None).ends_update(m)] == list(range(11))


def test_a_plan_ending_earlier_or_later_takes_the_epochs_it_needs():
    plan = TrainingPlan.create(8, 4, 1, 1, steps=None, epochs=2)  # 4 updates per epoch
    assert (plan.ending_at(5).total_updates, plan.ending_at(5).epochs) == (5, 2)
    assert plan.ending_at(12).epochs == 3 and plan.ending_at(4).epochs == 1
