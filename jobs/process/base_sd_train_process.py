"""BaseSDTrainProcess (`type: sd_trainer`): LoRA training of a diffusion model, assembled from parts.

run() reads as setup -> train -> finish. Each part is built with exactly what it needs and tested on its own:
the run folder (toolkit.run.folder), the checkpoints, save and resume in one (toolkit.run.checkpoint), the
monitor: status, control, metrics, report, samples, TensorBoard (toolkit.run.monitor), the objective
(toolkit.train.objective) and the data and conditioning (toolkit.data.training_data). The loop below only moves
micro-batches between them.
"""

from __future__ import annotations

import contextlib
import logging
import time
from collections.abc import Callable, Iterator
from functools import cached_property
from pathlib import Path

import torch
from accelerate.utils import broadcast, broadcast_object_list, set_seed
from torch.distributed.tensor import DTensor

from jobs.context import JobContext
from jobs.process.base_process import BaseProcess, StopRequested
from toolkit.config.loader import check_paths
from toolkit.config.schema import SDTrainerConfig
from toolkit.data.dataset import scan_datasets
from toolkit.data.training_data import BadData, TrainingData, usable_cores
from toolkit.device import DTYPES, ModulePlacement, as_dtype, flush, memory_debug, modules_on
from toolkit.models.base import ModelAdapter
from toolkit.models.registry import get_adapter_class
from toolkit.network.files import file_has_component, load_component, part_file, write_comfy_file
from toolkit.network.lora import add_lora, mirror_lora, write_components_file, write_peft_folder
from toolkit.network.metadata import TrainingFacts, lora_metadata, reduce_path, tag_frequency
from toolkit.paths import normalize_path
from toolkit.run.accelerator import RunAccelerator
from toolkit.run.checkpoint import Checkpoints, TrainedParts
from toolkit.run.disk import DiskProblem, disk_error, disk_message, space_warning, tree_bytes
from toolkit.run.faults import Faults
from toolkit.errors import UserError
from toolkit.run.folder import RunFolder, RunFolderError
from toolkit.run.monitor import Monitor, UpdateValues
from toolkit.run.out_of_memory import JobMemory, OutOfMemory, is_out_of_memory, module_bytes, out_of_memory_message
from toolkit.run.sampling import Sampler, SampleRenderer, cuda_devices
from toolkit.run.sharding import (
    Sharded,
    Unsharded,
    autocast_forward,
    block_modules,
    shard_denoiser,
    sharded_parameters,
)
from toolkit.run.signals import GracefulStop
from toolkit.train.ema import LoraEMA
from toolkit.train.lr_schedulers import build_lr_scheduler
from toolkit.train.nonfinite import NonFiniteWatch, RunFacts
from toolkit.train.objective import DiffusionObjective, StepDraw
from toolkit.train.optimizers import (
    build_optimizer,
    evaluation_weights,
    logged_lr,
    optimizer_figures,
    start_training,
    unwrapped,
    update_rms,
)
from toolkit.train.plan import Position, TrainingPlan, accumulation_window
from toolkit.train.validation import HeldOut, Validation, read_held_out
from toolkit.train.weights import in_eval_mode

log = logging.getLogger("difftune")


class BaseSDTrainProcess(BaseProcess):
    config: SDTrainerConfig

    def __init__(self, job: JobContext, index: int, config: SDTrainerConfig,
                 objective: Callable[..., DiffusionObjective] = DiffusionObjective):
        """`objective` builds the loss part from (the `train` objective group, the seed, the adapter, the blank
        prompt's embeddings): another objective is registered as `partial(BaseSDTrainProcess, objective=...)`,
        not written as a subclass."""
        super().__init__(job, index, config)
        self.make_objective = objective
        #: faults the tests inject (DIFFTUNE_TEST_FAULTS; none in a real run)
        self.faults = Faults.from_env()
        #: the phase the run is in (toolkit.run.out_of_memory.PHASES), for an out-of-memory message; left as it was
        #: when an error leaves it
        self.phase = "loading"
        #: the sample indices of the last micro-batch taken (host data), for the same message
        self.last_indices: list[int] = []
        #: files found unreadable while training: warned about once, counted in the metrics lines
        self.bad_data = BadData()

    def run(self) -> None:
        cfg = self.config
        self.start()
        try:
            self.monitor.started()
            # run.py checked already; API users get it here, and a later process sees what earlier ones wrote
            check_paths(self.job.config, self.job.config_path, only=self.index)
            resume_from = self.agreed_resume_point(self.folder.resume_point(cfg.train.resume, cfg.train.overwrite))
            self.setup()
            if resume_from is not None:
                self.position = self.checkpoints.resume(resume_from, self.plan.micro_batches_per_epoch,
                                                        cfg.train.gradient_accumulation)
                self.warn_of_a_new_split(self.checkpoints.resumed_config)
            self.open_run_folder(resumed=resume_from is not None)
            self.warn_of_space()
            self.monitor.planned(self.plan, self.position.global_step, resume_from is not None, self.sampler)
            if self.position.global_step >= self.plan.total_updates and resume_from is not None:
                return self.report_already_complete()
            self.train()
            self.finish()
        except StopRequested:
            raise
        except BaseException as error:
            if is_out_of_memory(error) and not isinstance(error, OutOfMemory):
                stop = OutOfMemory(self.out_of_memory_message(error))
                self.monitor.failed(stop, self.position.global_step)
                raise stop from error
            if disk_error(error, self.folder.root) is not None and not isinstance(error, DiskProblem):
                stop = DiskProblem(self.disk_message(error))
                self.monitor.failed(stop, self.position.global_step)
                raise stop from error
            self.monitor.failed(error, self.position.global_step)
            raise
        finally:
            self.close()

    def agreed_resume_point(self, found: Path | None) -> Path | None:
        """With `train.resume: auto` on several processes: the newest checkpoint complete for every process (without
        a shared filesystem each machine has its own checkpoints, and a machine stopped mid-save lacks the newest), the
        same step everywhere, each process reading it from its own machine's folder."""
        from accelerate.utils import gather_object

        from toolkit.run.checkpoint_folders import scan_checkpoints, step_dir_name

        acc, cfg = self.accelerator, self.config
        if acc.num_processes == 1 or cfg.train.resume != "auto" or cfg.train.overwrite:
            return found
        complete, _ = scan_checkpoints(self.folder.checkpoints)
        steps = sorted(int(path.name[5:]) for path in complete)
        everywhere = gather_object([steps])
        common = set.intersection(*(set(s) for s in everywhere))
        if not common:
            if any(everywhere):
                raise RunFolderError(
                    f"no checkpoint is complete for every process (complete steps per process: {everywhere}): with "
                    "train.shared_filesystem: false each machine needs its own copy; copy a checkpoint folder to the "
                    "machines that lack it, or set train.overwrite: true to start over")
            return None
        step = max(common)
        if found is not None and found.name != step_dir_name(step):
            log.warning("resuming from step %d, the newest checkpoint complete on every machine (this one also has %s)",
                        step, found.name)
        return self.folder.checkpoints / step_dir_name(step)

    @contextlib.contextmanager
    def in_phase(self, name: str, inject: bool = True) -> Iterator[None]:
        """The run in phase `name` for the block (an error leaves it there, for the message that names it)."""
        before, self.phase = self.phase, name
        if inject:
            self.faults.phase(name)
        yield
        self.phase = before

    def job_memory(self) -> JobMemory:
        """What an out-of-memory message weighs, from the config and whatever of the model has loaded."""
        cfg = self.config
        adapter = getattr(self, "adapter", None)
        fields = type(cfg.model).model_fields
        sizes = (0, 0, 0) if adapter is None else (
            module_bytes([adapter.trainable_module()]), module_bytes(adapter.text_encoder_modules()),
            module_bytes(adapter.image_encoder_modules()))
        return JobMemory(
            *sizes, has_quantize="quantize" in fields, quantized=bool(getattr(cfg.model, "quantize", False)),
            has_low_vram="low_vram" in fields, low_vram=bool(getattr(cfg.model, "low_vram", False)),
            gradient_checkpointing=cfg.train.gradient_checkpointing, batch_size=cfg.train.batch_size,
            resolution=max(max(d.resolution) for d in cfg.datasets),
            cache_latents=all(d.cache_latents or d.cache_latents_to_disk for d in cfg.datasets),
            cache_text=cfg.train.cache_text_embeddings, sample_size=(cfg.sample.width, cfg.sample.height),
            on_accelerator=self.accelerator.device.type != "cpu")

    def disk_message(self, error: BaseException) -> str:
        """The path, what was being written (a checkpoint: the size of the last one, or the LoRA's and its optimizer
        state's), the space free, and the checkpoint a rerun resumes from."""
        checkpoints = getattr(self, "checkpoints", None)
        last = checkpoints.last_saved_step if checkpoints is not None else None
        writing, folder, needed = {
            "saving": ("a checkpoint", self.folder.checkpoints, self.checkpoint_bytes()),
            "final": ("the final LoRA files", self.folder.root, self.final_bytes()),
            "sampling": ("samples", self.folder.samples, None),
            "caching": ("the caches", self.folder.root, None),
        }.get(self.phase, ("the run's files", self.folder.root, None))
        return disk_message(error, writing, folder, needed, last or None)

    def checkpoint_bytes(self) -> int | None:
        """About what a checkpoint takes: the newest complete one's size, else the LoRA in float32 with two
        optimizer moments and the EMA (what AdamW keeps; 8-bit optimizers keep less)."""
        from toolkit.run.checkpoint_folders import scan_checkpoints

        complete, _ = scan_checkpoints(self.folder.checkpoints)
        if complete:
            return tree_bytes(complete[-1])
        params = getattr(self, "lora_params", None)
        if not params:
            return None
        lora = sum(p.numel() for p in params) * 4
        return lora * (3 + (1 if self.config.train.ema is not None else 0))

    def final_bytes(self) -> int | None:
        params = getattr(self, "lora_params", None)
        if not params:
            return None
        lora = sum(p.numel() for p in params) * DTYPES[self.config.save.dtype].itemsize
        return lora * len(self.final_forms()) * (2 if self.config.train.ema is not None else 1)

    def warn_of_space(self) -> None:
        """At the start (main process): a warning where the checkpoints kept and the final files cannot fit."""
        checkpoint = self.checkpoint_bytes()
        if not self.accelerator.is_main_process or not checkpoint:
            return
        keep = self.config.save.max_step_saves_to_keep or 1
        warning = space_warning(self.folder.root, checkpoint, keep, self.final_bytes() or 0)
        if warning:
            log.warning("%s", warning)

    def out_of_memory_message(self, error: BaseException) -> str:
        """The phase (in training: the bucket and batch of the micro-batch), memory and what to change."""
        detail = ""
        if self.phase == "training" and self.last_indices:
            items = self.data.dataset.items
            buckets = sorted({items[i].bucket for i in self.last_indices})
            detail = (f"update {self.position.global_step + 1}, bucket "
                      + ", ".join(f"{w}x{h}" for w, h in buckets) + f", {len(self.last_indices)} per micro-batch")
        message = out_of_memory_message(self.phase, detail, self.job_memory(), error)
        step = getattr(self.checkpoints, "last_saved_step", None) if hasattr(self, "checkpoints") else None
        if step is not None and step > 0:
            message += f"\nThe run stopped; its checkpoint of update {step} is complete, and the same command resumes from it."
        else:
            message += "\nThe run stopped; the same command starts it again."
        return message

    def start(self) -> None:
        """The run folder, the accelerator and the monitor: what exists before anything loads."""
        cfg = self.config
        self.folder = RunFolder(Path(cfg.training_folder) / self.job.name, self.job.name, cfg.model.facts.file_parts)
        network = cfg.network
        self.runtime = RunAccelerator(
            cfg.train.runtime, cfg.device, self.folder.root, cfg.logging.tensorboard,
            # peft's LoKr/LoHa skip a dropped module's computation entirely (LoRA's module dropout multiplies by 0)
            unused_parameters=network.type != "lora" and network.module_dropout > 0, model_dtype=cfg.model.dtype)
        self.precision = self.runtime.precision
        self.accelerator = self.runtime.accelerator
        self.monitor = Monitor(self.folder, self.accelerator, self.runtime.host_group, cfg.logging, self.job.name)
        self.position = Position()

    def close(self) -> None:
        """Trackers and the metrics file closed; the dataloader's workers ended; accelerate's process-wide state
        forgotten for the next job."""
        self.monitor.close()
        data = getattr(self, "data", None)  # not there when the run failed before its data was read
        if data is not None:
            data.close()
        self.runtime.close()

    # ---- setup ---------------------------------------------------------------------------------------

    def setup(self) -> None:
        """Every part, built in order: model and adapter, data and caches, plan, optimizer and schedule, the
        accelerate wrap, then the parts that take the prepared components."""
        cfg, acc = self.config, self.accelerator
        # Library randomness (LoRA init, dropout) starts from the seed, per rank; DDP copies rank 0's initial
        # weights to the others. Training draws (noise, timesteps) use their own generators.
        set_seed(cfg.train.seed, device_specific=True)
        self.placement = ModulePlacement(acc.device, cfg.model.low_vram, cfg.logging.debug_memory)
        # the data is read first: a bad dataset is named before minutes of model loading
        facts = cfg.model.facts
        scanned = scan_datasets(cfg.datasets, cfg.trigger_word, facts.frame_step, facts.title)
        held_out = None
        if cfg.validation is not None:  # a split's samples leave the training data here
            scanned, held_out = read_held_out(cfg.validation, cfg.datasets, scanned, cfg.train.seed, cfg.trigger_word,
                                              facts.frame_step, facts.title)
        with self.in_phase("loading"):
            self.adapter = self.load_model()
            self.param_groups = self.add_network()
            self.sharding = self.shard()
        self.lora_params = [param for group in self.param_groups for param in group["params"]]
        self.mirrors = [mirror_lora(self.adapter.trainable_module(), m) for m in self.adapter.sampling.mirrors()]
        self.data = TrainingData(cfg.datasets, cfg.trigger_word, cfg.train, self.adapter, self.placement, scanned)
        self.data.warn_overlong_captions()
        blank = None
        if cfg.train.blank_prompt_preservation:  # encoded now: the text encoder may leave with the cache
            with self.placement.visiting(self.adapter.text_encoder_modules()):
                blank = self.adapter.text.blank_prompt_embeds().to(acc.device)
        self.objective = self.make_objective(cfg.train.objective, cfg.train.seed, self.adapter, blank)
        with self.in_phase("caching"):
            self.data.build_caches(self.runtime.cache_writers())
            self.validation = self.make_validation(held_out) if held_out is not None else None
        self.plan = self.make_plan()
        self.optimizer = build_optimizer(cfg.train.optimization, self.param_groups,
                                         loss_scaled=acc.scaler is not None)
        self.ema = LoraEMA(cfg.train.ema, self.lora_params) if cfg.train.ema is not None else None
        self.prepare_components()
        self.stepper = self.optimizer_that_steps()
        self.lr_scheduler = build_lr_scheduler(cfg.train.lr_schedule, self.stepper, self.plan)
        model_name = cfg.model.name_or_path if cfg.save.metadata == "full" else reduce_path(cfg.model.name_or_path)
        renderer = SampleRenderer(cfg.sample, cfg.trigger_word, self.folder.samples, model_name)
        if renderer.enabled:
            renderer.check_size(self.adapter.divisor)
        self.sampler = Sampler(renderer, self.adapter, self.placement, self.trained_modules, self.mirrors,
                               acc.is_main_process, cfg.logging.debug_memory, weights=self.sample_weights,
                               precision=self.precision, every_process_renders=self.sharding.enabled)
        self.say_which_files()
        parts = TrainedParts(self.components, self.optimizer, self.lr_scheduler, acc.scaler, self.ema, self.sharding)
        self.checkpoints = Checkpoints(acc, self.folder.checkpoints, cfg.save.max_step_saves_to_keep, parts,
                                       cfg.model_dump(mode="json"), self.lora_metadata, cfg.logging.debug_memory,
                                       writes=self.runtime.writes_resume_files)

    def warn_of_a_new_split(self, saved: dict) -> None:
        """A validation split the run did not have from its start holds out images that were trained on."""
        split = self.config.validation.split if self.config.validation is not None else None
        before = (saved.get("validation") or {}).get("split")
        same_seed = (saved.get("train") or {}).get("seed") == self.config.train.seed
        if split is not None and (before != split or not same_seed) and self.accelerator.is_main_process:
            log.warning("validation.split %s is new since the checkpoint: its held-out images were trained on until "
                        "step %d, so the validation loss reads lower than it would", split, self.position.global_step)

    def make_validation(self, held_out: HeldOut) -> Validation:
        """The validation part: the held-out samples encoded once, the image encoder and then the text encoder brought
        to the accelerator for it where caching or `low_vram` sent them away (one at a time, as for samples)."""
        cfg, acc, adapter = self.config, self.accelerator, self.adapter
        validation = Validation(cfg.validation, held_out.items(adapter.divisor), cfg.train.objective, cfg.train.seed,
                                adapter, sizes=adapter.facts.size_conditioning,
                                mask_min_values=held_out.mask_min_values(), references=adapter.reference_rules)
        # sharded: every process takes part in every forward, so each evaluates every batch
        processes, rank = (1, 0) if self.sharding.enabled else (acc.num_processes, acc.process_index)
        with modules_on(adapter.image_encoder_modules(), self.placement.device):
            validation.encode_latents(rank, processes)
        with modules_on(adapter.text_encoder_modules(), self.placement.device):
            validation.encode_prompts()
        return validation

    @property
    def sharded(self) -> bool:
        """`train.sharding: fsdp` over more than one process (on one it changes nothing)."""
        return self.config.train.sharding == "fsdp" and self.accelerator.num_processes > 1

    def load_model(self) -> ModelAdapter:
        cfg, acc = self.config, self.accelerator
        # The main process first (without a shared filesystem, each machine's first): it alone downloads or builds
        # (tiny presets) what is missing; the others then read the finished files instead of racing to write them.
        # Only it renders samples (sharded: all of them), so only it loads models used for nothing else. Sharded, the
        # denoiser is built empty: `shard` fills it.
        with self.runtime.writer_first():
            adapter = get_adapter_class(cfg.model.arch).load(
                cfg.model, acc.device, self.precision.base, debug_memory=cfg.logging.debug_memory,
                sampling_models=acc.is_main_process or self.sharded, empty_denoiser=self.sharded)
        if cfg.train.zero_terminal_snr:
            adapter.use_zero_terminal_snr()
        adapter.use_training_guidance(cfg.train.guidance_scale, cfg.train.bypass_guidance_embedding)
        refuse_extra_references(cfg, adapter.reference_rules)
        if cfg.train.gradient_checkpointing:
            adapter.trainable_module().enable_gradient_checkpointing()
        log.info("model: %s", adapter.describe())
        return adapter

    def add_network(self) -> list[dict]:
        """The adapter on the trainable module, and on the text encoders with `network.train_text_encoder` (each from
        `pretrained_lora_path` when given and the file has it); the optimizer's parameter groups: the denoiser's at
        `train.lr`, the text encoders' at `train.text_encoder_lr`."""
        network, train, adapter = self.config.network, self.config.train, self.adapter
        idle = adapter.modules_without_gradients()
        denoiser_network = network if not idle else network.model_copy(
            update={"ignore_if_contains": [*(network.ignore_if_contains or []), *idle]})
        # sharded: the LoRA waits on the CPU beside the empty denoiser until `shard` places each process's part
        device = torch.device("cpu") if self.sharded else self.accelerator.device
        denoiser_params = [param for module in adapter.denoisers()  # one denoiser, or each trained expert
                           for param in add_lora(module, denoiser_network, adapter.lora_target_modules(),
                                                 adapter.conv_target_modules(), device)]
        groups = [{"params": denoiser_params}]
        self.text_params: list[torch.nn.Parameter] = []
        #: the text encoders' LR of the last update (None while they do not train)
        self.text_encoder_lr: float | None = None
        if network.train_text_encoder:
            # the family's text targets at the same rank and alpha; module filters and conv ranks are the denoiser's
            text_network = network.model_copy(update={"target_modules": None, "only_if_contains": None,
                                                      "ignore_if_contains": None, "conv": None, "conv_alpha": None})
            for component in adapter.text_encoder_components():
                self.text_params += add_lora(component.module, text_network, adapter.text_lora_target_modules())
            groups.append({"params": self.text_params, "lr": train.text_lr})
            adapter.text_encoders_train = True
        self.components = adapter.lora_components(text_encoders=network.train_text_encoder)
        if network.pretrained_lora_path:
            path = Path(normalize_path(network.pretrained_lora_path, "network.pretrained_lora_path"))
            with memory_debug("LoRA load", self.config.logging.debug_memory):
                self.load_pretrained_components(path)
        return groups

    def load_pretrained_components(self, path: Path) -> None:
        """The denoiser's adapter from the file (it must fit); each text encoder's where the file has it, else that
        one starts fresh (said so). Denoisers with files of their own (experts) load from the file of their part
        (`x_high_noise.safetensors` / `x_low_noise.safetensors`, in any form, for either given); one whose file is
        missing starts fresh (said so)."""
        denoisers = [c for c in self.components if not c.text_encoder]
        text = [c for c in self.components if c.text_encoder]
        for component in denoisers:
            if not component.file_part:
                load_component(component, path, others_trained=bool(text))
                continue
            own = part_file(path, component.file_part, list(self.adapter.facts.file_parts))
            if own.is_file():
                load_component(component, own)
            else:
                log.info("no %s for the %s LoRA: it starts fresh", own, component.file_part)
        for component in text:
            if file_has_component(path, component):
                load_component(component, path, others_trained=True)
            else:
                log.info("%s has no %s weights: its LoRA starts fresh", path, component.prefix)

    def shard(self) -> Unsharded:
        """`train.sharding: fsdp`: each denoiser (with its LoRA) sharded over the processes block by block and filled,
        each process reading its part of the weights; the parameter groups then hold the sharded parameters."""
        if not self.sharded:
            return Unsharded()
        cfg, acc = self.config, self.accelerator
        if cfg.train.fsdp_cpu_offload and acc.device.type == "cuda":
            # its shards, gradients and optimizer state are on the host, which the GPUs' NCCL group cannot reduce
            raise UserError("train.fsdp_cpu_offload is not supported on GPUs yet (its host-side gradients need a gloo "
                            "group beside NCCL); remove it, or shard over more GPUs")
        denoisers = self.adapter.denoisers()
        with memory_debug("sharding", cfg.logging.debug_memory), sharded_parameters(denoisers, self.param_groups):
            for module in denoisers:
                shard_denoiser(module, self.adapter.sharded_blocks, acc.device, cfg.train.fsdp_cpu_offload,
                               self.runtime.host_group)
        if acc.is_main_process:
            units = sum(len(block_modules(module, self.adapter.sharded_blocks)) for module in denoisers)
            log.info("sharding: the denoiser split over %d processes (FSDP2, %d blocks)%s", acc.num_processes, units,
                     ", shards in host memory" if cfg.train.fsdp_cpu_offload else "")
        return Sharded(denoisers)

    def make_plan(self) -> TrainingPlan:
        train = self.config.train
        plan = TrainingPlan.create(
            samples=len(self.data.dataset), batches=len(self.data.batch_sampler),
            processes=self.accelerator.num_processes, gradient_accumulation=train.gradient_accumulation,
            steps=train.steps, epochs=train.epochs, warmup_steps=train.lr_warmup_steps,
            warmup_ratio=train.lr_warmup_ratio,
        )
        if self.accelerator.is_main_process:
            log.info("%s", plan.describe())
        return plan

    def prepare_components(self) -> None:
        """accelerate wraps the model and optimizer; the LR scheduler is not prepared (it steps once per real update
        here, whatever the process count), nor is the dataloader: its order (`RunBatchOrder`) shards the batches as
        accelerate would, in one pass over the run's epochs, and the trainer places each batch itself."""
        acc = self.accelerator
        workers = self.data.num_workers(self.runtime.processes_here)
        if self.config.train.runtime.num_workers is None and acc.is_main_process:
            log.info("data loader: %d worker process(es) per training process (train.num_workers unset: chosen "
                     "for %d cores)", workers, usable_cores())
        self.data.dataloader = self.data.make_dataloader(pin_memory=acc.device.type == "cuda", workers=workers,
                                                         num_processes=acc.num_processes,
                                                         rank=acc.process_index)
        if self.sharding.enabled:  # FSDP2 reduces the gradients itself: the model is not wrapped in DDP
            module = autocast_forward(self.adapter.trainable_module(), acc)
            self.optimizer = acc.prepare(self.optimizer)
        else:
            if len(self.adapter.denoisers()) > 1:
                # experts: an update trains one of them, so the others' LoRA gets no gradient that update
                self.runtime.allow_unused_parameters()
            self.keep_frozen_out_of_ddp(self.adapter.trainable_module())
            module, self.optimizer = acc.prepare(self.adapter.trainable_module(), self.optimizer)
        self.adapter.use_for_training(module)
        if self.text_params and acc.num_processes > 1:
            # DDP broadcasts rank 0's initial weights of the module it wraps; the text encoders' LoRA likewise here
            for param in self.text_params:
                param.data = broadcast(param.data, from_process=0)
        self.trained_module = module
        #: what switches between training and eval mode: the wrapped denoiser and any trained text encoders
        self.trained_modules = [module, *(c.module for c in self.components if c.text_encoder)]

    def optimizer_that_steps(self) -> torch.optim.Optimizer:
        """What takes each step (and clears the gradients after it): accelerate's wrapper where a GradScaler needs it
        (fp16), else the optimizer it wraps. The trainer steps only on updates whose gradients are in sync, where the
        wrapper's step is the optimizer's own plus, at every step, a search of the disk for an optional package and a
        signature check (about 0.1 ms of host time per update, docs/performance.md). The LR scheduler is built on
        the same object, so that it sees each step."""
        return self.optimizer if self.accelerator.scaler is not None else unwrapped(self.optimizer)

    def keep_frozen_out_of_ddp(self, module: torch.nn.Module) -> None:
        """DDP broadcasts every parameter at start and every buffer at each forward. The frozen base is loaded the
        same on every process, so only the LoRA needs it: skipping the rest saves copying the whole model (and
        quantized weights, which DDP does not broadcast correctly, are left alone)."""
        if self.accelerator.num_processes == 1:
            return
        frozen = [name for name, param in module.named_parameters() if not param.requires_grad]
        buffers = [name for name, _ in module.named_buffers()]
        torch.nn.parallel.DistributedDataParallel._set_params_and_buffers_to_ignore_for_model(module, frozen + buffers)

    def open_run_folder(self, resumed: bool) -> None:
        """Remove what `train.overwrite` replaces and write the resolved config (the main process; without a shared
        filesystem each machine's first, in its own run folder); a resumed run sets aside the checkpoints newer than the
        one it continues from."""
        acc = self.accelerator
        acc.wait_for_everyone()
        if self.runtime.writes_resume_files:
            resolved = self.job.config.model_dump(mode="json")
            resolved["config"]["process"] = [self.config.model_dump(mode="json")]
            self.folder.open(self.config.train.overwrite, resolved)
            if resumed:
                self.folder.set_aside_after(self.position.global_step)
        acc.wait_for_everyone()

    # ---- the loop ------------------------------------------------------------------------------------

    def train(self) -> None:
        """Epochs of micro-batches until the plan's last update, or until every process agreed to stop."""
        for module in self.trained_modules:
            module.train()
        start_training(self.optimizer)
        self.nonfinite = self.make_nonfinite_watch()
        if self.ema is not None:
            self.ema.begin(self.position.global_step)
        with GracefulStop() as signal, self.in_phase("training", inject=False):
            # from the start: a Ctrl-C during the step-0 samples stops cleanly too
            if self.validation is not None and self.position.global_step == 0:
                self.monitor.log_evaluation(0, self.position.epoch, self.validate())
            if self.config.sample.sample_at_start and self.position.global_step == 0:
                self.sample(step=0)
            self.monitor.open_progress(self.position.global_step)
            # one pass from the position, as long as updates are left (epochs beyond the plan's where a resume
            # changed the epoch's length or fp16 skipped updates)
            batches = self.data.run_batches(self.accelerator.device, self.position)
            while self.position.global_step < self.plan.total_updates:
                if self.train_epoch(batches, signal):
                    self.monitor.close_progress()
                    return self.stop_with_checkpoint()
        self.monitor.close_progress()

    def make_nonfinite_watch(self) -> NonFiniteWatch:
        cfg = self.config
        facts = RunFacts(lr=cfg.train.lr, optimizer=cfg.train.optimizer, max_grad_norm=cfg.train.max_grad_norm,
                         train_dtype=self.precision.mixed_precision,
                         model_dtype={torch.float16: "fp16", torch.bfloat16: "bf16"}.get(self.precision.base, "fp32"),
                         arch=cfg.model.arch, resumed_at=self.position.global_step)
        return NonFiniteWatch(cfg.train.on_nan, cfg.train.max_skipped_updates, facts, self.position.skipped_updates)

    def batch_files(self, batch: dict) -> list[str]:
        """The files of a micro-batch's samples (host data: nothing waits)."""
        items = self.data.dataset.items
        return [str(items[index].record.path) for index in batch["indices"]]

    def train_epoch(self, batches: Iterator[dict], signal: GracefulStop) -> bool:
        """The micro-batches of one epoch, taken from the run's `batches`; True when the run stops. Nothing here
        reads a value back from the device except a logged update (and the progress bar, at most once a second), so
        the host keeps queueing work."""
        pos = self.position
        window: list[dict[str, torch.Tensor]] = []
        files: list[str] = []
        samples = 0
        for micro_batch, batch in self.data.epoch_batches(batches, pos):
            pos.micro_batch_in_epoch = micro_batch + 1
            samples += len(batch["indices"])
            files += self.batch_files(batch)
            self.bad_data.note(batch, self.data.dataset.latents)
            ends_update = self.plan.ends_update(micro_batch)
            with self.gradient_sync(ends_update):
                loss, parts = self.train_step(batch, pos.epoch, micro_batch)
                self.backward(loss, micro_batch)
            window.append({"loss": loss.detach(), **parts})
            if not ends_update:
                continue
            update = self.optimizer_update(window, files)
            self.monitor.throughput.count(samples, completed=update is not None)
            window, files, samples = [], [], 0
            if update is None:
                continue
            evaluated = self.validate() if self.validation_due(update.step) else None
            # a logged update reads the device anyway: the non-finite watch's flags come in the same transfer
            flags = self.nonfinite.flags() if self.monitor.logs(update.step, evaluated) else None
            read = self.monitor.after_update(update, lambda: self.optimizer_readings(update), evaluated, flags)
            self.nonfinite.read(read if flags is not None else None, self.position.global_step)
            self.scheduled_outputs(update.step)
            if pos.global_step >= self.plan.total_updates:
                return False
            if self.act_on(self.monitor.decide(signal.requested)):
                return True
        pos.epoch += 1
        pos.micro_batch_in_epoch = 0
        return False

    def gradient_sync(self, ends_update: bool):
        """Around a micro-batch's backward: DDP averages the gradients over the processes only at the micro-batch
        that ends an update (`TrainingPlan.ends_update`); the others accumulate locally (`no_sync`). The windows are
        counted here, by the micro-batch's place in its epoch, not by accelerate's accumulation (which counts
        batches since its prepared loader began, and which an environment variable can change)."""
        if ends_update or self.accelerator.num_processes == 1:
            return contextlib.nullcontext()
        if self.sharding.enabled:
            return self.sharding.gradient_sync(False)
        return self.accelerator.no_sync(self.trained_module)

    def train_step(self, batch: dict, epoch: int, micro_batch: int) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
        """The objective's loss of one micro-batch and its named parts."""
        self.last_indices = batch["indices"]
        self.faults.phase("training")
        acc = self.accelerator
        at = StepDraw(epoch, micro_batch * acc.num_processes + acc.process_index, self.position.global_step,
                      min(1.0, self.position.global_step / self.plan.total_updates))
        result = self.objective.loss(batch, self.data.embeds_for(batch, epoch), at)
        if self.monitor.timestep_stats is not None:
            self.monitor.timestep_stats.add(result.u, result.per_sample)
        loss = self.faults.loss(result.loss, epoch * self.plan.micro_batches_per_epoch + micro_batch + 1)
        return loss, result.parts

    def backward(self, loss: torch.Tensor, micro_batch: int) -> None:
        """The micro-batch's gradients: its loss divided by the size of its accumulation window (every window has
        `gradient_accumulation` micro-batches except, possibly, an epoch's last: the update's gradient is the mean
        over its window), scaled for fp16 by accelerate's GradScaler where there is one. Without accumulation or a
        GradScaler the loss's own backward runs, without a node for a division by 1."""
        window = accumulation_window(micro_batch, self.plan.micro_batches_per_epoch, self.plan.gradient_accumulation)
        if window > 1:
            loss = loss / window
        if self.accelerator.scaler is not None:
            self.accelerator.backward(loss)  # accelerate's own accumulation is 1 (RunAccelerator): scaling only
        else:
            loss.backward()

    def optimizer_update(self, window: list[dict[str, torch.Tensor]], files: list[str]) -> UpdateValues | None:
        """Clip, step the optimizer and (once) the LR scheduler. None when the update was dropped: by fp16's
        GradScaler (reading that flag is the one per-update wait for the device that GradScaler needs), or for
        non-finite values with `train.on_nan: skip` (its one wait per update)."""
        acc = self.accelerator
        if self.text_params and acc.num_processes > 1:
            self.average_text_encoder_grads()
        grad_norm = self.clip_gradients()
        names, values = self.update_values(window, grad_norm)
        scaled = acc.scaler is not None  # fp16: an overflowed gradient is the scaler's to skip, not on_nan's
        watched = len(names) - 1 if scaled else len(names)
        if self.nonfinite.skipping:
            bad = self.nonfinite.non_finite(names[:watched], values[:watched])
            if bad:
                self.stepper.zero_grad(set_to_none=True)
                return self.skip_update(bad, files)
        lr, *others = self.lr_scheduler.get_last_lr()
        self.text_encoder_lr = others[0] if others else None
        self.step_figures = optimizer_figures(self.optimizer)  # before the step: Prodigy's d for this update
        self.stepper.step()
        self.stepper.zero_grad(set_to_none=True)
        if acc.optimizer_step_was_skipped:
            # the device was read for that flag: whether the loss itself was finite costs no further wait
            bad = self.nonfinite.non_finite(names[:watched], values[:watched])
            if bad:
                self.nonfinite.watch(self.position.global_step + 1, names[:watched], values[:watched], files)
                self.nonfinite.check(self.position.global_step)
            log.warning("optimizer step skipped (non-finite gradients); the LR schedule does not advance")
            return None
        self.lr_scheduler.step()
        self.position.global_step += 1
        if self.ema is not None:
            self.ema.after_update(self.position.global_step)
        self.nonfinite.watch(self.position.global_step, names[:watched], values[:watched], files)
        return UpdateValues(self.position.global_step, self.position.epoch, lr, names, values)

    def update_values(self, window: list[dict[str, torch.Tensor]], grad_norm) -> tuple[list[str], torch.Tensor]:
        """The update's loss parts (means over its micro-batches and processes) and gradient norm, float32, on the
        device: nothing waits."""
        acc = self.accelerator
        names = list(window[0]) + ["grad_norm"]
        if (acc.num_processes == 1 and len(window) == 1 and isinstance(grad_norm, torch.Tensor)
                and grad_norm.device == window[0]["loss"].device):  # torch gives a CPU 0 where nothing had gradients
            # one micro-batch's values are its means: one stack with the norm, no mean, reduction or join
            return names, as_dtype(torch.stack([*window[0].values(), grad_norm]), torch.float32)
        means = window_means(window)
        if acc.num_processes > 1:
            means = acc.reduce(means, reduction="mean")  # one collective, queued like the rest
        grad_norm = torch.as_tensor(grad_norm, dtype=torch.float32, device=means.device).reshape(1)
        return names, torch.cat([means, grad_norm])

    def skip_update(self, bad: list[str], files: list[str]) -> None:
        """An update dropped for non-finite values (`train.on_nan: skip`): no optimizer or LR step, not counted;
        logged, and counted in metrics.jsonl and the checkpoint (the run stops past train.max_skipped_updates)."""
        step = self.position.global_step + 1
        log.warning("%s", self.nonfinite.skipped_one(step, bad, files))
        self.position.skipped_updates = self.nonfinite.skipped
        self.monitor.log_skipped(step, self.position.epoch, self.nonfinite.skipped)
        return None

    def clip_gradients(self) -> torch.Tensor:
        """The gradients' total norm (a device value), the gradients clipped to `train.max_grad_norm` (0: not
        clipped). fp16 gradients are unscaled first (accelerate's `unscale_gradients`, nothing otherwise); then
        torch's own clipping, which is what accelerate's `clip_grad_norm_` comes to for DDP or one process. Sharded,
        the denoiser's gradients are DTensors on one mesh, which torch's norm takes (its total is the same on every
        process); a trained text encoder's are plain tensors, so their norms are taken apart and joined."""
        self.accelerator.unscale_gradients()
        limit = self.config.train.max_grad_norm or float("inf")
        if not (self.sharding.enabled and self.text_params):
            norm = torch.nn.utils.clip_grad_norm_(self.lora_params, limit)
            return norm.to_local() if isinstance(norm, DTensor) else norm  # sharded: every process has the total
        text = {id(p) for p in self.text_params}
        sharded = [p for p in self.lora_params if id(p) not in text]
        parts = [torch.nn.utils.get_total_norm([p.grad for p in params if p.grad is not None])
                 for params in (sharded, self.text_params)]
        parts = [part.to_local() if isinstance(part, DTensor) else part for part in parts]
        norm = torch.linalg.vector_norm(torch.stack([part.to(parts[0].device) for part in parts]))
        # torch's clipping rule (`clip_grads_with_norm_`), on each process's own part of the sharded gradients
        grads = [p.grad.to_local() if isinstance(p.grad, DTensor) else p.grad for p in self.lora_params
                 if p.grad is not None]
        torch._foreach_mul_(grads, torch.clamp(limit / (norm + 1e-6), max=1.0))
        return norm

    def average_text_encoder_grads(self) -> None:
        """The text encoders are not wrapped in DDP (their LoRA is small, and wrapping would route every prompt
        through a wrapper): their gradients are averaged over the processes here, in one collective per update,
        after the last micro-batch of the accumulation window."""
        grads = [p.grad if p.grad is not None else torch.zeros_like(p) for p in self.text_params]
        flat = self.accelerator.reduce(torch.cat([g.reshape(-1) for g in grads]), reduction="mean")
        offset = 0
        for param, grad in zip(self.text_params, grads):
            param.grad = flat[offset: offset + grad.numel()].view_as(grad)
            offset += grad.numel()

    def optimizer_readings(self, update: UpdateValues) -> dict:
        """The LR the update used (the optimizer's own where it picks it) and its update RMS, for a metrics line."""
        readings = {"lr": logged_lr(self.optimizer, update.scheduled_lr, self.step_figures)}
        if self.text_encoder_lr is not None:
            readings["lr_text_encoder"] = self.text_encoder_lr
        rms = update_rms(self.optimizer)
        if rms is not None:
            readings["update_rms"] = float(rms)
        return readings | self.step_figures | self.bad_data.figures()

    def validation_due(self, step: int) -> bool:
        return self.validation is not None and self.validation.due(step, self.plan.total_updates)

    def validate(self) -> dict[str, float]:
        """The validation figures of the current weights (schedule-free: its averaged weights), on every process
        together; the trained modules in eval mode, the global RNG untouched, not counted as training time."""
        module = self.adapter.trainable_module()  # outside DDP and torch.compile; accelerate's autocast is on it
        with (self.in_phase("validation"), self.monitor.throughput.paused(), evaluation_weights(self.optimizer),
              in_eval_mode(self.trained_modules), torch.random.fork_rng(devices=cuda_devices(self.accelerator.device))):
            return self.validation.evaluate(module, self.accelerator)

    def sample_weights(self):
        """The weights samples render with: the EMA with `sample.use_ema`, else the trained weights (schedule-free:
        its averaged ones)."""
        if self.config.sample.use_ema and self.ema is not None and self.ema.started:
            return self.ema.applied()
        return evaluation_weights(self.optimizer)

    def scheduled_outputs(self, step: int) -> None:
        if self.config.save.save_every and step % self.config.save.save_every == 0:
            self.save_checkpoint()
        if self.config.sample.sample_every and step % self.config.sample.sample_every == 0:
            self.nonfinite.check(self.position.global_step)
            self.sample(step)

    def sample(self, step: int) -> None:
        """The samples of `step`. Running out of memory while rendering skips them with a warning naming the memory
        and what would lower it; training goes on (every process still meets at the end of sampling). Sharded, every
        process renders inside the same forwards, so running out of memory there stops the run like any other."""
        try:
            with self.in_phase("sampling"):
                self.monitor.sample(step)
        except BaseException as error:
            # sharded, every process is inside the same forwards: one that skips would leave the others waiting
            if not is_out_of_memory(error) or self.sharding.enabled:
                raise
            message = self.out_of_memory_message(error).split("\nThe run stopped")[0]
            self.phase = "training"
            flush()
            log.warning("samples of step %d skipped; training goes on. %s", step, message)
            self.accelerator.wait_for_everyone()
            self.monitor.throughput.restart()

    def act_on(self, decision) -> bool:
        """`save` and `sample` act now (the run goes on); returns whether every process stops after this update."""
        step = self.position.global_step
        if decision.save and self.checkpoints.last_saved_step != step:
            log.info("control: saving a checkpoint at step %d", step)
            self.save_checkpoint()
        if decision.sample:
            if self.sampler.enabled:
                log.info("control: rendering samples at step %d", step)
            else:
                log.warning("control: sample asked for, but the config has no sample.prompts")
            self.sample(step)
        self.monitor.acknowledge()
        return decision.stop

    # ---- outputs -------------------------------------------------------------------------------------

    def save_checkpoint(self) -> None:
        """A checkpoint of the current state; never of weights a non-finite update reached (`train.on_nan`)."""
        self.nonfinite.check(self.position.global_step)
        flush()
        with self.in_phase("saving"):
            folder = self.checkpoints.save(self.position)
        if self.accelerator.is_main_process:
            log.info("saved checkpoint %s", folder)
        self.monitor.write_report()
        self.monitor.throughput.restart()  # saving is not training time

    def stop_with_checkpoint(self) -> None:
        step = self.position.global_step
        if self.checkpoints.last_saved_step != step:
            self.save_checkpoint()
        self.monitor.ended("stopped", step)
        raise StopRequested(f"stopped at step {step}; checkpoint saved in {self.folder.checkpoints}. Run the same "
                            "command again to resume.")

    def finish(self) -> None:
        step = self.position.global_step
        self.nonfinite.check(step)  # the final files are never of weights a non-finite update reached
        if self.checkpoints.last_saved_step != step:
            self.save_checkpoint()
        if self.accelerator.is_main_process or self.sharding.enabled:
            self.write_final_loras()
        self.monitor.metrics.close()
        if not (self.config.sample.sample_every and step % self.config.sample.sample_every == 0):
            self.sample(step)
        self.monitor.write_report()
        self.monitor.ended("finished", step)
        self.accelerator.wait_for_everyone()

    def report_already_complete(self) -> None:
        log.info("training is already complete at step %d (train.steps / epochs give %d); raise them to continue",
                 self.position.global_step, self.plan.total_updates)
        first_part, primary = self.components[0].file_part, self.adapter.files.primary
        missing = not self.folder.final_lora_form(primary, primary, first_part).exists()
        if self.ema is not None and self.ema.started:
            missing |= not self.folder.final_lora_form(primary, primary, first_part, ema=True).exists()
        if self.accelerator.num_processes > 1:  # the main machine's view (without a shared filesystem only it has them)
            missing = broadcast_object_list([missing])[0]
        if (self.accelerator.is_main_process or self.sharding.enabled) and missing:
            self.write_final_loras()
        self.monitor.write_report()
        self.monitor.ended("finished", self.position.global_step)

    def lora_metadata(self, step: int) -> dict[str, str]:
        """A checkpoint's LoRA header: the full config (a checkpoint is the run's own memory, not for sharing)."""
        return lora_metadata(self.training_facts(step), level="full")

    @cached_property
    def dataset_facts(self) -> tuple[dict[str, dict[str, int]], int, int]:
        """Tag frequency per dataset folder, training and regularisation images (x repeats): the same for the
        whole run, so counted once rather than at every checkpoint."""
        datasets = self.config.datasets
        records = {(item.dataset, item.record.path): item.record for item in self.data.dataset.items}
        per_dataset = [[r for (index, _), r in records.items() if index == i] for i in range(len(datasets))]
        images = [(len(per_dataset[i]) * d.num_repeats, d.is_reg) for i, d in enumerate(datasets)]
        tags = tag_frequency((Path(d.folder_path).name, [r.caption for r in per_dataset[i]])
                             for i, d in enumerate(datasets))
        return tags, sum(n for n, reg in images if not reg), sum(n for n, reg in images if reg)

    def training_facts(self, step: int) -> TrainingFacts:
        """What the LoRA files' metadata says about this run (toolkit.network.metadata)."""
        cfg, adapter = self.config, self.adapter
        described = adapter.describe()
        tags, train_images, reg_images = self.dataset_facts
        return TrainingFacts(
            name=self.job.name, arch=adapter.arch, base_model=described.get("base_model", cfg.model.name_or_path),
            network_type=cfg.network.type, rank=cfg.network.linear, alpha=cfg.network.linear_alpha,
            conv_rank=cfg.network.conv, conv_alpha=cfg.network.conv_alpha, use_dora=cfg.network.use_dora,
            kohya_base_model=adapter.files.kohya_base_model,
            modelspec_architecture=adapter.files.modelspec_architecture,
            prediction_type=adapter.noise_schedule.prediction_type,
            resolution=max(max(d.resolution) for d in cfg.datasets),
            num_train_images=train_images, num_reg_images=reg_images,
            num_epochs=self.plan.epochs, epoch=min(self.position.epoch + 1, self.plan.epochs) if step else 0,
            steps=step, learning_rate=cfg.train.lr,
            tag_frequency=tags,
            started_at=self.checkpoints.started_at, finished_at=time.time(), trigger_word=cfg.trigger_word,
            config=cfg.model_dump(mode="json"), zero_terminal_snr=cfg.train.zero_terminal_snr,
            text_encoder_lr=cfg.train.text_lr if cfg.network.train_text_encoder else None,
        )

    def final_forms(self) -> list[str]:
        """The primary form first, then the others `save.formats` asks for; a DoRA run also writes the diffusers
        form, the one form every loader of it applies exactly (diffusers itself)."""
        primary, formats = self.adapter.files.primary, list(self.config.save.formats)
        if self.config.network.use_dora and "diffusers" not in formats:
            formats.append("diffusers")
        return [primary, *(f for f in formats if f != primary)]

    def say_which_files(self) -> None:
        """At the start, what the final files will be where a form cannot carry everything everywhere."""
        if self.config.network.use_dora and self.adapter.files.primary == "comfy" and self.accelerator.is_main_process:
            log.warning("DoRA: %s.safetensors (ComfyUI/kohya form, output-axis dora_scale) is applied exactly by "
                        "kohya/LyCORIS, approximately by ComfyUI and Forge, and without its magnitudes by A1111 and "
                        "diffusers; %s.diffusers.safetensors is written too, exact in diffusers", self.job.name,
                        self.job.name)

    def write_final_loras(self) -> None:
        """<name>.safetensors in the family's primary form, and each other form `save.formats` lists beside it as
        <name>.<form>.safetensors, with the metadata `save.metadata` asks for. Sharded, every process gathers the
        weights and the main process writes."""
        metadata = lora_metadata(self.training_facts(self.position.global_step), self.config.save.metadata)
        with self.in_phase("final"):
            # schedule-free: the averaged weights are the trained LoRA
            with evaluation_weights(self.optimizer), self.sharding.gathered():
                self.write_final_forms(metadata, ema=False)
            if self.ema is not None and self.ema.started:
                with self.ema.applied(), self.sharding.gathered():
                    self.write_final_forms(metadata, ema=True)

    def write_final_forms(self, metadata: dict[str, str], ema: bool) -> None:
        """Every form of every file part with the weights now in the trained parameters (`ema`: named as the EMA);
        written by the main process."""
        if not self.accelerator.is_main_process:
            return
        files = self.adapter.files
        parts = dict.fromkeys(c.file_part for c in self.components)  # one file per part, in order
        for part in parts:
            components = [c for c in self.components if c.file_part == part]
            for form in self.final_forms():
                path = self.folder.final_lora_form(form, files.primary, part, ema=ema)
                self.write_lora_form(form, path, metadata, components)
                log.info("saved %s %s (%s form)", "EMA LoRA" if ema else "LoRA", path, form)

    def write_lora_form(self, form: str, path: Path, metadata: dict[str, str], components) -> None:
        dtype, hashes = DTYPES[self.config.save.dtype], self.config.save.metadata != "minimal"
        if form == "diffusers":
            write_components_file(path, components, dtype, metadata, hashes)
        elif form == "peft":  # the denoiser only (the config refuses peft folders with a trained text encoder)
            write_peft_folder(path, components[0].module, dtype)
        else:
            write_comfy_file(path, components, dtype, metadata, hashes)


def window_means(window: list[dict[str, torch.Tensor]]) -> torch.Tensor:
    """Each named part's mean over the micro-batches of an update, float32, in the order of the first's names
    (every micro-batch of an update has the same parts, on every process). A window of one micro-batch is its
    values as they are (the mean of one value is that value): one stack instead of a stack and a mean per part."""
    names = list(window[0])
    if len(window) == 1:
        return torch.stack([window[0][name] for name in names]).float()
    return torch.stack([torch.stack([parts[name] for parts in window]).float().mean() for name in names])


def refuse_extra_references(cfg, rules) -> None:
    """More reference folders, or sample references, than the loaded model takes per sample (Qwen-Image-Edit's first
    version: one), named by key; the config checked the family's most already."""
    if rules is None:
        return
    sources = [(f"datasets[{i}].control_path", d.reference_folders) for i, d in enumerate(cfg.datasets)]
    if cfg.validation is not None:
        sources.append(("validation.control_path", cfg.validation.reference_folders))
    sources += [(f"sample.prompts[{i}].references", files) for i, files in enumerate(cfg.sample.references)]
    for key, given in sources:
        if len(given) > rules.slots:
            raise UserError(f"{key}: this model takes {rules.slots} reference image(s) per sample, not {len(given)}")
