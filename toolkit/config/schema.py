"""Typed job configuration.

Every key has a type, a default and a description; unknown keys are errors (``extra="forbid"``).
Defaults live here and nowhere else. ``aka`` lists names other trainers use for the same key, so
that an error for a foreign name can suggest ours. `model` is chosen by `arch`: each family's keys are its
own config class (toolkit/models/<family>/config.py), so a key another family has is an error here too.
This module and what it imports load no torch: a job file is checked before any library loads.
"""

from __future__ import annotations

import re
from typing import Annotated, Any, Literal, Union

from pydantic import Field, field_validator

from toolkit.config.base import HALF_PRECISIONS, DType, Problem, QType, Section, aka
from toolkit.config.sections import (
    DatasetConfig,
    EMAConfig,
    LoggingConfig,
    LRSchedulerParams,
    LRScheduleSection,
    NetworkConfig,
    ObjectiveSection,
    OptimizerSection,
    RuntimeSection,
    SampleConfig,
    SaveConfig,
    TimestepParamsConfig,
    TrainConfig,
    ValidationConfig,
)
from toolkit.models.config import ModelConfigBase, is_single_file
from toolkit.models.registry import config_classes, family_facts

__all__ = ["DType", "QType", "Section", "aka", "ModelConfig", "ModelConfigBase", "SDTrainerConfig", "JobBody", "JobConfig",
           "NetworkConfig", "SaveConfig", "DatasetConfig", "LRSchedulerParams", "TimestepParamsConfig", "OptimizerSection", "LRScheduleSection", "ObjectiveSection", "RuntimeSection", "TrainConfig", "EMAConfig", "SampleConfig",
           "ValidationConfig", "LoggingConfig"]

#: `model`: the config class of the family `arch` names (a pydantic discriminated union)
ModelConfig = Annotated[Union[tuple(config_classes())], Field(discriminator="arch")]


DEVICE_PATTERN = re.compile(r"^(auto|cpu|cuda|cuda:\d+)$")


#: optimizers that cannot step sharded parameters (DTensors), and why (torch 2.14, bitsandbytes 0.50)
SHARDABLE_OPTIMIZERS_NOT = {
    "adamw8bit": "bitsandbytes' kernels take no sharded tensors",
    "lion8bit": "bitsandbytes' kernels take no sharded tensors",
    "adafactor": "its factored statistics mix sharded and plain tensors",
    "prodigy": "it flattens parameters, which fails on shapes the processes do not split evenly",
}


class SDTrainerConfig(Section):
    """Process `sd_trainer`: LoRA training of a diffusion model."""

    type: Literal["sd_trainer"] = Field("sd_trainer", description="Process type.")
    training_folder: str = Field("output", description="Runs are written to <training_folder>/<name>/.",
                                 json_schema_extra=aka("output_dir", "output_folder"))
    device: str = Field("auto", description="cpu | cuda | cuda:N | auto. Under `accelerate launch` each "
                        "process takes its own GPU; `cpu` forces the CPU.")
    trigger_word: str | None = Field(None, description="Added to every caption of non-regularisation "
                                     "datasets (or replaces `[trigger]`).")
    model: ModelConfig = Field(..., description="See below.")
    network: NetworkConfig = Field(NetworkConfig(), description="See below.")
    datasets: list[DatasetConfig] = Field(..., min_length=1, description="One or more image folders.")
    train: TrainConfig = Field(..., description="See below.")
    save: SaveConfig = Field(SaveConfig(), description="See below.")
    sample: SampleConfig = Field(SampleConfig(), description="See below.")
    validation: ValidationConfig | None = Field(None, description="A validation loss on held-out samples; off when "
                                                "unset. See below.")
    logging: LoggingConfig = Field(LoggingConfig(), description="See below.")

    def problems(self) -> list[Problem]:
        """Checks against the family's facts and across sections, before any weight loads."""
        return (self._family_problems() + self._text_encoder_lora_problems() + self._precision_problems()
                + self._sharding_problems())

    def _family_problems(self) -> list[Problem]:
        """What the family can do: keys it has no use for, or that need another of its keys."""
        facts, arch = family_facts(self.model.arch), self.model.arch
        problems = []
        if self.network.conv is not None and not facts.conv_layers:
            problems.append(("network.conv", f"the {arch} family ({facts.title}) has no conv layers to adapt; remove "
                             "network.conv"))
        if self.sample.prompts and facts.sampling_needs and getattr(self.model, facts.sampling_needs) is None:
            problems.append(("sample.prompts", f"{arch} renders sample images through another model: set "
                             f"model.{facts.sampling_needs}, or remove sample.prompts"))
        if self.train.zero_terminal_snr and not facts.ddpm_noise:
            problems.append(("train.zero_terminal_snr", f"the {arch} family ({facts.title}) has no DDPM noise "
                             "schedule to rescale; remove it"))
        if self.network.train_text_encoder and not facts.text_encoder_lora:
            problems.append(("network.train_text_encoder", f"the {arch} family ({facts.title}) trains no "
                             "text-encoder LoRA; remove it"))
        if self.train.guidance_scale is not None and not facts.guidance_embedding:
            problems.append(("train.guidance_scale", f"the {arch} family ({facts.title}) has no guidance embedding "
                             "to train with; remove it"))
        if self.train.bypass_guidance_embedding is not None and not facts.guidance_embedding:
            problems.append(("train.bypass_guidance_embedding", f"the {arch} family ({facts.title}) has no guidance "
                             "embedding to bypass; remove it"))
        elif self.train.bypass_guidance_embedding and self.train.guidance_scale is not None:
            problems.append(("train.guidance_scale", "train.bypass_guidance_embedding leaves the guidance embedding "
                             "out of training, so this value would not be used; remove one of them"))
        if self.sample.neg and not facts.negative_prompt:
            problems.append(("sample.neg", f"{facts.title} samples without classifier-free guidance, so a negative "
                             "prompt would not apply; remove it"))
        if self.sample.guidance_rescale is not None and not facts.guidance_rescale:
            problems.append(("sample.guidance_rescale", f"the {arch} sampling pipeline has no guidance rescale; "
                             "remove it"))
        problems += self._frame_problems(facts, arch) + self._reference_problems(facts, arch)
        if self.sample.use_ema and self.train.ema is None:
            problems.append(("sample.use_ema", "there is no EMA to render with; set train.ema (e.g. {decay: 0.999}) "
                             "or remove sample.use_ema"))
        return problems

    def _reference_problems(self, facts, arch: str) -> list[Problem]:
        """Reference folders only for image-editing families, at most as many as a sample takes; held-out pairs
        with their references."""
        rules = facts.references
        sources = [(f"datasets[{index}]", dataset) for index, dataset in enumerate(self.datasets)]
        if self.validation is not None:
            sources.append(("validation", self.validation))
        problems = []
        for at, source in sources:
            folders = source.reference_folders
            if folders and rules is None:
                problems.append((f"{at}.control_path", f"the {arch} family ({facts.title}) takes no reference "
                                 "images; remove it (image-editing families: flux_kontext, qwen_image_edit)"))
            elif rules is not None and len(folders) > rules.slots:
                problems.append((f"{at}.control_path", f"{facts.title} takes at most {rules.slots} reference "
                                 f"image(s) per sample, not {len(folders)} folders"))
            if getattr(source, "control_optional", False) and rules is not None and not rules.optional:
                problems.append((f"{at}.control_optional", f"{facts.title} cannot train without a reference image; "
                                 "remove it, and give every target its reference"))
        for index, references in enumerate(self.sample.references):
            if references and rules is None:
                problems.append((f"sample.prompts[{index}].references", f"{facts.title} samples take no reference "
                                 "images; give the prompt as a plain string"))
            elif rules is not None and len(references) > rules.slots:
                problems.append((f"sample.prompts[{index}].references", f"{facts.title} takes at most {rules.slots} "
                                 f"reference image(s) per sample, not {len(references)}"))
        if rules is not None and rules.in_text:
            problems += self._text_reference_problems(facts)
        validation = self.validation
        paired = [d for d in self.datasets if d.control_path is not None and not d.control_optional]
        if (rules is not None and validation is not None and validation.folder_path is not None
                and validation.control_path is None and paired):
            problems.append(("validation.control_path", "the training targets have references, so the held-out ones "
                             "need theirs: give the held-out references' folder(s)"))
        return problems

    def _text_reference_problems(self, facts) -> list[Problem]:
        """Where the text encoder reads each sample's references with its caption, a caption's embedding is one per
        (caption, references as the sample shows them): what a cache of them or one blank prompt cannot hold."""
        problems = []
        if self.train.blank_prompt_preservation:
            problems.append(("train.blank_prompt_preservation", f"{facts.title} reads each sample's reference images "
                             "with its prompt, so there is no one blank-prompt embedding to preserve; remove it"))
        if not self.train.cache_text_embeddings:
            return problems
        for index, dataset in enumerate(self.datasets):
            if dataset.control_path is None:
                continue
            for key in ("random_crop", "shuffle_tokens"):
                if getattr(dataset, key):
                    problems.append((f"datasets[{index}].{key}", f"with train.cache_text_embeddings, {facts.title}'s "
                                     "text embeddings are cached per caption and reference image as trained; "
                                     + ("a random crop changes the reference each draw" if key == "random_crop" else
                                        "cached views cannot move the caption's segments, which follow the "
                                        "references' vision tokens") + ": turn one of them off"))
            if dataset.token_dropout_rate:
                problems.append((f"datasets[{index}].token_dropout_rate", f"with train.cache_text_embeddings, "
                                 f"{facts.title}'s cached views cannot drop the caption's segments, which follow the "
                                 "references' vision tokens: turn one of them off"))
        return problems

    def _frame_problems(self, facts, arch: str) -> list[Problem]:
        """Frame counts and rates only where the family trains on clips, and only counts it takes."""
        problems = []
        for index, dataset in enumerate(self.datasets):
            problem = facts.frame_count_problem(dataset.num_frames)
            if problem:
                problems.append((f"datasets[{index}].num_frames", problem))
            if dataset.fps is not None and not facts.video:
                problems.append((f"datasets[{index}].fps", f"the {arch} family ({facts.title}) trains on images "
                                 "only; remove it"))
        if self.sample.num_frames is not None:
            problem = facts.frame_count_problem(self.sample.num_frames)
            if problem:
                problems.append(("sample.num_frames", problem))
        if self.sample.fps is not None and not facts.video:
            problems.append(("sample.fps", f"the {arch} family ({facts.title}) renders images; remove it"))
        return problems

    def _precision_problems(self) -> list[Problem]:
        """Two different half precisions for the base and the autocast cannot run: the base's norm layers (GroupNorm,
        LayerNorm) do not take activations of the other half dtype, on the CPU or CUDA (toolkit/precision.py)."""
        base, compute = (HALF_PRECISIONS.get(self.model.dtype), HALF_PRECISIONS.get(self.train.dtype))
        if base and compute and base != compute:
            return [("model.dtype", f"{self.model.dtype} cannot go with train.dtype: {self.train.dtype}: the base's norm "
                     "layers cannot take activations of the other half precision; use the same for both, or "
                     "model.dtype: fp32")]
        return []

    def _sharding_problems(self) -> list[Problem]:
        """What `train.sharding: fsdp` cannot go with, each named with the other key (toolkit/run/sharding.py)."""
        train, model, network = self.train, self.model, self.network
        if train.sharding != "fsdp":
            if train.fsdp_cpu_offload:
                return [("train.fsdp_cpu_offload", "applies only with train.sharding: fsdp")]
            return []
        problems = []
        why = "cannot go with train.sharding: fsdp"
        if getattr(model, "quantize", False):
            problems.append(("model.quantize", f"{why}: quanto's packed weights are not parameters FSDP can shard; "
                             "train the quantized base with DDP (train.sharding: none), or shard it unquantized"))
        if is_single_file(model.name_or_path):
            problems.append(("model.name_or_path", f"a single model file {why} yet: each process reads its part of "
                             "each weight from a diffusers folder (a model folder with transformer/ or unet/)"))
        if getattr(model, "assistant_lora_path", None):
            problems.append(("model.assistant_lora_path", f"{why}: the assistant LoRA is merged into full weights "
                             "before training, and no process holds them"))
        if getattr(model, "sampling", None) is not None:
            problems.append(("model.sampling", f"{why}: the separate sampling model would hold the trained LoRA "
                             "outside the sharded model"))
        if network.use_dora:
            problems.append(("network.use_dora", f"{why}: DoRA's magnitudes start from the full base weights"))
        if train.compile:
            problems.append(("train.compile", f"{why} yet"))
        if train.optimizer in SHARDABLE_OPTIMIZERS_NOT:
            problems.append(("train.optimizer", f"{train.optimizer} {why}: {SHARDABLE_OPTIMIZERS_NOT[train.optimizer]}; "
                             "use adamw or schedulefree_adamw"))
        for key, value in (("model.dtype", model.dtype), ("train.dtype", train.dtype)):
            if HALF_PRECISIONS.get(value) == "fp16":
                problems.append((key, f"fp16 {why}: its loss scaling skips an update where a gradient overflowed, "
                                 "and each process sees only its part of the gradients; use bf16"))
        return problems

    def _text_encoder_lora_problems(self) -> list[Problem]:
        """A trained text encoder encodes every caption live; combinations that cannot are named here."""
        network, train = self.network, self.train
        if not network.train_text_encoder:
            if train.text_encoder_lr is not None:
                return [("train.text_encoder_lr", "applies only with network.train_text_encoder: true")]
            return []
        problems = []
        if train.cache_text_embeddings:
            problems.append(("network.train_text_encoder", "cannot go with train.cache_text_embeddings: a trained text encoder "
                             "changes every caption's embedding at each step, so they cannot be cached; turn one off"))
        if train.blank_prompt_preservation:
            problems.append(("network.train_text_encoder", "cannot go with train.blank_prompt_preservation: the "
                             "preservation term compares with the base model's blank-prompt prediction through a frozen text "
                             "encoder; turn one off"))
        if "peft" in self.save.formats:
            problems.append(("network.train_text_encoder", "cannot go with save.formats: [peft]: a peft folder holds one model; "
                             "use the comfy or diffusers form, which hold the UNet and the text encoders"))
        return problems

    @field_validator("device")
    @classmethod
    def _known_device(cls, value: str) -> str:
        if not DEVICE_PATTERN.match(value):
            raise ValueError(f"'{value}' is not one of cpu | cuda | cuda:N | auto")
        return value


class JobBody(Section):
    """The `config:` block of a job file."""

    name: str = Field(..., min_length=1, description="Run name: the folder <training_folder>/<name>/ and the "
                      "LoRA file name.")
    process: list[Any] = Field(..., min_length=1, description="Processes run in order; each has a `type`.")

    @field_validator("name")
    @classmethod
    def _usable_as_file_name(cls, value: str) -> str:
        if "/" in value or "\\" in value or value in {".", ".."}:
            raise ValueError(f"'{value}' must be usable as a folder name (no path separators)")
        return value


class JobConfig(Section):
    """A whole job file."""

    job: Literal["extension", "train"] = Field("extension", description="Job kind; both run the processes.")
    config: JobBody = Field(..., description="Name and processes.")
    meta: dict[str, Any] = Field({}, description="Free-form metadata, copied into outputs.")
