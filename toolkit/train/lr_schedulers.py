"""LR schedules over optimizer updates (diffusers' implementations).

The scheduler is never handed to `accelerator.prepare`: accelerate would step it once per process per
update. The trainer steps it exactly once per real optimizer update, so the LR is a function of the
update index alone, whatever the number of processes.
"""

from __future__ import annotations

import torch
from diffusers.optimization import get_polynomial_decay_schedule_with_warmup, get_scheduler

from toolkit.config.sections import LRScheduleSection
from toolkit.train.plan import TrainingPlan


def build_lr_scheduler(train: LRScheduleSection, optimizer: torch.optim.Optimizer, plan: TrainingPlan):
    params = train.lr_scheduler_params
    name = train.lr_scheduler
    if name == "constant" and plan.warmup_updates:  # diffusers' `constant` ignores warmup
        name = "constant_with_warmup"
    if name == "polynomial":  # get_scheduler does not pass lr_end through
        return get_polynomial_decay_schedule_with_warmup(
            optimizer, plan.warmup_updates, plan.total_updates, lr_end=params.lr_end, power=params.power
        )
    return get_scheduler(
        name,
        optimizer,
        num_warmup_steps=plan.warmup_updates,
        num_training_steps=plan.total_updates,
        num_cycles=params.num_cycles,
        power=params.power,
    )
