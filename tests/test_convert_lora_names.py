"""`run.py --convert-lora` resolves kohya's names against module names built from configs alone: the full-size
published layout (no file at all), a diffusers folder's configs, or a single file's header. No weight file is read:
the tests turn every weight reader of safetensors and torch into an error for any file but the LoRA's own."""

from __future__ import annotations

from pathlib import Path

import pytest
import safetensors
import safetensors.torch
import torch
from safetensors.torch import load_file, save_file

import run
from toolkit.models.sd15.adapter import SD15Adapter
from toolkit.models.sdxl.adapter import SDXLAdapter


@pytest.fixture
def no_weights_read(monkeypatch, tmp_path):
    """Every safetensors / torch weight read of a file outside tmp_path/lora fails the test: the readers are replaced
    wherever they are bound (safetensors', torch's, and the names diffusers, transformers and difftune imported)."""
    import sys

    # imported first, so the names they bind are replaced (a module first imported while the readers are replaced
    # would keep this test's guards for good)
    import diffusers.models.model_loading_utils  # noqa: F401
    import transformers.modeling_utils  # noqa: F401

    import toolkit.network.files  # noqa: F401
    import toolkit.network.lora  # noqa: F401
    import toolkit.quantize  # noqa: F401

    allowed = tmp_path / "lora"
    allowed.mkdir()
    originals = {id(f): f for f in (safetensors.safe_open, safetensors.torch.safe_open, safetensors.torch.load_file,
                                    torch.load)}

    def guard(original):
        def read(path, *args, **kwargs):
            if not Path(str(path)).resolve().is_relative_to(allowed.resolve()):
                pytest.fail(f"a weight file was read: {path}")
            return original(path, *args, **kwargs)
        return read

    guards = {key: guard(f) for key, f in originals.items()}
    for name, module in list(sys.modules.items()):
        if module is None or not name.startswith(("safetensors", "torch", "diffusers", "transformers", "toolkit")):
            continue
        for attribute in ("safe_open", "load_file", "safe_load_file", "load"):
            value = getattr(module, attribute, None)
            if id(value) in guards and (name == "torch" or attribute != "load"):
                monkeypatch.setattr(module, attribute, guards[id(value)])
    return allowed


def kohya_targets(adapter) -> list[str]:
    """The UNet modules the family's LoRA targets (diffusers' paths)."""
    endings = tuple(adapter.lora_target_modules())
    return [name for name, module in adapter.unet.named_modules()
            if isinstance(module, torch.nn.Linear) and name.endswith(endings)]


def test_the_published_layouts_are_built_on_the_meta_device():
    for family, modules in ((SD15Adapter, 128), (SDXLAdapter, 722)):
        adapter = family.for_module_names(None)
        assert all(p.device.type == "meta" for p in adapter.unet.parameters())
        assert all(p.device.type == "meta" for p in adapter.text_encoder.parameters())
        assert len(kohya_targets(adapter)) == modules, family.arch


def test_a_full_size_sdxl_lora_converts_to_kohyas_names_with_no_model_at_all(no_weights_read, tmp_path):
    """A diffusers-form LoRA of the full-size SDXL UNet (rank 1) -> kohya's names in the original UNet layout
    (`input_blocks`, `middle_block`, `output_blocks`), from the published configs alone."""
    meta = SDXLAdapter.for_module_names(None)
    state = {}
    for name in kohya_targets(meta):
        linear = meta.unet.get_submodule(name)
        state[f"unet.{name}.lora.down.weight"] = torch.randn(1, linear.in_features)
        state[f"unet.{name}.lora.up.weight"] = torch.randn(linear.out_features, 1)
    source, target = no_weights_read / "full.safetensors", no_weights_read / "kohya.safetensors"
    save_file(state, str(source), metadata={"difftune_arch": "sdxl"})
    assert run.main(["--convert-lora", str(source), str(target), "--to", "comfy"]) == 0
    names = {key.split(".")[0] for key in load_file(str(target))}
    assert len(names) == 722  # kohya's SDXL UNet modules
    assert "lora_unet_input_blocks_4_1_transformer_blocks_0_attn1_to_q" in names
    assert "lora_unet_middle_block_1_transformer_blocks_9_ff_net_2" in names


def test_a_kohya_file_converts_back_against_a_folders_configs(no_weights_read, tmp_path, tiny_sd15):
    """The tiny preset's folder gives its configs only (`--model`): kohya's flattened names resolve against them."""
    from peft import LoraConfig, inject_adapter_in_model

    from toolkit.models.base import denoiser_component
    from toolkit.network.files import write_comfy_file

    adapter = SD15Adapter.for_module_names(str(tiny_sd15))
    targets = kohya_targets(adapter)
    unet = adapter.unet.to_empty(device="cpu")
    inject_adapter_in_model(LoraConfig(r=2, lora_alpha=2, target_modules=adapter.lora_target_modules()), unet)
    comfy = no_weights_read / "kohya.safetensors"
    write_comfy_file(comfy, [denoiser_component(unet, adapter.files)], torch.float32, {"difftune_arch": "sd15"})
    back = no_weights_read / "back.safetensors"
    assert run.main(["--convert-lora", str(comfy), str(back), "--to", "diffusers", "--model", str(tiny_sd15)]) == 0
    keys = load_file(str(back)).keys()
    assert "unet.down_blocks.0.attentions.0.transformer_blocks.0.attn1.to_q.lora.down.weight" in keys
    assert len(keys) == 2 * len(targets) and targets
