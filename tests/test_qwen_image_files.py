"""Qwen-Image from ComfyUI's files: the transformer (diffusers' names under `model.diffusion_model.`; read layer by
layer, scaled fp8 kept as stored), the Qwen2.5-VL text encoder in ComfyUI's names (transformers' older layout, no
LM head) and the Qwen tokenizer of ComfyUI's source tree. The VAE still comes from the base's folder."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from comfy_files import contiguous, plain, stored, write_tokenizer_tree
from diffusers import QwenImageTransformer2DModel
from safetensors.torch import save_file
from test_flux_files import header_of, meta_state, published_config
from transformers import Qwen2_5_VLConfig, Qwen2_5_VLForConditionalGeneration

from toolkit.models.qwen_image.adapter import QwenImageAdapter
from toolkit.models.qwen_image.files import qwen_image_files
from toolkit.models.registry import model_config

CPU = torch.device("cpu")
QWEN = json.loads((Path(__file__).parents[1] / "toolkit/models/qwen_image/variants.json").read_text())["qwen-image"]
PROMPTS = ["a red circle on a blue background", "a cat"]


def comfy_names(state: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """Qwen2.5-VL's transformers 5 names as ComfyUI's file has them: `model.` and `visual.`, no LM head."""
    out = {}
    for key, value in state.items():
        if key.startswith("model.language_model."):
            out["model." + key[len("model.language_model."):]] = value
        elif key.startswith("model.visual."):
            out[key[len("model."):]] = value
    return out


def test_the_full_size_transformer_and_text_encoder_are_told_from_their_names():
    files = qwen_image_files()
    transformer = meta_state(lambda: QwenImageTransformer2DModel.from_config(QWEN["configs"]["transformer"]))
    assert files.denoiser.variant(header_of(transformer, "model.diffusion_model."))[1].name == "qwen-image"
    config = published_config("text_encoders.json", "qwen25-vl-7b")
    encoder = meta_state(lambda: Qwen2_5_VLForConditionalGeneration(Qwen2_5_VLConfig(**config)))
    kind = files.text_encoders["qwen25_vl_7b"]
    assert kind.variant(header_of(comfy_names(encoder), name="qwen_2.5_vl_7b_fp8_scaled.safetensors"))[1].name == \
        "qwen25-vl-7b"


@pytest.fixture(scope="module")
def folder_model(tiny_cache):
    return QwenImageAdapter.load(model_config(arch="qwen_image", name_or_path="tiny"), CPU, torch.float32)


@pytest.fixture(scope="module")
def installation(folder_model, tmp_path_factory):
    root = tmp_path_factory.mktemp("ComfyUI")
    models = root / "models"
    for folder in ("diffusion_models", "text_encoders"):
        (models / folder).mkdir(parents=True)
    transformer = {f"model.diffusion_model.{k}": v for k, v in plain(folder_model.transformer).items()}
    encoder = comfy_names(plain(folder_model.text_encoder))
    for storage in ("float32", "scaled_fp8"):
        save_file(contiguous(stored(transformer, storage)),
                  str(models / "diffusion_models" / f"qwen_{storage}.safetensors"))
        save_file(contiguous(stored(encoder, storage)),
                  str(models / "text_encoders" / f"qwen_2.5_vl_{storage}.safetensors"))
    write_tokenizer_tree(root, {"comfy/text_encoders/qwen25_tokenizer": folder_model.tokenizer})
    return models


def predictions(adapter) -> tuple[torch.Tensor, torch.Tensor]:
    noisy = torch.randn(2, 16, 4, 4, generator=torch.Generator().manual_seed(0))
    embeds = adapter.encode_prompts(PROMPTS)
    with torch.no_grad():
        return embeds.embeds.float(), adapter.predict(noisy, torch.tensor([300.0, 700.0]), embeds).float()


@pytest.mark.parametrize("storage", ["float32", "scaled_fp8"])
@pytest.mark.parametrize("quantize", [False, True], ids=["stored", "quantized"])
def test_comfyuis_files_give_the_folders_model(installation, folder_model, monkeypatch, storage, quantize):
    """float32 files: bit for bit the folder's model. Scaled fp8: the transformer's and the text encoder's Linear
    weights stay fp8 (also where the rest is quantized: `model.quantize`), within fp8's rounding of the folder."""
    monkeypatch.setattr(QwenImageAdapter, "default_components", folder_model.source)  # the VAE's folder
    cfg = model_config(arch="qwen_image",
                       name_or_path=str(installation / "diffusion_models" / f"qwen_{storage}.safetensors"),
                       text_encoder_path=str(installation / "text_encoders" / f"qwen_2.5_vl_{storage}.safetensors"),
                       quantize=quantize, qtype="qint8")
    ours = QwenImageAdapter.load(cfg, CPU, torch.float32)
    assert ours.parts_from["transformer"].endswith("(tiny Qwen-Image preset (tiny))")
    assert ours.parts_from["tokenizer"].endswith("qwen25_tokenizer (ComfyUI)")
    mine, theirs = predictions(ours), predictions(folder_model)
    if storage == "float32" and not quantize:
        assert all(torch.equal(a, b) for a, b in zip(mine, theirs))
        return
    if storage == "scaled_fp8":
        to_q = ours.transformer.get_submodule("transformer_blocks.0.attn.to_q")
        assert to_q.weight._data.dtype == torch.float8_e4m3fn
        q_proj = ours.text_encoder.model.language_model.layers[0].self_attn.q_proj
        assert q_proj.weight._data.dtype == torch.float8_e4m3fn
    for a, b in zip(mine, theirs):
        assert (a - b).abs().mean() < 0.1 * b.abs().mean()
