"""The Wuerstchen v2 prior from its original published files: the stage-C torch checkpoint (`ema_state_dict`, torch's
fused attention) and laion's open_clip bigG file (the whole CLIP model, its text tower read); variants from names
and shapes of the full-size layout; --convert-lora of a kohya-style prior LoRA with no model at all."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from comfy_files import plain
from diffusers.pipelines.deprecated.wuerstchen import WuerstchenPrior
from ldm_format import open_clip
from safetensors.torch import load_file, save_file
from test_convert_lora_names import no_weights_read  # noqa: F401  (the fixture)
from test_flux_files import header_of, meta_state

import run
from toolkit.models.registry import model_config
from toolkit.models.single_files import UnknownFile
from toolkit.models.wuerstchen.adapter import WuerstchenAdapter
from toolkit.models.wuerstchen.files import wuerstchen_files

CPU = torch.device("cpu")
PRIOR = json.loads((Path(__file__).parents[1] / "toolkit/models/wuerstchen/variants.json").read_text())[
    "wuerstchen-v2-prior"]


def fused_attention(state: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """A diffusers WuerstchenPrior's weights in the published checkpoint's names (torch's MultiheadAttention)."""
    out = {}
    for key, value in state.items():
        if ".attention.to_q." in key:
            kind = key.rsplit(".", 1)[1]
            stem = key.split(".attention.")[0]
            out[f"{stem}.attention.attn.in_proj_{kind}"] = torch.cat(
                [state[key.replace(".to_q.", f".to_{p}.")] for p in "qkv"])
        elif ".attention.to_k." in key or ".attention.to_v." in key:
            continue
        else:
            out[key.replace(".attention.to_out.0.", ".attention.attn.out_proj.")] = value
    return out


def full_prior(config: dict) -> dict[str, torch.Tensor]:
    return fused_attention(meta_state(lambda: WuerstchenPrior.from_config(config)))


def test_the_published_prior_is_told_from_its_names_and_shapes():
    kind = wuerstchen_files().denoiser
    assert kind.variant(header_of(full_prior(PRIOR["configs"]["prior"]), name="model_v2_stage_c.pt"))[1].name == \
        "wuerstchen-v2-prior"
    june = {**PRIOR["configs"]["prior"], "c_cond": 1024}  # the first v2 upload, conditioned on CLIP-H
    with pytest.raises(UnknownFile, match=r"no known variant \(read: width 1536, condition width 1024, blocks 96"):
        kind.variant(header_of(full_prior(june), name="model_v2_stage_c.pt"))


@pytest.fixture(scope="module")
def folder_model(tiny_wuerstchen):
    return WuerstchenAdapter.load(model_config(arch="wuerstchen", name_or_path="tiny", image_encoder_path="tiny"),
                                  CPU, torch.float32)


def test_the_published_files_give_the_folders_prior(folder_model, tiny_wuerstchen, tmp_path):
    """The prior as the authors' checkpoint holds it, and the text tower of a whole open_clip CLIP file (its vision
    tower not read): the same text embeddings and prediction as the diffusers folder."""
    prior = tmp_path / "model_v2_stage_c.pt"
    torch.save({"ema_state_dict": fused_attention(plain(folder_model.prior)), "iter": 918000}, prior)
    text = {f"text_model.{k}": v for k, v in plain(folder_model.text_encoder).items()}
    width = text["text_model.final_layer_norm.weight"].shape[0]
    text["text_projection.weight"] = torch.eye(width)
    clip = {**open_clip(text, ""), "visual.proj": torch.zeros(4, 4), "logit_scale": torch.tensor(4.6)}
    save_file({k: v.contiguous() for k, v in clip.items()}, str(tmp_path / "open_clip_pytorch_model.safetensors"))
    cfg = model_config(arch="wuerstchen", name_or_path=str(prior), image_encoder_path="tiny",
                       text_encoder_path=str(tmp_path / "open_clip_pytorch_model.safetensors"),
                       tokenizer=str(tiny_wuerstchen / "prior"))
    ours = WuerstchenAdapter.load(cfg, CPU, torch.float32)
    noisy = torch.randn(2, 16, 4, 4, generator=torch.Generator().manual_seed(0))
    results = []
    for adapter in (ours, folder_model):
        embeds = adapter.encode_prompts(["a red circle", ""])
        with torch.no_grad():
            results.append((embeds.embeds, adapter.predict(noisy, torch.tensor([0.3, 0.7]), embeds)))
    assert torch.equal(results[0][0], results[1][0]) and torch.equal(results[0][1], results[1][1])


def test_a_kohya_style_prior_lora_converts_with_no_model(no_weights_read):  # noqa: F811
    """No image encoder, no prior folder: the published prior's module names, built from its config on the meta
    device, resolve kohya's flattened names."""
    meta = WuerstchenAdapter.for_module_names(None)
    endings = tuple(meta.lora_target_modules())
    names = [n for n, m in meta.prior.named_modules() if isinstance(m, torch.nn.Linear) and n.endswith(endings)]
    state = {}
    for name in names:
        linear = meta.prior.get_submodule(name)
        key = "lora_prior_unet_" + name.replace(".", "_")
        state[f"{key}.lora_down.weight"] = torch.randn(1, linear.in_features)
        state[f"{key}.lora_up.weight"] = torch.randn(linear.out_features, 1)
        state[f"{key}.alpha"] = torch.tensor(1.0)
    source, target = no_weights_read / "kohya.safetensors", no_weights_read / "diffusers.safetensors"
    save_file(state, str(source))
    assert run.main(["--convert-lora", str(source), str(target), "--to", "diffusers", "--arch", "wuerstchen"]) == 0
    keys = load_file(str(target)).keys()
    assert "prior.blocks.2.attention.to_q.lora.down.weight" in keys and len(keys) == 2 * len(names)
