"""BaseSDTrainProcess: owns the components and the training loop; subclasses give the loss."""

from __future__ import annotations

import json
import logging
import math
import time
import warnings
from contextlib import nullcontext
from dataclasses import dataclass
from pathlib import Path

import torch
from accelerate.utils import gather_object, set_seed
from tqdm.auto import tqdm

from toolkit import checkpoint
from toolkit.config.schema import SDTrainerConfig
from toolkit.data.buckets import BucketBatchSampler
from toolkit.data.dataset import build_dataset, collate
from toolkit.data.latent_cache import LatentCache, cache_root
from toolkit.data.text_cache import CachedCaptions, LiveCaptions
from toolkit.device import (
    DTYPES,
    flush,
    memory_debug,
    memory_fields,
    modules_on,
    safe_module_to_device,
    torch_dtype,
)
from toolkit.metrics import MetricsWriter, Throughput, TimestepStats, truncate_after
from toolkit.models import ModelAdapter, get_adapter_class
from toolkit.network.files import load_pretrained, write_comfy_file
from toolkit.network.lora import (
    add_lora,
    compare_lora_state,
    load_lora_file,
    lora_state_dict,
    mirror_lora,
    write_lora_file,
)
from toolkit.paths import normalize_path
from toolkit.sampling import SampleRenderer
from toolkit.signals import GracefulStop
from toolkit.train.lr_schedulers import build_lr_scheduler
from toolkit.train.optimizers import build_optimizer, logged_lr, update_rms
from toolkit.train.plan import TrainingPlan, accumulation_window

from .base_process import StopRequested
from .base_train_process import BaseTrainProcess
from .watching import WatchedRun

log = logging.getLogger("difftune")


@dataclass
class Position:
    """Where training is: updates done, and the data position of the next micro-batch."""

    global_step: int = 0
    epoch: int = 0
    micro_batch_in_epoch: int = 0


@dataclass
class UpdateValues:
    """One update's loss parts and gradient norm, still on the device (averaged over processes): they come to
    the host, in one transfer, only when the update is logged or the progress bar is due."""

    step: int
    epoch: int
    scheduled_lr: float
    names: list[str]
    values: torch.Tensor  # one float32 value per name

    @property
    def loss(self) -> torch.Tensor:
        return self.values[self.names.index("loss")]


class BaseSDTrainProcess(WatchedRun, BaseTrainProcess):
    config: SDTrainerConfig
    adapter: ModelAdapter

    def run(self) -> None:
        self.setup_accelerator()
        try:
            self.open_monitor()
            resume_from = self.find_resume_checkpoint()
            self.setup()
            if resume_from is not None:
                self.resume(resume_from)
            self.open_run_folder()
            if resume_from is not None:
                self.set_aside_abandoned_checkpoints()
            self.open_metrics(resumed=resume_from is not None)
            self.announce_plan()
            if self.position.global_step >= self.plan.total_updates and resume_from is not None:
                self.report_already_complete()
                return
            with GracefulStop() as self.stop:
                self.train()
            if self.position.global_step < self.plan.total_updates:  # left the loop on a collective stop
                self.stop_with_checkpoint()
            self.finish()
        except StopRequested:
            raise
        except BaseException as error:
            step = self.position.global_step if self.monitor.planned else None  # before: the folder's last known
            self.monitor.ended("failed", step, f"{type(error).__name__}: {error}")
            raise
        finally:
            self.end_tracking()
            self.teardown_accelerator()

    # ---- setup ---------------------------------------------------------------------------------

    def setup(self) -> None:
        # Library randomness (LoRA init, dropout) starts from the seed, per rank; DDP copies rank 0's
        # initial weights to the others. Training draws (noise, timesteps) use their own generators.
        set_seed(self.config.train.seed, device_specific=True)
        self.offloaded: list[torch.nn.Module] = []
        self.adapter = self.load_model()
        self.lora_params = self.add_network()
        self.mirrors = [mirror_lora(self.adapter.trainable_module(), mirror) for mirror in self.adapter.lora_mirrors()]
        self.dataset = build_dataset(self.config.datasets, self.config.trigger_word, self.adapter.divisor)
        self.warn_overlong_captions()
        self.check_timestep_options()
        if self.config.train.blank_prompt_preservation:  # encoded now: the text encoder may leave with the cache
            with self.visiting(self.adapter.text_encoder_modules()):
                self.blank_embeds = self.adapter.blank_prompt_embeds().to(self.accelerator.device)
        self.build_caches()
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
            if self.adapter.sampling_unavailable():
                raise ValueError(f"sample.prompts: {self.adapter.sampling_unavailable()}")
        self.checkpointer = checkpoint.Checkpointer(
            self.accelerator, self.checkpoints_dir, self.config.save.max_step_saves_to_keep
        )
        self.position = Position()
        self.timestep_stats = TimestepStats() if self.config.logging.debug_timesteps else None
        self.last_saved_step = -1
        self.stop = GracefulStop()
        self.stopping = False
        self.smoothed_loss: torch.Tensor | None = None  # on the device, like the losses it follows
        self.throughput = Throughput(self.accelerator.num_processes)
        self.postfix_shown_at = 0.0

    def load_model(self) -> ModelAdapter:
        adapter_class = get_adapter_class(self.config.model.arch)
        device = self.accelerator.device
        # The main process first: it alone downloads or builds (tiny presets) what is missing; the others
        # then read the finished files instead of racing to write them.
        with self.accelerator.main_process_first():
            adapter = adapter_class.load(self.config.model, device, torch_dtype(self.config.model.dtype, device),
                                         debug_memory=self.config.logging.debug_memory)
        if self.config.train.gradient_checkpointing:
            adapter.trainable_module().enable_gradient_checkpointing()
        log.info("model: %s", adapter.describe())
        return adapter

    def add_network(self) -> list[torch.nn.Parameter]:
        """The adapter on the trainable module (from `pretrained_lora_path` when given); its parameters."""
        network, adapter, module = self.config.network, self.adapter, self.adapter.trainable_module()
        if network.conv is not None and not adapter.conv_target_modules():
            raise ValueError(f"network.conv: the {adapter.arch} family has no conv layers to adapt")
        params = add_lora(module, network, adapter.lora_target_modules(), adapter.conv_target_modules())
        if network.pretrained_lora_path:
            path = Path(normalize_path(network.pretrained_lora_path, "network.pretrained_lora_path"))
            with memory_debug("LoRA load", self.config.logging.debug_memory):
                load_pretrained(module, path, adapter.lora_prefix, adapter.comfy_prefix, adapter.comfy_separator)
        return params

    def warn_overlong_captions(self) -> None:
        records = list({item.record.path: item.record for item in self.dataset.items}.values())
        cut = self.adapter.overlong_prompts([r.caption for r in records])
        if cut:
            log.warning("%d captions are longer than the text encoder takes and will be cut, e.g. %s",
                        len(cut), records[cut[0]].path)

    def check_timestep_options(self) -> None:
        params = self.config.train.timestep_params
        if self.config.train.timestep_type == "shift" and params.dynamic_shift and self.adapter.shift_schedule() is None:
            raise ValueError(f"train.timestep_params.dynamic_shift: the {self.adapter.arch} scheduler defines no "
                             "base/max shift; set timestep_params.shift instead")

    def build_caches(self) -> None:
        """Latent and text-embedding caches as the config asks; encoders that are no longer needed in the
        loop then leave the accelerator (they come back only to render samples)."""
        cfgs, train = self.config.datasets, self.config.train
        roots = {i: cache_root(cfg.folder_path, cfg.cache_dir) for i, cfg in enumerate(cfgs)}
        caching = {i: roots[i] for i, cfg in enumerate(cfgs) if cfg.cache_latents or cfg.cache_latents_to_disk}
        if caching:
            cache = LatentCache(self.dataset, caching, {i: cfgs[i].cache_latents_to_disk for i in caching},
                                self.adapter.encoder_identity("image"))
            with self.visiting(self.adapter.image_encoder_modules()):
                cache.build(self.adapter, self.accelerator)
            self.dataset.latents = cache
            if cache.covers_everything:
                self.offload(self.adapter.image_encoder_modules(), "image encoder unload")
        if train.cache_text_embeddings:
            self.conditioning = CachedCaptions(self.adapter, self.dataset, cfgs, train.seed, self.config.trigger_word,
                                               roots)
            with self.visiting(self.adapter.text_encoder_modules()):
                self.conditioning.build(self.accelerator)
            self.offload(self.adapter.text_encoder_modules(), "text encoder unload")
        else:
            self.conditioning = LiveCaptions(self.adapter, self.dataset, cfgs, train.seed, self.config.trigger_word)
        # encoders still needed in the loop (live encoding) are on the accelerator, also under low_vram
        for module in self.adapter.image_encoder_modules() + self.adapter.text_encoder_modules():
            if module not in self.offloaded:
                safe_module_to_device(module, self.accelerator.device)

    def visiting(self, modules: list[torch.nn.Module]):
        """With `model.low_vram`, encoders wait on the CPU and visit the accelerator only while they work."""
        return modules_on(modules, self.accelerator.device) if self.config.model.low_vram else nullcontext()

    def offload(self, modules: list[torch.nn.Module], label: str) -> None:
        with memory_debug(label, self.config.logging.debug_memory):
            for module in modules:
                safe_module_to_device(module, "cpu")
        self.offloaded += modules

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
            persistent_workers=self.config.train.num_workers > 0 and self.config.train.persistent_workers,
            pin_memory=self.accelerator.device.type == "cuda",
            # Each new iterator draws a worker seed; its own generator keeps that draw out of the global
            # RNG, so a resumed run (which starts an iterator mid-epoch) sees the same global RNG stream.
            generator=torch.Generator().manual_seed(self.config.train.seed),
        )
        self.keep_frozen_out_of_ddp(self.adapter.trainable_module())
        module, self.optimizer, self.dataloader = self.accelerator.prepare(
            self.adapter.trainable_module(), self.optimizer, dataloader
        )
        self.adapter.use_for_training(module)
        self.trained_module = module
        self.verify_plan(len(self.dataloader))

    def keep_frozen_out_of_ddp(self, module: torch.nn.Module) -> None:
        """DDP broadcasts every parameter at start and every buffer at each forward. The frozen base is loaded
        the same on every process, so only the LoRA needs it: skipping the rest saves copying the whole model
        (and quantized weights, which DDP does not broadcast correctly, are left alone)."""
        if self.accelerator.num_processes == 1:
            return
        frozen = [name for name, param in module.named_parameters() if not param.requires_grad]
        buffers = [name for name, _ in module.named_buffers()]
        torch.nn.parallel.DistributedDataParallel._set_params_and_buffers_to_ignore_for_model(module, frozen + buffers)

    def verify_plan(self, real_micro_batches: int) -> None:
        if real_micro_batches != self.plan.micro_batches_per_epoch:
            log.warning(
                "the dataloader yields %d micro-batches per process per epoch, the plan said %d; "
                "recomputing the plan from the real length",
                real_micro_batches, self.plan.micro_batches_per_epoch,
            )
            self.plan = self.plan.with_micro_batches(real_micro_batches)

    def open_metrics(self, resumed: bool) -> None:
        """metrics.jsonl keeps one line per update: lines after the resumed step (an interrupted run's
        updates that no checkpoint kept) are dropped, a fresh start begins an empty file."""
        path = self.run_dir / "metrics.jsonl"
        if self.is_main:
            truncate_after(path, self.position.global_step if resumed else 0)
        self.metrics = MetricsWriter(path, enabled=self.is_main)

    # ---- resume --------------------------------------------------------------------------------

    def resume(self, folder: Path) -> None:
        """Load a checkpoint into the built components; validates before it changes anything."""
        state = checkpoint.TrainState.read(folder)
        self.load_trained_state(folder)
        self.position = self.resumed_position(state)
        self.fast_forward_lr_scheduler(state)
        same_world = state.world_size == self.accelerator.num_processes
        if not self.checkpointer.restore_rng(folder, same_world) and same_world:
            log.warning("%s: no RNG state for rank %d; library randomness will differ",
                        folder, self.accelerator.process_index)
        self.last_saved_step = state.global_step
        for change in checkpoint.config_changes(state.config, self.config.model_dump(mode="json")):
            log.info("changed since the checkpoint: %s", change)
        log.info("resuming from %s at step %d (epoch %d, micro-batch %d)", folder, state.global_step,
                 self.position.epoch, self.position.micro_batch_in_epoch)

    def load_trained_state(self, folder: Path) -> None:
        lora_file = folder / checkpoint.LORA_FILE
        saved_lora = checkpoint.load_safetensors(lora_file)
        problems = compare_lora_state(self.lora_state(torch.float32), saved_lora)
        saved_optimizer = checkpoint.load_torch(folder / checkpoint.OPTIMIZER_FILE)
        problems += [f"{checkpoint.OPTIMIZER_FILE}: {problem}"
                     for problem in checkpoint.optimizer_problems(saved_optimizer, self.optimizer)]
        if problems:
            raise checkpoint.CheckpointError(
                f"checkpoint {folder} does not match the current config: " + "; ".join(problems)
            )
        with memory_debug("LoRA load", self.config.logging.debug_memory):
            load_lora_file(self.adapter.trainable_module(), lora_file, self.adapter.lora_prefix)
        for change in checkpoint.load_optimizer_keeping_hyperparameters(self.optimizer, saved_optimizer):
            log.info("optimizer setting changed since the checkpoint: %s", change)
        scaler = self.accelerator.scaler
        if scaler is not None and (folder / checkpoint.SCALER_FILE).is_file():
            scaler.load_state_dict(checkpoint.load_torch(folder / checkpoint.SCALER_FILE))

    def resumed_position(self, state: checkpoint.TrainState) -> Position:
        epoch, consumed = state.epoch, state.micro_batch_in_epoch
        processes = self.accelerator.num_processes
        if state.world_size != processes:
            log.warning("the checkpoint was written by %d processes, this run has %d: the LR continues at "
                        "step %d, but the data order from here differs from an uninterrupted run",
                        state.world_size, processes, state.global_step)
            accumulation = self.config.train.gradient_accumulation
            consumed = consumed * state.world_size // processes // accumulation * accumulation
        if consumed >= len(self.dataloader):
            epoch, consumed = epoch + 1, 0
        return Position(state.global_step, epoch, consumed)

    def fast_forward_lr_scheduler(self, state: checkpoint.TrainState) -> None:
        """The LR is a function of the update index: replay the current schedule to the resumed step, so a
        changed `lr`, `steps` or schedule applies from here on."""
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")  # "scheduler.step() before optimizer.step()"
            for _ in range(state.global_step):
                self.lr_scheduler.step()
        now = self.lr_scheduler.get_last_lr()[0]
        if not math.isclose(now, state.lr, rel_tol=1e-9, abs_tol=1e-15):
            log.info("LR at step %d: %.3g in the checkpoint, %.3g with the current schedule", state.global_step,
                     state.lr, now)

    def set_aside_abandoned_checkpoints(self) -> None:
        """Continuing from an older checkpoint abandons the newer ones; they move aside, not away."""
        if not self.is_main:
            return
        aside = checkpoint.set_aside_newer(self.checkpoints_dir, self.position.global_step, self.final_lora_path)
        if aside is not None:
            log.warning("continuing from step %d: the newer checkpoints of the earlier run were moved to %s",
                        self.position.global_step, aside)

    def report_already_complete(self) -> None:
        log.info("training is already complete at step %d (train.steps / epochs give %d); raise them to "
                 "continue", self.position.global_step, self.plan.total_updates)
        if self.is_main and not self.final_lora_path.exists():
            self.write_final_loras()
        if self.is_main:
            self.write_report()
        self.monitor.ended("finished", self.position.global_step)

    # ---- loop ----------------------------------------------------------------------------------

    def train(self) -> None:
        self.trained_module.train()
        if self.config.sample.sample_at_start and self.position.global_step == 0:
            self.sample(step=0)
        progress = tqdm(total=self.plan.total_updates, initial=self.position.global_step, desc="train",
                        unit="step", disable=not self.progress_enabled)
        self.throughput.restart()
        # `stopping` is only ever set from the collective check, so every process leaves together
        while self.position.global_step < self.plan.total_updates and not self.stopping:
            self.train_epoch(progress)
        progress.close()

    def epoch_batches(self):
        """This epoch's micro-batches on this process, from the resumed position (skipped, not loaded)."""
        skip = self.position.micro_batch_in_epoch
        loader = self.accelerator.skip_first_batches(self.dataloader, skip) if skip else self.dataloader
        # accelerate's loader passes its own iteration count to the sampler when iterated; a resumed run
        # (or a skip loader) starts that count at 0, so set it to the real epoch on both.
        loader.set_epoch(self.position.epoch)
        self.batch_sampler.set_epoch(self.position.epoch)
        self.conditioning.start_epoch(self.position.epoch)
        return enumerate(loader, start=skip)

    def train_epoch(self, progress: tqdm) -> None:
        """The micro-batches of one epoch. Nothing in here reads a value back from the device except a logged
        update (and the progress bar, at most once a second), so the host keeps queueing work ahead."""
        pos = self.position
        window: list[dict[str, torch.Tensor]] = []
        samples = 0
        for micro_batch, batch in self.epoch_batches():
            pos.micro_batch_in_epoch = micro_batch + 1
            samples += len(batch["indices"])
            with self.accelerator.accumulate(self.trained_module):
                loss, parts = self.train_step(batch, pos.epoch, micro_batch)
                self.accelerator.backward(loss * self.loss_scale(micro_batch))
                window.append({"loss": loss.detach(), **parts})
                if not self.accelerator.sync_gradients:
                    continue
                update = self.optimizer_update(window)
            self.throughput.count(samples, completed=update is not None)
            if update is not None:
                self.after_update(update, progress)
                if pos.global_step >= self.plan.total_updates or self.steer():
                    return
            window, samples = [], 0
        pos.epoch += 1
        pos.micro_batch_in_epoch = 0

    def loss_scale(self, micro_batch: int) -> float:
        """accelerate divides every loss by `gradient_accumulation`; a short last window of k micro-batches
        is scaled back up by A / k so that its gradient is the mean over its k micro-batches."""
        accumulation = self.config.train.gradient_accumulation
        return accumulation / accumulation_window(micro_batch, self.plan.micro_batches_per_epoch, accumulation)

    def train_step(self, batch: dict, epoch: int, micro_batch: int) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
        """The loss of one micro-batch and its named parts; the trainer subclass defines it."""
        raise NotImplementedError

    def optimizer_update(self, window: list[dict[str, torch.Tensor]]) -> UpdateValues | None:
        """Clip, step the optimizer and (once) the LR scheduler. None when the optimizer skipped the step
        (fp16 only: reading that flag is the one per-update wait for the device that GradScaler needs)."""
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
        names = list(window[0])  # every micro-batch of an update has the same parts, on every process
        means = torch.stack([torch.stack([parts[name] for parts in window]).float().mean() for name in names])
        if self.accelerator.num_processes > 1:
            means = self.accelerator.reduce(means, reduction="mean")  # one collective, queued like the rest
        grad_norm = torch.as_tensor(grad_norm, dtype=torch.float32, device=means.device).reshape(1)
        return UpdateValues(self.position.global_step, self.position.epoch, lr, names + ["grad_norm"],
                            torch.cat([means, grad_norm]))

    def after_update(self, update: UpdateValues, progress: tqdm) -> None:
        step = update.step
        loss = update.loss
        self.smoothed_loss = loss if self.smoothed_loss is None else self.smoothed_loss + 0.1 * (loss - self.smoothed_loss)
        logged = step % self.config.logging.log_every == 0 or step == self.plan.total_updates
        postfix_due = self.progress_enabled and time.monotonic() - self.postfix_shown_at >= 1.0
        if logged or postfix_due:
            record = self.host_record(update)
            if logged:
                self.log_record(record)
            if postfix_due:
                progress.set_postfix(loss=f"{record['smoothed_loss']:.4f}", lr=f"{record['lr']:.2e}",
                                     s_it=f"{record['time']:.2f}", refresh=False)
                self.postfix_shown_at = time.monotonic()
        progress.update(1)
        self.monitor.heartbeat(step)
        if self.config.save.save_every and step % self.config.save.save_every == 0:
            self.save_checkpoint()
        if self.config.sample.sample_every and step % self.config.sample.sample_every == 0:
            self.sample(step)

    def host_record(self, update: UpdateValues) -> dict:
        """The update's values on the host (one transfer, which waits for the device), with the LR it used
        and the throughput since the last logged update."""
        values = torch.cat([update.values, self.smoothed_loss.float().reshape(1)]).tolist()
        record = {"step": update.step, "epoch": update.epoch, **dict(zip(update.names, values[:-1]))}
        record["smoothed_loss"] = values[-1]
        record["lr"] = logged_lr(self.optimizer, update.scheduled_lr)
        rms = update_rms(self.optimizer)
        if rms is not None:
            record["update_rms"] = float(rms)
        return record | self.throughput.read()

    def log_record(self, record: dict) -> None:
        """A metrics.jsonl line (and TensorBoard scalars) for a logged update; the throughput window restarts."""
        record = {k: v for k, v in record.items() if k != "smoothed_loss"}
        if self.timestep_stats is not None:
            record.update(self.timestep_stats.flush())
        record.update(memory_fields())
        self.metrics.write(record)
        if self.config.logging.tensorboard:
            self.accelerator.log({k: v for k, v in record.items() if isinstance(v, (int, float))},
                                 step=record["step"])
        self.throughput.restart()  # the next line's time and samples/s count from here

    def stop_with_checkpoint(self) -> None:
        if self.last_saved_step != self.position.global_step:
            self.save_checkpoint()
        self.metrics.close()
        self.monitor.ended("stopped", self.position.global_step)
        raise StopRequested(
            f"stopped at step {self.position.global_step}; checkpoint saved in {self.checkpoints_dir}. "
            "Run the same command again to resume."
        )

    # ---- outputs -------------------------------------------------------------------------------

    def lora_metadata(self) -> dict[str, str]:
        facts = self.adapter.describe()
        return {
            "difftune_config": json.dumps(self.config.model_dump(mode="json"), sort_keys=True),
            "difftune_name": self.job.name,
            "difftune_step": str(self.position.global_step),
            "difftune_arch": facts["arch"],
            "difftune_base_model": facts.get("base_model", ""),
        }

    def lora_state(self, dtype: torch.dtype) -> dict[str, torch.Tensor]:
        return lora_state_dict(self.adapter.trainable_module(), self.adapter.lora_prefix, dtype)

    def write_final_loras(self) -> None:
        """The finished LoRA in every format `save.formats` asks for."""
        dtype = DTYPES[self.config.save.dtype]
        formats = self.config.save.formats or self.adapter.default_save_formats
        if self.config.network.use_dora and not self.config.save.formats:
            formats = [f for f in formats if f != "comfy"]  # no ComfyUI form of DoRA yet
        if "diffusers" in formats:
            self.write_lora(self.final_lora_path, dtype)
            log.info("saved LoRA %s", self.final_lora_path)
        if "comfy" in formats:
            path = self.final_lora_path.with_suffix(".comfy.safetensors")
            adapter = self.adapter
            write_comfy_file(path, adapter.trainable_module(), adapter.lora_prefix, adapter.comfy_prefix,
                             adapter.comfy_separator, dtype, self.lora_metadata(), self.config.network.type,
                             adapter.kohya_base_model)
            log.info("saved LoRA %s (ComfyUI/kohya keys)", path)

    def write_lora(self, path: Path, dtype: torch.dtype) -> None:
        write_lora_file(path, self.lora_state(dtype), self.lora_metadata(), self.adapter.trainable_module(),
                        self.adapter.lora_prefix)

    def train_state(self) -> checkpoint.TrainState:
        """Where training is; called on every rank (it gathers each rank's step and LR)."""
        pos = self.position
        lr = self.lr_scheduler.get_last_lr()[0]
        config = self.config.model_dump(mode="json")
        return checkpoint.TrainState(
            global_step=pos.global_step,
            epoch=pos.epoch,
            micro_batch_in_epoch=pos.micro_batch_in_epoch,
            world_size=self.accelerator.num_processes,
            lr=lr,
            config_fingerprint=checkpoint.fingerprint(config),
            config=config,
            versions=checkpoint.library_versions(),
            ranks=gather_object([{"rank": self.accelerator.process_index, "global_step": pos.global_step, "lr": lr}]),
        )

    def write_checkpoint_payload(self, folder: Path) -> None:
        """Everything but the RNG files; float32 LoRA so that a resume continues exactly."""
        self.write_lora(folder / checkpoint.LORA_FILE, torch.float32)
        torch.save(self.optimizer.state_dict(), folder / checkpoint.OPTIMIZER_FILE)
        torch.save(self.lr_scheduler.state_dict(), folder / checkpoint.SCHEDULER_FILE)
        if self.accelerator.scaler is not None:
            torch.save(self.accelerator.scaler.state_dict(), folder / checkpoint.SCALER_FILE)

    def save_checkpoint(self) -> None:
        flush()
        folder = self.checkpointer.save(self.train_state(), self.write_checkpoint_payload)
        self.last_saved_step = self.position.global_step
        if self.is_main:
            log.info("saved checkpoint %s", folder)
            self.write_report()
        self.throughput.restart()  # saving is not training time

    def finish(self) -> None:
        step = self.position.global_step
        if self.last_saved_step != step:
            self.save_checkpoint()
        if self.is_main:
            self.write_final_loras()
        self.metrics.close()
        if not (self.config.sample.sample_every and step % self.config.sample.sample_every == 0):
            self.sample(step)
        if self.is_main:
            self.write_report()
        self.monitor.ended("finished", step)
        self.accelerator.wait_for_everyone()
