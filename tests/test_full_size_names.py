"""The primary LoRA file's key names for the full-size models (built on the meta device: module names only, no
weights): exactly the names ComfyUI/kohya give those models' modules, and diffusers' own converter for such files
maps every one of them back to a module of the full-size model."""

from __future__ import annotations

import pytest
import torch
from diffusers import (
    FluxPipeline,
    FluxTransformer2DModel,
    QwenImagePipeline,
    QwenImageTransformer2DModel,
    UNet2DConditionModel,
    WanPipeline,
    WanTransformer3DModel,
    ZImageTransformer2DModel,
)
from diffusers.loaders.lora_conversion_utils import (
    _convert_non_diffusers_lora_to_diffusers,
    _convert_non_diffusers_qwen_lora_to_diffusers,
    _convert_non_diffusers_wan_lora_to_diffusers,
    _convert_non_diffusers_z_image_lora_to_diffusers,
    _maybe_map_sgm_blocks_to_diffusers,
)
from diffusers.utils import convert_unet_state_dict_to_peft

from benchmarks.full_size import (
    FLUX_FULL,
    QWEN_IMAGE_FULL,
    SD15_FULL,
    SDXL_FULL,
    WAN22_A14B_FULL,
    ZIMAGE_FULL,
)
from toolkit.config.sections import NetworkConfig
from toolkit.models.flux.adapter import flux_lora_targets
from toolkit.models.qwen_image.adapter import qwen_lora_targets
from toolkit.models.registry import get_adapter_class
from toolkit.models.wan.adapter import BLOCK_TARGETS as wan_block_targets
from toolkit.network.files import comfy_ready, layout_renames, module_names
from toolkit.network.formats import to_comfy
from toolkit.network.lora import adapter_layers, add_lora, lora_state_dict, module_scales


def full_size(arch: str) -> torch.nn.Module:
    with torch.device("meta"):
        if arch in ("sd15", "sdxl"):
            return UNet2DConditionModel(**{"sd15": SD15_FULL, "sdxl": SDXL_FULL}[arch]["unet"])
        if arch in ("flux", "flux_kontext"):  # FLUX.1 Kontext [dev]: the [dev] transformer's config
            return FluxTransformer2DModel(**FLUX_FULL["transformer"])
        if arch in ("qwen_image", "qwen_image_edit"):  # the editing models keep Qwen-Image's transformer
            return QwenImageTransformer2DModel(**QWEN_IMAGE_FULL["transformer"])
        if arch == "wan":
            return WanTransformer3DModel(**WAN22_A14B_FULL["transformers"][0])
        return ZImageTransformer2DModel(**ZIMAGE_FULL["transformer"])


def default_targets(arch: str, module: torch.nn.Module, family) -> list[str]:
    """The family's default LoRA targets for this module (FLUX.1's and Qwen-Image's depend on its block count)."""
    if arch in ("flux", "flux_kontext"):
        return flux_lora_targets(module)
    if arch in ("qwen_image", "qwen_image_edit"):
        return qwen_lora_targets(len(module.transformer_blocks))
    if arch == "wan":
        return [f"blocks.{i}.{target}" for i in range(len(module.blocks)) for target in wan_block_targets]
    return family.lora_target_modules(None)


def primary_state(arch: str, network: NetworkConfig) -> tuple[torch.nn.Module, dict[str, torch.Tensor], list[str]]:
    """The full-size module with the adapter (its weights materialised as zeros on the CPU, the base left on the
    meta device), the primary file's state as the trainer writes it, and the adapted module paths."""
    family = get_adapter_class(arch)
    module = full_size(arch)
    module.requires_grad_(False)
    targets = default_targets(arch, module, family)
    add_lora(module, network, targets, family.conv_target_modules(None))
    for layer in adapter_layers(module).values():
        for part in ("lora_A", "lora_B"):
            getattr(layer, part).to_empty(device="cpu")
    with torch.no_grad():
        for name, param in module.named_parameters():
            if "lora_" in name:
                param.zero_()
    files = family.files
    weights, alphas = comfy_ready(lora_state_dict(module, files.prefix, torch.float32), files.prefix,
                                  module_scales(module))
    renames = {files.prefix: layout_renames(files, module_names(module))}
    state = to_comfy(weights, {files.prefix: files.comfy_prefix}, alphas.__getitem__, files.comfy_separator, renames,
                     files.comfy_peft_names)
    return module, state, sorted(adapter_layers(module))


def modules_named(state: dict[str, torch.Tensor]) -> set[str]:
    return {key.rsplit(".", 2)[0] if key.endswith(".weight") else key.rsplit(".", 1)[0] for key in state}


def test_sd15_primary_names_are_kohyas_for_the_full_size_unet():
    """kohya/ComfyUI/A1111 name an SD 1.x module `lora_unet_` + its diffusers path with `_` for `.` (ComfyUI
    builds them from unet_to_diffusers, A1111 converts them to its LDM names)."""
    network = NetworkConfig(linear=4, linear_alpha=4, conv=2, conv_alpha=1)
    module, state, adapted = primary_state("sd15", network)
    attention = [path for path in adapted if ".attn" in path]
    assert len(attention) == 16 * 2 * 4  # q, k, v, out of both attentions of SD 1.5's 16 transformer blocks
    assert len(adapted) - len(attention) > 40  # the resnet, shortcut and resampling convs (LoCon)
    assert modules_named(state) == {"lora_unet_" + path.replace(".", "_") for path in adapted}
    assert "lora_unet_mid_block_attentions_0_transformer_blocks_0_attn2_to_k" in modules_named(state)
    assert "lora_unet_up_blocks_3_resnets_2_conv_shortcut" in modules_named(state)
    converted, alphas = _convert_non_diffusers_lora_to_diffusers(dict(state))
    # what load_lora_weights does next: attention-processor names to module names
    unet = convert_unet_state_dict_to_peft({k.removeprefix("unet."): v for k, v in converted.items()})
    back = {key.rsplit(".lora_", 1)[0] for key in unet}
    assert back == set(adapted) and len(alphas) == len(adapted)
    names = dict(module.named_modules())
    assert all(path in names for path in back)


def test_sdxl_primary_names_are_kohyas_for_the_full_size_unet():
    """kohya trains SDXL on the original UNet and names its modules by it (`input_blocks` / `middle_block` /
    `output_blocks`); ComfyUI, A1111/Forge and diffusers read those names. Every linear layer of SDXL's 70
    transformer blocks and 11 transformer models (kohya's 722 UNet modules) and the LoCon convs."""
    network = NetworkConfig(linear=4, linear_alpha=4, conv=2, conv_alpha=1)
    module, state, adapted = primary_state("sdxl", network)
    linear = [path for path in adapted if "attentions" in path]
    assert len(linear) == 722
    named = modules_named(state)
    for kohya in ("lora_unet_input_blocks_4_1_transformer_blocks_0_attn1_to_q",
                  "lora_unet_input_blocks_8_1_transformer_blocks_9_ff_net_2",
                  "lora_unet_middle_block_1_transformer_blocks_9_attn2_to_out_0",
                  "lora_unet_middle_block_1_proj_in",
                  "lora_unet_output_blocks_0_1_transformer_blocks_9_ff_net_0_proj",
                  "lora_unet_output_blocks_5_1_proj_out",
                  "lora_unet_input_blocks_1_0_in_layers_2", "lora_unet_input_blocks_3_0_op",
                  "lora_unet_output_blocks_2_2_conv", "lora_unet_output_blocks_8_0_skip_connection"):
        assert kohya in named, kohya
    assert not any("down_blocks" in name or "up_blocks" in name for name in named)
    # what StableDiffusionXLPipeline.load_lora_weights does: block numbers remapped by the UNet's config, then renamed
    remapped = _maybe_map_sgm_blocks_to_diffusers(dict(state), module.config)
    converted, alphas = _convert_non_diffusers_lora_to_diffusers(remapped)
    unet = convert_unet_state_dict_to_peft({k.removeprefix("unet."): v for k, v in converted.items()})
    back = {key.rsplit(".lora_", 1)[0] for key in unet}
    assert back == set(adapted) and len(alphas) == len(adapted)


def test_zimage_primary_names_are_comfyuis_for_the_full_size_transformer():
    """ComfyUI maps Z-Image LoRAs by `diffusion_model.<diffusers module path>` (to_q/to_k/to_v onto its fused
    qkv); diffusers' Z-Image converter reads the same names back to the transformer's modules."""
    network = NetworkConfig(linear=4, linear_alpha=4, target_modules=["to_q", "to_k", "to_v", "to_out.0",
                                                                      "feed_forward.w1", "feed_forward.w2",
                                                                      "feed_forward.w3"])
    module, state, adapted = primary_state("zimage", network)
    assert len(adapted) == 34 * 7  # 30 layers, 2 noise and 2 context refiners: attention and feed-forward
    assert modules_named(state) == {f"diffusion_model.{path}" for path in adapted}
    assert "diffusion_model.layers.29.attention.to_out.0" in modules_named(state)
    converted = _convert_non_diffusers_z_image_lora_to_diffusers(dict(state))
    back = {key.split(".", 1)[1].rsplit(".lora_", 1)[0] for key in converted}
    assert back == set(adapted)
    names = dict(module.named_modules())
    assert all(path in names for path in back)


def test_flux_primary_names_are_the_diffusers_paths_for_the_full_size_transformer():
    """FLUX.1: `transformer.<diffusers path>.lora_A/lora_B.weight` + a float `.alpha`: the names ComfyUI and Forge
    map onto the original model (q/k/v into its fused qkv by slices) and FluxPipeline reads as they are. On the
    full-size [dev] transformer: 19 double blocks x 12 targets and 38 single blocks x 5."""
    network = NetworkConfig(linear=4, linear_alpha=2)
    module, state, adapted = primary_state("flux", network)
    assert len(adapted) == 19 * 12 + 38 * 5
    named = modules_named(state)
    assert named == {f"transformer.{path}" for path in adapted}
    for name in ("transformer.transformer_blocks.18.attn.to_add_out", "transformer.single_transformer_blocks.37.proj_mlp",
                 "transformer.transformer_blocks.0.ff_context.net.0.proj"):
        assert name in named, name
    assert all(key.endswith((".lora_A.weight", ".lora_B.weight", ".alpha")) for key in state)
    weights, alphas = FluxPipeline.lora_state_dict(dict(state), return_alphas=True)
    back = {key.removeprefix("transformer.").rsplit(".lora_", 1)[0] for key in weights}
    assert back == set(adapted)
    assert {float(alpha) for alpha in alphas.values()} == {2.0} and len(alphas) == len(adapted)


def test_flux_kontext_primary_names_are_flux_ones_and_the_kontext_pipeline_reads_them():
    """FLUX.1 Kontext's LoRA is written in FLUX.1's form (ComfyUI and Forge load Kontext as a FLUX.1 model): the same
    names for the full-size transformer, read back by FluxKontextPipeline's loader."""
    from diffusers import FluxKontextPipeline

    network = NetworkConfig(linear=4, linear_alpha=2)
    _, kontext, adapted = primary_state("flux_kontext", network)
    _, flux, _ = primary_state("flux", network)
    assert kontext.keys() == flux.keys() and len(adapted) == 19 * 12 + 38 * 5
    weights, alphas = FluxKontextPipeline.lora_state_dict(dict(kontext), return_alphas=True)
    assert {key.removeprefix("transformer.").rsplit(".lora_", 1)[0] for key in weights} == set(adapted)


@pytest.mark.slow  # the full-size 20B transformer on the meta device with its LoRA
def test_qwen_image_edit_primary_names_are_qwen_image_ones_and_both_edit_pipelines_read_them():
    """Qwen-Image-Edit's LoRA is written in Qwen-Image's form (ComfyUI loads edit LoRAs under the same names):
    `diffusion_model.<path>` for the full-size transformer, read back by QwenImageEditPipeline's and QwenImageEditPlusPipeline's
    loaders."""
    from diffusers import QwenImageEditPipeline, QwenImageEditPlusPipeline

    network = NetworkConfig(linear=4, linear_alpha=4)
    _, edit, adapted = primary_state("qwen_image_edit", network)
    assert modules_named(edit) == {f"diffusion_model.{path}" for path in adapted} and len(adapted) == 60 * 12 - 4
    for pipeline in (QwenImageEditPipeline, QwenImageEditPlusPipeline):
        weights = pipeline.lora_state_dict(dict(edit))
        assert {key.removeprefix("transformer.").rsplit(".lora_", 1)[0] for key in weights} == set(adapted)


def test_qwen_image_primary_names_are_comfyuis_for_the_full_size_transformer():
    """ComfyUI's Qwen-Image model keeps diffusers' module paths and maps LoRAs by `diffusion_model.<path>`
    (lora_down / lora_up / alpha); QwenImagePipeline's converter reads the same names back. On the full-size 20B
    transformer: 60 blocks x 12 targets, less the last block's 4 text-only ones."""
    network = NetworkConfig(linear=16, linear_alpha=16)
    module, state, adapted = primary_state("qwen_image", network)
    assert len(adapted) == 60 * 12 - 4
    named = modules_named(state)
    assert named == {f"diffusion_model.{path}" for path in adapted}
    for name in ("diffusion_model.transformer_blocks.0.attn.add_q_proj", "diffusion_model.transformer_blocks.59.img_mlp.net.2",
                 "diffusion_model.transformer_blocks.58.txt_mlp.net.0.proj"):
        assert name in named, name
    assert all(key.endswith((".lora_down.weight", ".lora_up.weight", ".alpha")) for key in state)
    converted = _convert_non_diffusers_qwen_lora_to_diffusers(dict(state))
    back = {key.removeprefix("transformer.").rsplit(".lora_", 1)[0] for key in converted}
    assert back == set(adapted)
    weights = QwenImagePipeline.lora_state_dict(dict(state))
    assert {key.removeprefix("transformer.").rsplit(".lora_", 1)[0] for key in weights} == set(adapted)
    names = dict(module.named_modules())
    assert all(path in names for path in back)


def test_wan_primary_names_are_comfyuis_for_the_full_size_expert():
    """ComfyUI's Wan model keeps the original code's layer names (`blocks.N.self_attn.q`, `cross_attn.o`, `ffn.0`,
    `ffn.2`; comfy/ldm/wan/model.py) and maps LoRAs by `diffusion_model.<name>` with lora_down / lora_up / alpha;
    WanPipeline's converter reads the same names back. On a full-size Wan 2.2 A14B expert (as Wan 2.1 14B): 40
    blocks x 10 targets."""
    network = NetworkConfig(linear=16, linear_alpha=8)
    module, state, adapted = primary_state("wan", network)
    assert len(adapted) == 40 * 10
    comfy_names = {f"diffusion_model.blocks.{i}.{attention}.{projection}" for i in range(40)
                   for attention in ("self_attn", "cross_attn") for projection in "qkvo"}
    comfy_names |= {f"diffusion_model.blocks.{i}.ffn.{layer}" for i in range(40) for layer in (0, 2)}
    assert modules_named(state) == comfy_names
    assert all(key.endswith((".lora_down.weight", ".lora_up.weight", ".alpha")) for key in state)
    converted = _convert_non_diffusers_wan_lora_to_diffusers(dict(state))
    back = {key.removeprefix("transformer.").rsplit(".lora_", 1)[0] for key in converted}
    assert back == set(adapted)
    weights = WanPipeline.lora_state_dict(dict(state))
    assert {key.removeprefix("transformer.").rsplit(".lora_", 1)[0] for key in weights} == set(adapted)
    names = dict(module.named_modules())
    assert all(path in names for path in back)


def test_the_full_size_qwen_image_text_encoder_feeds_the_transformer():
    """The benchmark's Qwen2.5-VL-7B-wide text encoder builds (on the meta device) and its width is the
    transformer's text input."""
    from transformers import Qwen2_5_VLConfig, Qwen2_5_VLForConditionalGeneration

    with torch.device("meta"):
        encoder = Qwen2_5_VLForConditionalGeneration(Qwen2_5_VLConfig(**QWEN_IMAGE_FULL["text_encoder"]))
    assert encoder.config.text_config.hidden_size == QWEN_IMAGE_FULL["transformer"]["joint_attention_dim"] == 3584


@pytest.mark.parametrize("arch", ["sd15", "sdxl", "zimage", "flux", "flux_kontext", "qwen_image", "qwen_image_edit",
                                  "wan"])
def test_the_primary_form_is_the_comfy_form_for_these_families(arch):
    assert get_adapter_class(arch).files.primary == "comfy"
