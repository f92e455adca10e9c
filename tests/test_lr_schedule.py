"""The LR is a function of the update index alone: right on any number of processes, by epochs or by steps.

Two-process runs use `accelerate launch --multi_gpu` on the CPU (gloo) with the real run.py; other process counts
are checked against accelerate's own sharded loader in this process.
"""

from __future__ import annotations

import itertools
import json
import math

import pytest
import torch
from helpers import make_images, trainer_process, write_job

from jobs.job import get_job
from toolkit.config.loader import load_config
from toolkit.config.schema import TrainConfig
from toolkit.run.metrics import read_metrics
from toolkit.train.lr_schedulers import build_lr_scheduler
from toolkit.train.plan import TrainingPlan

LR = 1e-3


def lr_sequence(plan: TrainingPlan, **train) -> tuple[list[float], float]:
    """The LR each update uses, and the LR after the last one, as the trainer steps the scheduler."""
    optimizer = torch.optim.AdamW([torch.nn.Parameter(torch.zeros(1))], lr=LR)
    scheduler = build_lr_scheduler(TrainConfig(lr=LR, steps=plan.total_updates, **train).lr_schedule, optimizer, plan)
    used = []
    for _ in range(plan.total_updates):
        used.append(scheduler.get_last_lr()[0])
        optimizer.step()
        scheduler.step()
    return used, scheduler.get_last_lr()[0]


def plan_for(total: int, warmup: int = 0) -> TrainingPlan:
    return TrainingPlan.create(samples=total, batches=total, processes=1, gradient_accumulation=1,
                               steps=total, epochs=None, warmup_steps=warmup)


def test_warmup_then_cosine_to_zero():
    used, final = lr_sequence(plan_for(20, warmup=5), lr_scheduler="cosine", lr_warmup_steps=5)
    assert used[:6] == pytest.approx([0, LR / 5, 2 * LR / 5, 3 * LR / 5, 4 * LR / 5, LR])
    for k in range(5, 20):
        assert used[k] == pytest.approx(LR * 0.5 * (1 + math.cos(math.pi * (k - 5) / 15)))
    assert final == 0


def test_warmup_is_not_counted_twice_in_restart_cycles():
    used, _ = lr_sequence(plan_for(24, warmup=4), lr_scheduler="cosine_with_restarts", lr_warmup_steps=4,
                          lr_scheduler_params={"num_cycles": 2})
    # 20 updates after warmup, 2 cycles of 10: restarts at update index 4 + 10
    assert used[4] == pytest.approx(LR) and used[14] == pytest.approx(LR)
    assert used[13] < LR * 0.05


@pytest.mark.parametrize("name", ["constant", "constant_with_warmup", "linear", "cosine", "cosine_with_restarts",
                                  "polynomial"])
def test_every_schedule_warms_up(name):
    used, _ = lr_sequence(plan_for(10, warmup=4), lr_scheduler=name, lr_warmup_steps=4)
    assert used[:5] == pytest.approx([0, LR / 4, LR / 2, 3 * LR / 4, LR])


def test_polynomial_ends_at_lr_end():
    _, final = lr_sequence(plan_for(10), lr_scheduler="polynomial",
                           lr_scheduler_params={"power": 2.0, "lr_end": 1e-5})
    assert final == pytest.approx(1e-5)


def test_warmup_longer_than_an_epoch_run_is_an_error_naming_the_keys():
    plan = TrainingPlan.create(8, 4, 1, 1, steps=None, epochs=1)
    with pytest.raises(ValueError, match="train.lr_warmup_steps"):
        TrainingPlan.create(8, 4, 1, 1, steps=None, epochs=1, warmup_steps=plan.total_updates)


@pytest.mark.slow
def test_single_process_run_logs_warmup_and_cosine(tmp_path, registry, tiny_sd15):
    process = trainer_process(tmp_path, train={"steps": 10, "lr": LR, "lr_scheduler": "cosine",
                                               "lr_warmup_steps": 4})
    config, path = load_config(str(write_job(tmp_path / "job.yaml", "warm", process)), registry)
    get_job(config, path, registry).run()
    logged = [r["lr"] for r in read_metrics(tmp_path / "output" / "warm" / "metrics.jsonl")]
    expected, final = lr_sequence(plan_for(10, warmup=4), lr_scheduler="cosine", lr_warmup_steps=4)
    assert logged == pytest.approx(expected)
    state = json.loads((tmp_path / "output" / "warm" / "checkpoints" / "step_000000010" / "train_state.json").read_text())
    assert state["lr"] == pytest.approx(final) == 0


def job_file(tmp_path, name: str, images: int, **train):
    data = tmp_path / f"data_{images}"
    if not data.exists():
        make_images(data, images)
    process = trainer_process(tmp_path, trigger_word=None, datasets=[{"folder_path": str(data), "resolution": [32]}],
                              train={"lr": LR, **train})
    return write_job(tmp_path / f"{name}.yaml", name, process)


def run_results(tmp_path, name: str) -> tuple[list[dict], dict]:
    """A launched run's metrics and its last checkpoint's train state."""
    run_dir = tmp_path / "output" / name
    last = sorted((run_dir / "checkpoints").iterdir())[-1]
    return read_metrics(run_dir / "metrics.jsonl"), json.loads((last / "train_state.json").read_text())


def uneven_plan(batches: int, processes: int, epochs: int) -> TrainingPlan:
    """The plan of `batches` images of batch 1 over `processes` with accumulation 2 for `epochs`."""
    return TrainingPlan.create(batches, batches, processes, gradient_accumulation=2, steps=None, epochs=epochs)


def uneven_job(tmp_path, batches: int, processes: int, epochs: int):
    """That job, and the plan it should take."""
    return uneven_plan(batches, processes, epochs), job_file(tmp_path, f"uneven{batches}", batches, batch_size=1,
                                                             steps=None, epochs=epochs, gradient_accumulation=2)


SCHEDULE = {"batch_size": 4, "gradient_accumulation": 5, "lr_scheduler": "cosine_with_restarts",
            "lr_scheduler_params": {"num_cycles": 2}}


def schedule_jobs(tmp_path) -> list[str]:
    """The schedule jobs of the shared two-process launch (conftest.py `two_process_launch`): the same schedule by
    epochs and by steps (two processes of one job file, each into its own training folder), a linear schedule over
    2 updates, and 11 images in uneven shards."""
    data = make_images(tmp_path / "data_51", 51)
    jobs = [trainer_process(tmp_path, trigger_word=None, training_folder=str(tmp_path / folder),
                            datasets=[{"folder_path": str(data), "resolution": [32]}],
                            train={"lr": LR, **SCHEDULE, **train})
            for folder, train in (("by_epochs", {"steps": None, "epochs": 10}), ("by_steps", {"steps": 20}))]
    linear = job_file(tmp_path, "lin", 5, batch_size=1, steps=None, epochs=1, gradient_accumulation=2,
                      lr_scheduler="linear")
    _, uneven = uneven_job(tmp_path, 11, 2, 1)
    return [str(write_job(tmp_path / "both.yaml", "lr", *jobs)), str(linear), str(uneven)]


def assert_follows_plan(tmp_path, name: str, plan: TrainingPlan) -> None:
    metrics, state = run_results(tmp_path, name)
    assert len(metrics) == state["global_step"] == plan.total_updates
    assert [r["epoch"] for r in metrics] == [k // plan.updates_per_epoch for k in range(plan.total_updates)]


@pytest.mark.parametrize("processes", [1, 2, 3, 4])
@pytest.mark.parametrize("batches", [5, 7, 11])
def test_the_run_order_gives_each_process_the_batches_accelerate_would(processes, batches):
    """Uneven shards on any process count: every epoch of the run's order (`RunBatchOrder`, one pass over the
    epochs) gives each process exactly the batches accelerate's prepared loader of the bucket sampler gives it that
    epoch, as many as the plan's micro-batches per epoch, which its updates cover in windows of
    `gradient_accumulation`. The two-process launch checks the same end to end (`uneven11`)."""
    from accelerate.data_loader import prepare_data_loader

    from toolkit.data.buckets import BucketBatchSampler
    from toolkit.data.run_order import RunBatchOrder

    plan = uneven_plan(batches, processes, epochs=3)
    sampler = BucketBatchSampler([(1, 32, 32, False)] * batches, 1, seed=42)
    for rank in range(processes):
        prepared = prepare_data_loader(torch.utils.data.DataLoader(list(range(batches)), batch_sampler=sampler),
                                       num_processes=processes, process_index=rank, put_on_device=False)
        order = RunBatchOrder(sampler, processes, rank)
        expected = []
        for epoch in range(3):
            prepared.set_epoch(epoch)
            sampler.set_epoch(epoch)  # as the trainer set both on accelerate's loader
            shard = [batch.tolist() for batch in prepared]
            assert order.epoch(epoch) == shard and len(shard) == order.per_epoch == plan.micro_batches_per_epoch
            expected.append(shard)
        order.start_at(0, 0, 3)
        assert list(order) == [batch for shard in expected for batch in shard] and len(order) == 3 * order.per_epoch
        order.start_at(1, 2, 3)  # resumed at micro-batch 2 of epoch 1: the rest of epoch 1, then epoch 2
        assert list(order) == expected[1][2:] + expected[2] and len(order) == 2 * order.per_epoch - 2
        order.start_at(1, 2)  # a run's pass: no end, epoch after epoch
        assert list(itertools.islice(order, 2 * order.per_epoch - 2)) == expected[1][2:] + expected[2]
    assert plan.updates_per_epoch == math.ceil(plan.micro_batches_per_epoch / 2)
    assert plan.total_updates == 3 * plan.updates_per_epoch
    # batches of different lengths (two buckets of 5 and 4 samples, batch 2: 2, 2, 1 and 2, 2), repeated whole
    mixed = BucketBatchSampler([(1, 32, 32, False)] * 5 + [(1, 64, 32, False)] * 4, 2, seed=7)
    for rank in range(processes):
        prepared = prepare_data_loader(torch.utils.data.DataLoader(list(range(9)), batch_sampler=mixed),
                                       num_processes=processes, process_index=rank, put_on_device=False)
        for epoch in range(2):
            prepared.set_epoch(epoch)
            mixed.set_epoch(epoch)
            assert RunBatchOrder(mixed, processes, rank).epoch(epoch) == [batch.tolist() for batch in prepared]


@pytest.mark.slow
@pytest.mark.multiprocess
def test_epochs_and_steps_agree_and_process_count_does_not_change_the_lr(two_process_launch, registry):
    """51 samples, batch 4, 2 processes, accumulation 5: 13 batches -> 7 and 6 per process -> 2 updates per epoch
    (windows of 5 and 2 micro-batches). In the same launch: 5 images, batch 1, accumulation 2, 1 epoch:
    ceil(ceil(5/2)/2) = 2 updates, the linear schedule per update; 11 images: the plan's updates and epochs, uneven
    shards."""
    tmp_path, result = two_process_launch
    assert result.returncode == 0, result.stderr[-4000:]
    plan = uneven_plan(11, 2, 1)
    metrics, state = run_results(tmp_path, "lin")
    assert [r["lr"] for r in metrics] == pytest.approx([LR, LR / 2])
    assert state["global_step"] == 2 and state["world_size"] == 2
    assert [(r["rank"], r["global_step"], r["lr"]) for r in state["ranks"]] == [(0, 2, 0.0), (1, 2, 0.0)]
    assert_follows_plan(tmp_path, "uneven11", plan)
    assert "updates per epoch                    2" in result.stderr
    by_epochs, by_steps = (read_metrics(tmp_path / folder / "lr" / "metrics.jsonl") for folder in ("by_epochs", "by_steps"))
    lrs = [r["lr"] for r in by_epochs]
    assert len(lrs) == 20 and lrs == pytest.approx([r["lr"] for r in by_steps])
    assert lrs[10] == pytest.approx(LR) and lrs[9] < LR * 0.05  # the restart

    process = trainer_process(tmp_path, trigger_word=None, train={"lr": LR, "steps": 20, **SCHEDULE},
                              datasets=[{"folder_path": str(tmp_path / "data_51"), "resolution": [32]}])
    config, path = load_config(str(write_job(tmp_path / "one.yaml", "one", process)), registry)
    get_job(config, path, registry).run()
    assert [r["lr"] for r in read_metrics(tmp_path / "output" / "one" / "metrics.jsonl")] == pytest.approx(lrs)


@pytest.mark.slow
def test_an_update_gets_the_mean_gradient_of_its_window_a_short_one_too(tmp_path, registry, monkeypatch):
    """3 images of batch 1 with accumulation 2 (an epoch: a window of 2 micro-batches, then a short one of 1), in an
    environment that asks accelerate for 4: each update's gradient is the mean of its micro-batches' gradients,
    each computed alone at the same weights and draws."""
    from helpers import run_job

    from jobs.process.base_sd_train_process import BaseSDTrainProcess

    monkeypatch.setenv("ACCELERATE_GRADIENT_ACCUMULATION_STEPS", "4")
    step, update = BaseSDTrainProcess.train_step, BaseSDTrainProcess.optimizer_update
    alone, updates, asked = [], [], []

    def step_also_alone(self, batch, epoch, micro_batch):
        held = [p.grad for p in self.lora_params]
        for param in self.lora_params:
            param.grad = None
        step(self, batch, epoch, micro_batch)[0].backward()  # the draws are a function of (epoch, micro-batch)
        alone.append([p.grad.clone() for p in self.lora_params])
        for param, grad in zip(self.lora_params, held):
            param.grad = grad
        return step(self, batch, epoch, micro_batch)

    def recorded_update(self, window, files):
        updates.append(([p.grad.clone() for p in self.lora_params], len(window)))
        asked.append(self.accelerator.gradient_accumulation_steps)
        return update(self, window, files)

    monkeypatch.setattr(BaseSDTrainProcess, "train_step", step_also_alone)
    monkeypatch.setattr(BaseSDTrainProcess, "optimizer_update", recorded_update)
    data = make_images(tmp_path / "data", 3)
    process = trainer_process(tmp_path, datasets=[{"folder_path": str(data), "resolution": [32]}],
                              train={"batch_size": 1, "steps": 4, "gradient_accumulation": 2})
    run_job(tmp_path, registry, "windows", process)
    assert asked == [1, 1, 1, 1]  # accelerate's own, which would divide each loss again
    assert [n for _, n in updates] == [2, 1, 2, 1] and len(alone) == 6
    first = 0
    for grads, n in updates:
        mean = [torch.stack([alone[first + k][i] for k in range(n)]).mean(0) for i in range(len(grads))]
        assert all(torch.allclose(g, m, rtol=1e-5, atol=1e-8) for g, m in zip(grads, mean, strict=True))
        assert any(g.abs().sum() > 0 for g in grads)
        first += n


@pytest.mark.slow
def test_a_skipped_update_takes_the_run_past_its_planned_epochs(tmp_path, registry, monkeypatch):
    """`epochs: 1` of 4 images at batch 2 plans 2 updates in 1 epoch. When the first step is skipped (fp16's
    non-finite gradients), its micro-batch is used without an update: the run continues into a second epoch of
    its one pass over the data and ends with its 2 updates, the LR schedule advanced once per real update."""
    from accelerate import Accelerator
    from helpers import run_job

    asked = []
    monkeypatch.setattr(Accelerator, "optimizer_step_was_skipped", property(lambda self: asked.append(1) or len(asked) == 1))
    data = make_images(tmp_path / "data", 4)
    process = trainer_process(tmp_path, datasets=[{"folder_path": str(data), "resolution": [32]}],
                              train={"batch_size": 2, "steps": None, "epochs": 1, "lr_scheduler": "linear"})
    trainer, folder = run_job(tmp_path, registry, "skipped", process)
    assert trainer.plan.epochs == 1 and trainer.plan.total_updates == 2 and len(asked) == 3
    records = read_metrics(folder / "metrics.jsonl")
    assert [(r["step"], r["epoch"]) for r in records] == [(1, 0), (2, 1)]
    assert records[0]["lr"] == pytest.approx(LR) and records[1]["lr"] == pytest.approx(LR / 2)
