"""Pieces several model families share: placing frozen parts, VAE latents, and cache identities."""

from __future__ import annotations

import hashlib
from pathlib import Path

import torch
from diffusers import DDPMScheduler

from toolkit.device import WEIGHTS_ATTRIBUTE, as_dtype, safe_module_to_device, to_device
from toolkit.diffusion.timesteps import ShiftSchedule
from toolkit.models.base import LatentDist, TextRules
from toolkit.models.config import is_single_file  # noqa: F401  (the adapters take it from here)


def place_frozen(denoiser: torch.nn.Module, encoders: list[torch.nn.Module], device: torch.device, low_vram: bool,
                 parked: list[torch.nn.Module] = ()) -> None:
    """Freeze every part and set eval mode; the denoiser goes to `device`, the encoders too unless `low_vram`
    (the trainer brings them when they work), and `parked` parts (sample-only) stay on the CPU."""
    for module in (denoiser, *encoders, *parked):
        module.requires_grad_(False)
        module.eval()
    safe_module_to_device(denoiser, device)
    for module in encoders:
        safe_module_to_device(module, "cpu" if low_vram else device)


@torch.no_grad()
def vae_latent_dist(vae, pixels: torch.Tensor) -> LatentDist:
    """The VAE posterior of pixels in [-1, 1]: mean and std, before sampling."""
    posterior = vae.encode(pixels.to(**weights_placement(vae))).latent_dist
    return LatentDist(posterior.mean, posterior.std)


def vae_latents(dist: LatentDist, generator: torch.Generator | None, scaling: float, shift: float = 0.0
                ) -> torch.Tensor:
    """A posterior sample as the denoiser sees it, (sample - shift) x scaling, float32. The noise is drawn on
    a CPU generator, so it does not depend on the device. Without a std, the mean itself (the mode: nothing drawn),
    computed in the mean's dtype as the editing pipelines compute their reference latents."""
    if dist.std is None:
        sample = dist.mean
    else:
        mean = as_dtype(dist.mean, torch.float32)
        eps = to_device(torch.randn(mean.shape, generator=generator, dtype=torch.float32), mean.device)
        sample = torch.addcmul(mean, as_dtype(dist.std, torch.float32), eps)  # mean + std x eps
    if isinstance(shift, torch.Tensor) or shift != 0.0:
        sample = sample - shift
    return sample * scaling


class ChannelNormalizedLatents:
    """Latents normalised per channel with the VAE config's `latents_mean` / `latents_std` (Qwen-Image, Wan): the
    pipelines decode latents * std + mean, so training latents are (sample - mean) / std. The statistics are kept
    per device, shaped to broadcast over latents with `spatial_dims` trailing axes (2: images, 3: video)."""

    def __init__(self, vae_config, spatial_dims: int):
        self.stats = (torch.tensor(vae_config.latents_mean).float(), torch.tensor(vae_config.latents_std).float())
        self.shape = (1, -1) + (1,) * spatial_dims
        self._on: dict[torch.device, tuple[torch.Tensor, torch.Tensor]] = {}

    def on(self, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
        """(mean, std) on `device`, copied there once."""
        if device not in self._on:
            self._on[device] = tuple(to_device(s.view(self.shape), device) for s in self.stats)
        return self._on[device]

    def sample(self, dist: LatentDist, generator: torch.Generator | None) -> torch.Tensor:
        if dist.std is None:
            return self.mode(dist.mean)
        mean, std = self.on(dist.mean.device)
        return vae_latents(dist, generator, 1 / std, mean)

    def mode(self, latent_mean: torch.Tensor) -> torch.Tensor:
        """The encoder's mean normalised as the editing pipelines normalise their reference latents: (mean -
        latents_mean) / latents_std in the mean's dtype (`QwenImageEditPipeline._encode_vae_image`)."""
        mean, std = self.on(latent_mean.device)
        return (latent_mean - mean.to(latent_mean.dtype)) / std.to(latent_mean.dtype)


def weights_fingerprint(module: torch.nn.Module, buffers: bool = False) -> str:
    """A digest of a module's weights (each tensor's sum and norm), and of its floating-point buffers when
    asked (e.g. BatchNorm statistics): a VAE or text encoder swapped in under the same path and config still
    changes cache keys."""
    tensors = list(module.parameters())
    if buffers:
        tensors += [b for b in module.buffers() if b.is_floating_point()]
    with torch.no_grad():
        stats = torch.stack([torch.stack([p.sum(dtype=torch.float64), torch.linalg.vector_norm(p, dtype=torch.float64)])
                             for p in tensors])
    return hashlib.sha256(stats.cpu().numpy().round(6).tobytes()).hexdigest()[:16]


def encoder_identity(arch: str, part: str, source: str, module: torch.nn.Module, extra: str = "",
                     buffers: bool = False) -> str:
    """The cache key of an encoder: its source, dtype, config and weights (plus `extra` facts that shape its
    output, e.g. a chat template)."""
    config = getattr(module, "config", None)
    config = config.to_json_string() if hasattr(config, "to_json_string") else str(config)
    dtype = next(module.parameters()).dtype
    facts = f"{source}|{dtype}|{config}|{weights_fingerprint(module, buffers)}|{extra}"
    return f"{arch}-{part}-{hashlib.sha256(facts.encode()).hexdigest()[:16]}"


#: kohya's text-encoder LoRA targets in a CLIP text model: every linear layer of attention and MLP
CLIP_TEXT_TARGETS = ("q_proj", "k_proj", "v_proj", "out_proj", "fc1", "fc2")


class ClipTextRules(TextRules):
    """A CLIP tokenizer's limit (`model_max_length`, 77): longer captions are cut, and said so."""

    def overlong_prompts(self, prompts: list[str]) -> list[int]:
        tokenizer = self.adapter.tokenizer
        lengths = [len(ids) for ids in tokenizer(prompts, truncation=False).input_ids]
        return [i for i, length in enumerate(lengths) if length > tokenizer.model_max_length]


def ddpm_scheduler(scheduler, prediction_type: str | None = None, zero_terminal_snr: bool = False) -> DDPMScheduler:
    """The family's training scheduler with `model.prediction_type` and `train.zero_terminal_snr` applied (rescaled
    betas, and trailing timesteps, which samplers need to start from the zero-SNR step). Samplers built from its
    config (`from_config`) inherit both."""
    overrides: dict = {}
    if prediction_type:
        overrides["prediction_type"] = prediction_type
    if zero_terminal_snr:
        overrides.update(rescale_betas_zero_snr=True, timestep_spacing="trailing")
    return DDPMScheduler.from_config(scheduler.config, **overrides)


def run_in_own_dtype(module: torch.nn.Module, parts: list[torch.nn.Module]) -> None:
    """Cast the inputs of `parts` (sub-modules of `module`) to `module`'s dtype: a VAE kept in float32 beside a
    float16 model then decodes the float16 latents a pipeline hands it."""
    dtype = next(module.parameters()).dtype

    def cast(_, args):
        return tuple(a.to(dtype) if torch.is_tensor(a) and a.is_floating_point() else a for a in args)

    for part in parts:
        part.register_forward_pre_hook(cast)


def dynamic_shift_schedule(config) -> ShiftSchedule | None:
    """A flow-matching scheduler's dynamic-shift line, only where the scheduler uses it (`use_dynamic_shifting`).

    Pipelines compute `mu` from the image's token count, but FlowMatchEulerDiscreteScheduler ignores it unless
    dynamic shifting is on: FLUX.1 [dev] has it on; FLUX.1 [schnell] and Z-Image(-Turbo) ship with it off and a
    fixed `shift`, so this is None there."""
    return ShiftSchedule.from_scheduler_config(config) if config.get("use_dynamic_shifting") else None




#: config qtype -> transformers' QuantoConfig weights (text encoders quantized by transformers as they load)
TRANSFORMERS_QUANTO = {"qfloat8": "float8", "qint8": "int8", "qint4": "int4"}


def transformers_quantization(qtype: str | None, device: torch.device) -> dict:
    """`from_pretrained` arguments that quantize a transformers model with quanto as its weights load (onto the
    accelerator, where quantizing is fast), or none without `qtype`."""
    if not qtype:
        return {}
    from transformers import QuantoConfig

    from toolkit.quantize import keep_qfloat8_off_marlin, keep_quantized_linear_dtypes_matched

    keep_qfloat8_off_marlin()
    keep_quantized_linear_dtypes_matched()
    arguments = {"quantization_config": QuantoConfig(weights=TRANSFORMERS_QUANTO[qtype])}
    if device.type != "cpu":
        arguments["device_map"] = {"": str(device)}
    return arguments


def subfolder_weight_files(source: str, subfolder: str, variant: str | None, revision: str | None) -> list[Path]:
    """The safetensors files of one model in a diffusers folder, or in a hub repo (its weight files of `variant`
    only, from the local hub cache or downloaded): for reading them layer by layer (toolkit.quantize)."""
    from toolkit.quantize import weight_files

    if Path(source).is_dir():
        return weight_files(Path(source) / subfolder, variant)
    from huggingface_hub import snapshot_download

    weights = f"{subfolder}/*.{variant}.safetensors" if variant else f"{subfolder}/*.safetensors"
    folder = snapshot_download(source, allow_patterns=[f"{subfolder}/*.json", weights], revision=revision,
                               ignore_patterns=None if variant else [f"{subfolder}/*.*.safetensors"])
    return weight_files(Path(folder) / subfolder, variant)


def empty_denoiser(model_class, source: str, subfolder: str, dtype: torch.dtype, variant: str | None = None,
                   revision: str | None = None) -> torch.nn.Module:
    """The denoiser built from its config alone (`train.sharding: fsdp`): parameters on the meta device in `dtype`
    (the modules diffusers keeps in float32, `_keep_in_fp32_modules`, in float32), buffers computed on the CPU (rotary
    tables and the like are made at construction, not read), frozen, in eval mode. Its weight files are kept on it
    (`WEIGHTS_ATTRIBUTE`): toolkit/run/sharding.py fills each process's rows from them."""
    from accelerate import init_empty_weights

    from toolkit.quantize import StreamedWeights

    config = model_class.load_config(source, subfolder=subfolder, revision=revision)
    with init_empty_weights(include_buffers=False):
        model = model_class.from_config(config)
    # parameters in `dtype` by diffusers' own rule (a name part in `_keep_in_fp32_modules` keeps float32); buffers as
    # construction made them (rotary tables are float32 and not in the weight files)
    keep = model_class._keep_in_fp32_modules or []
    for name, param in model.named_parameters():
        wanted = torch.float32 if any(part in name.split(".") for part in keep) else dtype
        param.data = param.data.to(wanted)
    model.requires_grad_(False)
    setattr(model, WEIGHTS_ATTRIBUTE, StreamedWeights(subfolder_weight_files(source, subfolder, variant, revision)))
    return model.eval()


def pretrained_denoiser(model_class, source: str, subfolder: str, dtype: torch.dtype, empty: bool = False,
                        variant: str | None = None, revision: str | None = None) -> torch.nn.Module:
    """A family's denoiser from a diffusers folder or hub id: loaded by diffusers' `from_pretrained`, or with `empty`
    built on the meta device for the sharding to fill (`empty_denoiser`)."""
    if empty:
        return empty_denoiser(model_class, source, subfolder, dtype, variant, revision)
    return model_class.from_pretrained(source, subfolder=subfolder, torch_dtype=dtype, variant=variant,
                                       revision=revision)


def first_weight(module: torch.nn.Module) -> torch.Tensor:
    """The module's first parameter, as `next(module.parameters())` finds it (depth first, its own before its
    children's), without the generators `parameters()` builds: a module's device is asked for at every micro-batch,
    and diffusers' and transformers' `.device` walk every submodule (about 0.35 ms on a VAE; docs/performance.md)."""
    found = _first_parameter(module)
    if found is None:
        raise ValueError(f"{type(module).__name__} has no parameters")
    return found


def _first_parameter(module: torch.nn.Module) -> torch.Tensor | None:
    for parameter in module._parameters.values():
        if parameter is not None:
            return parameter
    for child in module._modules.values():
        found = None if child is None else _first_parameter(child)
        if found is not None:
            return found
    return None


def weights_placement(module: torch.nn.Module) -> dict:
    """The device and dtype of a module's first weight (`first_weight`), for `.to(**...)`."""
    weight = first_weight(module)
    return {"device": weight.device, "dtype": weight.dtype}
