"""The tiny Wuerstchen preset: a random prior, CLIP text encoder and tokenizer (a diffusers prior folder), an
EfficientNetV2-S image encoder at 1/8 width (same layers and keys as the real one) and a tiny stage-B decoder
folder, all built offline."""

from __future__ import annotations

from pathlib import Path

import torch

from toolkit.models.tiny import byte_level_clip_tokenizer, ensure_tiny

TINY_WUERSTCHEN = {
    "prior": {"c_in": 16, "c": 32, "c_cond": 32, "c_r": 8, "depth": 2, "nhead": 2, "dropout": 0.0},
    "text_encoder": {"hidden_size": 32, "intermediate_size": 64, "num_attention_heads": 4,
                     "num_hidden_layers": 2, "max_position_embeddings": 77},
    "image_encoder": {"width": 0.125, "c_latent": 16},
    "decoder": {"c_in": 4, "c_out": 4, "c_r": 8, "patch_size": 2, "c_cond": 32, "c_hidden": [32], "nhead": [-1],
                "blocks": [1], "level_config": ["CT"], "inject_effnet": [True], "effnet_embd": 16, "clip_embd": 32,
                "dropout": 0.0},
    "vqgan": {"levels": 2, "bottleneck_blocks": 1, "embed_dim": 32, "latent_channels": 4, "num_vq_embeddings": 16},
    # the prior predicts (x - a) / |1 - b|: at plain random init b is near 1 for some pixels and the outputs
    # explode; a smaller output layer starts it where a trained prior is, near |1 - b| = 1
    "prior_out_scale": 0.1,
    "seed": 0,
}


def _tiny_clip(tokenizer, preset: dict):
    from transformers import CLIPTextConfig, CLIPTextModel

    config = CLIPTextConfig(vocab_size=len(tokenizer), bos_token_id=tokenizer.bos_token_id,
                            eos_token_id=tokenizer.eos_token_id, pad_token_id=tokenizer.pad_token_id, **preset)
    return CLIPTextModel(config)


@torch.no_grad()
def _conditioned(prior, scale: float):
    prior.out[1].weight.mul_(scale)
    prior.out[1].bias.mul_(scale)
    return prior


@torch.no_grad()
def _calibrated(encoder):
    """Set the mapper's BatchNorm statistics from random images, so that (like the trained encoder) its
    embeddings have about zero mean and unit variance instead of nearly constant random-init values."""
    encoder.eval()
    pixels = torch.rand(8, 3, 64, 64) * 2 - 1
    features = encoder.mapper[0](encoder.backbone(pixels))
    norm = encoder.mapper[1]
    norm.running_mean.copy_(features.mean(dim=(0, 2, 3)))
    norm.running_var.copy_(features.var(dim=(0, 2, 3)))
    return encoder


def _build_tiny_wuerstchen(folder: Path, preset: dict) -> None:
    from diffusers import DDPMWuerstchenScheduler
    from diffusers.pipelines.deprecated.wuerstchen import (
        PaellaVQModel,
        WuerstchenDecoderPipeline,
        WuerstchenDiffNeXt,
        WuerstchenPrior,
        WuerstchenPriorPipeline,
    )
    from safetensors.torch import save_file

    from toolkit.models.wuerstchen.image_encoder import EfficientNetImageEncoder

    tokenizer = byte_level_clip_tokenizer(preset["text_encoder"]["max_position_embeddings"])
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(preset["seed"])
        parts = {
            "prior": _conditioned(WuerstchenPrior(**preset["prior"]), preset["prior_out_scale"]),
            "prior_text_encoder": _tiny_clip(tokenizer, preset["text_encoder"]),
            "decoder": WuerstchenDiffNeXt(**preset["decoder"]),
            "vqgan": PaellaVQModel(**preset["vqgan"]),
            "decoder_text_encoder": _tiny_clip(tokenizer, preset["text_encoder"]),
        }
        image_encoder = _calibrated(EfficientNetImageEncoder(**preset["image_encoder"]))
    prior = WuerstchenPriorPipeline(tokenizer=tokenizer, text_encoder=parts["prior_text_encoder"],
                                    prior=parts["prior"], scheduler=DDPMWuerstchenScheduler())
    decoder = WuerstchenDecoderPipeline(tokenizer=tokenizer, text_encoder=parts["decoder_text_encoder"],
                                        decoder=parts["decoder"], scheduler=DDPMWuerstchenScheduler(),
                                        vqgan=parts["vqgan"])
    prior.save_pretrained(folder / "prior", safe_serialization=True)
    decoder.save_pretrained(folder / "decoder", safe_serialization=True)
    save_file({k: v.contiguous() for k, v in image_encoder.state_dict().items()}, folder / "image_encoder.safetensors")


def ensure_tiny_wuerstchen(preset: dict = TINY_WUERSTCHEN) -> Path:
    """The tiny Wuerstchen folder (prior/, decoder/, image_encoder.safetensors), built on first use."""
    return ensure_tiny("wuerstchen", preset, _build_tiny_wuerstchen)
