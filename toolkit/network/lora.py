"""LoRA through peft on the model's trainable module, and LoRA files in diffusers' format."""

from __future__ import annotations

import json
import os
from pathlib import Path

import torch
from diffusers.loaders.lora_base import LORA_ADAPTER_METADATA_KEY
from diffusers.utils import convert_state_dict_to_diffusers, convert_unet_state_dict_to_peft
from peft import LoraConfig, get_peft_model_state_dict, set_peft_model_state_dict
from safetensors.torch import load_file, save_file

from ..config.schema import NetworkConfig


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
    return {f"{prefix}.{key}": value.detach().to("cpu", dtype).contiguous() for key, value in state.items()}


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
