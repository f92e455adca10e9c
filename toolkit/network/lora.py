"""Adapters (peft's LoRA, LoKr, LoHa) on the model's trainable module, and their files in diffusers' format."""

from __future__ import annotations

import copy
import json
import re
from collections.abc import Mapping
from contextlib import contextmanager
from pathlib import Path

import torch
from diffusers import ModelMixin
from diffusers.loaders.lora_base import LORA_ADAPTER_METADATA_KEY
from diffusers.utils import convert_state_dict_to_diffusers, convert_unet_state_dict_to_peft
from peft import (
    LoHaConfig,
    LoKrConfig,
    LoraConfig,
    PeftConfig,
    get_peft_model_state_dict,
    inject_adapter_in_model,
    set_peft_model_state_dict,
)
from peft.tuners.tuners_utils import BaseTunerLayer
from safetensors.torch import load_file, save_file

from toolkit.config.sections import NetworkConfig
from toolkit.device import to_device
from toolkit.errors import UserError
from toolkit.files import write_atomic, write_folder_atomic
from toolkit.network.formats import renamed

#: peft adapter name of the trained adapter, and of a merged assistant LoRA while it is being merged
ADAPTER = "default"
ASSISTANT_ADAPTER = "assistant"


def name_matches(name: str, suffixes: list[str]) -> bool:
    """peft's rule: a module is a target when its full name is, or ends with `.` + , one of the names."""
    return any(name == suffix or name.endswith("." + suffix) for suffix in suffixes)


def select_targets(module: torch.nn.Module, cfg: NetworkConfig, linear_defaults: list[str],
                   conv_defaults: list[str]) -> tuple[list[str], list[str]]:
    """Full names of the modules the adapter goes on: (at the linear rank, at the conv rank). `target_modules`
    (else the family's linear defaults) at the linear rank; the family's conv layers at `conv` when it is set;
    then the only_if_contains / ignore_if_contains filters on the full names."""
    linear_names, conv_names = [], []
    for name, sub in module.named_modules():
        if cfg.only_if_contains and not any(text in name for text in cfg.only_if_contains):
            continue
        if cfg.ignore_if_contains and any(text in name for text in cfg.ignore_if_contains):
            continue
        if cfg.conv is not None and isinstance(sub, torch.nn.Conv2d) and name_matches(name, conv_defaults):
            conv_names.append(name)
        elif isinstance(sub, (torch.nn.Linear, torch.nn.Conv2d)) and name_matches(name, cfg.target_modules
                                                                                  or linear_defaults):
            linear_names.append(name)
    if not linear_names and not conv_names:
        raise UserError("network: no module matches the targets and filters (target_modules, only_if_contains, "
                         "ignore_if_contains)")
    return linear_names, conv_names


def build_network_config(cfg: NetworkConfig, linear_names: list[str], conv_names: list[str]) -> PeftConfig:
    """peft's config for `network.type`, on exactly these modules; conv layers get their own rank and alpha."""
    conv_alpha = cfg.conv_alpha if cfg.conv_alpha is not None else cfg.conv
    patterns = {"rank_pattern": {re.escape(n): cfg.conv for n in conv_names},
                "alpha_pattern": {re.escape(n): conv_alpha for n in conv_names}}
    targets = linear_names + conv_names
    if cfg.type == "lora":
        return LoraConfig(r=cfg.linear, lora_alpha=cfg.linear_alpha, lora_dropout=cfg.dropout, use_dora=cfg.use_dora,
                          init_lora_weights="gaussian", target_modules=targets, **patterns)
    config_class = {"lokr": LoKrConfig, "loha": LoHaConfig}[cfg.type]
    # peft's LyCORIS layers drop ranks and whole modules themselves (training mode only)
    # LoKr rescales kept ranks only when asked (LoHa always does), as the schema promises
    extra = {"rank_dropout_scale": True} if cfg.type == "lokr" else {}
    return config_class(r=cfg.linear, alpha=cfg.linear_alpha, rank_dropout=cfg.rank_dropout,
                        module_dropout=cfg.module_dropout, target_modules=targets, **extra, **patterns)


def add_lora(module: torch.nn.Module, cfg: NetworkConfig, default_targets: list[str],
             conv_targets: list[str] | None = None, device: torch.device | None = None) -> list[torch.nn.Parameter]:
    """Add the adapter `cfg` describes and return its parameters, in float32 (on `device` when given: a denoiser whose
    frozen weights wait on the CPU, e.g. an idle expert under low_vram, still trains its LoRA on the accelerator).
    diffusers models take it through diffusers' peft integration; other models (transformers' text encoders, whose
    own `add_adapter` wants a newer peft) through peft's `inject_adapter_in_model`, which sets the same
    `peft_config`."""
    linear_names, conv_names = select_targets(module, cfg, default_targets, conv_targets or [])
    config = build_network_config(cfg, linear_names, conv_names)
    with adapters_made_on_host(module):
        if isinstance(module, ModelMixin):
            module.add_adapter(config)
        else:
            inject_adapter_in_model(config, module, adapter_name=ADAPTER)
    if cfg.type == "lora" and (cfg.rank_dropout or cfg.module_dropout):
        add_lora_dropouts(module, cfg.rank_dropout, cfg.module_dropout)
    params = [p for p in module.parameters() if p.requires_grad]
    if not params:
        raise UserError("the adapter has no trainable parameters (check network.target_modules)")
    for param in params:
        param.data = param.data.to(device=device, dtype=torch.float32)
    return params


@contextmanager
def adapters_made_on_host(module: torch.nn.Module):
    """peft puts each new adapter layer on its base layer's device, so on a model built on the meta device (a sharded
    base, filled later: toolkit/run/sharding.py) the adapter's initial values would be lost. Inside this block each
    meta parameter is stood in for by a CPU tensor of its shape and dtype that takes no memory (one element, expanded),
    so peft makes the adapter on the CPU in the base's dtype, from the same random stream as on a loaded model; the
    meta parameters are put back after. (peft has no option for it.) Nothing in peft may read the base's values
    meanwhile: DoRA, whose magnitudes start from them, is refused with sharding at config time."""
    held = [(owner, name, param) for owner in module.modules() for name, param in owner._parameters.items()
            if param is not None and param.device.type == "meta"]
    for owner, name, param in held:
        stand_in = torch.empty((), dtype=param.dtype).expand(param.shape)
        owner._parameters[name] = torch.nn.Parameter(stand_in, requires_grad=False)
    try:
        yield
    finally:
        for owner, name, param in held:
            owner._parameters[name] = param


def adapter_layers(module: torch.nn.Module) -> dict[str, BaseTunerLayer]:
    """The adapter's layers by full module name."""
    return {name: layer for name, layer in module.named_modules()
            if isinstance(layer, BaseTunerLayer) and ADAPTER in getattr(layer, "r", {})}


def module_scales(module: torch.nn.Module) -> dict[str, float]:
    """The factor peft applies to each adapted module's product (alpha / rank), by full module name."""
    return {name: float(layer.scaling[ADAPTER]) for name, layer in adapter_layers(module).items()}


def effective_deltas(module: torch.nn.Module) -> dict[str, torch.Tensor]:
    """What the adapter adds to each adapted weight (scale included), by module name: the quantity every file
    form must preserve."""
    with torch.no_grad():
        return {name: layer.get_delta_weight(ADAPTER).detach().float().cpu()
                for name, layer in adapter_layers(module).items()}


def lora_state_dict(module: torch.nn.Module, prefix: str, dtype: torch.dtype) -> dict[str, torch.Tensor]:
    """The adapter's weights under `prefix`, on the CPU: LoRA in diffusers' form (`.lora.down.weight`), LoKr and
    LoHa with peft's (LyCORIS's) names (`.lokr_w1`, `.hada_w1_a`, ...), which diffusers has no other form for."""
    state = get_peft_model_state_dict(module)
    if is_lora(module):
        state = convert_state_dict_to_diffusers(state)
        # diffusers' converter renames only modules it knows (e.g. not Z-Image's feed_forward.w1): finish the job,
        # so every key has one form; its loaders map `.lora.down` / `.lora.up` back to peft either way
        # ... and its text-encoder names (`.lora_linear_layer.down`) take the same form
        state = {key.replace(".lora_A.", ".lora.down.").replace(".lora_B.", ".lora.up.")
                 .replace(".lora_linear_layer.down.", ".lora.down.").replace(".lora_linear_layer.up.", ".lora.up."): value
                 for key, value in state.items()}
    return {f"{prefix}.{key}": value.detach().to("cpu", dtype).contiguous() for key, value in state.items()}


def is_lora(module: torch.nn.Module) -> bool:
    return module.peft_config[ADAPTER].peft_type.value == "LORA"


def packed_config(module: torch.nn.Module, prefix: str) -> dict:
    config = module.peft_config["default"].to_dict()
    return {f"{prefix}.{key}": sorted(value) if isinstance(value, set) else value for key, value in config.items()}


def adapter_metadata(module: torch.nn.Module, prefix: str) -> str:
    """The peft config as diffusers stores it in a LoRA header, so that alpha and targets load back."""
    return json.dumps(packed_config(module, prefix), indent=2, sort_keys=True, default=str)


def components_state_dict(components, dtype: torch.dtype) -> dict[str, torch.Tensor]:
    """The adapter weights of every trained component (`LoraComponent`s), each under its prefix."""
    state: dict[str, torch.Tensor] = {}
    for component in components:
        state.update(lora_state_dict(component.module, component.prefix, dtype))
    return state


def to_diffusers_form(state: dict[str, torch.Tensor], prefix: str, text_encoder: bool,
                      renames: Mapping[str, str]) -> dict[str, torch.Tensor]:
    """A component's LoRA weights (keys `<prefix>.<path>.lora.down.weight`) as diffusers' loaders read them: a text
    encoder's paths renamed (`renames`: its `text_model.` level) and its weights named as diffusers' text-encoder
    loader wants (`.lora_linear_layer.down`; it refuses `.lora.down`, which its UNet loader takes)."""
    if not text_encoder:
        return state
    out = {}
    for key, value in state.items():
        path = renamed(key[len(prefix) + 1:], renames)
        out[f"{prefix}.{path}".replace(".lora.down.", ".lora_linear_layer.down.")
            .replace(".lora.up.", ".lora_linear_layer.up.")] = value
    return out


def from_diffusers_form(state: dict[str, torch.Tensor], prefix: str, renames: Mapping[str, str]
                        ) -> dict[str, torch.Tensor]:
    """The inverse of `to_diffusers_form` for the keys under `prefix` (other keys are left out)."""
    back = {theirs: ours for ours, theirs in renames.items()}
    out = {}
    for key, value in state.items():
        if key.startswith(prefix + "."):
            path = renamed(key[len(prefix) + 1:], back).replace(".lora_linear_layer.", ".lora.")
            out[f"{prefix}.{path}"] = value
    return out


def read_components_file(path: Path, components) -> dict[str, torch.Tensor]:
    """A file `write_components_file` wrote, its keys back in the one form the state dicts here use."""
    state = load_file(str(path))
    out: dict[str, torch.Tensor] = {}
    for component in components:
        out.update(from_diffusers_form(state, component.prefix, component.diffusers_renames))
    claimed = {key for key in state if any(key.startswith(c.prefix + ".") for c in components)}
    out.update({key: value for key, value in state.items() if key not in claimed})  # reported as unexpected
    return out


def write_components_file(path: Path, components, dtype: torch.dtype, metadata: dict[str, str],
                          kohya_hashes: bool = False) -> None:
    """The diffusers-form file of every trained component (the UNet and any text encoders, as diffusers'
    `save_lora_weights` writes them), with each component's peft config in the header."""
    packed: dict = {}
    for component in components:
        packed.update(packed_config(component.module, component.prefix))
    header = {LORA_ADAPTER_METADATA_KEY: json.dumps(packed, indent=2, sort_keys=True, default=str), **metadata}
    state: dict[str, torch.Tensor] = {}
    for c in components:
        state.update(to_diffusers_form(lora_state_dict(c.module, c.prefix, dtype), c.prefix, c.text_encoder,
                                       c.diffusers_renames))
    write_safetensors(path, state, header, kohya_hashes)


def write_safetensors(path: Path, state: dict[str, torch.Tensor], metadata: dict[str, str],
                      kohya_hashes: bool = False) -> None:
    """Write atomically (temporary name, then rename): a crash never leaves half a file. `kohya_hashes` adds the
    `sshs_*` hashes A1111/Forge index LoRAs by (of these exact tensors)."""
    if kohya_hashes:
        from toolkit.network.metadata import kohya_hashes as hashes

        metadata = {**metadata, **hashes(state, metadata)}
    write_atomic(path, lambda tmp: save_file(state, str(tmp), metadata={"format": "pt", **metadata}))


def write_lora_file(path: Path, state: dict[str, torch.Tensor], metadata: dict[str, str], module, prefix: str,
                    kohya_hashes: bool = False) -> None:
    """A diffusers-format LoRA file, with the peft config in the header so alpha loads back."""
    write_safetensors(path, state, {LORA_ADAPTER_METADATA_KEY: adapter_metadata(module, prefix), **metadata},
                      kohya_hashes)


#: peft's adapter folder: what PeftModel.save_pretrained writes and from_pretrained reads
PEFT_WEIGHTS, PEFT_CONFIG, PEFT_KEY_PREFIX = "adapter_model.safetensors", "adapter_config.json", "base_model.model."


def save_peft_folder(folder: Path, config: PeftConfig, state: dict[str, torch.Tensor]) -> None:
    """A peft adapter folder from its config and its weights under peft's module names (without the
    `base_model.model.` prefix PeftModel adds), written atomically."""
    prefixed = {PEFT_KEY_PREFIX + key: value.contiguous() for key, value in state.items()}

    def write(tmp: Path) -> None:
        config.save_pretrained(str(tmp))
        save_file(prefixed, str(tmp / PEFT_WEIGHTS), metadata={"format": "pt"})

    write_folder_atomic(folder, write)


def write_peft_folder(folder: Path, module: torch.nn.Module, dtype: torch.dtype = torch.float32) -> None:
    """The trained adapter as peft's own save_pretrained writes it, so that
    `PeftModel.from_pretrained(<the trained module's base>, folder)` loads it."""
    state = {key: value.detach().to("cpu", dtype) for key, value in get_peft_model_state_dict(module).items()}
    save_peft_folder(folder, copy.deepcopy(module.peft_config[ADAPTER]), state)


def merge_lora_state(module: torch.nn.Module, state: dict[str, torch.Tensor], prefix: str,
                     metadata: dict | None = None, network_alphas: dict[str, float] | None = None) -> None:
    """Merge a LoRA (diffusers keys under `prefix`; alphas from `metadata`, the peft config of its header, or from
    `network_alphas`, the file's `.alpha` keys as a pipeline's `lora_state_dict` returns them) into `module`'s
    weights and drop its layers: a frozen assistant adapter costs nothing afterwards. Merge before quantizing;
    peft's merge into quantized weights is wrong."""
    module.load_lora_adapter(state, prefix=prefix, adapter_name=ASSISTANT_ADAPTER, metadata=metadata,
                             network_alphas=network_alphas or None)
    module.fuse_lora(adapter_names=[ASSISTANT_ADAPTER])
    module.unload_lora()


class LoraMirror:
    """The trained adapter carried by a second model of the same structure (e.g. a separate sampling
    transformer): its adapter layers hold the very modules and parameters of the trained model, so they can
    never go stale. `detached()` takes them out while the mirror moves between devices, so that moving it
    leaves the trained adapter where it is."""

    def __init__(self, mirror: torch.nn.Module, layers: list[tuple[BaseTunerLayer, BaseTunerLayer]]):
        self.mirror = mirror
        self.layers = layers  # (mirror layer, trained layer)

    @staticmethod
    def parts(layer: BaseTunerLayer) -> list[str]:
        """The layer's per-adapter containers (LoRA's lora_A/lora_B/dropout/DoRA magnitude, LyCORIS's weights)."""
        names = dict.fromkeys([*layer.adapter_layer_names, "lora_dropout"])
        return [n for n in names if ADAPTER in getattr(layer, n, {})]

    def shared_parameters(self) -> list[tuple[torch.nn.Parameter, torch.nn.Parameter]]:
        """(mirror's, trained) adapter parameter pairs, for checks."""
        pairs = []
        for layer, source in self.layers:
            for part in self.parts(source):
                mine, theirs = getattr(layer, part)[ADAPTER], getattr(source, part)[ADAPTER]
                if isinstance(theirs, torch.nn.Parameter):
                    pairs.append((mine, theirs))
                else:
                    pairs += list(zip(mine.parameters(), theirs.parameters()))
        return pairs

    @contextmanager
    def detached(self):
        held = [(layer, part) for layer, source in self.layers for part in self.parts(source)]
        for layer, part in held:
            del getattr(layer, part)[ADAPTER]
        try:
            yield
        finally:
            self.attach()

    def attach(self) -> None:
        for layer, source in self.layers:
            for part in self.parts(source):
                getattr(layer, part)[ADAPTER] = getattr(source, part)[ADAPTER]


def mirror_lora(trained: torch.nn.Module, mirror: torch.nn.Module) -> LoraMirror:
    """Give `mirror` the adapter of `trained` (after `add_lora` on it) by sharing its adapter layers' modules
    and parameters. The mirror's own layer wrappers stay in eval mode (sampling); the shared parts follow the
    trained model's mode."""
    mirror.add_adapter(copy.deepcopy(trained.peft_config[ADAPTER]))
    sources, layers = adapter_layers(trained), adapter_layers(mirror)
    if sorted(layers) != sorted(sources):
        missing = sorted(set(sources) ^ set(layers))[:3]
        raise ValueError(f"the mirrored model's adapter layers differ from the trained model's (e.g. {missing})")
    mirror_layers = [(layer, sources[name]) for name, layer in layers.items()]
    for layer, _ in mirror_layers:
        layer.train(False)  # before sharing: afterwards this would reach the trained parts too
    shared = LoraMirror(mirror, mirror_layers)
    shared.attach()
    return shared


def compare_lora_state(expected: dict[str, torch.Tensor], found: dict[str, torch.Tensor]) -> list[str]:
    """Differences between two LoRA state dicts (keys and shapes), in words; empty when they match."""
    problems = []
    missing, unexpected = sorted(set(expected) - set(found)), sorted(set(found) - set(expected))
    if missing:
        problems.append(f"{len(missing)} LoRA weights of the current config are not in it (e.g. {missing[0]})")
    if unexpected:
        problems.append(f"{len(unexpected)} of its LoRA weights are not in the current config (e.g. {unexpected[0]})")
    for key in sorted(set(expected) & set(found)):
        if expected[key].shape != found[key].shape:
            ours, theirs = tuple(expected[key].shape), tuple(found[key].shape)
            problems.append(f"{key}: shape {theirs} in the checkpoint vs {ours} now"
                            + (f" (rank {min(theirs)} vs {min(ours)})" if "lora" in key else ""))
            break
    return problems


def load_lora_file(module: torch.nn.Module, path: Path, prefix: str) -> None:
    """Load an adapter file written by `write_lora_file` back into the module's peft adapter."""
    load_lora_state(module, load_file(str(path)), prefix, str(path))


def load_lora_state(module: torch.nn.Module, state: dict[str, torch.Tensor], prefix: str,
                    source: str = "adapter weights") -> None:
    """Load difftune/diffusers-keyed adapter weights (under `prefix`) into the module's peft adapter as they are."""
    inner = {key[len(prefix) + 1:]: value for key, value in state.items() if key.startswith(f"{prefix}.")}
    if is_lora(module):
        inner = convert_unet_state_dict_to_peft(inner)
    result = set_peft_model_state_dict(module, inner, adapter_name=ADAPTER)
    unexpected = getattr(result, "unexpected_keys", None)
    if unexpected:
        raise ValueError(f"{source}: weights that match no adapter layer: {unexpected[:3]}")


def add_lora_dropouts(module: torch.nn.Module, rank_dropout: float, module_dropout: float) -> int:
    """Rank and module dropout (kohya's options, which peft lacks) as forward hooks on each LoRA down
    projection, active in training mode only. Returns how many LoRA layers got them.

    - module dropout: with probability `module_dropout` per forward pass, the layer's LoRA output is 0;
    - rank dropout: each rank channel of each sample is zeroed with probability `rank_dropout`, and the
      kept ones are scaled by 1 / (1 - rank_dropout), so the expected update is unchanged.
    Draws use the global torch RNG, like torch's dropout, whose per-rank state checkpoints keep.
    """

    def hook(down: torch.nn.Module, inputs, output: torch.Tensor) -> torch.Tensor:
        if not down.training:
            return output
        if module_dropout and torch.rand(()).item() < module_dropout:
            return output * 0.0  # not zeros_like: the layer stays in the graph, so DDP sees its (zero) grads
        if rank_dropout:
            shape = (output.shape[0],) + (1,) * (output.dim() - 2) + (output.shape[-1],)
            keep = to_device(torch.rand(shape) >= rank_dropout, output.device, output.dtype)  # host draw, no wait
            return output * keep / (1 - rank_dropout)
        return output

    layers = [m for m in module.modules() if hasattr(m, "lora_A") and "default" in getattr(m, "lora_A", {})]
    for layer in layers:
        layer.lora_A["default"].register_forward_hook(hook)
    return len(layers)
