"""BaseSDTrainProcess: owns the components and the training loop; subclasses give the loss."""

from __future__ import annotations

import json
import logging
import time
from dataclasses import dataclass

import torch
from accelerate.utils import gather_object
from tqdm.auto import tqdm

from toolkit import checkpoint
from toolkit.config.schema import SDTrainerConfig
from toolkit.data.buckets import BucketBatchSampler
from toolkit.data.dataset import ImageDataset, build_dataset, collate
from toolkit.device import DTYPES, flush, torch_dtype
from toolkit.metrics import MetricsWriter
from toolkit.models import ModelAdapter, get_adapter_class
from toolkit.network.lora import add_lora, lora_state_dict, write_lora_file
from toolkit.sampling import SampleRenderer
from toolkit.train.lr_schedulers import build_lr_scheduler
from toolkit.train.optimizers import build_optimizer
from toolkit.train.plan import TrainingPlan

from .base_train_process import BaseTrainProcess

log = logging.getLogger("difftune")


@dataclass
class Position:
    """Where training is: updates done, and the data position of the next micro-batch."""

    global_step: int = 0
    epoch: int = 0
    micro_batch_in_epoch: int = 0


class BaseSDTrainProcess(BaseTrainProcess):
    config: SDTrainerConfig
    adapter: ModelAdapter

    def run(self) -> None:
        self.setup_accelerator()
        try:
            self.prepare_run_folder()
            self.setup()
            self.train()
            self.finish()
        finally:
            self.teardown_accelerator()

    # ---- setup ---------------------------------------------------------------------------------

    def setup(self) -> None:
        self.adapter = self.load_model()
        self.lora_params = add_lora(
            self.adapter.trainable_module(), self.config.network, self.adapter.lora_target_modules()
        )
        self.dataset = build_dataset(self.config.datasets, self.config.trigger_word, self.adapter.divisor)
        self.batch_sampler = BucketBatchSampler(
            self.dataset.bucket_keys(), self.config.train.batch_size, self.config.train.seed
        )
        self.plan = self.make_plan()
        self.optimizer = build_optimizer(self.config.train, self.lora_params)
        self.prepare_components()
        self.lr_scheduler = build_lr_scheduler(self.config.train, self.optimizer, self.plan)
        self.renderer = SampleRenderer(
            self.config.sample, self.config.trigger_word, self.run_dir / "samples", self.config.model.name_or_path
        )
        if self.renderer.enabled:
            self.renderer.check_size(self.adapter.divisor)
        self.metrics = MetricsWriter(self.run_dir / "metrics.jsonl", enabled=self.is_main)
        self.position = Position()

    def load_model(self) -> ModelAdapter:
        adapter_class = get_adapter_class(self.config.model.arch)
        device = self.accelerator.device
        # The main process first: it alone downloads or builds (tiny presets) what is missing; the others
        # then read the finished files instead of racing to write them.
        with self.accelerator.main_process_first():
            adapter = adapter_class.load(self.config.model, device, torch_dtype(self.config.model.dtype, device))
        if self.config.train.gradient_checkpointing:
            adapter.trainable_module().enable_gradient_checkpointing()
        log.info("model: %s", adapter.describe())
        return adapter

    def make_plan(self) -> TrainingPlan:
        train = self.config.train
        plan = TrainingPlan.create(
            samples=len(self.dataset),
            batches=len(self.batch_sampler),
            processes=self.accelerator.num_processes,
            gradient_accumulation=train.gradient_accumulation,
            steps=train.steps,
            epochs=train.epochs,
            warmup_steps=train.lr_warmup_steps,
            warmup_ratio=train.lr_warmup_ratio,
        )
        if self.is_main:
            log.info("%s", plan.describe())
        return plan

    def prepare_components(self) -> None:
        """accelerate wraps the model, optimizer and dataloader; the LR scheduler is not prepared."""
        dataloader = torch.utils.data.DataLoader(
            self.dataset,
            batch_sampler=self.batch_sampler,
            collate_fn=collate,
            num_workers=self.config.train.num_workers,
            persistent_workers=self.config.train.num_workers > 0,
            pin_memory=self.accelerator.device.type == "cuda",
        )
        module, self.optimizer, self.dataloader = self.accelerator.prepare(
            self.adapter.trainable_module(), self.optimizer, dataloader
        )
        self.adapter.use_for_training(module)
        self.trained_module = module
        self.verify_plan(len(self.dataloader))

    def verify_plan(self, real_micro_batches: int) -> None:
        if real_micro_batches != self.plan.micro_batches_per_epoch:
            log.warning(
                "the dataloader yields %d micro-batches per process per epoch, the plan said %d; "
                "recomputing the plan from the real length",
                real_micro_batches, self.plan.micro_batches_per_epoch,
            )
            self.plan = self.plan.with_micro_batches(real_micro_batches)

    # ---- loop ----------------------------------------------------------------------------------

    def train(self) -> None:
        self.trained_module.train()
        if self.config.sample.sample_at_start:
            self.sample(step=0)
        progress = tqdm(total=self.plan.total_updates, desc="train", unit="step", disable=not self.is_main)
        while self.position.global_step < self.plan.total_updates:
            self.train_epoch(progress)
        progress.close()

    def train_epoch(self, progress: tqdm) -> None:
        pos = self.position
        self.batch_sampler.set_epoch(pos.epoch)
        window: list[torch.Tensor] = []
        started = time.perf_counter()
        for micro_batch, batch in enumerate(self.dataloader):
            pos.micro_batch_in_epoch = micro_batch + 1
            with self.accelerator.accumulate(self.trained_module):
                loss = self.train_step(batch, pos.epoch, micro_batch)
                self.accelerator.backward(loss)
                window.append(loss.detach())
                if not self.accelerator.sync_gradients:
                    continue
                record = self.optimizer_update(window)
            if record is not None:
                record["time"] = time.perf_counter() - started
                self.after_update(record, progress)
                if pos.global_step >= self.plan.total_updates:
                    return
            window, started = [], time.perf_counter()
        pos.epoch += 1
        pos.micro_batch_in_epoch = 0

    def train_step(self, batch: dict, epoch: int, micro_batch: int) -> torch.Tensor:
        """The loss of one micro-batch; the trainer subclass defines it."""
        raise NotImplementedError

    def optimizer_update(self, window: list[torch.Tensor]) -> dict | None:
        """Clip, step the optimizer and (once) the LR scheduler. None when the optimizer skipped the step."""
        max_norm = self.config.train.max_grad_norm or float("inf")
        grad_norm = self.accelerator.clip_grad_norm_(self.lora_params, max_norm)
        lr = self.lr_scheduler.get_last_lr()[0]
        self.optimizer.step()
        self.optimizer.zero_grad(set_to_none=True)
        if self.accelerator.optimizer_step_was_skipped:
            log.warning("optimizer step skipped (non-finite gradients); the LR schedule does not advance")
            return None
        self.lr_scheduler.step()
        self.position.global_step += 1
        loss = self.accelerator.reduce(torch.stack(window).mean(), reduction="mean")
        return {
            "step": self.position.global_step,
            "epoch": self.position.epoch,
            "loss": loss.item(),
            "lr": lr,
            "grad_norm": float(grad_norm),
        }

    def after_update(self, record: dict, progress: tqdm) -> None:
        self.metrics.write(record)
        progress.update(1)
        progress.set_postfix(loss=f"{record['loss']:.4f}", lr=f"{record['lr']:.2e}",
                             s_it=f"{record['time']:.2f}", refresh=False)
        step = record["step"]
        if self.config.save.save_every and step % self.config.save.save_every == 0:
            self.save_checkpoint()
        if self.config.sample.sample_every and step % self.config.sample.sample_every == 0:
            self.sample(step)

    # ---- outputs -------------------------------------------------------------------------------

    def sample(self, step: int) -> None:
        if not self.renderer.enabled:
            return
        if self.is_main:
            self.trained_module.eval()
            self.renderer.render(self.adapter, step)
            self.trained_module.train()
            flush()
        self.accelerator.wait_for_everyone()

    def lora_metadata(self) -> dict[str, str]:
        facts = self.adapter.describe()
        return {
            "difftune_config": json.dumps(self.config.model_dump(mode="json"), sort_keys=True),
            "difftune_name": self.job.name,
            "difftune_step": str(self.position.global_step),
            "difftune_arch": facts["arch"],
            "difftune_base_model": facts.get("base_model", ""),
        }

    def lora_state(self) -> dict[str, torch.Tensor]:
        return lora_state_dict(self.adapter.trainable_module(), self.adapter.lora_prefix, DTYPES[self.config.save.dtype])

    def write_lora(self, path) -> None:
        write_lora_file(path, self.lora_state(), self.lora_metadata(), self.adapter.trainable_module(),
                        self.adapter.lora_prefix)

    def train_state(self) -> dict:
        """Where training is; called on every rank (it gathers each rank's step and LR)."""
        pos = self.position
        lr = self.lr_scheduler.get_last_lr()[0]
        ranks = gather_object([{"rank": self.accelerator.process_index, "global_step": pos.global_step, "lr": lr}])
        return {
            "global_step": pos.global_step,
            "epoch": pos.epoch,
            "micro_batch_in_epoch": pos.micro_batch_in_epoch,
            "world_size": self.accelerator.num_processes,
            "lr": lr,
            "ranks": ranks,
        }

    def save_checkpoint(self) -> None:
        flush()
        state = self.train_state()
        if self.is_main:
            folder = checkpoint.save_checkpoint(
                self.run_dir / "checkpoints",
                self.position.global_step,
                lambda tmp: self.write_lora(tmp / "lora.safetensors"),
                state,
                keep=self.config.save.max_step_saves_to_keep,
            )
            log.info("saved checkpoint %s", folder)
        self.accelerator.wait_for_everyone()

    def finish(self) -> None:
        step = self.position.global_step
        if not (self.config.save.save_every and step % self.config.save.save_every == 0):
            self.save_checkpoint()
        if self.is_main:
            final = self.run_dir / f"{self.job.name}.safetensors"
            self.write_lora(final)
            log.info("saved LoRA %s", final)
        self.metrics.close()
        if not (self.config.sample.sample_every and step % self.config.sample.sample_every == 0):
            self.sample(step)
        self.accelerator.wait_for_everyone()
