"""Stable Diffusion 1.x from a checkpoint as ComfyUI's `models/checkpoints/` keeps it (UNet, CLIP-L and VAE in one
file, in the original names), or from a UNet, CLIP-L and VAE in files of their own; configs shipped, tokenizer from
the installation; stored fp8 kept. Variants told from names and shapes of the full-size layout on the meta device."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch
from comfy_files import contiguous, plain, stored, write_tokenizer_tree
from diffusers import AutoencoderKL, UNet2DConditionModel
from ldm_format import convert_unet, convert_vae, save_as_ldm_checkpoint
from safetensors.torch import load_file, save_file
from test_flux_files import header_of, meta_state, published_config
from test_models_from import header_only, sections
from transformers import CLIPTextConfig, CLIPTextModel

from toolkit.errors import UserError
from toolkit.models.comfy_folder import report
from toolkit.models.registry import family_files, model_config
from toolkit.models.sd15.adapter import SD15Adapter
from toolkit.models.sd15.files import sd15_files
from toolkit.models.single_files import UnknownFile

CPU = torch.device("cpu")
SD15 = json.loads((Path(__file__).parents[1] / "toolkit/models/sd15/variants.json").read_text())["sd15"]
DTYPES = [pytest.param(torch.float32, id="float32"), pytest.param(torch.bfloat16, id="bf16")]


def full_checkpoint(unet_config: dict) -> dict[str, torch.Tensor]:
    """A full-size SD 1.x checkpoint's tensors (meta device) in the original names: UNet, CLIP-L, VAE."""
    unet = meta_state(lambda: UNet2DConditionModel.from_config(unet_config))
    clip = meta_state(lambda: CLIPTextModel(CLIPTextConfig(**published_config("text_encoders.json", "clip-l"))))
    vae_config = published_config("vaes.json", "sd-vae")
    vae = meta_state(lambda: AutoencoderKL.from_config(vae_config))
    state = {**convert_unet(unet, unet_config), **convert_vae(vae, vae_config)}
    state.update({f"cond_stage_model.transformer.text_model.{k}": v for k, v in clip.items()})
    return state


def test_a_full_size_sd15_checkpoint_is_told_from_its_names_and_shapes():
    files = sd15_files()
    header = header_of(full_checkpoint(SD15["configs"]["unet"]), name="v1-5-pruned-emaonly.safetensors")
    assert files.denoiser.variant(header)[1].name == "sd15"
    assert files.text_encoders["clip_l"].variant(header)[1].name == "clip-l"
    part, vae = files.vae.variant(header)
    assert vae.name == "sd-vae" and part.prefix == "first_stage_model."


def test_an_sd2_checkpoint_is_named_with_what_was_read():
    config = {**SD15["configs"]["unet"], "cross_attention_dim": 1024, "use_linear_projection": True,
              "attention_head_dim": [5, 10, 20, 20]}
    header = header_of(full_checkpoint(config), name="v2-1_768-ema-pruned.safetensors")
    with pytest.raises(UnknownFile, match=r"v2-1_768.*no known variant \(read: width 320, input channels 4, context "
                                          r"width 1024, linear projection True"):
        sd15_files().denoiser.variant(header)


@pytest.fixture(scope="module")
def folder_model(tiny_sd15):
    loaded = {}

    def get(dtype):
        if dtype not in loaded:
            loaded[dtype] = SD15Adapter.load(model_config(arch="sd15", name_or_path="tiny"), CPU, dtype)
        return loaded[dtype]

    return get


def predictions(adapter) -> tuple[torch.Tensor, torch.Tensor]:
    generator = torch.Generator().manual_seed(0)
    noisy = torch.randn(2, 4, 8, 8, generator=generator)
    embeds = adapter.encode_prompts(["a red circle", ""])
    with torch.no_grad():
        return embeds.embeds.float(), adapter.predict(noisy, torch.tensor([300, 700]), embeds).float()


@pytest.fixture(scope="module")
def installation(tiny_sd15, folder_model, tmp_path_factory):
    """A ComfyUI installation holding the tiny preset as a checkpoint (float32 and fp8), and as three files."""
    root = tmp_path_factory.mktemp("ComfyUI")
    models = root / "models"
    (models / "checkpoints").mkdir(parents=True)
    checkpoint = save_as_ldm_checkpoint(tiny_sd15, models / "checkpoints" / "tiny-sd15.safetensors")
    fp8 = models / "checkpoints" / "tiny-sd15-fp8.safetensors"
    save_file(contiguous(stored(load_file(str(checkpoint)), "fp8")), str(fp8))
    adapter = folder_model(torch.float32)
    unet_config = dict(adapter.unet.config)
    (models / "unet").mkdir()
    save_file(contiguous({k.removeprefix("model.diffusion_model."): v for k, v in
                          convert_unet(plain(adapter.unet), unet_config).items()}),
              str(models / "unet" / "u.safetensors"))
    (models / "clip").mkdir()
    save_file(contiguous({f"text_model.{k}": v for k, v in plain(adapter.text_encoder).items()}),
              str(models / "clip" / "clip_l.safetensors"))
    (models / "vae").mkdir()
    save_file(contiguous({k.removeprefix("first_stage_model."): v for k, v in
                          convert_vae(plain(adapter.vae), dict(adapter.vae.config)).items()}),
              str(models / "vae" / "vae-ft.safetensors"))
    write_tokenizer_tree(root, {"comfy/sd1_tokenizer": adapter.tokenizer})
    return models


@pytest.mark.parametrize("dtype", DTYPES)
def test_a_checkpoint_alone_is_the_folders_model(installation, folder_model, dtype):
    """No folder, no single_file_config: the UNet, CLIP-L and VAE from the checkpoint, the tokenizer from the
    installation; the same embeddings, prediction and latents as the folder, bit for bit."""
    ours = SD15Adapter.load(model_config(arch="sd15", name_or_path=str(installation / "checkpoints" /
                                                                       "tiny-sd15.safetensors")), CPU, dtype)
    theirs = folder_model(dtype)
    for a, b in zip(predictions(ours), predictions(theirs)):
        assert torch.equal(a, b)
    pixels = torch.rand(1, 3, 32, 32, generator=torch.Generator().manual_seed(1)) * 2 - 1
    assert torch.equal(ours.encode_latent_dist(pixels).mean, theirs.encode_latent_dist(pixels).mean)
    assert ours.parts_from["vae"].endswith("(tiny VAE, float32)")
    assert ours.parts_from["tokenizer"].endswith("sd1_tokenizer (ComfyUI)")
    assert ours.noise_schedule.num_train_timesteps == 1000


def test_a_pickled_checkpoint_is_read_too(installation, folder_model, tmp_path):
    """Older checkpoints are pickled (.ckpt, a `state_dict` inside): read mapped, tensors only."""
    state = load_file(str(installation / "checkpoints" / "tiny-sd15.safetensors"))
    torch.save({"state_dict": state, "global_step": 1}, tmp_path / "tiny.ckpt")
    ckpt = SD15Adapter.load(model_config(arch="sd15", name_or_path=str(tmp_path / "tiny.ckpt"),
                                         tokenizer=str(installation.parent)), CPU, torch.float32)
    for a, b in zip(predictions(ckpt), predictions(folder_model(torch.float32))):
        assert torch.equal(a, b)
    (tmp_path / "broken.ckpt").write_bytes(b"not a pickle")
    with pytest.raises(UserError, match="broken.ckpt: not a checkpoint torch reads safely"):
        SD15Adapter.load(model_config(arch="sd15", name_or_path=str(tmp_path / "broken.ckpt")), CPU, torch.float32)


def test_parts_in_files_of_their_own_and_an_fp8_checkpoint(installation, folder_model):
    models = installation
    parts = model_config(arch="sd15", name_or_path=str(models / "unet" / "u.safetensors"),
                         text_encoder_path=str(models / "clip" / "clip_l.safetensors"),
                         vae_name_or_path=str(models / "vae" / "vae-ft.safetensors"))
    for a, b in zip(predictions(SD15Adapter.load(parts, CPU, torch.float32)), predictions(folder_model(torch.float32))):
        assert torch.equal(a, b)
    fp8 = SD15Adapter.load(model_config(arch="sd15", name_or_path=str(models / "checkpoints" /
                                                                      "tiny-sd15-fp8.safetensors")), CPU, torch.float32)
    to_q = fp8.unet.get_submodule("down_blocks.0.attentions.0.transformer_blocks.0.attn1.to_q")
    assert to_q.weight._data.dtype == torch.float8_e4m3fn
    _, full = predictions(folder_model(torch.float32))
    _, mine = predictions(fp8)
    assert (mine - full).abs().mean() < 0.1 * full.abs().mean()


def test_a_checkpoint_outside_an_installation_needs_a_tokenizer(installation, tmp_path, tiny_sd15):
    loose = Path(shutil.copy(installation / "checkpoints" / "tiny-sd15.safetensors", tmp_path / "tiny.safetensors"))
    with pytest.raises(UserError, match="No weight file holds a tokenizer"):
        SD15Adapter.load(model_config(arch="sd15", name_or_path=str(loose)), CPU, torch.float32)
    adapter = SD15Adapter.load(model_config(arch="sd15", name_or_path=str(loose), tokenizer=str(tiny_sd15)), CPU,
                               torch.float32)
    assert adapter.parts_from["tokenizer"] == f"{tiny_sd15} (model.tokenizer)"


def test_models_from_lists_a_checkpoint_as_a_whole_base(installation, tmp_path):
    """A checkpoint holds its text encoder and VAE: its section names the file alone."""
    families = {arch: family_files(arch) for arch in ("flux", "flux_kontext", "sd15")}
    text = report(installation, families, only=["sd15"])
    by_file = {Path(s["name_or_path"]).name: s for s in sections(text)}
    assert set(by_file) == {"tiny-sd15.safetensors", "tiny-sd15-fp8.safetensors", "u.safetensors"}
    assert by_file["tiny-sd15.safetensors"].keys() == {"arch", "name_or_path", "tokenizer"}
    assert "# CLIP-L text encoder: in tiny-sd15.safetensors" in text
    assert Path(by_file["u.safetensors"]["vae_name_or_path"]).parent.name in ("vae", "checkpoints")
    full = tmp_path / "full" / "models" / "checkpoints" / "v1-5-pruned-emaonly.safetensors"
    header_only(full, {k: tuple(v.shape) for k, v in full_checkpoint(SD15["configs"]["unet"]).items()}, "fp16")
    assert "# Stable Diffusion 1.5: v1-5-pruned-emaonly.safetensors (fp16)" in report(full.parents[1], families)
