"""Adapter types (LoRA, LoKr, LoHa), conv layers and filters, and their files: every form keeps the effective
weight deltas, whatever the alphas and ranks."""

from __future__ import annotations

import copy
import logging

import pytest
import torch
from diffusers import (
    FluxTransformer2DModel,
    QwenImageTransformer2DModel,
    UNet2DConditionModel,
    ZImageTransformer2DModel,
)
from helpers import trainer_process, write_job
from safetensors import safe_open
from safetensors.torch import save_file

import run
from jobs.job import get_job
from toolkit.config.loader import load_config
from toolkit.config.schema import NetworkConfig
from toolkit.errors import UserError
from toolkit.models.flux.adapter import FluxAdapter, flux_lora_targets
from toolkit.models.qwen_image.adapter import QwenImageAdapter, qwen_lora_targets
from toolkit.models.sd15.adapter import SD15Adapter
from toolkit.models.zimage.adapter import ZImageAdapter
from toolkit.network.files import ComponentNaming, convert_file, load_pretrained
from toolkit.network.lora import (
    adapter_layers,
    add_lora,
    effective_deltas,
    lora_state_dict,
    module_scales,
    write_lora_file,
)

FAMILIES = {
    "sd15": (SD15Adapter, lambda: UNet2DConditionModel.from_pretrained(sd15_folder(), subfolder="unet")),
    "zimage": (ZImageAdapter, lambda: ZImageTransformer2DModel.from_pretrained(zimage_folder(), subfolder="transformer")),
    "flux": (FluxAdapter, lambda: FluxTransformer2DModel.from_pretrained(flux_folder(), subfolder="transformer")),
    "qwen_image": (QwenImageAdapter, lambda: QwenImageTransformer2DModel.from_pretrained(qwen_image_folder(),
                                                                                        subfolder="transformer")),
}


def qwen_image_folder():
    from toolkit.models.qwen_image.tiny import ensure_tiny_qwen_image

    return ensure_tiny_qwen_image()


def flux_folder():
    from toolkit.models.flux.tiny import ensure_tiny_flux

    return ensure_tiny_flux()


def sd15_folder():
    from toolkit.models.sd15.tiny import ensure_tiny_sd15

    return ensure_tiny_sd15()


def zimage_folder():
    from toolkit.models.zimage.tiny import ensure_tiny_zimage

    return ensure_tiny_zimage()


def adapted(arch: str, network: NetworkConfig, seed: int | None = 0):
    """The family's trainable module with the adapter; with a seed, every adapter weight randomised (so no
    factor is zero and deltas are informative)."""
    family, build = FAMILIES[arch]
    module = build()
    if arch in ("flux", "qwen_image"):  # targets by block count
        targets = flux_lora_targets(module) if arch == "flux" else qwen_lora_targets(len(module.transformer_blocks))
    else:
        targets = family.lora_target_modules(None)
    params = add_lora(module, network, targets, family.conv_target_modules(None))
    if seed is not None:
        generator = torch.Generator().manual_seed(seed)
        with torch.no_grad():
            for param in params:
                param.copy_(torch.randn(param.shape, generator=generator) * 0.3)
    return family, module


def assert_same_deltas(expected: dict, found: dict) -> None:
    assert expected.keys() == found.keys() and expected
    for name in expected:
        torch.testing.assert_close(found[name], expected[name], atol=1e-6, rtol=1e-5)


@pytest.mark.parametrize("arch", ["sd15", "zimage", "flux", "qwen_image"])
@pytest.mark.parametrize("kind", ["lora", "lokr", "loha"])
def test_diffusers_comfy_diffusers_round_trip_keeps_every_delta(arch, kind, tmp_path, tiny_cache):
    """alpha 3 at rank 4: the diffusers file, its ComfyUI form, and that converted back all load (into a config
    with another alpha) to the trained deltas."""
    network = NetworkConfig(type=kind, linear=4, linear_alpha=3)
    family, module = adapted(arch, network)
    expected = effective_deltas(module)
    ours = tmp_path / "ours.safetensors"
    write_lora_file(ours, lora_state_dict(module, family.files.prefix, torch.float32), {}, module, family.files.prefix)
    names = [name for name, _ in module.named_modules() if name]
    forms = {"comfy": tmp_path / "comfy.safetensors", "back": tmp_path / "back.safetensors"}
    convert_file(ours, forms["comfy"], "comfy", [ComponentNaming.of_files(family.files)])
    convert_file(forms["comfy"], forms["back"], "diffusers", [ComponentNaming.of_files(family.files, names)])
    for path in (ours, forms["comfy"], forms["back"]):
        _, fresh = adapted(arch, NetworkConfig(type=kind, linear=4, linear_alpha=1), seed=None)
        load_pretrained(fresh, path, family.files)
        assert_same_deltas(expected, effective_deltas(fresh))


def test_a_kohya_file_with_alphas_starts_training_with_its_deltas(tmp_path, tiny_cache, caplog):
    """A hand-written kohya file (alpha 3 at rank 4, plus a text-encoder key difftune does not train): after
    loading into a config with alpha 8, each delta is (3 / 4) up @ down, computed here independently."""
    family, module = adapted("sd15", NetworkConfig(linear=4, linear_alpha=8), seed=None)
    generator = torch.Generator().manual_seed(1)
    kohya, expected = {}, {}
    for name, scale in module_scales(module).items():
        layer = module.get_submodule(name)
        down = torch.randn(4, layer.in_features, generator=generator)
        up = torch.randn(layer.out_features, 4, generator=generator)
        key = "lora_unet_" + name.replace(".", "_")
        kohya |= {f"{key}.lora_down.weight": down, f"{key}.lora_up.weight": up, f"{key}.alpha": torch.tensor(3.0)}
        expected[name] = 0.75 * up @ down
    kohya["lora_te_text_model_encoder_layers_0_mlp_fc1.lora_down.weight"] = torch.zeros(4, 8)
    path = tmp_path / "kohya.safetensors"
    save_file(kohya, str(path))
    with caplog.at_level(logging.WARNING, logger="difftune"):
        load_pretrained(module, path, family.files)
    assert "skipping 1 weights of other components" in caplog.text
    assert_same_deltas(expected, effective_deltas(module))


def test_a_file_of_other_ranks_is_refused_clearly(tmp_path, tiny_cache):
    family, module = adapted("sd15", NetworkConfig(linear=4, linear_alpha=4))
    path = tmp_path / "rank4.safetensors"
    write_lora_file(path, lora_state_dict(module, "unet", torch.float32), {}, module, "unet")
    _, other = adapted("sd15", NetworkConfig(linear=8, linear_alpha=4), seed=None)
    with pytest.raises(UserError, match=r"rank4.safetensors does not fit network .*rank 4 vs 8"):
        load_pretrained(other, path, family.files)


def test_conv_layers_and_filters_choose_the_adapted_modules(tiny_cache):
    network = NetworkConfig(linear=4, linear_alpha=4, conv=2, conv_alpha=1, only_if_contains=["down_blocks"],
                            ignore_if_contains=["attn2"])
    _, module = adapted("sd15", network, seed=None)
    scales = module_scales(module)
    assert scales and all("down_blocks" in name and "attn2" not in name for name in scales)
    convs = {name: scale for name, scale in scales.items() if name.endswith(("conv1", "conv2", "conv"))}
    assert convs and set(convs.values()) == {0.5}  # conv_alpha 1 / conv rank 2
    assert {scales[n] for n in scales if n.endswith("to_q")} == {1.0}
    assert module.get_submodule(next(iter(convs))).lora_A["default"].weight.shape[0] == 2


@pytest.mark.slow
def test_pretrained_lora_and_comfy_form_through_a_job(tmp_path, registry, tiny_sd15):
    """A LoKr with conv layers trained by a job, its ComfyUI file given to a second job as pretrained_lora_path
    (with another alpha): the second run starts from the first's deltas."""
    first = trainer_process(tmp_path, network={"type": "lokr", "linear": 4, "linear_alpha": 2, "conv": 2},
                            train={"steps": 3, "lr": 1e-2}, save={"formats": ["diffusers", "comfy"]})
    config, path = load_config(str(write_job(tmp_path / "first.yaml", "first", first)), registry)
    job = get_job(config, path, registry)
    job.run()
    trained = effective_deltas(job.processes[0].adapter.trainable_module())
    comfy = tmp_path / "output" / "first" / "first.safetensors"  # SD 1.x: the primary file is the ComfyUI form
    second = trainer_process(tmp_path, network={"type": "lokr", "linear": 4, "linear_alpha": 4, "conv": 2,
                                                "pretrained_lora_path": str(comfy)}, train={"steps": 1})
    config, path = load_config(str(write_job(tmp_path / "second.yaml", "second", second)), registry)
    job = get_job(config, path, registry)
    job.processes[0].start()
    try:
        job.processes[0].setup()
        assert_same_deltas(trained, effective_deltas(job.processes[0].adapter.trainable_module()))
    finally:
        job.processes[0].close()


@pytest.mark.slow
def test_convert_lora_command(tmp_path, registry, tiny_sd15):
    process = trainer_process(tmp_path, network={"linear": 4, "linear_alpha": 2}, train={"steps": 2},
                              save={"formats": ["diffusers"]})
    config, path = load_config(str(write_job(tmp_path / "job.yaml", "conv", process)), registry)
    job = get_job(config, path, registry)
    job.run()
    expected = effective_deltas(job.processes[0].adapter.trainable_module())
    ours = tmp_path / "output" / "conv" / "conv.diffusers.safetensors"
    assert run.main(["--convert-lora", str(ours), str(tmp_path / "c.safetensors"), "--to", "comfy"]) == 0
    assert run.main(["--convert-lora", str(tmp_path / "c.safetensors"), str(tmp_path / "d.safetensors"),
                     "--to", "diffusers", "--arch", "sd15", "--model", str(tiny_sd15)]) == 0
    family, fresh = adapted("sd15", NetworkConfig(linear=4, linear_alpha=4), seed=None)
    load_pretrained(fresh, tmp_path / "d.safetensors", family.files)
    assert_same_deltas(expected, effective_deltas(fresh))
    assert run.main(["--convert-lora", str(tmp_path / "absent.safetensors"), str(tmp_path / "x"), "--to", "comfy"]) == 2


def test_type_specific_options_are_checked():
    with pytest.raises(ValueError, match="`use_dora` applies to type lora only"):
        NetworkConfig(type="lokr", use_dora=True)
    with pytest.raises(ValueError, match="`conv_alpha` needs `conv`"):
        NetworkConfig(conv_alpha=2)


def test_dora_round_trips_in_the_diffusers_file(tmp_path, tiny_cache):
    network = NetworkConfig(linear=4, linear_alpha=4, use_dora=True)
    family, module = adapted("sd15", network)
    path = tmp_path / "dora.safetensors"
    write_lora_file(path, lora_state_dict(module, "unet", torch.float32), {}, module, "unet")
    _, fresh = adapted("sd15", network, seed=None)
    load_pretrained(fresh, path, family.files)
    assert_same_deltas(effective_deltas(module), effective_deltas(fresh))
    magnitudes = [n for n, _ in fresh.named_parameters() if "lora_magnitude_vector" in n]
    assert magnitudes and all(torch.equal(fresh.get_parameter(n), module.get_parameter(n)) for n in magnitudes)


def merged_weights(module: torch.nn.Module) -> dict[str, torch.Tensor]:
    """Each adapted layer's weight with the adapter merged in (peft's merge: DoRA's magnitude included)."""
    merged = copy.deepcopy(module)
    out = {}
    for name, layer in adapter_layers(merged).items():
        layer.merge()
        out[name] = layer.get_base_layer().weight.detach().clone()
    return out


def test_dora_comfy_form_round_trips_through_convert_lora(tmp_path, tiny_cache):
    """DoRA (linear and conv layers) -> the ComfyUI form (lora_down/up, alpha, output-axis dora_scale) -> back:
    the same effective weights."""
    network = NetworkConfig(linear=4, linear_alpha=2, conv=2, conv_alpha=1, use_dora=True)
    family, module = adapted("sd15", network)
    ours = tmp_path / "dora.diffusers.safetensors"
    write_lora_file(ours, lora_state_dict(module, "unet", torch.float32), {"difftune_arch": "sd15"}, module, "unet")
    comfy, back = tmp_path / "dora.safetensors", tmp_path / "back.safetensors"
    assert run.main(["--convert-lora", str(ours), str(comfy), "--to", "comfy"]) == 0
    with safe_open(str(comfy), "pt") as handle:
        scales = {k: handle.get_tensor(k).shape for k in handle.keys() if k.endswith(".dora_scale")}
    assert scales["lora_unet_down_blocks_0_attentions_0_transformer_blocks_0_attn1_to_q.dora_scale"] == (32, 1)
    assert scales["lora_unet_down_blocks_0_resnets_0_conv1.dora_scale"] == (32, 1, 1, 1)
    assert run.main(["--convert-lora", str(comfy), str(back), "--to", "diffusers", "--arch", "sd15",
                     "--model", str(sd15_folder())]) == 0
    _, fresh = adapted("sd15", network, seed=None)
    load_pretrained(fresh, back, family.files)
    expected, found = merged_weights(module), merged_weights(fresh)
    assert expected.keys() == found.keys() and expected
    assert max((expected[n] - found[n]).abs().max().item() for n in expected) <= 1e-6


def test_a_dora_scale_per_input_column_is_refused_by_name():
    from toolkit.network.formats import dora_magnitude

    with pytest.raises(ValueError, match="per input column"):
        dora_magnitude(torch.ones(1, 8))


def test_peft_named_diffusers_files_load_too(tmp_path, tiny_cache):
    """Files with peft's own names (`.lora_A.weight`, as some tools write diffusers LoRAs) start training."""
    from peft import get_peft_model_state_dict

    family, module = adapted("zimage", NetworkConfig(linear=4, linear_alpha=4))
    state = {f"transformer.{k}": v for k, v in get_peft_model_state_dict(module).items()}
    assert any(".lora_A." in k for k in state)
    path = tmp_path / "peft_named.safetensors"
    save_file(state, str(path))
    _, fresh = adapted("zimage", NetworkConfig(linear=4, linear_alpha=4), seed=None)
    load_pretrained(fresh, path, family.files)
    assert_same_deltas(effective_deltas(module), effective_deltas(fresh))


@pytest.mark.parametrize("network", [NetworkConfig(linear=4, linear_alpha=2, conv=2),
                                     NetworkConfig(linear=4, linear_alpha=8, use_dora=True)], ids=["locon", "dora"])
def test_the_peft_folder_loads_with_peft_to_the_same_outputs(tmp_path, tiny_cache, network):
    from peft import PeftModel

    from toolkit.network.lora import write_peft_folder

    _, module = adapted("sd15", network)
    folder = tmp_path / "mine_peft"
    write_peft_folder(folder, module)
    assert sorted(p.name for p in folder.iterdir()) == ["adapter_config.json", "adapter_model.safetensors"]
    base = FAMILIES["sd15"][1]()
    loaded = PeftModel.from_pretrained(base, str(folder))
    generator = torch.Generator().manual_seed(0)
    sample, hidden = torch.randn(1, 4, 16, 16, generator=generator), torch.randn(1, 77, 32, generator=generator)
    plain = FAMILIES["sd15"][1]()
    with torch.no_grad():
        ours = module(sample, 500, encoder_hidden_states=hidden).sample
        theirs = loaded(sample, 500, encoder_hidden_states=hidden).sample
        without = plain(sample, 500, encoder_hidden_states=hidden).sample
    assert (ours - theirs).abs().max() <= 1e-5
    assert (ours - without).abs().max() > 1e-4  # the adapter acts


@pytest.mark.slow
def test_convert_lora_reaches_every_form_and_back(tmp_path, tiny_cache):
    """diffusers file -> peft folder -> ComfyUI file -> diffusers file, by the command line: the same effective
    weights (DoRA magnitudes included) all the way, and the peft folder loads with peft."""
    from peft import PeftModel

    network = NetworkConfig(linear=4, linear_alpha=2, use_dora=True)
    family, module = adapted("sd15", network)
    start = tmp_path / "start.safetensors"
    write_lora_file(start, lora_state_dict(module, "unet", torch.float32), {}, module, "unet")
    peft_folder, comfy, back = tmp_path / "as_peft", tmp_path / "comfy.safetensors", tmp_path / "back.safetensors"
    assert run.main(["--convert-lora", str(start), str(peft_folder), "--to", "peft", "--arch", "sd15"]) == 0
    assert run.main(["--convert-lora", str(peft_folder), str(comfy), "--to", "comfy", "--arch", "sd15"]) == 0
    assert run.main(["--convert-lora", str(comfy), str(back), "--to", "diffusers", "--arch", "sd15",
                     "--model", str(sd15_folder())]) == 0
    _, fresh = adapted("sd15", network, seed=None)
    load_pretrained(fresh, back, family.files)
    expected, found = merged_weights(module), merged_weights(fresh)
    assert max((expected[n] - found[n]).abs().max().item() for n in expected) <= 1e-6
    loaded = PeftModel.from_pretrained(FAMILIES["sd15"][1](), str(peft_folder))
    generator = torch.Generator().manual_seed(0)
    sample, hidden = torch.randn(1, 4, 16, 16, generator=generator), torch.randn(1, 77, 32, generator=generator)
    with torch.no_grad():
        assert (module(sample, 500, encoder_hidden_states=hidden).sample
                - loaded(sample, 500, encoder_hidden_states=hidden).sample).abs().max() <= 1e-5
