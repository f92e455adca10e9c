"""LoRA files in diffusers and ComfyUI/kohya form: round trips, and diffusers loads both alike."""

from __future__ import annotations

import json

import pytest
import torch
from diffusers import StableDiffusionPipeline
from helpers import trainer_process, write_job
from safetensors import safe_open
from safetensors.torch import load_file

from jobs.job import get_job
from toolkit.config.loader import load_config
from toolkit.network.formats import from_comfy, to_comfy

PREFIXES = {"unet": "lora_unet"}


@pytest.fixture(scope="module")
def run_dir(tmp_path_factory, registry, tiny_sd15):
    tmp = tmp_path_factory.mktemp("formats")
    process = trainer_process(tmp, network={"linear": 4, "linear_alpha": 8},
                              save={"dtype": "float32", "formats": ["diffusers"]},
                              train={"steps": 6, "lr": 5e-3})
    config, path = load_config(str(write_job(tmp / "job.yaml", "fmt", process)), registry)
    get_job(config, path, registry).run()
    return tmp / "output" / "fmt"


@pytest.mark.slow
def test_the_primary_file_has_kohya_keys_alphas_and_metadata(run_dir):
    """<name>.safetensors of an SD 1.x run is the ComfyUI/kohya form; the diffusers form is the extra file."""
    assert sorted(p.name for p in run_dir.glob("*.safetensors")) == ["fmt.diffusers.safetensors", "fmt.safetensors"]
    with safe_open(str(run_dir / "fmt.safetensors"), "pt") as handle:
        keys, meta = list(handle.keys()), handle.metadata()
        alphas = [handle.get_tensor(k) for k in keys if k.endswith(".alpha")]
    assert "lora_unet_down_blocks_0_attentions_0_transformer_blocks_0_attn1_to_q.lora_down.weight" in keys
    assert all(k.startswith("lora_unet_") for k in keys)
    assert alphas and all(float(a) == 8.0 for a in alphas)
    assert (meta["ss_network_dim"], meta["ss_network_alpha"], meta["ss_base_model_version"]) == ("4", "8.0", "sd_v1")
    assert json.loads(meta["difftune_config"])["network"]["linear"] == 4


@pytest.mark.slow
def test_diffusers_comfy_diffusers_round_trip_is_exact(run_dir):
    original = load_file(str(run_dir / "fmt.diffusers.safetensors"))
    modules = sorted({k.rsplit(".lora.", 1)[0] for k in original})
    back, alphas = from_comfy(to_comfy(original, PREFIXES, lambda module: 8.0), PREFIXES, modules)
    assert back.keys() == original.keys()
    assert all(torch.equal(back[k], original[k]) for k in original)
    assert set(alphas.values()) == {8.0} and len(alphas) == len(modules)


@pytest.mark.slow
def test_diffusers_loads_both_files_to_the_same_output(run_dir, tiny_sd15):
    def render(weight_name):
        pipe = StableDiffusionPipeline.from_pretrained(tiny_sd15, safety_checker=None, requires_safety_checker=False)
        pipe.set_progress_bar_config(disable=True)
        if weight_name:
            pipe.load_lora_weights(str(run_dir), weight_name=weight_name)
        return pipe("shp, a red circle", num_inference_steps=2, width=64, height=64, output_type="np",
                    generator=torch.Generator().manual_seed(0)).images

    base, ours, comfy = render(None), render("fmt.diffusers.safetensors"), render("fmt.safetensors")
    assert abs(ours - base).max() > 1e-3
    assert abs(ours - comfy).max() <= 1e-5


@pytest.mark.slow
def test_diffusers_loads_both_files_of_a_conv_lora_alike(tmp_path, registry, tiny_sd15):
    """LoRA on the resnet and resampling convs too (LoCon): the ComfyUI/kohya file loads in diffusers to the
    same output as the diffusers file."""
    process = trainer_process(tmp_path, network={"linear": 4, "linear_alpha": 8, "conv": 2, "conv_alpha": 1},
                              save={"dtype": "float32", "formats": ["diffusers"]}, train={"steps": 6, "lr": 5e-3})
    config, path = load_config(str(write_job(tmp_path / "job.yaml", "loc", process)), registry)
    get_job(config, path, registry).run()
    folder = tmp_path / "output" / "loc"
    with safe_open(str(folder / "loc.safetensors"), "pt") as handle:
        assert "lora_unet_down_blocks_0_resnets_0_conv1.lora_down.weight" in handle.keys()

    def render(weight_name):
        pipe = StableDiffusionPipeline.from_pretrained(tiny_sd15, safety_checker=None, requires_safety_checker=False)
        pipe.set_progress_bar_config(disable=True)
        pipe.load_lora_weights(str(folder), weight_name=weight_name)
        return pipe("shp, a red circle", num_inference_steps=2, width=64, height=64, output_type="np",
                    generator=torch.Generator().manual_seed(0)).images

    assert abs(render("loc.diffusers.safetensors") - render("loc.safetensors")).max() <= 1e-5
