"""Adapter file formats: difftune/diffusers keys <-> ComfyUI/kohya keys.

diffusers (LoRA): `unet.<module path>.lora.down.weight` / `.lora.up.weight`, alphas in the header metadata
(peft's config). LoKr and LoHa keep peft's (= LyCORIS's) weight names: `.lokr_w1`, `.lokr_w2_a`, `.hada_w1_a`...
ComfyUI/kohya: `lora_unet_<module path with _>.lora_down.weight` / `.lora_up.weight` (or the LyCORIS names)
and a scalar `.alpha` per module, which A1111/Forge and ComfyUI read. Module paths are the diffusers ones in
both (kohya names SD 1.x modules by the diffusers UNet's paths), so converting is a rename plus the alphas.
Families whose ComfyUI loader keeps dotted diffusers paths (Z-Image: `diffusion_model.layers.0.attention.to_q
.lora_down.weight`) use the separator ".". Families whose kohya names follow another module layout (SDXL: kohya
trains the original `input_blocks` / `middle_block` / `output_blocks` UNet) give `renames`: module path
prefixes in diffusers' layout -> the same modules in the file's layout (longest prefix wins).

DoRA: peft's magnitude (`.lora_magnitude_vector`, one value per output row: shape [out] for a Linear,
[1, out, 1, 1] for a conv) is kohya/LyCORIS's `.dora_scale` in its output-axis orientation ([out, 1] and
[out, 1, 1, 1], LyCORIS's `wd_on_out`, its default since 3.2): the same numbers, the same meaning
(m * (W + dW) / ||W + dW|| per output row), reshaped.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from types import MappingProxyType

import torch

EMPTY: Mapping[str, str] = MappingProxyType({})

#: diffusers' LoRA weight names -> kohya's
LORA_SUFFIX = {"lora.down.weight": "lora_down.weight", "lora.up.weight": "lora_up.weight"}
#: LyCORIS weight names, the same in both forms
LYCORIS_SUFFIXES = ("lokr_w1", "lokr_w1_a", "lokr_w1_b", "lokr_w2", "lokr_w2_a", "lokr_w2_b", "lokr_t2",
                    "hada_w1_a", "hada_w1_b", "hada_w2_a", "hada_w2_b", "hada_t1", "hada_t2")
#: DoRA's magnitude: peft's name -> kohya/LyCORIS's
DORA_SUFFIX = {"lora_magnitude_vector": "dora_scale"}
TO_COMFY = {**LORA_SUFFIX, **{name: name for name in LYCORIS_SUFFIXES}, **DORA_SUFFIX}
#: LoRA weight names of the ComfyUI form for families whose loaders read peft's names with `.alpha` (FLUX.1:
#: ComfyUI, Forge and diffusers all apply `transformer.<path>.lora_A/lora_B.weight` + `.alpha` alike)
PEFT_NAMES = {"lora.down.weight": "lora_A.weight", "lora.up.weight": "lora_B.weight"}
TO_COMFY_PEFT_NAMES = {**TO_COMFY, **PEFT_NAMES}
FROM_COMFY = {comfy: ours for ours, comfy in (*TO_COMFY.items(), *PEFT_NAMES.items())}


def dora_scale(magnitude: torch.Tensor) -> torch.Tensor:
    """peft's magnitude ([out], or [1, out, 1, 1] for a conv) -> LyCORIS's output-axis dora_scale ([out, 1, ...])."""
    if magnitude.dim() == 1:
        return magnitude.reshape(-1, 1)
    return magnitude.reshape(magnitude.shape[1], 1, *magnitude.shape[2:])


def dora_magnitude(scale: torch.Tensor) -> torch.Tensor:
    """LyCORIS's dora_scale -> peft's magnitude. Only the output-axis orientation maps onto peft's DoRA (the
    [1, in] form decomposes per input column, which peft cannot hold)."""
    if scale.dim() < 2 or scale.shape[1] != 1:
        raise ValueError(f"a dora_scale of shape {tuple(scale.shape)} decomposes per input column; only the "
                         "output-axis form ([out, 1], LyCORIS's wd_on_out) maps onto peft's DoRA")
    return scale.reshape(-1) if scale.dim() == 2 else scale.reshape(1, scale.shape[0], *scale.shape[2:])


def renamed(module: str, renames: Mapping[str, str]) -> str:
    """`module` with its longest prefix found in `renames` replaced (whole path components only)."""
    parts = module.split(".")
    for n in range(len(parts), 0, -1):
        head = ".".join(parts[:n])
        if head in renames:
            return ".".join([renames[head], *parts[n:]])
    return module


def comfy_module_name(prefix: str, module: str, separator: str, renames: Mapping[str, str] = EMPTY) -> str:
    """`lora_unet_down_blocks_0_...` (kohya, separator "_") or `diffusion_model.layers.0...` (separator ".")."""
    module = renamed(module, renames) if renames else module
    return f"{prefix}{separator}{module.replace('.', '_') if separator == '_' else module}"


def split_weight_key(key: str, suffixes) -> tuple[str, str]:
    """(module path, weight name) of an adapter key."""
    for suffix in sorted(suffixes, key=len, reverse=True):
        if key.endswith("." + suffix):
            return key[: -len(suffix) - 1], suffix
    raise ValueError(f"not an adapter weight key: {key}")


def to_comfy(state: dict[str, torch.Tensor], prefixes: dict[str, str], alpha_of: Callable[[str], float],
             separator: str = "_", renames: Mapping[str, Mapping[str, str]] = EMPTY,
             peft_names: bool = False) -> dict[str, torch.Tensor]:
    """difftune/diffusers-keyed adapter weights -> ComfyUI/kohya keys with one `.alpha` per module.

    `prefixes` maps a component prefix (`unet`) to its ComfyUI prefix (`lora_unet`); `alpha_of(module path)`
    gives each module's alpha (path without the component prefix); `separator` joins prefix and path ("_"
    flattens the path as kohya does, "." keeps it); `renames` maps a component prefix to its module renames;
    `peft_names` writes LoRA weights as `lora_A` / `lora_B` instead of kohya's `lora_down` / `lora_up`.
    """
    names = TO_COMFY_PEFT_NAMES if peft_names else TO_COMFY
    out: dict[str, torch.Tensor] = {}
    for key, value in state.items():
        component, rest = key.split(".", 1)
        module, suffix = split_weight_key(rest, TO_COMFY)
        name = comfy_module_name(prefixes[component], module, separator, renames.get(component, EMPTY))
        out[f"{name}.{names[suffix]}"] = dora_scale(value) if suffix in DORA_SUFFIX else value
        out.setdefault(f"{name}.alpha", torch.tensor(float(alpha_of(module)), dtype=torch.float32))
    return out


def from_comfy(state: dict[str, torch.Tensor], prefixes: dict[str, str], module_names: list[str],
               separator: str = "_", renames: Mapping[str, Mapping[str, str]] = EMPTY
               ) -> tuple[dict[str, torch.Tensor], dict[str, float]]:
    """ComfyUI/kohya keys -> difftune/diffusers keys, plus each module's alpha (by full diffusers module path).
    `module_names` are the model's module paths (`unet.down_blocks.0...to_q`): underscores in kohya names are
    ambiguous, so names are matched against the real modules rather than guessed."""
    by_comfy = {}
    for full in module_names:
        component, module = full.split(".", 1)
        by_comfy[comfy_module_name(prefixes[component], module, separator, renames.get(component, EMPTY))] = full
    weights, alphas = {}, {}
    for key, value in state.items():
        name, suffix = split_weight_key(key, [*FROM_COMFY, "alpha"])
        if name not in by_comfy:
            raise ValueError(f"adapter key {key} matches no module of this model")
        if suffix == "alpha":
            alphas[by_comfy[name]] = float(value)
        else:
            ours = FROM_COMFY[suffix]
            weights[f"{by_comfy[name]}.{ours}"] = dora_magnitude(value) if ours in DORA_SUFFIX else value
    return weights, alphas


def is_comfy_form(state: dict[str, torch.Tensor], comfy_prefix: str, separator: str, prefix: str = "") -> bool:
    """Whether keys are in the ComfyUI form. Where it shares its prefix with the diffusers form (FLUX.1's
    `transformer.`), the ComfyUI form is the one with `.alpha` keys (diffusers files keep alphas in the header, or
    none: alpha = rank)."""
    ours = [key for key in state if key.startswith(comfy_prefix + separator)]
    if comfy_prefix + separator == prefix + ".":
        return any(key.endswith(".alpha") for key in ours)
    return bool(ours)
