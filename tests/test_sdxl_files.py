"""SDXL from a checkpoint as fine-tunes ship it (SGM UNet, CLIP-L, OpenCLIP bigG with fused attention, VAE: one file)
or from ComfyUI's separate clip_l and clip_g files; configs shipped, tokenizers from the installation (the second
padding with "!"). Variants told from names and shapes of the full-size layout on the meta device."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from comfy_files import contiguous, plain, write_tokenizer_tree
from diffusers import AutoencoderKL, UNet2DConditionModel
from ldm_format import convert_vae, open_clip, save_as_sgm_checkpoint, sgm_unet
from safetensors.torch import save_file
from test_flux_files import header_of, meta_state, published_config
from transformers import CLIPTextConfig, CLIPTextModel, CLIPTextModelWithProjection

from toolkit.errors import UserError
from toolkit.models.registry import model_config
from toolkit.models.sdxl.adapter import SDXLAdapter
from toolkit.models.sdxl.files import sdxl_files

CPU = torch.device("cpu")
SDXL = json.loads((Path(__file__).parents[1] / "toolkit/models/sdxl/variants.json").read_text())["sdxl-base"]
DTYPES = [pytest.param(torch.float32, id="float32"), pytest.param(torch.bfloat16, id="bf16")]


def test_a_full_size_sdxl_checkpoint_is_told_from_its_names_and_shapes():
    unet = meta_state(lambda: UNet2DConditionModel.from_config(SDXL["configs"]["unet"]))
    clip = meta_state(lambda: CLIPTextModel(CLIPTextConfig(**published_config("text_encoders.json", "clip-l"))))
    clip_g = meta_state(lambda: CLIPTextModelWithProjection(CLIPTextConfig(**published_config("text_encoders.json",
                                                                                             "clip-g"))))
    vae_config = published_config("vaes.json", "sdxl-vae")
    vae = meta_state(lambda: AutoencoderKL.from_config(vae_config))
    state = {**sgm_unet(unet), **convert_vae(vae, vae_config), **open_clip(clip_g, "conditioner.embedders.1.model.")}
    state.update({f"conditioner.embedders.0.transformer.text_model.{k}": v for k, v in clip.items()})
    files, header = sdxl_files(), header_of(state, name="illustriousXL.safetensors")
    assert files.denoiser.variant(header)[1].name == "sdxl-base"
    assert files.text_encoders["clip_l"].variant(header)[1].name == "clip-l"
    assert files.text_encoders["clip_g"].variant(header)[1].name == "clip-g"
    assert files.vae.variant(header)[1].name == "sdxl-vae"
    # ComfyUI's clip_g file (transformers' names, the projection beside them) reads as a CLIP of no CLIP-L variant
    # and as CLIP-G: the files of a list are told apart
    from toolkit.models.single_files import detect

    kind, _, variant = detect(header_of(clip_g), files.text_encoders.values())
    assert (kind.name, variant.name) == ("clip_g", "clip-g")


@pytest.fixture(scope="module")
def folder_model(tiny_sdxl):
    loaded = {}

    def get(dtype):
        if dtype not in loaded:
            loaded[dtype] = SDXLAdapter.load(model_config(arch="sdxl", name_or_path="tiny"), CPU, dtype)
        return loaded[dtype]

    return get


@pytest.fixture(scope="module")
def installation(tiny_sdxl, folder_model, tmp_path_factory):
    root = tmp_path_factory.mktemp("ComfyUI")
    models = root / "models"
    (models / "checkpoints").mkdir(parents=True)
    save_as_sgm_checkpoint(tiny_sdxl, models / "checkpoints" / "tiny-xl.safetensors")
    adapter = folder_model(torch.float32)
    (models / "text_encoders").mkdir()
    save_file(contiguous({f"text_model.{k}": v for k, v in plain(adapter.text_encoder).items()}),
              str(models / "text_encoders" / "clip_l.safetensors"))
    save_file(contiguous(plain(adapter.text_encoder_2)), str(models / "text_encoders" / "clip_g.safetensors"))
    write_tokenizer_tree(root, {"comfy/sd1_tokenizer": adapter.tokenizer})
    return models


def predictions(adapter) -> tuple[torch.Tensor, ...]:
    generator = torch.Generator().manual_seed(0)
    noisy = torch.randn(2, 4, 8, 8, generator=generator)
    embeds = adapter.encode_prompts(["a red circle", ""])
    sizes = torch.tensor([[64, 64, 0, 0, 64, 64]] * 2)
    with torch.no_grad():
        prediction = adapter.predict(noisy, torch.tensor([300, 700]), embeds, image_sizes=sizes)
    return embeds.embeds.float(), embeds.pooled.float(), prediction.float()


@pytest.mark.parametrize("dtype", DTYPES)
def test_a_checkpoint_alone_is_the_folders_model(installation, folder_model, dtype):
    """No folder, no single_file_config: both text encoders (CLIP-G converted from open_clip's layout), the UNet and
    the VAE from the checkpoint, tokenizers from the installation; bit for bit the folder's model."""
    ours = SDXLAdapter.load(model_config(arch="sdxl", name_or_path=str(installation / "checkpoints" /
                                                                       "tiny-xl.safetensors")), CPU, dtype)
    for a, b in zip(predictions(ours), predictions(folder_model(dtype))):
        assert torch.equal(a, b)
    assert ours.tokenizer_2.pad_token == "!" and ours.parts_from["tokenizer_2"].endswith("sd1_tokenizer (ComfyUI)")


def test_comfyuis_clip_files_in_either_order(installation, folder_model):
    files = [str(installation / "text_encoders" / name) for name in ("clip_g.safetensors", "clip_l.safetensors")]
    checkpoint = str(installation / "checkpoints" / "tiny-xl.safetensors")
    ours = SDXLAdapter.load(model_config(arch="sdxl", name_or_path=checkpoint, text_encoder_path=files), CPU,
                            torch.float32)
    for a, b in zip(predictions(ours), predictions(folder_model(torch.float32))):
        assert torch.equal(a, b)
    assert "clip_g.safetensors (tiny CLIP-G" in ours.parts_from["text_encoders"]
    with pytest.raises(UserError, match="no CLIP-G text encoder among"):
        SDXLAdapter.load(model_config(arch="sdxl", name_or_path=checkpoint, text_encoder_path=files[1:]), CPU,
                         torch.float32)
