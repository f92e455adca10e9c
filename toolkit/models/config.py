"""The `model` keys every family shares, option groups several families declare, and the class-level facts a
family states about itself. Free of torch, so config checks read them before any library loads."""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar, Literal

from pydantic import Field

from toolkit.config.base import QType, Section, aka


@dataclass(frozen=True)
class ReferenceFacts:
    """How a family takes reference images (image-editing models: the source image of an edit, or several): paired
    with each target by base name (`datasets[].control_path`), encoded by the family's VAE and given to the denoiser
    beside the noisy target."""

    #: the most references one sample takes (one folder each in `datasets[].control_path`)
    slots: int = 1
    #: the family trains without a reference too (`datasets[].control_optional`: a sample without one trains as a
    #: plain text-to-image sample)
    optional: bool = True
    #: how a reference is sized: `target` (resized to cover the target's bucket and cropped with it, as FLUX.1
    #: Kontext trains) or `budget` (a pixel area, `area`, at its own aspect ratio, sides rounded to `multiple`, as the
    #: Qwen-Image-Edit pipelines size them)
    size: Literal["target", "budget"] = "target"
    #: the multiple a `budget` reference's sides are rounded to
    multiple: int = 16
    #: a `budget` reference's pixel area: None for its target's bucket's area
    area: int | None = None
    #: the text encoder reads the references with the prompt (Qwen-Image-Edit): a prompt's embedding depends on its
    #: sample's references, so text caches are keyed by them too
    in_text: bool = False


@dataclass(frozen=True)
class FamilyFacts:
    """What a family can do, known before any weight loads (config-time checks read these)."""

    #: one line for `model.arch` docs and messages
    title: str
    #: the family has convolution layers `network.conv` can adapt (LoCon)
    conv_layers: bool = False
    #: the `model` key of an extra model without which sample images cannot be rendered (None: none needed)
    sampling_needs: str | None = None
    #: a DDPM noise schedule: `model.prediction_type` and `train.zero_terminal_snr` apply
    ddpm_noise: bool = False
    #: the family's pipeline takes `guidance_rescale` (`sample.guidance_rescale`)
    guidance_rescale: bool = False
    #: LoRA on the text encoders too (`network.train_text_encoder`)
    text_encoder_lora: bool = False
    #: the denoiser is conditioned on each image's original size, crop and target size (`image_sizes`)
    size_conditioning: bool = False
    #: a guidance-distilled denoiser with a guidance embedding (`train.guidance_scale`)
    guidance_embedding: bool = False
    #: samples use a negative prompt (`sample.neg`); guidance-distilled samplers without classifier-free guidance
    #: have none
    negative_prompt: bool = True
    #: components that may be written to files of their own, <name>_<part>.safetensors (Wan 2.2 A14B's experts)
    file_parts: tuple[str, ...] = ()
    #: a video family: training clips and samples have `frame_step` x k + 1 frames (the VAE's temporal
    #: compression; Wan: 4, so 1, 5, 9, ... 81); 0 for image-only families (clips and `num_frames` refused)
    frame_step: int = 0
    #: an image-editing family: samples are conditioned on reference images too (`datasets[].control_path`); None
    #: for the rest (the key is refused)
    references: ReferenceFacts | None = None

    @property
    def video(self) -> bool:
        return self.frame_step > 0

    def frame_count_problem(self, frames: int) -> str | None:
        """Why `frames` is not a frame count this family takes, or None when it is."""
        if not self.video:
            return None if frames == 1 else f"{self.title} trains on images only (1 frame)"
        if (frames - 1) % self.frame_step:
            below = (frames - 1) // self.frame_step * self.frame_step + 1
            return (f"{self.title} takes {self.frame_step}k + 1 frames (e.g. {below} or "
                    f"{below + self.frame_step}), not {frames}")
        return None


class ModelConfigBase(Section):
    """The base model to fine-tune: keys every family takes."""

    arch: str = Field(..., description="Model family (see the sections per family below).",
                      json_schema_extra=aka("model_type", "base_model"))
    name_or_path: str = Field(
        ...,
        description="A diffusers folder, a hub id, a single-file .safetensors checkpoint, or `tiny` for a "
        "small random model built offline (tests, quickstart).",
        json_schema_extra=aka("path", "pretrained_model_name_or_path", "model_path"),
    )
    dtype: Literal["auto", "float32", "float16", "bfloat16", "fp32", "fp16", "bf16"] = Field(
        "auto", description="Dtype of the frozen base weights. `auto`: float32 on the CPU; on CUDA `train.dtype`'s half "
        "precision where it names one (fp16 with fp16), else bfloat16. Two different half precisions for this and "
        "`train.dtype` are refused (docs/architecture.md, Precision)."
    )
    variant: str | None = Field(None, description="Weight file variant of a diffusers folder, e.g. `fp16`.")
    revision: str | None = Field(None, description="Hub revision (branch, tag or commit) to load.")
    low_vram: bool = Field(False, description="Keep every module the current phase does not use on the CPU: the "
                           "encoders visit the accelerator only to build the caches (or stay for live encoding), "
                           "and sample-only models only while sampling.")

    #: the family's facts (set by each family's config class)
    facts: ClassVar[FamilyFacts] = FamilyFacts(title="")


class QuantizedBaseOptions(Section):
    """Quantizing the frozen base with optimum-quanto, and an assistant LoRA merged into it: the same keys for
    every family that offers them."""

    quantize: bool = Field(False, description="Quantize the frozen denoiser with optimum-quanto (block by block; "
                           "embedders and final layers stay in full precision).")
    qtype: QType = Field("qfloat8", description="Weight type of `quantize`.")
    quantize_te: bool = Field(False, description="Quantize the text encoder likewise.")
    qtype_te: QType = Field("qfloat8", description="Weight type of `quantize_te`.")
    assistant_lora_path: str | None = Field(
        None, description="A LoRA merged into the training denoiser only (e.g. a Turbo training adapter); never "
        "into a separate sampling model or the saved LoRA.")


class TextFilesOptions(Section):
    """The base's text encoders as single files (ComfyUI's `models/text_encoders`), beside a single-file denoiser in
    `name_or_path`: which variant each file is, is read from its tensor names and shapes, and its configs ship with
    difftune, so nothing is downloaded. Without them, a single-file denoiser takes its other parts from
    `single_file_config`."""

    text_encoder_path: str | list[str] | None = Field(
        None, description="The text encoder file, or a list of files for a family with several (in any order: each "
        "is told apart by its contents), e.g. ComfyUI's clip_l.safetensors and t5xxl_fp16.safetensors. fp8 and "
        "scaled-fp8 files are used as stored.", json_schema_extra=aka("text_encoder", "clip_path", "te_path"))
    tokenizer: str | None = Field(
        None, description="Where the tokenizers come from (no weight file holds them): a ComfyUI installation "
        "(its source tree's tokenizer folders), a diffusers pipeline folder or hub id (its tokenizer subfolders), "
        "or, for a family with one tokenizer, a tokenizer folder. Default: the ComfyUI installation the model files "
        "lie in, else `single_file_config`. docs/models.md says which tokenizer each family needs.")


class PartFilesOptions(TextFilesOptions):
    """The base's text encoders and VAE as single files (ComfyUI's `models/text_encoders`, `models/vae`)."""

    vae_name_or_path: str | None = Field(
        None, description="The VAE: a single file (e.g. ComfyUI's ae.safetensors), a diffusers VAE folder, or a "
        "hub id. Default: the base's.", json_schema_extra=aka("vae", "vae_path"))


class DDPMOptions(Section):
    """The target of a DDPM family (epsilon or v-prediction fine-tunes of the same architecture)."""

    prediction_type: Literal["epsilon", "v_prediction"] | None = Field(
        None, description="What the denoiser predicts: `epsilon` (noise) or `v_prediction` (velocity, e.g. "
        "v-prediction fine-tunes; pair with `train.zero_terminal_snr`). Default: the scheduler config's. Samples use "
        "the same.", json_schema_extra=aka("v_parameterization", "v_pred"))


class SamplingModelConfig(Section):
    """A denoiser used only to render sample images."""

    name_or_path: str = Field(..., description="A diffusers folder or hub id (e.g. Tongyi-MAI/Z-Image-Turbo), or a "
                              "single-file transformer .safetensors.")
    subfolder: str | None = Field("transformer", description="Subfolder of the transformer in a diffusers folder.")
    quantize: bool = Field(False, description="Quantize it with optimum-quanto.")
    qtype: QType = Field("qfloat8", description="Weight type of `quantize`.")


def is_single_file(source: str | None) -> bool:
    """A single-file checkpoint (rather than a diffusers folder or hub id), as the config and the loader read it."""
    return source is not None and source.strip().lower().endswith(SINGLE_FILE_SUFFIXES)


#: the endings of a single-file part (safetensors, GGUF, pickled checkpoints)
SINGLE_FILE_SUFFIXES = (".safetensors", ".sft", ".gguf", ".ckpt", ".pt", ".pth")
