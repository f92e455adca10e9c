"""LoRA file formats: diffusers keys <-> ComfyUI/kohya keys.

diffusers: `unet.<module path>.lora.down.weight` / `.lora.up.weight`, alpha in the header metadata.
ComfyUI/kohya: `lora_unet_<module path with _>.lora_down.weight` / `.lora_up.weight` and a scalar
`.alpha` per module, which A1111/Forge and ComfyUI read. Module paths are the diffusers ones in both
(kohya names SD 1.x modules by the diffusers UNet's paths), so converting is a rename plus the alphas.
Families whose ComfyUI loader keeps dotted diffusers paths (Z-Image: `diffusion_model.layers.0.attention.to_q`
.lora_down.weight) use the separator ".".
"""

from __future__ import annotations

import torch

DIFFUSERS_SUFFIX = {"lora.down.weight": "lora_down.weight", "lora.up.weight": "lora_up.weight"}


def comfy_module_name(prefix: str, module: str, separator: str) -> str:
    """`lora_unet_down_blocks_0_...` (kohya, separator "_") or `diffusion_model.layers.0...` (separator ".")."""
    return f"{prefix}{separator}{module.replace('.', '_') if separator == '_' else module}"


def to_comfy(state: dict[str, torch.Tensor], prefixes: dict[str, str], alpha: float,
             separator: str = "_") -> dict[str, torch.Tensor]:
    """diffusers-keyed LoRA weights -> ComfyUI/kohya keys with one `.alpha` per module.

    `prefixes` maps a diffusers component prefix (`unet`) to its ComfyUI prefix (`lora_unet`); `separator`
    joins prefix and module path ("_" flattens the path as kohya does, "." keeps it).
    """
    out: dict[str, torch.Tensor] = {}
    for key, value in state.items():
        component, rest = key.split(".", 1)
        module, suffix = _split_suffix(rest, DIFFUSERS_SUFFIX)
        name = comfy_module_name(prefixes[component], module, separator)
        out[f"{name}.{DIFFUSERS_SUFFIX[suffix]}"] = value
        out.setdefault(f"{name}.alpha", torch.tensor(float(alpha), dtype=value.dtype))
    return out


def from_comfy(state: dict[str, torch.Tensor], prefixes: dict[str, str], module_names: list[str],
               separator: str = "_") -> tuple[dict[str, torch.Tensor], dict[str, float]]:
    """kohya keys -> diffusers keys, plus each module's alpha. `module_names` are the diffusers module
    paths (`unet.down_blocks.0...to_q`): underscores in kohya names are ambiguous, so names are matched
    against the real modules rather than guessed."""
    by_kohya = {}
    for full in module_names:
        component, module = full.split(".", 1)
        by_kohya[comfy_module_name(prefixes[component], module, separator)] = full
    reverse = {v: k for k, v in DIFFUSERS_SUFFIX.items()}
    weights, alphas = {}, {}
    for key, value in state.items():
        name, suffix = _split_suffix(key, [*reverse, "alpha"])
        if name not in by_kohya:
            raise ValueError(f"LoRA key {key} matches no module of this model")
        if suffix == "alpha":
            alphas[by_kohya[name]] = float(value)
        else:
            weights[f"{by_kohya[name]}.{reverse[suffix]}"] = value
    return weights, alphas


def _split_suffix(key: str, suffixes) -> tuple[str, str]:
    for suffix in suffixes:
        if key.endswith("." + suffix):
            return key[: -len(suffix) - 1], suffix
    raise ValueError(f"not a LoRA weight key: {key}")


def kohya_metadata(rank: int, alpha: float, base_model_version: str) -> dict[str, str]:
    """The header keys tools that read kohya metadata look for."""
    return {"ss_network_dim": str(rank), "ss_network_alpha": str(alpha),
            "ss_base_model_version": base_model_version, "ss_network_module": "networks.lora"}
