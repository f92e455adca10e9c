"""Adapter files in and out: the ComfyUI/kohya file next to the diffusers one, starting training from an existing
file of either form with its alphas honoured, and converting files between the forms (`run.py --convert-lora`).

The invariant everywhere is the effective weight delta (alpha / rank included): whatever a file's alphas and
ranks, what it adds to the model's weights survives reading, converting and loading.
"""

from __future__ import annotations

import json
import logging
import re
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path

import torch
from diffusers.loaders.lora_base import LORA_ADAPTER_METADATA_KEY
from safetensors import safe_open

from toolkit.errors import UserError
from toolkit.models.base import LoraComponent, LoraFileFormat, denoiser_component
from toolkit.network.formats import (
    EMPTY,
    FROM_COMFY,
    from_comfy,
    is_comfy_form,
    split_weight_key,
    to_comfy,
)
from toolkit.network.lora import (
    PEFT_CONFIG,
    PEFT_KEY_PREFIX,
    PEFT_WEIGHTS,
    compare_lora_state,
    from_diffusers_form,
    load_lora_state,
    lora_state_dict,
    module_scales,
    save_peft_folder,
    to_diffusers_form,
    write_safetensors,
)

log = logging.getLogger("difftune")

#: the weight of each adapter type that carries the scale when alphas are folded in (delta is linear in it)
SCALE_CARRIERS = ("lora.up.weight", "lora_B.weight", "lokr_w1", "lokr_w1_a", "hada_w1_a")


def read_header(path: Path) -> dict[str, str]:
    """A safetensors file's metadata alone (no tensors are read)."""
    if not path.is_file():
        raise FileNotFoundError(f"adapter file not found: {path}")
    with safe_open(str(path), "pt") as handle:
        return handle.metadata() or {}


def key_names(path: Path) -> list[str]:
    """An adapter file's key names, without reading its tensors; none for a folder (a peft folder holds one model,
    the trained module's, read by `read_peft_folder`)."""
    if path.is_dir():
        return []
    with safe_open(str(path), "pt") as handle:
        return list(handle.keys())


def is_comfy_file(path: Path, files: LoraFileFormat) -> bool:
    """Whether an adapter file holds ComfyUI/kohya keys."""
    return is_comfy_form(dict.fromkeys(key_names(path)), files.comfy_prefix, files.comfy_separator, files.prefix)


def read_safetensors(path: Path) -> tuple[dict[str, torch.Tensor], dict[str, str]]:
    if not path.is_file():
        raise FileNotFoundError(f"adapter file not found: {path}")
    with safe_open(str(path), "pt") as handle:
        return {key: handle.get_tensor(key) for key in handle.keys()}, handle.metadata() or {}


def header_scales(metadata: dict[str, str], prefix: str, modules: list[str]) -> dict[str, float] | None:
    """Per-module scales (alpha / r, peft's rule for every adapter type) from the peft config in a diffusers
    header, or None without one."""
    if LORA_ADAPTER_METADATA_KEY not in metadata:
        return None
    config = json.loads(metadata[LORA_ADAPTER_METADATA_KEY])
    alpha = config.get(f"{prefix}.lora_alpha", config.get(f"{prefix}.alpha"))
    rank = config.get(f"{prefix}.r")
    if alpha is None or rank is None:
        return None

    def pick(patterns: dict, module: str, default: float) -> float:
        hits = [value for key, value in (patterns or {}).items() if re.match(rf"(.*\.)?({key})$", module)]
        return float(hits[0] if hits else default)

    return {m: pick(config.get(f"{prefix}.alpha_pattern"), m, alpha) / pick(config.get(f"{prefix}.rank_pattern"), m, rank)
            for m in modules}


def module_paths(state: dict[str, torch.Tensor], prefix: str) -> list[str]:
    """The module paths (without `prefix`) that a difftune/diffusers-keyed state holds weights for."""
    suffixes = [*FROM_COMFY.values(), "lora_A.weight", "lora_B.weight", "lora_magnitude_vector",
                "lora_magnitude_vector.weight"]
    return sorted({split_weight_key(key[len(prefix) + 1:], suffixes)[0] for key in state
                   if key.startswith(prefix + ".")})


def rank_of(state: dict[str, torch.Tensor], prefix: str, module: str) -> int:
    """A module's rank as ComfyUI reads it from the weights (LoRA's down projection, a LyCORIS decomposed
    factor); 0 for LoKr with full factors, where ComfyUI and LyCORIS apply no alpha / rank."""
    for suffix, dim in (("lora.down.weight", 0), ("lora_A.weight", 0), ("lokr_w1_b", 0), ("lokr_w2_b", 0),
                        ("hada_w1_b", 0)):
        key = f"{prefix}.{module}.{suffix}"
        if key in state:
            return state[key].shape[dim]
    return 0


def comfy_scales(state: dict[str, torch.Tensor], prefix: str, alphas: dict[str, float]) -> dict[str, float]:
    """Per-module scales as ComfyUI applies a file's `.alpha`: alpha / rank, or 1 where there is no rank."""
    return {m: (alpha / rank_of(state, prefix, m) if rank_of(state, prefix, m) else 1.0) for m, alpha in alphas.items()}


def layout_renames(files: LoraFileFormat, module_names: list[str] | None) -> Mapping[str, str]:
    """The family's kohya module renames for a model with these module names (none for most families)."""
    return files.comfy_renames(module_names) if files.comfy_renames is not None and module_names else EMPTY


def module_names(module: torch.nn.Module) -> list[str]:
    return [name for name, _ in module.named_modules() if name]


def read_adapter_file(path: Path, prefix: str, comfy_prefix: str, separator: str, model_modules: list[str] | None,
                      renames: Mapping[str, str] = EMPTY, others_trained: bool = False,
                      diffusers_renames: Mapping[str, str] = EMPTY
                      ) -> tuple[dict[str, torch.Tensor], dict[str, float]]:
    """(weights keyed `<prefix>.<module>.<weight>` in difftune's form, the scale each module's delta carries).
    Scales come from the diffusers header (peft's alpha / r), from ComfyUI `.alpha` keys (alpha / rank), or
    are 1 when the file says nothing (diffusers' rule: alpha = rank). ComfyUI/kohya files need `model_modules`
    (the module paths under `prefix`) where their names are flattened; keys of other components (e.g. text
    encoders) are skipped with a warning. A folder is read as peft's own (adapter_config.json and
    adapter_model.safetensors, as `PeftModel.save_pretrained` and `save.formats: [peft]` write it)."""
    if path.is_dir():
        state, metadata = read_peft_folder(path, prefix)
    else:
        state, metadata = read_safetensors(path)
    if not is_comfy_form(state, comfy_prefix, separator, prefix):
        # peft-named files (`.lora_A.` / `.lora_B.`) are diffusers files too, and diffusers' text-encoder names
        # (`.lora_linear_layer.`, under `text_model.`): one form from here on
        weights = {key.replace(".lora_A.", ".lora.down.").replace(".lora_B.", ".lora.up."): value
                   for key, value in from_diffusers_form(state, prefix, diffusers_renames).items()}
        if not weights:
            raise UserError(f"{path}: no adapter weights under `{prefix}.` or `{comfy_prefix}{separator}` (not an "
                             "adapter for this model family?)")
        modules = module_paths(weights, prefix)
        return weights, header_scales(metadata, prefix, modules) or dict.fromkeys(modules, 1.0)
    ours = {key: value for key, value in state.items() if key.startswith(comfy_prefix + separator)}
    if len(ours) < len(state) and not others_trained:
        log.warning("%s: skipping %d weights of other components (only %s... is trained here)", path,
                    len(state) - len(ours), comfy_prefix)
    if model_modules is None:
        if separator == "_":
            raise ValueError(f"{path}: kohya names are flattened; converting them needs the model's module names")
        model_modules = sorted({split_weight_key(k, [*FROM_COMFY, "alpha"])[0][len(comfy_prefix) + 1:]
                                for k in ours})
    weights, alphas = from_comfy(ours, {prefix: comfy_prefix}, [f"{prefix}.{m}" for m in model_modules], separator,
                                 {prefix: renames})
    modules = module_paths(weights, prefix)
    named = {m: alphas.get(f"{prefix}.{m}", float(rank_of(weights, prefix, m) or 1)) for m in modules}
    return weights, comfy_scales(weights, prefix, named)


def read_peft_folder(folder: Path, prefix: str) -> tuple[dict[str, torch.Tensor], dict[str, str]]:
    """A peft adapter folder as a diffusers-form state under `prefix` and a header holding its config."""
    config_path, weights_path = folder / PEFT_CONFIG, folder / PEFT_WEIGHTS
    if not config_path.is_file() or not weights_path.is_file():
        raise FileNotFoundError(f"{folder}: not a peft adapter folder (needs {PEFT_CONFIG} and {PEFT_WEIGHTS})")
    state, _ = read_safetensors(weights_path)
    config = json.loads(config_path.read_text(encoding="utf-8"))
    renamed = {f"{prefix}.{key.removeprefix(PEFT_KEY_PREFIX)}": value for key, value in state.items()}
    header = {f"{prefix}.{key}": value for key, value in config.items()}
    return renamed, {LORA_ADAPTER_METADATA_KEY: json.dumps(header)}


def write_peft_form(folder: Path, weights: dict[str, torch.Tensor], prefix: str, scales: dict[str, float]) -> None:
    """LoRA (DoRA included) weights as a peft adapter folder: exact per-module ranks and alphas (rank_pattern,
    alpha_pattern), so `PeftModel.from_pretrained` applies the same deltas. LoKr and LoHa are written as peft
    folders at training time (`save.formats: [peft]`), where their factorisation is known."""
    from peft import LoraConfig

    modules = sorted(scales)
    if any(f"{prefix}.{m}.lora.down.weight" not in weights for m in modules):
        raise ValueError("only LoRA (and DoRA) files convert to a peft folder; LoKr and LoHa: save.formats: [peft]")
    ranks = {m: rank_of(weights, prefix, m) for m in modules}
    config = LoraConfig(
        r=max(ranks.values()), lora_alpha=max(ranks.values()), target_modules=modules,
        rank_pattern={m: r for m, r in ranks.items()}, alpha_pattern={m: scales[m] * ranks[m] for m in modules},
        use_dora=any(key.endswith(".lora_magnitude_vector") for key in weights))
    state = {key[len(prefix) + 1:].replace(".lora.down.", ".lora_A.").replace(".lora.up.", ".lora_B."): value
             for key, value in weights.items()}
    save_peft_folder(folder, config, state)


def comfy_ready(weights: dict[str, torch.Tensor], prefix: str, scales: dict[str, float]
                ) -> tuple[dict[str, torch.Tensor], dict[str, float]]:
    """Weights and `.alpha` values that make ComfyUI apply `scales`: alpha = scale x rank, or, where ComfyUI
    applies no alpha (full LoKr factors), the scale folded into the weights."""
    folded = {m: scale for m, scale in scales.items() if not rank_of(weights, prefix, m)}
    alphas = {m: (1.0 if m in folded else scale * rank_of(weights, prefix, m)) for m, scale in scales.items()}
    return rescaled(weights, prefix, folded), alphas


def rescaled(state: dict[str, torch.Tensor], prefix: str, ratios: dict[str, float]) -> dict[str, torch.Tensor]:
    """`state` with each module's scale-carrying weight multiplied by its ratio (deltas are linear in it)."""
    out = dict(state)
    for module, ratio in ratios.items():
        if ratio == 1.0:
            continue
        for suffix in SCALE_CARRIERS:
            key = f"{prefix}.{module}.{suffix}"
            if key in out:
                out[key] = out[key] * ratio
                break
        else:
            raise ValueError(f"{module}: cannot rescale this adapter type's weights")
    return out


def load_pretrained(module: torch.nn.Module, path: Path, files: LoraFileFormat) -> None:
    """Start the adapter from a file: its weights, rescaled so that the effective deltas are the file's under
    this config's alphas (e.g. a kohya file with alpha 8 at rank 16 into a config with linear_alpha 16)."""
    load_component(denoiser_component(module, files), path)


def file_has_component(path: Path, component: LoraComponent) -> bool:
    """Whether an adapter file holds weights of this component."""
    own = (component.prefix + ".", component.comfy_prefix + component.comfy_separator)
    return any(key.startswith(own) for key in key_names(path))


def load_component(component: LoraComponent, path: Path, others_trained: bool = False) -> None:
    """`load_pretrained` for one trained component (the denoiser or a text encoder). `others_trained`: the file's
    other components are loaded too (no warning that they are skipped)."""
    module, prefix = component.module, component.prefix
    ours = module_scales(module)
    weights, scales = read_adapter_file(path, prefix, component.comfy_prefix, component.comfy_separator,
                                        module_names(module), component.comfy_renames, others_trained,
                                        component.diffusers_renames)
    problems = compare_lora_state(lora_state_dict(module, prefix, torch.float32), weights)
    if problems:
        raise UserError(f"network.pretrained_lora_path {path} does not fit network (type, ranks, targets) for "
                        f"{prefix}: " + "; ".join(problems))
    # DoRA too: its norm is taken of W + scale B A, so folding the ratio into B is exact
    ratios = {m: scales[m] / ours[m] for m in ours}
    load_lora_state(module, rescaled(weights, prefix, ratios), prefix)
    changed = sum(abs(r - 1) > 1e-9 for r in ratios.values())
    log.info("started the %s adapter from %s%s", prefix, path,
             f" ({changed} modules rescaled to this config's alphas)" if changed else "")


def write_comfy_file(path: Path, components: list[LoraComponent], dtype: torch.dtype, metadata: dict[str, str],
                     kohya_hashes: bool = False) -> None:
    """The ComfyUI/kohya form of the trained adapter (every component: `lora_unet_...`, `lora_te1_...`), with
    alphas; `kohya_hashes` adds kohya's `sshs_*`."""
    state: dict[str, torch.Tensor] = {}
    for c in components:
        weights, alphas = comfy_ready(lora_state_dict(c.module, c.prefix, torch.float32), c.prefix,
                                      module_scales(c.module))
        state.update(to_comfy(weights, {c.prefix: c.comfy_prefix}, alphas.__getitem__, c.comfy_separator,
                              {c.prefix: c.comfy_renames}, c.comfy_peft_names))
    # weights in the save dtype; alphas stay float32 (0.1 in bf16 would read back as 0.10009766)
    state = {k: v if k.endswith(".alpha") else v.to(dtype) for k, v in state.items()}
    write_safetensors(path, state, metadata, kohya_hashes)


@dataclass(frozen=True)
class ComponentNaming:
    """How one trained component's weights are named in each form: what converting a file needs (no LoRA on the
    model). `module_names`: the model's module paths under it (kohya's flattened names are matched against them;
    None where no model was loaded)."""

    prefix: str
    comfy_prefix: str
    separator: str = "_"
    renames: Mapping[str, str] = field(default_factory=dict)
    module_names: list[str] | None = None
    #: a text encoder: diffusers' loaders want its text-encoder key names in the diffusers form
    text_encoder: bool = False
    #: kohya names follow another layout that only the model's module names give (and they are missing)
    layout_unknown: bool = False
    #: module path renames of the diffusers form (a CLIP text model's `text_model.` level)
    diffusers_renames: Mapping[str, str] = field(default_factory=dict)
    #: LoRA weights named as peft does in the ComfyUI form (LoraFileFormat.comfy_peft_names)
    peft_names: bool = False

    @classmethod
    def of_files(cls, files: LoraFileFormat, names: list[str] | None = None) -> ComponentNaming:
        """The family's trained module, with the model's module names where they are known."""
        return cls(files.prefix, files.comfy_prefix, files.comfy_separator, layout_renames(files, names), names,
                   layout_unknown=files.comfy_renames is not None and not names, peft_names=files.comfy_peft_names)

    @classmethod
    def of(cls, component: LoraComponent) -> ComponentNaming:
        return cls(component.prefix, component.comfy_prefix, component.comfy_separator, component.comfy_renames,
                   module_names(component.module), component.text_encoder,
                   diffusers_renames=component.diffusers_renames, peft_names=component.comfy_peft_names)

    def in_file(self, path: Path) -> bool:
        return any(key.startswith((self.prefix + ".", self.comfy_prefix + self.separator)) for key in key_names(path))


def has_other_components(path: Path, files: LoraFileFormat) -> bool:
    """Whether an adapter file holds weights beyond the family's trained module (e.g. text encoders)."""
    own = (files.prefix + ".", files.comfy_prefix + files.comfy_separator)
    return any(not key.startswith(own) for key in key_names(path))


def convert_file(source: Path, target: Path, to: str, namings: list[ComponentNaming]) -> int:
    """Rewrite an adapter in another form (`comfy`, `diffusers`, or a `peft` folder); deltas unchanged. `namings`:
    the family's trained module first (it must be in the file), then any text encoders (converted where the file
    has them). To diffusers, the scales are folded into the weights (alpha = rank, what every diffusers loader
    assumes without a header). The header's metadata is kept, its kohya hashes recomputed for the new tensors.
    Returns the modules converted."""
    denoiser, *others = namings
    if to == "comfy" and denoiser.layout_unknown:
        raise ValueError("this family's kohya names follow another module layout; converting to them needs the "
                         "model's module names (give --model)")
    parts = []
    for naming in [denoiser, *(n for n in others if n.in_file(source))]:
        weights, scales = read_adapter_file(source, naming.prefix, naming.comfy_prefix, naming.separator,
                                            naming.module_names, naming.renames, bool(others), naming.diffusers_renames)
        parts.append((naming, weights, scales))
    count = sum(len(scales) for _, _, scales in parts)
    if to == "peft":
        if len(parts) > 1:
            raise ValueError(f"{source} holds text-encoder weights too; a peft folder holds one model: convert to "
                             "comfy or diffusers")
        write_peft_form(target, parts[0][1], denoiser.prefix, parts[0][2])
        return count
    metadata = {} if source.is_dir() else read_header(source)
    kept = {k: v for k, v in metadata.items() if k != LORA_ADAPTER_METADATA_KEY and not k.startswith("sshs_")}
    state: dict[str, torch.Tensor] = {}
    for naming, weights, scales in parts:
        if to == "comfy":
            ready, alphas = comfy_ready(weights, naming.prefix, scales)
            state.update(to_comfy(ready, {naming.prefix: naming.comfy_prefix}, alphas.__getitem__, naming.separator,
                                  {naming.prefix: naming.renames}, naming.peft_names))
        else:
            folded = rescaled(weights, naming.prefix, scales)
            state.update(to_diffusers_form(folded, naming.prefix, naming.text_encoder, naming.diffusers_renames))
    write_safetensors(target, state, kept, kohya_hashes=any(k.startswith("ss_") for k in kept))
    return count

def part_file(path: Path, part: str, parts: list[str]) -> Path:
    """The file of `part` beside `path`, a file of any of `parts` in any form (`x_high_noise.safetensors` ->
    `x_low_noise.safetensors`, `x_high_noise.diffusers.safetensors` -> `x_low_noise.diffusers.safetensors`), or
    `path` itself when it names no part."""
    stem, dot, forms = path.name.partition(".")
    for other in parts:
        if stem.endswith(f"_{other}"):
            return path.with_name(f"{stem[: -len(other) - 1]}_{part}{dot}{forms}")
    return path
