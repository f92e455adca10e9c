"""Z-Image from the files a ComfyUI installation keeps: the transformer in the original layout (fused qkv), ComfyUI's
qwen_3_4b text encoder (`model.` names), FLUX.1's ae.safetensors, and the Qwen tokenizer of ComfyUI's source tree
(Qwen2.5-VL's, whose chat template is not Qwen3's); Turbo told from the file's name; fp8 and GGUF kept as stored."""

from __future__ import annotations

import copy
import json
from pathlib import Path

import pytest
import torch
from comfy_files import contiguous, gguf_dequantized, plain, stored, write_gguf, write_tokenizer_tree
from diffusers import ZImageTransformer2DModel
from ldm_format import convert_vae
from safetensors.torch import save_file
from test_flux_files import header_of, meta_state, published_config
from transformers import Qwen3Config, Qwen3Model

from toolkit.models.registry import model_config
from toolkit.models.zimage.adapter import ZImageAdapter
from toolkit.models.zimage.files import zimage_files

CPU = torch.device("cpu")
VARIANTS = json.loads((Path(__file__).parents[1] / "toolkit/models/zimage/variants.json").read_text())
DTYPES = [pytest.param(torch.float32, id="float32"), pytest.param(torch.bfloat16, id="bf16")]
#: Qwen2.5-VL's chat template as ComfyUI's qwen25_tokenizer folder carries it (a system turn first)
QWEN25_TEMPLATE = ("{% for message in messages %}{% if loop.first and message['role'] != 'system' %}"
                   "<|im_start|>system\nYou are a helpful assistant.<|im_end|>\n{% endif %}<|im_start|>"
                   "{{ message['role'] }}\n{{ message['content'] }}<|im_end|>\n{% endfor %}"
                   "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")


def original_names(state: dict[str, torch.Tensor], prefix: str = "") -> dict[str, torch.Tensor]:
    """A diffusers ZImageTransformer2DModel's weights in the original / ComfyUI layout (the inverse of diffusers'
    converter): fused qkv, `attention.out`, `q_norm`/`k_norm`, `x_embedder` and `final_layer`."""
    renames = {".attention.to_out.0.": ".attention.out.", ".attention.norm_q.": ".attention.q_norm.",
               ".attention.norm_k.": ".attention.k_norm.", "all_x_embedder.2-1.": "x_embedder.",
               "all_final_layer.2-1.": "final_layer."}
    out = {}
    for key, value in state.items():
        if ".attention.to_k." in key or ".attention.to_v." in key:
            continue
        if ".attention.to_q." in key:
            out[prefix + key.replace(".to_q.", ".qkv.")] = torch.cat(
                [state[key.replace(".to_q.", f".to_{p}.")] for p in "qkv"])
            continue
        for old, new in renames.items():
            key = key.replace(old, new)
        out[prefix + key] = value
    return out


@pytest.mark.parametrize("name, expected", [("z_image_turbo_bf16.safetensors", "z-image-turbo"),
                                            ("z_image_bf16.safetensors", "z-image")])
def test_z_image_and_turbo_share_a_layout_and_the_name_tells_them(name, expected):
    config = VARIANTS[expected]["configs"]["transformer"]
    state = original_names(meta_state(lambda: ZImageTransformer2DModel.from_config(config)))
    variant = zimage_files().denoiser.variant(header_of(state, "model.diffusion_model.", name))[1]
    assert variant.name == expected
    assert variant.config("scheduler")["shift"] == {"z-image-turbo": 3.0, "z-image": 6.0}[expected]


def test_comfyuis_qwen3_4b_file_is_told_from_its_names():
    qwen = meta_state(lambda: Qwen3Model(Qwen3Config(**published_config("text_encoders.json", "qwen3-4b"))))
    header = header_of({f"model.{k}": v for k, v in qwen.items()}, name="qwen_3_4b.safetensors")
    part, variant = zimage_files().text_encoders["qwen3_4b"].variant(header)
    assert variant.name == "qwen3-4b" and part.prefix == "model."


@pytest.fixture(scope="module")
def folder_model(tiny_cache):
    loaded = {}

    def get(dtype, preset="tiny-turbo"):
        if (dtype, preset) not in loaded:
            loaded[dtype, preset] = ZImageAdapter.load(model_config(arch="zimage", name_or_path=preset), CPU, dtype)
        return loaded[dtype, preset]

    return get


@pytest.fixture(scope="module")
def installation(folder_model, tmp_path_factory):
    root = tmp_path_factory.mktemp("ComfyUI")
    models = root / "models"
    for folder in ("diffusion_models", "text_encoders", "vae"):
        (models / folder).mkdir(parents=True)
    adapter = folder_model(torch.float32)
    transformer = original_names(plain(adapter.transformer))
    for storage in ("float32", "scaled_fp8"):
        save_file(contiguous(stored(transformer, storage)),
                  str(models / "diffusion_models" / f"z_image_turbo_{storage}.safetensors"))
    write_gguf(transformer, models / "diffusion_models" / "z_image_turbo_Q8_0.gguf", "lumina2")
    save_file(contiguous({f"model.{k}": v for k, v in plain(adapter.text_encoder).items()}),
              str(models / "text_encoders" / "qwen_3_4b.safetensors"))
    save_file(contiguous({k.removeprefix("first_stage_model."): v for k, v in
                          convert_vae(plain(adapter.vae), dict(adapter.vae.config)).items()}),
              str(models / "vae" / "ae.safetensors"))
    tokenizer = copy.deepcopy(adapter.tokenizer)
    tokenizer.chat_template = QWEN25_TEMPLATE
    write_tokenizer_tree(root, {"comfy/text_encoders/qwen25_tokenizer": tokenizer})
    return models


def files_config(models: Path, transformer: str):
    return model_config(arch="zimage", name_or_path=str(models / "diffusion_models" / transformer),
                        text_encoder_path=str(models / "text_encoders" / "qwen_3_4b.safetensors"),
                        vae_name_or_path=str(models / "vae" / "ae.safetensors"))


def predictions(adapter) -> tuple[torch.Tensor, torch.Tensor]:
    noisy = torch.randn(2, 16, 8, 8, generator=torch.Generator().manual_seed(0))
    embeds = adapter.encode_prompts(["a red circle on a blue background", ""])
    with torch.no_grad():
        return embeds.embeds.float(), adapter.predict(noisy, torch.tensor([300.0, 700.0]), embeds).float()


@pytest.mark.parametrize("dtype", DTYPES)
def test_the_files_give_the_folders_model(installation, folder_model, dtype):
    """Bit for bit the folder's model; the prompts in Qwen3's chat form although ComfyUI's tokenizer folder carries
    Qwen2.5-VL's template; Turbo's scheduler, from the file's name."""
    ours = ZImageAdapter.load(files_config(installation, "z_image_turbo_float32.safetensors"), CPU, dtype)
    for a, b in zip(predictions(ours), predictions(folder_model(dtype))):
        assert torch.equal(a, b)
    assert ours.chat_prompt("a cat") == "<|im_start|>user\na cat<|im_end|>\n<|im_start|>assistant\n"
    assert ours.scheduler.config.shift == 3.0 and "Z-Image preset (tiny-turbo)" in ours.parts_from["transformer"]


@pytest.mark.parametrize("transformer, storage", [("z_image_turbo_scaled_fp8.safetensors", "scaled fp8"),
                                                  ("z_image_turbo_Q8_0.gguf", "gguf Q8_0")])
def test_stored_weights_stay_as_stored(installation, folder_model, transformer, storage):
    ours = ZImageAdapter.load(files_config(installation, transformer), CPU, torch.float32)
    assert ours.parts_from["transformer"].endswith(f", {storage})")
    _, full = predictions(folder_model(torch.float32))
    _, mine = predictions(ours)
    assert (mine - full).abs().mean() < 0.1 * full.abs().mean()
    if storage.startswith("gguf"):
        from diffusers.loaders.single_file_utils import convert_z_image_transformer_checkpoint_to_diffusers

        exact = ZImageAdapter.load(model_config(arch="zimage", name_or_path="tiny-turbo"), CPU, torch.float32)
        exact.transformer.load_state_dict(convert_z_image_transformer_checkpoint_to_diffusers(
            gguf_dequantized(installation / "diffusion_models" / transformer)))
        torch.testing.assert_close(mine, predictions(exact)[1], atol=1e-5, rtol=1e-5)
