"""LoRA through peft on the model's trainable module, and LoRA files in diffusers' format."""

from __future__ import annotations

import json
import os
from contextlib import contextmanager
from pathlib import Path

import torch
from diffusers.loaders.lora_base import LORA_ADAPTER_METADATA_KEY
from diffusers.utils import convert_state_dict_to_diffusers, convert_unet_state_dict_to_peft
from peft import LoraConfig, get_peft_model_state_dict, set_peft_model_state_dict
from peft.tuners.lora import LoraLayer
from safetensors.torch import load_file, save_file

from ..config.schema import NetworkConfig

#: peft adapter name of a merged assistant LoRA while it is being merged
ASSISTANT_ADAPTER = "assistant"


def build_lora_config(cfg: NetworkConfig, default_targets: list[str]) -> LoraConfig:
    return LoraConfig(
        r=cfg.linear,
        lora_alpha=cfg.linear_alpha,
        lora_dropout=cfg.dropout,
        init_lora_weights="gaussian",
        target_modules=cfg.target_modules or default_targets,
    )


def add_lora(module: torch.nn.Module, cfg: NetworkConfig, default_targets: list[str]) -> list[torch.nn.Parameter]:
    """Add a LoRA adapter (diffusers' peft integration) and return its parameters, kept in float32."""
    module.add_adapter(build_lora_config(cfg, default_targets))
    if cfg.rank_dropout or cfg.module_dropout:
        add_lora_dropouts(module, cfg.rank_dropout, cfg.module_dropout)
    params = [p for p in module.parameters() if p.requires_grad]
    if not params:
        raise ValueError("the LoRA adapter has no trainable parameters (check network.target_modules)")
    for param in params:
        param.data = param.data.float()
    return params


def lora_state_dict(module: torch.nn.Module, prefix: str, dtype: torch.dtype) -> dict[str, torch.Tensor]:
    """The adapter's weights with diffusers' keys (`<prefix>.<module>.lora.down.weight`), on the CPU."""
    state = convert_state_dict_to_diffusers(get_peft_model_state_dict(module))
    # diffusers' converter renames only modules it knows (e.g. not Z-Image's feed_forward.w1): finish the job, so
    # every key has one form; its loaders map `.lora.down` / `.lora.up` back to peft either way
    return {f"{prefix}.{key.replace('.lora_A.', '.lora.down.').replace('.lora_B.', '.lora.up.')}":
            value.detach().to("cpu", dtype).contiguous() for key, value in state.items()}


def adapter_metadata(module: torch.nn.Module, prefix: str) -> str:
    """The peft config as diffusers stores it in a LoRA header, so that alpha and targets load back."""
    config = module.peft_config["default"].to_dict()
    packed = {f"{prefix}.{key}": sorted(value) if isinstance(value, set) else value for key, value in config.items()}
    return json.dumps(packed, indent=2, sort_keys=True, default=str)


def write_safetensors(path: Path, state: dict[str, torch.Tensor], metadata: dict[str, str]) -> None:
    """Write atomically (temporary name, then rename): a crash never leaves half a file."""
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.tmp")
    save_file(state, str(tmp), metadata={"format": "pt", **metadata})
    os.replace(tmp, path)


def write_lora_file(path: Path, state: dict[str, torch.Tensor], metadata: dict[str, str], module, prefix: str) -> None:
    """A diffusers-format LoRA file, with the peft config in the header so alpha loads back."""
    write_safetensors(path, state, {LORA_ADAPTER_METADATA_KEY: adapter_metadata(module, prefix), **metadata})


def merge_lora_state(module: torch.nn.Module, state: dict[str, torch.Tensor], prefix: str,
                     metadata: dict | None = None) -> None:
    """Merge a LoRA (diffusers keys under `prefix`; `metadata`: the peft config from its header, which carries
    alpha) into `module`'s weights and drop its layers: a frozen assistant adapter costs nothing afterwards.
    Merge before quantizing; peft's merge into quantized weights is wrong."""
    module.load_lora_adapter(state, prefix=prefix, adapter_name=ASSISTANT_ADAPTER, metadata=metadata)
    module.fuse_lora(adapter_names=[ASSISTANT_ADAPTER])
    module.unload_lora()


class LoraMirror:
    """The trained LoRA carried by a second model of the same structure (e.g. a separate sampling
    transformer): its LoRA layers hold the very modules of the trained model, so they share parameters and can
    never go stale. `detached()` takes them out while the mirror moves between devices, so that moving it
    leaves the trained LoRA where it is."""

    PARTS = ("lora_A", "lora_B", "lora_dropout")

    def __init__(self, mirror: torch.nn.Module, layers: list[tuple[torch.nn.Module, torch.nn.Module]]):
        self.mirror = mirror
        self.layers = layers  # (mirror layer, trained layer)

    def shared_parameters(self) -> list[tuple[torch.nn.Parameter, torch.nn.Parameter]]:
        """(mirror's, trained) LoRA parameter pairs, for checks."""
        return [(mine, theirs) for layer, source in self.layers for part in ("lora_A", "lora_B")
                for mine, theirs in zip(getattr(layer, part).parameters(), getattr(source, part).parameters())]

    @contextmanager
    def detached(self):
        for layer, _ in self.layers:
            for part in self.PARTS:
                del getattr(layer, part)["default"]
        try:
            yield
        finally:
            for layer, source in self.layers:
                for part in self.PARTS:
                    getattr(layer, part)["default"] = getattr(source, part)["default"]


def mirror_lora(trained: torch.nn.Module, mirror: torch.nn.Module, cfg: NetworkConfig,
                default_targets: list[str]) -> LoraMirror:
    """Give `mirror` the LoRA of `trained` (after `add_lora` on it) by sharing its LoRA modules."""
    mirror.add_adapter(build_lora_config(cfg, default_targets))
    sources = {name: module for name, module in trained.named_modules() if isinstance(module, LoraLayer)}
    layers = []
    for name, layer in mirror.named_modules():
        if not isinstance(layer, LoraLayer):
            continue
        if name not in sources:
            raise ValueError(f"the LoRA layer {name} of the mirrored model has no counterpart in the trained model")
        layers.append((layer, sources[name]))
    if len(layers) != len(sources):
        raise ValueError(f"the mirrored model has {len(layers)} LoRA layers, the trained model {len(sources)}")
    for layer, source in layers:
        for part in LoraMirror.PARTS:
            getattr(layer, part)["default"] = getattr(source, part)["default"]
    return LoraMirror(mirror, layers)


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
    """Load a LoRA file written by `write_lora_file` back into the module's peft adapter."""
    state = load_file(str(path))
    inner = {key[len(prefix) + 1:]: value for key, value in state.items() if key.startswith(f"{prefix}.")}
    result = set_peft_model_state_dict(module, convert_unet_state_dict_to_peft(inner), adapter_name="default")
    unexpected = getattr(result, "unexpected_keys", None)
    if unexpected:
        raise ValueError(f"{path}: weights that match no LoRA layer: {unexpected[:3]}")


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
            keep = (torch.rand(shape) >= rank_dropout).to(output.device, output.dtype)
            return output * keep / (1 - rank_dropout)
        return output

    layers = [m for m in module.modules() if hasattr(m, "lora_A") and "default" in getattr(m, "lora_A", {})]
    for layer in layers:
        layer.lora_A["default"].register_forward_hook(hook)
    return len(layers)
