"""Wuerstchen's image encoder (EfficientNetV2-S features + a 1x1 mapper), built by torchvision with the key
layout of the stage-B checkpoint's `effnet_state_dict`, and reading those weights."""

from __future__ import annotations

import copy
import pickle
from functools import partial
from pathlib import Path

import torch
from safetensors.torch import load_file
from torch import nn
from torchvision.models import efficientnet

#: ImageNet normalisation the encoder was trained with
IMAGENET_MEAN = (0.485, 0.456, 0.406)
IMAGENET_STD = (0.229, 0.224, 0.225)
#: EfficientNetV2-S's stages in its `features` Sequential (0 is the stem, 7 the last 1x1 conv)
EFFNET_STAGES = range(1, 7)


def _multiple_of_8(value: float) -> int:
    # torchvision rounds expanded widths to multiples of 8; widths that already are keep the real block layout
    return max(8, round(value / 8) * 8)


class EfficientNetImageEncoder(nn.Module):
    """Wuerstchen's image encoder: EfficientNetV2-S features, a 1x1 conv to `c_latent` channels and a
    BatchNorm2d. torchvision builds the backbone; the key layout (`backbone.*`, `mapper.*`) is that of the
    `effnet_state_dict` in Wuerstchen's stage-B checkpoint. `width` < 1 narrows every stage (tiny models) while
    keeping the stages, layers and keys."""

    def __init__(self, width: float = 1.0, c_latent: int = 16, stage_channels: list[int] | None = None,
                 last_channel: int | None = None):
        super().__init__()
        settings, real_last = efficientnet._efficientnet_conf("efficientnet_v2_s")
        channels = stage_channels or [_multiple_of_8(c * width) for c in
                                      [settings[0].input_channels] + [st.out_channels for st in settings]]
        last_channel = last_channel or _multiple_of_8(real_last * width)
        stages = []
        for index, stage in enumerate(settings):
            stage = copy.copy(stage)
            stage.input_channels, stage.out_channels = channels[index], channels[index + 1]
            stages.append(stage)
        net = efficientnet.EfficientNet(stages, dropout=0.0, last_channel=last_channel,
                                        norm_layer=partial(nn.BatchNorm2d, eps=1e-3))
        self.backbone = net.features
        self.mapper = nn.Sequential(nn.Conv2d(last_channel, c_latent, kernel_size=1, bias=False),
                                    nn.BatchNorm2d(c_latent))
        self.stage_channels = channels

    def forward(self, pixels: torch.Tensor) -> torch.Tensor:
        return self.mapper(self.backbone(pixels))

    @classmethod
    def from_state_dict(cls, state: dict[str, torch.Tensor], source: str) -> EfficientNetImageEncoder:
        """An encoder shaped like `state` (stage widths read from its tensors), loaded strictly except for
        BatchNorm's `num_batches_tracked` counters, which conversions often drop and eval mode never reads."""
        if any(key.startswith("backbone.8.") for key in state):
            raise ValueError(f"{source}: an EfficientNetV2-L encoder (it has a backbone.8 stage); the Wuerstchen v2 "
                             "prior needs the V2-S `effnet_state_dict` of model_v2_stage_b.pt")
        try:
            channels = [state["backbone.0.0.weight"].shape[0]] + [_stage_out_channels(state, i) for i in EFFNET_STAGES]
            last_channel, c_latent = state["backbone.7.0.weight"].shape[0], state["mapper.0.weight"].shape[0]
        except KeyError as missing:
            sample = ", ".join(sorted(state)[:3]) or "no tensors"
            raise ValueError(f"{source}: not a Wuerstchen EfficientNet image encoder (no {missing}; found "
                             f"{sample}, ...)") from None
        encoder = cls(c_latent=c_latent, stage_channels=channels, last_channel=last_channel)
        expected = {k: v for k, v in encoder.state_dict().items()
                    if not (k.endswith("num_batches_tracked") and k not in state)}
        problems = _state_problems(expected, state)
        if problems:
            raise ValueError(f"{source}: weights do not fit the EfficientNetV2-S image encoder: {problems}")
        encoder.load_state_dict(state, strict=False)
        return encoder


def _stage_out_channels(state: dict[str, torch.Tensor], stage: int) -> int:
    """A stage's output width: the size of the BatchNorm that ends its first block."""
    prefix = f"backbone.{stage}.0.block."
    blocks = [int(key[len(prefix):].split(".")[0]) for key in state if key.startswith(prefix)]
    if not blocks:
        raise KeyError(f"{prefix}*")
    return state[f"{prefix}{max(blocks)}.1.weight"].shape[0]


def _state_problems(expected: dict[str, torch.Tensor], given: dict[str, torch.Tensor]) -> str:
    """Missing, unexpected and mis-shaped keys, a few of each, in one line."""
    missing = sorted(set(expected) - set(given))
    unexpected = sorted(set(given) - set(expected))
    shapes = sorted(k for k in set(expected) & set(given) if expected[k].shape != given[k].shape)
    parts = [f"{label} {', '.join(keys[:4])}{' ...' if len(keys) > 4 else ''} ({len(keys)})"
             for label, keys in (("missing", missing), ("unexpected", unexpected), ("wrong shape", shapes)) if keys]
    return "; ".join(parts)


def read_image_encoder_state(path: str) -> dict[str, torch.Tensor]:
    """The encoder's state dict from a .safetensors file, or from a stage-B checkpoint's `effnet_state_dict`."""
    if not Path(path).is_file():
        raise FileNotFoundError(f"model.image_encoder_path: file not found: {path}")
    if path.endswith(".safetensors"):
        return load_file(path)
    try:
        # mmap: a stage-B checkpoint also holds the decoder and its optimizer; only the encoder is read
        checkpoint = torch.load(path, map_location="cpu", weights_only=True, mmap=True)
    except (pickle.UnpicklingError, RuntimeError) as error:
        raise ValueError(f"model.image_encoder_path {path}: cannot read it as a plain-tensor checkpoint ({error}); "
                         "extract its `effnet_state_dict` to a .safetensors file") from None
    if isinstance(checkpoint, dict) and "effnet_state_dict" in checkpoint:
        return checkpoint["effnet_state_dict"]
    if isinstance(checkpoint, dict) and "backbone.0.0.weight" in checkpoint:
        return checkpoint
    found = ", ".join(sorted(checkpoint)[:5]) if isinstance(checkpoint, dict) else type(checkpoint).__name__
    raise ValueError(f"model.image_encoder_path {path}: no `effnet_state_dict` in this checkpoint (found {found})")
