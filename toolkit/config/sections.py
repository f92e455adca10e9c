"""The sections of a job's process config (network, save, datasets, train and its groups, sample, logging):
the leaves of the schema, which lower layers (network, data, train) take as their types. Free of torch and of
the model registry; toolkit.config.schema assembles them with the family's `model` section."""

from __future__ import annotations

import os
from typing import Any, Literal

from pydantic import Field, field_validator, model_validator

from toolkit.config.base import DType, Problem, Section, aka
from toolkit.diffusion.timestep_params import TimestepParams
from toolkit.train.optimizer_params import optimizer_param_problems, uses_relative_step


def expanded_path(value: str) -> str:
    """A path with `~` and `$VARS` expanded, read once in the config so that the pre-run check and the loader read
    the same place."""
    return os.path.expandvars(os.path.expanduser(value.strip()))


class NetworkConfig(Section):
    """The trained adapter (peft's LoRA, LoKr or LoHa)."""

    type: Literal["lora", "lokr", "loha"] = Field(
        "lora", description="Adapter type: lora, lokr (Kronecker product) or loha (Hadamard product), as peft "
        "builds them.", json_schema_extra=aka("network_type", "network_module"))
    linear: int = Field(16, ge=1, description="Rank of linear layers (and of any target_modules).",
                        json_schema_extra=aka("rank", "network_dim", "r"))
    linear_alpha: float = Field(16.0, gt=0, description="Alpha of linear layers; the update is scaled by "
                                "alpha / rank.", json_schema_extra=aka("alpha", "network_alpha", "lora_alpha"))
    conv: int | None = Field(None, ge=1, description="Rank of the convolution layers the family adapts (SD's "
                             "resnet and resampling convs, LoCon style); unset: no conv layers.",
                             json_schema_extra=aka("conv_dim", "conv_rank"))
    conv_alpha: float | None = Field(None, gt=0, description="Alpha of the conv layers; default `conv`.")
    use_dora: bool = Field(False, description="lora only: weight-decomposed LoRA (DoRA, peft's use_dora). The magnitude is "
                           "saved as peft's `lora_magnitude_vector` (diffusers form) and as kohya/LyCORIS's output-axis "
                           "`dora_scale` (ComfyUI form; docs/networks.md says which tools apply it exactly).")
    dropout: float = Field(0.0, ge=0, lt=1, description="lora: dropout on the LoRA input (peft's lora_dropout).",
                           json_schema_extra=aka("lora_dropout"))
    target_modules: list[str] | None = Field(
        None, description="Module names (or name endings) to adapt; default: the family's attention projections."
    )
    only_if_contains: list[str] | None = Field(
        None, description="Adapt only modules whose full name contains one of these strings (e.g. `up_blocks`).")
    ignore_if_contains: list[str] | None = Field(
        None, description="Never adapt modules whose full name contains one of these strings.")
    rank_dropout: float = Field(0.0, ge=0, lt=1, description="Training only: zero each rank channel of each "
                                "sample with this probability (the rest rescaled to keep the mean).")
    module_dropout: float = Field(0.0, ge=0, lt=1, description="Training only: skip a whole adapter module for a "
                                  "forward pass with this probability.")
    train_text_encoder: bool = Field(
        False, description="Families with CLIP text encoders (sd15, sdxl): also train a LoRA on the text encoders "
        "(every linear layer of attention and MLP, at `linear` / `linear_alpha`), at `train.text_encoder_lr`. "
        "Captions are then encoded live every step (no `train.cache_text_embeddings`).",
        json_schema_extra=aka("train_text_encoder"))
    pretrained_lora_path: str | None = Field(
        None, description="Start from this adapter file (difftune/diffusers or ComfyUI/kohya keys, of the same "
        "type and ranks); its alphas are honoured, so the model starts with exactly the file's weight deltas.",
        json_schema_extra=aka("network_weights", "resume_lora"))

    def problems(self) -> list[Problem]:
        problems = []
        if self.use_dora and self.type != "lora":
            problems.append("`use_dora` applies to type lora only")
        if self.dropout and self.type != "lora":
            problems.append("`dropout` (lora_dropout) applies to type lora; lokr and loha take rank_dropout and "
                            "module_dropout")
        if self.conv_alpha is not None and self.conv is None:
            problems.append("`conv_alpha` needs `conv` (the conv rank)")
        return [("", problem) for problem in problems]


class SaveConfig(Section):
    """What is written, and when."""

    dtype: DType = Field("float16", description="Dtype of the saved LoRA weights.",
                         json_schema_extra=aka("save_precision"))
    save_every: int = Field(250, ge=0, description="Save a checkpoint every N steps (optimizer updates); "
                            "0 saves only at the end.", json_schema_extra=aka("save_every_n_steps"))
    formats: list[Literal["diffusers", "comfy", "peft"]] = Field(
        [], description="Extra forms of the final LoRA. <name>.safetensors is always written, in the form the most "
        "tools load for the family (ComfyUI/kohya keys with alphas for sd15 and zimage: ComfyUI, A1111/Forge, kohya "
        "and diffusers' load_lora_weights read it; diffusers keys for wuerstchen). Each other form listed here is "
        "written beside it as <name>.<form>.safetensors: `diffusers` (diffusers/peft keys, peft config in the "
        "header), `comfy` (ComfyUI/kohya keys); `peft` writes the folder <name>_peft/ (adapter_config.json, "
        "adapter_model.safetensors) that peft's `PeftModel.from_pretrained` loads onto the trained module.")
    metadata: Literal["private", "full", "minimal"] = Field(
        "private", description="What the final LoRA files' headers say. `private`: kohya's `ss_*` keys and hashes, "
        "the model spec and the job config with every local path reduced to its last component (hub ids stay; no "
        "home folder). `full`: the same with the config verbatim, for private use. `minimal`: only what loading "
        "needs. Checkpoints always keep the full config.")
    max_step_saves_to_keep: int = Field(4, ge=1, description="Complete step checkpoints kept; older ones are "
                                        "pruned after a newer one is complete.",
                                        json_schema_extra=aka("checkpoints_total_limit"))


def reference_folders(control_path: str | list[str] | None) -> list[str]:
    """A `control_path` as a list of folders, one per reference slot (none without it)."""
    if control_path is None:
        return []
    return [control_path] if isinstance(control_path, str) else list(control_path)


class DatasetConfig(Section):
    """One folder of images with sidecar captions."""

    folder_path: str = Field(..., description="Folder of images (png, jpg, jpeg, webp).",
                             json_schema_extra=aka("path", "image_dir", "train_data_dir", "instance_data_dir"))
    caption_ext: str = Field("txt", description="Extension of the caption file next to each image.",
                             json_schema_extra=aka("caption_extension"))
    default_caption: str = Field("", description="Caption for images without a caption file.")
    resolution: list[int] = Field(
        [512],
        description="Training sizes. Each value is a target pixel area (value x value); every image is "
        "trained at each size not larger than itself (always at least the smallest), in the aspect-ratio "
        "bucket closest to its own.",
    )
    num_repeats: int = Field(1, ge=1, description="How often each image appears per epoch.",
                             json_schema_extra=aka("repeats", "num_repeat"))
    is_reg: bool = Field(False, description="Regularisation images: the trigger word is not added.")
    shuffle_tokens: bool = Field(False, description="Shuffle the comma-separated caption segments every epoch, "
                                 "keeping the first `keep_tokens` in place; a segment holding the trigger word "
                                 "keeps its place too. With cached text embeddings each segment's cached token "
                                 "embeddings move as a whole, in the order uncached captions get (docs/models.md, "
                                 "Caption views).",
                                 json_schema_extra=aka("shuffle_caption"))
    keep_tokens: int = Field(1, ge=0, description="Leading caption segments that shuffling and token dropout "
                             "leave alone, cached text embeddings or not.")
    caption_dropout_rate: float = Field(0.0, ge=0, le=1, description="Probability that a sample's caption is "
                                        "replaced by the blank prompt.",
                                        json_schema_extra=aka("caption_dropout", "caption_dropout_probability"))
    token_dropout_rate: float = Field(0.0, ge=0, le=1, description="Probability that each caption segment "
                                      "after the kept ones is dropped (never the trigger word's). With cached "
                                      "text embeddings the segment's cached token embeddings are left out.")
    cache_latents: bool = Field(False, description="Encode every image once before training and keep the "
                                "latents in memory (every process encodes all of them).")
    cache_latents_to_disk: bool = Field(False, description="Encode every image once and keep the latents in "
                                        "the cache folder, reused by later runs; processes share the work.")
    cache_dir: str | None = Field(None, description="Cache folder; default `<folder_path>/_difftune_cache`. "
                                  "Safe to delete.")
    num_frames: int = Field(1, ge=1, description="Video families: frames per training clip (the family says which "
                            "counts are valid, e.g. 4k + 1 for wan). Clips (mp4, webm, mov, gif, animated webp) "
                            "give this many frames from their start; an image is a one-frame clip.",
                            json_schema_extra=aka("frames", "target_frames"))
    fps: float | None = Field(None, gt=0, description="Video families: read clips at this frame rate (frames "
                              "skipped or repeated to match); default each clip's own rate.",
                              json_schema_extra=aka("frame_rate", "target_fps"))
    short_clips: Literal["refuse", "loop"] = Field(
        "refuse", description="A clip with fewer than `num_frames` frames (at `fps`): `refuse` stops with its name, "
        "`loop` reads it round again from its start.")
    flip_x: bool = Field(False, description="Mirror each sample left-right with probability 1/2 (after its crop), "
                         "drawn per (seed, epoch, sample): the same on any process count and after a resume. A latent "
                         "cache keeps one entry per variant it has seen: a new one is encoded when first drawn (the "
                         "image encoder stays on the device).", json_schema_extra=aka("flip_aug", "random_flip"))
    flip_y: bool = Field(False, description="Mirror each sample top-bottom with probability 1/2, drawn like `flip_x`.")
    random_crop: bool = Field(False, description="Crop each sample from its resized image at a place drawn per (seed, "
                              "epoch, sample) instead of the centre (an image whose aspect matches its bucket has "
                              "one place only; SDXL is told the place). Cached like `flip_x`.")
    mask_path: str | None = Field(None, description="Folder of grayscale masks named like the images (any image "
                                  "extension): white trains, black is left out. Each mask follows its image's resize, "
                                  "crop and flips, is area-resized to the latent grid and weights the per-element "
                                  "loss; a sample's loss is the mean over the area it trains. It travels with the "
                                  "latent cache. A sample without a mask trains everywhere (one warning names them). "
                                  "8-bit, 16-bit, 32-bit and float masks are read by their own range; a colour mask "
                                  "as its luminance. Not the image folder itself (its masks would be samples).",
                                  json_schema_extra=aka("mask_folder"))
    mask_min_value: float = Field(0.0, ge=0, le=1, description="Mask values are raised to at least this (0-1): the "
                                  "masked-out areas keep this much weight.")
    control_path: str | list[str] | None = Field(
        None, description="Image-editing families (flux_kontext, qwen_image_edit): the folder of reference images, "
        "or a list of folders (one per reference slot, in order), each image named like its target (any image "
        "extension). The caption is the instruction. Pairs are checked before the model loads: every target without "
        "its reference is named. A reference is sized by the family's rule, and cropped and mirrored with its target "
        "(`flip_x`, `flip_y`, `random_crop`); its latent is cached with the target's.",
        json_schema_extra=aka("control_dir", "control_directory", "reference_path"))
    control_optional: bool = Field(False, description="Targets without a reference train without one (as plain "
                                   "text-to-image samples), where the family can; otherwise they are refused by name.")

    @field_validator("resolution", mode="before")
    @classmethod
    def _one_resolution_is_a_list(cls, value: Any) -> Any:
        return [value] if isinstance(value, int) else value

    @field_validator("resolution")
    @classmethod
    def _positive_sorted(cls, value: list[int]) -> list[int]:
        if not value or any(v < 8 for v in value):
            raise ValueError("give one or more sizes of at least 8 pixels")
        return sorted(set(value))

    @field_validator("caption_ext")
    @classmethod
    def _no_dot(cls, value: str) -> str:
        return value.lstrip(".")

    @field_validator("folder_path", "cache_dir", "mask_path")
    @classmethod
    def _expanded(cls, value: str | None) -> str | None:
        """`~` and `$VARS` expanded once here, so the pre-run check and the loader read the same folder."""
        return None if value is None else os.path.expandvars(os.path.expanduser(value.strip()))

    @field_validator("control_path")
    @classmethod
    def _reference_folders(cls, value: str | list[str] | None) -> str | list[str] | None:
        if isinstance(value, list):
            if not value:
                raise ValueError("give one folder, or a list of one or more folders")
            return [expanded_path(v) for v in value]
        return None if value is None else expanded_path(value)

    @property
    def reference_folders(self) -> list[str]:
        return reference_folders(self.control_path)

    def problems(self) -> list[Problem]:
        """The mask and reference folders are other folders: in the image folder, they would be read as samples
        too."""
        problems = []
        if self.mask_path is not None and os.path.realpath(self.mask_path) == os.path.realpath(self.folder_path):
            problems.append(("mask_path", f"the image folder itself ({self.folder_path}): its masks would be trained "
                             "on as images; put the masks in a folder of their own (named like the images) and give "
                             "that folder"))
        for folder in self.reference_folders:
            if os.path.realpath(folder) == os.path.realpath(self.folder_path):
                problems.append(("control_path", f"the image folder itself ({self.folder_path}): its references "
                                 "would be trained on as targets, each paired with itself; put the references in a "
                                 "folder of their own (named like the targets)"))
        if self.control_optional and self.control_path is None:
            problems.append(("control_optional", "there is no control_path whose references could be missing; "
                             "remove it"))
        return problems


class LRSchedulerParams(Section):
    """Parameters of the LR schedules that take them."""

    num_cycles: int = Field(1, ge=1, description="cosine_with_restarts: number of hard restarts.")
    power: float = Field(1.0, gt=0, description="polynomial: power of the decay.")
    lr_end: float = Field(0.0, ge=0, description="polynomial: final LR.")


class TimestepParamsConfig(Section):
    """Parameters of the timestep samplers (see docs/timesteps.md)."""

    mean: float | None = Field(None, description="sigmoid (and shift with shift_base: sigmoid): mean in logit space "
                               "(default 0); gaussian: mean in u-space (default 0.5).")
    std: float = Field(1.0, gt=0, description="sigmoid (and shift with shift_base: sigmoid): std in logit space.")
    shift: float = Field(3.0, gt=0, description="shift: the time shift s in u -> s u / (1 + (s - 1) u).")
    dynamic_shift: bool = Field(False, description="shift: take s from the image size and the scheduler's "
                                "base/max shift (flow-matching families).")
    shift_base: Literal["uniform", "sigmoid"] = Field(
        "uniform", description="shift: the draws the shift moves: uniform, or sigmoid (the logit-normal of the "
        "sigmoid sampler, with mean and std), as kohya's shift and flux_shift draw them.")
    gaussian_std: float = Field(0.2, gt=0, description="gaussian: std in u-space.")
    gaussian_std_start: float | None = Field(None, gt=0, description="gaussian curriculum: std at the start.")
    gaussian_std_end: float | None = Field(None, gt=0, description="gaussian curriculum: std at the end.")
    cycle: list[float] = Field([], description="fixed_cycle: u values visited in order, one per update.")

    def problems(self) -> list[Problem]:
        try:
            TimestepParams(**self.model_dump())  # raises naming every bad key
        except ValueError as err:
            return [("", str(err))]
        return []


class OptimizerSection(Section):
    """The optimizer (what `build_optimizer` takes)."""

    optimizer: Literal["adamw", "adamw8bit", "lion8bit", "adafactor", "prodigy", "schedulefree_adamw"] = Field(
        "adamw", description="Optimizer (docs/optimizers.md).", json_schema_extra=aka("optimizer_type"))
    lr: float = Field(1e-4, ge=0, description="Peak learning rate (unset or 0 with relative-step Adafactor, "
                      "which picks its own; with prodigy a multiplier of the step size it estimates, default 1.0).",
                      json_schema_extra=aka("learning_rate", "unet_lr"))
    text_encoder_lr: float | None = Field(
        None, ge=0, description="Peak learning rate of the text-encoder LoRA (`network.train_text_encoder`); "
        "default `lr`. The schedule scales it by the same factor as `lr` at every update (with `polynomial`, its end "
        "value is lr_end x text_encoder_lr / lr).", json_schema_extra=aka("text_encoder_lr", "te_lr"))
    optimizer_params: dict[str, Any] = Field(
        {}, description="Extra keyword arguments of the optimizer (e.g. weight_decay, betas).",
        json_schema_extra=aka("optimizer_args"),
    )
    max_grad_norm: float = Field(1.0, ge=0, description="Clip the gradient norm to this; 0 disables clipping.",
                                 json_schema_extra=aka("clip_grad_norm"))

    @model_validator(mode="before")
    @classmethod
    def _prodigy_lr_default(cls, data: Any) -> Any:
        """Prodigy's `lr` multiplies the step size it estimates: unset, it is 1.0 (not an Adam-style LR)."""
        if isinstance(data, dict) and data.get("optimizer") == "prodigy" and "lr" not in data:
            return {**data, "lr": 1.0}
        return data

    @property
    def text_lr(self) -> float:
        """The text encoders' peak LR: `text_encoder_lr`, else `lr`."""
        return self.lr if self.text_encoder_lr is None else self.text_encoder_lr


class LRScheduleSection(Section):
    """The LR schedule over optimizer updates (what `build_lr_scheduler` takes)."""

    lr_scheduler: Literal[
        "constant", "constant_with_warmup", "linear", "cosine", "cosine_with_restarts", "polynomial"
    ] = Field("constant", description="LR schedule over the optimizer updates.")
    lr_scheduler_params: LRSchedulerParams = Field(LRSchedulerParams(), description="See below.")
    lr_warmup_steps: int = Field(0, ge=0, description="Warmup updates (linear from 0 to `lr`).",
                                 json_schema_extra=aka("warmup_steps"))
    lr_warmup_ratio: float | None = Field(None, ge=0, lt=1, description="Warmup as a fraction of the total "
                                          "updates; not together with `lr_warmup_steps`.")


class ObjectiveSection(Section):
    """Timesteps and loss: what the training objective takes."""

    timestep_type: Literal["uniform", "sigmoid", "lognorm_blend", "shift", "weighted", "gaussian", "fixed_cycle"] = Field(
        "uniform", description="How noise levels are drawn (docs/timesteps.md).", json_schema_extra=aka("timestep_sampling"))
    timestep_params: TimestepParamsConfig = Field(TimestepParamsConfig(), description="See below.")
    content_or_style: Literal["balanced", "content", "style"] = Field(
        "balanced", description="Bias toward high noise (content, composition) or low noise (style, texture).")
    timestep_range: list[float] = Field([0.0, 1.0], min_length=2, max_length=2,
                                        description="[min, max] of u (0 = clean, 1 = pure noise) trained on.")
    loss_type: Literal["mse", "mae", "pseudo_huber"] = Field("mse", description="Per-sample loss.")
    huber_c: float = Field(0.1, gt=0, description="pseudo_huber: the transition point c.")
    min_snr_gamma: float | None = Field(None, gt=0, description="Min-SNR-gamma loss weighting (e.g. 5); off when "
                                        "unset.", json_schema_extra=aka("snr_gamma"))
    noise_offset: float = Field(0.0, ge=0, description="Add this times per-channel constant noise.")
    blank_prompt_preservation: bool = Field(False, description="Also keep the LoRA's prediction for the blank "
                                            "prompt equal to the base model's (loss `loss_bpp`).")
    blank_prompt_preservation_multiplier: float = Field(1.0, gt=0, description="Weight of the blank-prompt term.")
    blank_prompt_probability: float = Field(1.0, ge=0, le=1, description="Fraction of updates that compute the "
                                            "blank-prompt term (it costs a second forward pass).")
    differential_guidance_scale: float | None = Field(
        None, gt=0, description="Train toward pred + s (target - pred): s > 1 pushes further toward the target.")
    guidance_scale: float | None = Field(
        None, ge=0, description="Guidance-distilled families (flux [dev]): the value the guidance embedding gets "
        "during training; default 1.0 (a model without one, e.g. [schnell], ignores it).",
        json_schema_extra=aka("guidance"))
    bypass_guidance_embedding: bool | None = Field(
        None, description="Guidance-distilled families (flux): train without the guidance embedding, the "
        "conditioning being the timestep and pooled-text embeddings alone (ai-toolkit's bypass_guidance_embedding); "
        "samples still feed it sample.guidance_scale. Default: on for a Flex.1 base (a FLUX.1 layout with fewer "
        "than half as many double-stream as single-stream blocks), off for FLUX.1 [dev].")
    zero_terminal_snr: bool = Field(False, description="DDPM families (sd15, sdxl): rescale the betas so the last "
                                    "timestep is pure noise (zero terminal SNR), in training and in samples (trailing "
                                    "timesteps); what v-prediction fine-tunes are trained with.")


class RuntimeSection(Section):
    """How the loop runs: precision, memory, compilation, data workers."""

    dtype: Literal["auto", "fp32", "bf16", "fp16", "float32", "bfloat16", "float16"] = Field(
        "auto", description="Autocast precision of the denoiser's forward, in training, the validation loss and samples "
        "alike; the LoRA, its gradients and optimizer state stay float32. fp16 scales the loss with a GradScaler (on the "
        "CPU too). `auto`: none (fp32) on the CPU; on CUDA `model.dtype`'s half precision where it names one, else bf16.",
        json_schema_extra=aka("mixed_precision"),
    )
    gradient_checkpointing: bool = Field(False, description="Trade compute for memory in the trained model.")
    compile: bool = Field(False, description="torch.compile the trained model (through accelerate, after the DDP "
                          "wrap): the first updates (and each new bucket shape) wait for the compiler, later ones "
                          "run faster where the backend helps. Measured figures: docs/performance.md.")
    compile_backend: Literal["inductor", "aot_eager", "eager", "cudagraphs"] = Field(
        "inductor", description="torch.compile backend for `compile`: inductor generates fused kernels; aot_eager "
        "and eager only trace (quick checks that the model compiles at all)."
    )
    num_workers: int | None = Field(
        None, ge=0, description="DataLoader worker processes per training process. Unset: chosen from the CPU cores "
        "this process may use, shared by the training processes on the machine: none below 4 cores per process, else "
        "half of them, at most 4; none when every latent is cached in memory. On small machines workers cost more "
        "than they give (docs/performance.md).",
        json_schema_extra=aka("max_data_loader_n_workers", "dataloader_num_workers"))
    decoded_images_gib: float = Field(
        1.0, ge=0, description="Decoded images (resized to their bucket) each training process keeps in memory, at "
        "most this many GiB per process: each is then read and decoded once per run instead of every epoch; crops and "
        "flips are still drawn every time. The first images that fit are kept; loader workers (`num_workers`) keep "
        "none, they decode ahead of the loop instead. 0: decode every time. Samples with cached latents read their "
        "image only for a variant the cache has no entry for yet.")
    on_nan: Literal["stop", "skip"] = Field(
        "stop", description="A non-finite loss or gradient: `stop` ends the run, writing nothing over the last "
        "checkpoint, and names the update, its files and the likely cause (read at logged updates and saves: no "
        "extra wait for the device); `skip` drops the update (no optimizer or LR step, not counted toward "
        "train.steps; one wait for the device per update) and counts it in metrics.jsonl. fp16's own overflow "
        "skips are neither.")
    max_skipped_updates: int = Field(10, ge=1, description="on_nan: skip: the run stops after this many skipped "
                                     "updates in total (resumes included).")
    sharding: Literal["none", "fsdp"] = Field(
        "none", description="How several processes hold the denoiser. `none`: each holds all of it and the trained "
        "weights are averaged (DDP). `fsdp`: the denoiser and its trained weights are split over the processes block "
        "by block (torch's FSDP2), each process reading only its part from the weight files, so a base larger than "
        "one GPU trains without quantizing it; every process takes part in each forward, samples included. One "
        "process: no difference. Not with model.quantize (see docs/multi-gpu.md).")
    fsdp_cpu_offload: bool = Field(False, description="sharding: fsdp: keep each process's shards in host memory, "
                                   "brought to the GPU block by block as they compute (the largest bases; slower).")
    shared_filesystem: bool = Field(
        True, description="Several machines (`accelerate launch --num_machines N ...`): whether they see the run "
        "folder and the caches on one shared filesystem. true: one copy of every file, written by the main process of "
        "the main machine; each cache entry encoded by one process of the run. false: each machine keeps in its own run "
        "folder what a resume needs (checkpoints, caches), written by its first process; status, metrics, report, "
        "samples and the final LoRA files are written on the main machine only; a rerun resumes from the newest "
        "checkpoint complete on every machine.")
    collective_timeout_s: int = Field(
        600, ge=10, description="How long a process waits for the others at a collective before the run stops with "
        "an error: what bounds a hang when a machine vanishes without closing its connections (power or network "
        "loss). A killed process or machine closes them: the others stop within seconds.")
    persistent_workers: bool = Field(True, description="Keep the DataLoader workers for a further pass of the "
                                     "loader. A run's loader makes one pass over all of its epochs, so its workers "
                                     "live from the first epoch to the last either way; kept for configs from other "
                                     "tools.",
                                     json_schema_extra=aka("persistent_data_loader_workers"))


class EMAConfig(Section):
    """An exponential moving average of the trained weights (`train.ema`)."""

    decay: float = Field(0.999, gt=0, lt=1, description="Each EMA update keeps this share of the average: "
                         "ema = decay x ema + (1 - decay) x weights.", json_schema_extra=aka("ema_decay"))
    update_every: int = Field(1, ge=1, description="Update the average every N optimizer updates.",
                              json_schema_extra=aka("ema_update_interval"))
    start_step: int = Field(0, ge=0, description="The average starts as a copy of the weights after this update "
                            "and follows them from then on.")


class TrainConfig(OptimizerSection, LRScheduleSection, ObjectiveSection, RuntimeSection):
    """The optimisation loop. A `step` is one optimizer update everywhere. The keys stand side by side in the job
    file; each consumer takes its own group (`optimization`, `lr_schedule`, `objective`, `runtime`)."""

    batch_size: int = Field(1, ge=1, description="Images per micro-batch per process.",
                            json_schema_extra=aka("train_batch_size"))
    steps: int | None = Field(None, ge=1, description="Total optimizer updates. Wins over `epochs` when both "
                              "are given.", json_schema_extra=aka("max_train_steps", "max_steps"))
    epochs: int | None = Field(None, ge=1, description="Passes over the dataset, used when `steps` is unset.",
                               json_schema_extra=aka("num_train_epochs", "max_train_epochs"))
    gradient_accumulation: int = Field(1, ge=1, description="Micro-batches per optimizer update.",
                                       json_schema_extra=aka("gradient_accumulation_steps"))
    seed: int = Field(42, description="Seed of data order, noise and timesteps.")
    cache_text_embeddings: bool = Field(False, description="Encode every distinct caption once before training "
                                        "(cached in the datasets' cache folders), then move the text encoder "
                                        "off the accelerator.", json_schema_extra=aka("cache_text_encoder_outputs"))
    resume: bool | str = Field(
        "auto",
        description="`auto`: continue from the newest complete checkpoint of this run, if any. A path: continue "
        "from that checkpoint folder. `false`: start fresh (refused where a run already saved work, unless "
        "`overwrite`).",
        json_schema_extra=aka("resume_from_checkpoint"),
    )
    overwrite: bool = Field(False, description="Start over in a run folder that already holds a finished "
                            "LoRA or checkpoints (they are removed). Implies no resume.")
    ema: EMAConfig | None = Field(None, description="Keep an exponential moving average of the trained weights, "
                                  "written as <name>.ema.safetensors (and its other forms) beside the LoRA and kept "
                                  "in checkpoints; off when unset.")


    @property
    def optimization(self) -> OptimizerSection:
        return self.section(OptimizerSection)

    @property
    def lr_schedule(self) -> LRScheduleSection:
        return self.section(LRScheduleSection)

    @property
    def objective(self) -> ObjectiveSection:
        return self.section(ObjectiveSection)

    @property
    def runtime(self) -> RuntimeSection:
        return self.section(RuntimeSection)

    def _relative_step_problems(self) -> list[str]:
        if not uses_relative_step(self.optimizer, self.optimizer_params):
            return [] if self.lr > 0 else ["`lr` must be above 0 (only relative-step Adafactor picks its own)"]
        why = "adafactor with relative_step picks its own LR (bounded by optimizer_params min_lr/max_lr)"
        problems = []
        if "lr" in self.model_fields_set and self.lr != 0:
            problems.append(f"{why}, so a manual `lr` is ambiguous: remove `lr` (or set 0), or set "
                            "optimizer_params.relative_step: false to use `lr` and the LR schedule")
        if self.lr_scheduler not in ("constant", "constant_with_warmup") or self.lr_warmup_steps or self.lr_warmup_ratio:
            problems.append(f"{why}; an LR schedule or warmup would not apply: use lr_scheduler: constant, no "
                            "warmup, or set optimizer_params.relative_step: false")
        if self.text_encoder_lr is not None:
            problems.append(f"{why}, for the text encoders too, so `text_encoder_lr` would not apply: remove it, or "
                            "set optimizer_params.relative_step: false")
        return problems

    def _learning_rate_free_problems(self) -> list[str]:
        """Prodigy and schedule-free take the LR settings in their own way (docs/optimizers.md)."""
        problems = []
        if self.optimizer == "prodigy":
            if self.lr < 0.1:
                problems.append(f"prodigy: `lr` multiplies the step size Prodigy estimates itself (usually 1.0); "
                                f"{self.lr} looks like an Adam learning rate and would barely train. Remove `lr` or "
                                "set it near 1.0")
            if self.text_encoder_lr not in (None, 0, self.lr):
                problems.append("prodigy: one step size for all parameters; `text_encoder_lr` may only equal `lr` "
                                "(or be 0 to hold the text encoders still)")
        if self.optimizer == "schedulefree_adamw":
            if self.lr_scheduler not in ("constant", "constant_with_warmup"):
                problems.append(f"schedulefree_adamw replaces the LR schedule (it averages the weights instead of "
                                f"decaying the LR): use lr_scheduler constant or constant_with_warmup, not "
                                f"{self.lr_scheduler}")
            if "warmup_steps" in self.optimizer_params and (self.lr_warmup_steps or self.lr_warmup_ratio):
                problems.append("schedulefree_adamw: give the warmup once, as `lr_warmup_steps` (or "
                                "optimizer_params.warmup_steps), not both")
        return problems

    @field_validator("resume")
    @classmethod
    def _auto_or_path(cls, value: bool | str) -> bool | str:
        return "auto" if value is True else value

    def problems(self) -> list[Problem]:
        problems = []
        if self.steps is None and self.epochs is None:
            problems.append("give `steps` (optimizer updates) or `epochs`")
        if self.lr_warmup_steps and self.lr_warmup_ratio is not None:
            problems.append("give `lr_warmup_steps` or `lr_warmup_ratio`, not both")
        if self.steps is not None and self.lr_warmup_steps >= self.steps:
            problems.append(f"`lr_warmup_steps` ({self.lr_warmup_steps}) must be shorter than `steps` ({self.steps})")
        if self.lr_scheduler == "polynomial" and self.lr_scheduler_params.lr_end >= self.lr:
            problems.append(f"`lr_scheduler_params.lr_end` ({self.lr_scheduler_params.lr_end}) must be below `lr` "
                            f"({self.lr})")
        problems += optimizer_param_problems(self.optimizer, self.optimizer_params)
        problems += self._relative_step_problems()
        problems += self._learning_rate_free_problems()
        if self.ema is not None and self.steps is not None and self.ema.start_step >= self.steps:
            problems.append(f"`ema.start_step` ({self.ema.start_step}) is not before the last update ({self.steps}): "
                            "the EMA would never start; lower it")
        low, high = self.timestep_range
        if not 0 <= low < high <= 1:
            problems.append(f"`timestep_range` must be [min, max] with 0 <= min < max <= 1, got {self.timestep_range}")
        if self.timestep_type == "fixed_cycle" and not self.timestep_params.cycle:
            problems.append("`timestep_type: fixed_cycle` needs `timestep_params.cycle`, e.g. [0.9, 0.5, 0.1]")
        return [("", problem) for problem in problems]


class ValidationConfig(Section):
    """A validation loss: held-out samples at fixed noise and timesteps, so the value changes only when the
    weights do."""

    folder_path: str | None = Field(None, description="A folder of held-out images (and captions), read with "
                                    "datasets[0]'s settings (resolution, caption extension, default caption; the "
                                    "trigger word applied).", json_schema_extra=aka("validation_data_dir"))
    split: float | None = Field(None, gt=0, lt=1, description="Instead of a folder: this fraction of the training "
                                "datasets' images (at least one), chosen by `train.seed` and left out of training.",
                                json_schema_extra=aka("validation_split"))
    every: int = Field(100, ge=1, description="Evaluate every N optimizer updates (and before the first and after "
                       "the last).", json_schema_extra=aka("validation_steps", "eval_every"))
    batch_size: int = Field(4, ge=1, description="Samples per evaluation batch per process.")
    control_path: str | list[str] | None = Field(
        None, description="With `folder_path`, for image-editing families: the held-out targets' reference folder(s), "
        "as `datasets[].control_path` (a split's samples keep their dataset's references).")
    timesteps: int = Field(6, ge=1, le=64, description="Noise levels per sample: u = (k + 0.5) / N for k < N, the "
                           "same for every sample and evaluation; logged as `val_loss` and per third of the range "
                           "(`val_loss_low`, `val_loss_mid`, `val_loss_high`: u below 1/3, to 2/3, above).")

    def problems(self) -> list[Problem]:
        if (self.folder_path is None) == (self.split is None):
            return [("", "give `folder_path` (a held-out folder) or `split` (a fraction of the training data), "
                     "one of them")]
        if self.control_path is not None and self.folder_path is None:
            return [("control_path", "a split's samples keep their dataset's references; remove it, or give "
                     "`folder_path`")]
        return []

    @field_validator("control_path")
    @classmethod
    def _reference_folders(cls, value: str | list[str] | None) -> str | list[str] | None:
        return DatasetConfig._reference_folders(value)

    @property
    def reference_folders(self) -> list[str]:
        return reference_folders(self.control_path)

    @field_validator("folder_path")
    @classmethod
    def _expanded(cls, value: str | None) -> str | None:
        return None if value is None else os.path.expandvars(os.path.expanduser(value.strip()))


class SamplePrompt(Section):
    """A sample prompt with its reference images (image-editing families)."""

    prompt: str = Field(..., description="The prompt (the edit instruction); `[trigger]` is replaced by the trigger "
                        "word.", json_schema_extra=aka("text"))
    references: list[str] = Field(..., min_length=1, description="Reference image files, in slot order (as many as "
                                  "the family takes per sample).", json_schema_extra=aka("ctrl_img"))

    @field_validator("references")
    @classmethod
    def _expanded(cls, value: list[str]) -> list[str]:
        return [expanded_path(v) for v in value]


class SampleConfig(Section):
    """Sample images rendered during training."""

    sample_every: int = Field(0, ge=0, description="Render samples every N steps; 0 = only at the end "
                              "(when prompts are given).", json_schema_extra=aka("sample_every_n_steps"))
    prompts: list[str | SamplePrompt] = Field(
        [], description="Prompts; `[trigger]` is replaced by the trigger word. Image-editing families: an entry may be "
        "`{prompt: ..., references: [image files]}`, rendered from those reference images (shown beside the output "
        "in the report and dashboard).", json_schema_extra=aka("sample_prompts"))
    neg: str = Field("", description="Negative prompt (families with classifier-free guidance; refused for flux).", json_schema_extra=aka("negative_prompt"))
    seed: int = Field(42, description="Seed of the first prompt.")
    walk_seed: bool = Field(True, description="Prompt i uses seed + i (otherwise every prompt uses `seed`).")
    guidance_scale: float | None = Field(None, ge=0, description="Guidance scale; default per family: sd15 7, "
                                         "sdxl 5, wuerstchen 4 (the prior), zimage 0 (off, for Turbo; the base "
                                         "model wants about 4), flux 3.5 into [dev]'s guidance embedding (0 for "
                                         "[schnell]), qwen_image 4 (true CFG with `neg`; 1 turns it off).",
                                  json_schema_extra=aka("cfg_scale", "cfg"))
    sample_steps: int | None = Field(None, ge=1, description="Denoising steps per sample; default per family: 20 "
                                     "(flux [schnell] 4).",
                              json_schema_extra=aka("num_inference_steps", "steps"))
    width: int = Field(512, ge=8, description="Sample width in pixels (a multiple of the model's divisor).")
    height: int = Field(512, ge=8, description="Sample height in pixels (a multiple of the model's divisor).")
    sample_at_start: bool = Field(False, description="Also render a baseline before the first update.")
    num_frames: int | None = Field(None, ge=1, description="Video families: frames per sample video (the family's "
                                   "valid counts, e.g. 4k + 1 for wan); default per family: wan 81.",
                                   json_schema_extra=aka("frames"))
    fps: float | None = Field(None, gt=0, description="Video families: frame rate the sample videos are written at; "
                              "default per family: wan 16 (Wan 2.2 TI2V-5B 24).")
    use_ema: bool = Field(False, description="Render samples with the EMA weights (`train.ema`) instead of the "
                          "live ones; training is not disturbed.")
    guidance_rescale: float | None = Field(None, ge=0, le=1, description="Rescale the guided prediction toward the "
                                           "conditional one's spread (0.7 is usual with v-prediction and zero "
                                           "terminal SNR); families whose pipeline takes it (sd15, sdxl).",
                                           json_schema_extra=aka("cfg_rescale"))

    @property
    def texts(self) -> list[str]:
        """Each prompt's text."""
        return [p if isinstance(p, str) else p.prompt for p in self.prompts]

    @property
    def references(self) -> list[list[str]]:
        """Each prompt's reference image files (none for a plain prompt)."""
        return [[] if isinstance(p, str) else list(p.references) for p in self.prompts]


class LoggingConfig(Section):
    """What is logged."""

    log_every: int = Field(1, ge=1, description="Write a metrics.jsonl line every N steps (and always for the last). "
                           "Only logged updates read values back from the GPU, so N > 1 also lets the host run "
                           "further ahead of it.")
    debug_timesteps: bool = Field(False, description="Add a 10-bin histogram of the sampled u and the mean loss "
                                  "per bin to each metrics line (main process's draws).")
    tensorboard: bool = Field(False, description="Also log the metrics to TensorBoard (<run>/tensorboard/), through "
                              "accelerate's tracker; needs `pip install tensorboard` (the `tensorboard` extra).")
    debug_memory: bool = Field(False, description="Log accelerator memory (allocated, reserved, peak) and process "
                               "RSS around model load, quantization, encoder unloads, LoRA load and sampling.")
