"""Qwen-Image-Edit (the first version) and Qwen-Image-Edit-Plus (2509, 2511): the Qwen-Image transformer, VAE and
Qwen2.5-VL text encoder, conditioned on reference images twice.

Conventions, as QwenImageEditPipeline and QwenImageEditPlusPipeline apply them:
- the text encoder reads the instruction with the references in its prompt (the editing template; the Plus models
  name each reference "Picture i: " before its vision tokens, the first version puts one reference's vision tokens
  before the instruction), its last hidden state with the template's first 64 tokens dropped: so the embedding
  changes with the reference images. The images it reads are resized to 384 x 384 pixels at their own aspect ratio
  (Plus), or to 1024 x 1024 (the first version), sides multiples of 32;
- each reference is encoded by the VAE at the mode and normalised as the target's latents (in the VAE's dtype),
  packed 2 x 2 into tokens after the target's, with its own entry in `img_shapes` (the rotary positions); 2511's
  transformer (`zero_cond_t`) modulates the reference tokens as at timestep 0 from those shapes itself;
- the transformer's output is cut to the target's tokens: the loss never sees the references';
- which model a folder holds is read from its files: the pipeline class in model_index.json (first version or Plus)
  and `zero_cond_t` in the transformer's config (2511); a single file needs `model.version`.
Everything else is Qwen-Image's (toolkit/models/qwen_image): latents, noise schedule, LoRA targets and files.
"""

from __future__ import annotations

import dataclasses
import json
import math
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from diffusers import (
    FlowMatchEulerDiscreteScheduler,
    QwenImageEditPipeline,
    QwenImageEditPlusPipeline,
    QwenImagePipeline,
    QwenImageTransformer2DModel,
)
from diffusers.image_processor import VaeImageProcessor
from PIL import Image
from transformers import AutoProcessor

from toolkit.device import to_device
from toolkit.errors import UserError
from toolkit.models.base import PromptEmbeds
from toolkit.models.common import encoder_identity, first_weight, is_single_file
from toolkit.models.config import ReferenceFacts
from toolkit.models.qwen_image.adapter import QwenImageAdapter, QwenImageSampling, QwenImageText
from toolkit.models.qwen_image_edit.config import FACTS, QwenImageEditModelConfig
from toolkit.models.qwen_image_edit.tiny import (
    ensure_tiny_qwen_image_edit,
    ensure_tiny_qwen_image_edit_2509,
    ensure_tiny_qwen_image_edit_2511,
)
from toolkit.paths import normalize_path

#: the editing pipelines' prompt template (`prompt_template_encode` of the Plus pipeline; the first version's has
#: one image's vision tokens before the instruction) and the number of its leading tokens dropped
PROMPT_TEMPLATE = ("<|im_start|>system\nDescribe the key features of the input image (color, shape, size, texture, "
                   "objects, background), then explain how the user's text instruction should alter or modify the "
                   "image. Generate a new image that meets the user's requirements while maintaining consistency with "
                   "the original input where appropriate.<|im_end|>\n<|im_start|>user\n{}<|im_end|>\n"
                   "<|im_start|>assistant\n")
TEMPLATE_DROP = 64
#: one image's tokens in a prompt (the processor expands the pad token to the image's patch count)
IMAGE_TOKENS = "<|vision_start|><|image_pad|><|vision_end|>"
#: the Plus pipeline's name for reference i (from 1) in the prompt
PLUS_IMAGE_PROMPT = "Picture {}: " + IMAGE_TOKENS
#: the pixel area the text encoder reads a reference at: the Plus pipeline's `CONDITION_IMAGE_SIZE`; the first
#: version reads it at the size it encodes it (`calculate_dimensions(1024 * 1024, ...)`)
PLUS_CONDITION_AREA = 384 * 384
FIRST_CONDITION_AREA = 1024 * 1024
#: where a single file's other parts come from, by version
DEFAULT_COMPONENTS = {"edit": "Qwen/Qwen-Image-Edit", "2509": "Qwen/Qwen-Image-Edit-2509",
                      "2511": "Qwen/Qwen-Image-Edit-2511"}
TINY_SOURCES = {"tiny": ensure_tiny_qwen_image_edit, "tiny-2509": ensure_tiny_qwen_image_edit_2509,
                "tiny-2511": ensure_tiny_qwen_image_edit_2511}


def calculate_dimensions(area: int, aspect: float) -> tuple[int, int]:
    """The pipelines' `calculate_dimensions`: about `area` pixels at `aspect` (width / height), sides rounded to 32."""
    width = math.sqrt(area * aspect)
    height = width / aspect
    return round(width / 32) * 32, round(height / 32) * 32


@dataclass(frozen=True)
class EditVersion:
    """Which Qwen-Image-Edit: `edit` (the first, one reference), `2509` or `2511` (Plus, up to three)."""

    name: str

    @property
    def plus(self) -> bool:
        return self.name != "edit"

    @property
    def slots(self) -> int:
        return 3 if self.plus else 1

    @property
    def pipeline_class(self) -> type:
        return QwenImageEditPlusPipeline if self.plus else QwenImageEditPipeline

    def prompt(self, caption: str, references: int) -> str:
        """The templated prompt for an instruction and its reference count, as the pipeline writes it."""
        if self.plus:
            return PROMPT_TEMPLATE.format("".join(PLUS_IMAGE_PROMPT.format(i + 1) for i in range(references)) + caption)
        return PROMPT_TEMPLATE.format(IMAGE_TOKENS + caption)

    def condition_size(self, width: int, height: int) -> tuple[int, int]:
        """(width, height) the text encoder reads a reference of this size at."""
        return calculate_dimensions(PLUS_CONDITION_AREA if self.plus else FIRST_CONDITION_AREA, width / height)


def read_version(components: str, said: str | None, single: bool, revision: str | None = None) -> EditVersion:
    """The version a diffusers folder holds (its pipeline class; 2511's transformer has `zero_cond_t`), checked
    against `model.version` where both say; a single file's is `model.version`. A hub id is read from its files (at
    `revision`)."""
    if single:
        return EditVersion(said)
    pipeline = json.loads(Path(components, "model_index.json").read_text()) if Path(components).is_dir() else \
        QwenImageEditPipeline.load_config(components, revision=revision)
    transformer = QwenImageTransformer2DModel.load_config(components, subfolder="transformer", revision=revision)
    plus = pipeline.get("_class_name") == QwenImageEditPlusPipeline.__name__
    if not plus and pipeline.get("_class_name") != QwenImageEditPipeline.__name__:
        raise UserError(f"model.name_or_path: {components} holds a {pipeline.get('_class_name')}, not a "
                        "Qwen-Image-Edit pipeline")
    found = ("2511" if transformer.get("zero_cond_t") else "2509") if plus else "edit"
    if said is not None and said != found:
        raise UserError(f"model.version: {components} is Qwen-Image-Edit {found} (its model_index.json and "
                        f"transformer config say so), not {said}; remove the key or correct it")
    return EditVersion(found)


class QwenImageEditText(QwenImageText):
    """The instruction sits inside the editing template after the references' vision tokens; the text encoder reads
    the reference images with it (`reads_references`)."""

    reads_references = True

    def overlong_prompts(self, prompts: list[str]) -> list[int]:
        return []  # the pipelines cut nothing: the references' tokens count toward no limit there either


class QwenImageEditSampling(QwenImageSampling):
    """QwenImageEditPipeline or QwenImageEditPlusPipeline over the current components. The pipeline encodes each
    prompt with its references itself (the text encoder visits the accelerator for it) and sizes them its own way: the
    references at 1024 x 1024, the text encoder's at 384 x 384 (Plus)."""

    def pipeline(self):
        a = self.adapter
        return a.version.pipeline_class(scheduler=FlowMatchEulerDiscreteScheduler.from_config(a.scheduler.config),
                                        vae=a.vae, text_encoder=a.text_encoder, tokenizer=a.tokenizer,
                                        processor=a.processor, transformer=a.transformer)

    def conditioning(self, prompt: str, negative: str) -> None:
        return None  # the embedding depends on the sample's references: the pipeline encodes them with the prompt

    def reference_arguments(self, images: list[Image.Image], width: int, height: int) -> dict[str, Any]:
        return {"image": images if self.adapter.version.plus else images[0]}


class QwenImageEditAdapter(QwenImageAdapter):
    arch = "qwen_image_edit"
    facts = FACTS
    # Qwen-Image's form: ComfyUI and QwenImageEdit(Plus)Pipeline load edit LoRAs under the same names
    files = dataclasses.replace(QwenImageAdapter.files, modelspec_architecture="qwen-image-edit/lora")
    text_rules = QwenImageEditText
    sampling_parts = QwenImageEditSampling

    def __init__(self, transformer, vae, text_encoder, tokenizer, scheduler, processor, source: str,
                 version: EditVersion, reference_pixels: int | str | None = None):
        super().__init__(transformer, vae, text_encoder, tokenizer, scheduler, source)
        self.processor = processor
        self.version = version
        #: resizes the text encoder's reference images as the pipelines do
        self.image_processor = VaeImageProcessor(vae_scale_factor=self.vae_scale * 2)
        area = None if reference_pixels == "target" else reference_pixels or FACTS.references.area
        #: the references' rule for this model: one slot for the first version, `model.reference_pixels`' area (None:
        #: each target's)
        self._reference_rules = dataclasses.replace(FACTS.references, slots=version.slots, area=area)

    @property
    def reference_rules(self) -> ReferenceFacts:
        return self._reference_rules

    @classmethod
    def file_kinds(cls) -> None:
        """Qwen-Image-Edit's files are not read part by part yet: a single transformer file takes its config and other
        parts from `single_file_config` or the version's repository."""
        return None

    @classmethod
    def default_components_for(cls, model_cfg: QwenImageEditModelConfig) -> str:
        return DEFAULT_COMPONENTS[model_cfg.version or "2509"]

    @classmethod
    def adapter_options(cls, model_cfg: QwenImageEditModelConfig, components: str) -> dict:
        single = is_single_file(cls.resolve_source(model_cfg.name_or_path))
        revision = None if single else model_cfg.revision
        return {"version": read_version(components, model_cfg.version, single, revision),
                "reference_pixels": model_cfg.reference_pixels}

    @staticmethod
    def resolve_source(name_or_path: str, key: str = "model.name_or_path") -> str:
        """A folder, hub id or file; `tiny`, `tiny-2509` and `tiny-2511` become the tiny presets' folders."""
        name_or_path = normalize_path(name_or_path, key)
        return str(TINY_SOURCES[name_or_path]()) if name_or_path in TINY_SOURCES else name_or_path

    @staticmethod
    def load_components(source: str, dtype: torch.dtype, te_qtype: str | None, device: torch.device,
                        variant: str | None = None, revision: str | None = None) -> tuple:
        """Qwen-Image's parts and the processor that puts the reference images in the text encoder's prompt."""
        parts = QwenImageAdapter.load_components(source, dtype, te_qtype, device, variant, revision)
        return (*parts, AutoProcessor.from_pretrained(source, subfolder="processor", revision=revision))

    # ---- text ----------------------------------------------------------------------------------------

    def condition_images(self, references: list[Image.Image]) -> list[Image.Image]:
        """The reference pictures as the text encoder reads them: resized by the pipeline's rule (`condition_size`)
        with the pipeline's own image processor."""
        sized = []
        for picture in references:
            width, height = self.version.condition_size(picture.width, picture.height)
            sized.append(self.image_processor.resize(picture, height, width))
        return sized

    @torch.no_grad()
    def encode_prompts(self, prompts: list[str], references: list[list[Image.Image]] | None = None) -> PromptEmbeds:
        """As the editing pipeline's `encode_prompt`: each instruction in the editing template with its references'
        vision tokens (`references`: each prompt's pictures, in slot order, as a sample shows them; resized here as
        the pipeline resizes them), through the processor and the text encoder (its last hidden state), the template's
        first 64 tokens and the padding dropped, zero-padded to the longest prompt with a mask."""
        references = references or [[] for _ in prompts]
        texts = [self.version.prompt(caption, len(pictures)) for caption, pictures in zip(prompts, references)]
        images = [picture for pictures in references for picture in self.condition_images(pictures)]
        inputs = self.processor(text=texts, images=images or None, padding=True, return_tensors="pt")
        device = first_weight(self.text_encoder).device
        pixels = inputs.get("pixel_values")
        hidden = self.text_encoder.model(
            input_ids=to_device(inputs["input_ids"], device), attention_mask=to_device(inputs["attention_mask"], device),
            pixel_values=None if pixels is None else to_device(pixels, device, self.text_encoder.dtype),
            image_grid_thw=None if pixels is None else to_device(inputs["image_grid_thw"], device),
        ).last_hidden_state
        kept = [row.nonzero().squeeze(1)[TEMPLATE_DROP:] for row in inputs["attention_mask"].bool()]
        rows = [h.index_select(0, to_device(index, device)) for h, index in zip(hidden, kept)]
        return PromptEmbeds.padded(rows, torch.tensor([len(index) for index in kept]))

    def encoder_identity(self, part: str) -> str:
        if part == "image":
            return super().encoder_identity(part)
        extra = f"{PROMPT_TEMPLATE}|{TEMPLATE_DROP}|{len(self.tokenizer)}|{self.version.name}"
        return encoder_identity(self.arch, part, self.source, self.text_encoder, extra)

    # ---- the denoiser ------------------------------------------------------------------------------

    def reference_latents(self, mean: torch.Tensor) -> torch.Tensor:
        """The pipelines' reference latents: the encoder's mode, normalised in its dtype."""
        return self.latent_norm.mode(mean)

    def reference_tokens(self, references: list[torch.Tensor], dtype: torch.dtype,
                         device: torch.device) -> tuple[torch.Tensor, list[tuple[int, int, int]]]:
        """Each reference's latents packed as the pipeline packs them, after the target's, and each one's shape in
        `img_shapes` (`QwenImageEditPlusPipeline.__call__`)."""
        tokens, shapes = [], []
        for latents in references:
            batch, channels, height, width = latents.shape
            tokens.append(QwenImagePipeline._pack_latents(latents.to(device, dtype), batch, channels, height, width))
            shapes.append((1, height // 2, width // 2))
        return torch.cat(tokens, dim=1), shapes

    def describe(self) -> dict[str, str]:
        return {**super().describe(), "version": self.version.name}
