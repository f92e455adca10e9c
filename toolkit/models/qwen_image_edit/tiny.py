"""Tiny random Qwen-Image-Edit models, built offline and saved as normal diffusers QwenImageEditPipeline (the first
version) and QwenImageEditPlusPipeline (2509, and 2511 with its transformer's `zero_cond_t`) folders.

The parts are the tiny Qwen-Image's (toolkit/models/qwen_image/tiny.py) with what editing adds: a byte-level BPE
Qwen2Tokenizer whose merges make each word of both prompt templates one token (so the editing template's prefix is
64 tokens, as with the real tokenizer, and the pipelines' fixed drop of 64 removes exactly it) and which has
Qwen2.5-VL's vision tokens; a Qwen2.5-VL text encoder whose one-block vision tower reads the reference images the
prompt names; and a Qwen2VLProcessor (the real image processor: 14-pixel patches merged 2 x 2) that puts each image's
tokens in the prompt.
"""

from __future__ import annotations

from pathlib import Path

from toolkit.models.qwen_image.tiny import TEMPLATE_TEXT, TINY_QWEN_IMAGE, template_bpe_tokenizer
from toolkit.models.tiny import ensure_tiny, seeded

#: the editing pipelines' prompt template (`prompt_template_encode`) and the Plus pipeline's image prefix: the tiny
#: tokenizer learns their words
EDIT_TEMPLATE_TEXT = (("system\nDescribe the key features of the input image (color, shape, size, texture, objects, "
                       "background), then explain how the user's text instruction should alter or modify the image. "
                       "Generate a new image that meets the user's requirements while maintaining consistency with "
                       "the original input where appropriate."), "Picture 1: ", "Picture 2: ", "Picture 3: ")

#: Qwen2.5-VL's vision tokens, by the text encoder config's name for each
VISION_TOKENS = {"vision_start_token_id": "<|vision_start|>", "vision_end_token_id": "<|vision_end|>",
                 "image_token_id": "<|image_pad|>", "video_token_id": "<|video_pad|>"}

TINY_QWEN_IMAGE_EDIT = {**TINY_QWEN_IMAGE, "pipeline": "QwenImageEditPipeline", "vision_tokens": VISION_TOKENS,
                        "seed": 20}
TINY_QWEN_IMAGE_EDIT_2509 = {**TINY_QWEN_IMAGE_EDIT, "pipeline": "QwenImageEditPlusPipeline", "seed": 21}
TINY_QWEN_IMAGE_EDIT_2511 = {**TINY_QWEN_IMAGE_EDIT_2509, "seed": 22,
                             "transformer": {**TINY_QWEN_IMAGE["transformer"], "zero_cond_t": True}}


def build_qwen_image_edit(folder: Path, preset: dict) -> None:
    """A random Qwen-Image-Edit pipeline folder (its pipeline class named in the preset) with the preset's sizes."""
    import diffusers
    from diffusers import AutoencoderKLQwenImage, FlowMatchEulerDiscreteScheduler, QwenImageTransformer2DModel
    from transformers import (
        Qwen2_5_VLConfig,
        Qwen2_5_VLForConditionalGeneration,
        Qwen2VLImageProcessor,
        Qwen2VLProcessor,
        Qwen2VLVideoProcessor,
    )

    tokenizer = template_bpe_tokenizer(TEMPLATE_TEXT + EDIT_TEMPLATE_TEXT, tuple(preset["vision_tokens"].values()))
    ids = {name: tokenizer.convert_tokens_to_ids(token) for name, token in preset["vision_tokens"].items()}
    encoder = preset["text_encoder"]
    special = {"vocab_size": len(tokenizer), "pad_token_id": tokenizer.pad_token_id, "bos_token_id": None,
               "eos_token_id": tokenizer.convert_tokens_to_ids("<|im_end|>")}
    seed = preset["seed"]
    text_encoder = seeded(seed, lambda: Qwen2_5_VLForConditionalGeneration(Qwen2_5_VLConfig(
        text_config={**encoder["text_config"], **special}, vision_config=encoder["vision_config"], **ids)))
    vae = seeded(seed + 1, lambda: AutoencoderKLQwenImage(**preset["vae"]))
    transformer = seeded(seed + 2, lambda: QwenImageTransformer2DModel(**preset["transformer"]))
    processor = Qwen2VLProcessor(image_processor=Qwen2VLImageProcessor(), tokenizer=tokenizer,
                                 video_processor=Qwen2VLVideoProcessor())
    pipeline = getattr(diffusers, preset["pipeline"])
    pipe = pipeline(scheduler=FlowMatchEulerDiscreteScheduler(**preset["scheduler"]), vae=vae,
                    text_encoder=text_encoder, tokenizer=tokenizer, processor=processor, transformer=transformer)
    pipe.save_pretrained(folder, safe_serialization=True)


def ensure_tiny_qwen_image_edit(preset: dict = TINY_QWEN_IMAGE_EDIT) -> Path:
    """The folder of the tiny Qwen-Image-Edit (first version), built on first use."""
    return ensure_tiny("qwen_image_edit", preset, build_qwen_image_edit)


def ensure_tiny_qwen_image_edit_2509(preset: dict = TINY_QWEN_IMAGE_EDIT_2509) -> Path:
    """The folder of the tiny Qwen-Image-Edit-2509 (Plus), built on first use."""
    return ensure_tiny("qwen_image_edit_2509", preset, build_qwen_image_edit)


def ensure_tiny_qwen_image_edit_2511(preset: dict = TINY_QWEN_IMAGE_EDIT_2511) -> Path:
    """The folder of the tiny Qwen-Image-Edit-2511 (Plus, `zero_cond_t`), built on first use."""
    return ensure_tiny("qwen_image_edit_2511", preset, build_qwen_image_edit)
