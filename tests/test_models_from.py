"""`run.py --models-from`: the bases a ComfyUI models folder holds, from file headers alone. The folders here hold
full-size layouts as header-only safetensors files (names, dtypes and shapes of the published files; no data),
which is all the listing reads."""

from __future__ import annotations

import json
import struct
from pathlib import Path

import pytest
import yaml
from test_flux_files import FLUX_VARIANTS, KONTEXT_VARIANTS, full_transformer, meta_state, published_config

from comfy_files import flux_original_layout
from toolkit.models.comfy_folder import report
from toolkit.models.registry import family_files, model_config

DTYPE_NAMES = {"bf16": "BF16", "fp16": "F16", "fp8": "F8_E4M3"}


def header_only(path: Path, shapes: dict[str, tuple[int, ...]], storage: str = "bf16") -> Path:
    """A safetensors file with a real header (its tensors in `storage`; for fp8 the 2-D weights, the rest in bf16)
    and no tensor data."""
    header, offset = {}, 0
    for name, shape in shapes.items():
        dtype = DTYPE_NAMES[storage] if len(shape) == 2 or storage != "fp8" else "BF16"
        size = 1
        for n in shape:
            size *= n
        header[name] = {"dtype": dtype, "shape": list(shape), "data_offsets": [offset, offset + size]}
        offset += size
    raw = json.dumps(header).encode()
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_bytes(struct.pack("<Q", len(raw)) + raw)
    return path


def shapes(state) -> dict[str, tuple[int, ...]]:
    return {k: tuple(v.shape) for k, v in state.items()}


@pytest.fixture(scope="module")
def layouts():
    from diffusers import AutoencoderKL
    from transformers import CLIPTextConfig, CLIPTextModel, T5Config, T5EncoderModel

    return {
        "dev": shapes(flux_original_layout(full_transformer(FLUX_VARIANTS["flux1-dev"]["configs"]["transformer"]))),
        "kontext": shapes(flux_original_layout(full_transformer(
            KONTEXT_VARIANTS["flux1-kontext-dev"]["configs"]["transformer"]))),
        "odd": shapes(flux_original_layout(full_transformer(
            {**FLUX_VARIANTS["flux1-dev"]["configs"]["transformer"], "num_layers": 12}))),
        "clip_l": {f"text_model.{k}": v for k, v in shapes(meta_state(
            lambda: CLIPTextModel(CLIPTextConfig(**published_config("text_encoders.json", "clip-l"))))).items()},
        "t5xxl": shapes(meta_state(lambda: T5EncoderModel(T5Config(**published_config("text_encoders.json",
                                                                                       "t5-xxl"))))),
        "vae": shapes(meta_state(lambda: AutoencoderKL.from_config(published_config("vaes.json", "flux-vae")))),
    }


def comfy_installation(root: Path, layouts: dict, vae: bool = True) -> Path:
    models = root / "models"
    header_only(models / "diffusion_models" / "flux1-dev-fp8.safetensors", layouts["dev"], "fp8")
    header_only(models / "diffusion_models" / "flux1-kontext-dev.safetensors", layouts["kontext"])
    header_only(models / "diffusion_models" / "odd-merge.safetensors", layouts["odd"])
    header_only(models / "text_encoders" / "clip_l.safetensors", layouts["clip_l"], "fp16")
    header_only(models / "text_encoders" / "t5xxl_fp16.safetensors", layouts["t5xxl"], "fp16")
    header_only(models / "text_encoders" / "t5xxl_fp8_e4m3fn.safetensors", layouts["t5xxl"], "fp8")
    (models / "text_encoders" / "notes.safetensors").write_text("not a weight file")
    if vae:
        header_only(models / "vae" / "ae.safetensors", layouts["vae"])
    for folder in ("comfy/sd1_tokenizer", "comfy/text_encoders/t5_tokenizer"):
        (root / folder).mkdir(parents=True, exist_ok=True)
    return models


def sections(text: str) -> list[dict]:
    """The `model:` sections printed, parsed as YAML."""
    found = []
    for block in text.split("\n\n"):
        lines = [line for line in block.splitlines() if not line.startswith("#")]
        if lines and lines[0] == "model:":
            found.append(yaml.safe_load("\n".join(lines))["model"])
    return found


def all_families() -> dict:
    return {arch: family_files(arch) for arch in ("flux", "flux_kontext")}


def test_a_complete_installation_gives_a_section_per_base_to_paste(tmp_path, layouts):
    models = comfy_installation(tmp_path / "ComfyUI", layouts)
    text = report(tmp_path / "ComfyUI", all_families())  # the installation, or its models folder
    assert text == report(models, all_families())
    found = sections(text)
    by_file = {Path(s["name_or_path"]).name: s for s in found}
    assert set(by_file) == {"flux1-dev-fp8.safetensors", "flux1-kontext-dev.safetensors"}
    dev, kontext = by_file["flux1-dev-fp8.safetensors"], by_file["flux1-kontext-dev.safetensors"]
    assert dev["arch"] == "flux" and kontext["arch"] == "flux_kontext"  # Kontext's file told by its name
    assert [Path(p).name for p in dev["text_encoder_path"]] == ["clip_l.safetensors", "t5xxl_fp8_e4m3fn.safetensors"]
    assert [Path(p).name for p in kontext["text_encoder_path"]][1] == "t5xxl_fp16.safetensors"  # storage like its own
    assert Path(dev["vae_name_or_path"]).name == "ae.safetensors"
    assert dev["tokenizer"] == str(tmp_path / "ComfyUI")
    assert "# FLUX.1 [dev]: flux1-dev-fp8.safetensors (fp8)" in text
    assert "not of a known variant: odd-merge.safetensors: double blocks 12" in text
    for section in found:
        model_config(**section)  # each section is a valid `model`


def test_an_incomplete_installation_says_what_is_missing(tmp_path, layouts):
    comfy_installation(tmp_path / "ComfyUI", layouts, vae=False)
    text = report(tmp_path / "ComfyUI" / "models", all_families(), only=["flux"])
    assert "# flux: 1 FLUX.1 transformer file(s), missing FLUX.1 VAE" in text
    assert "# incomplete: no FLUX.1 VAE in this folder" in text
    assert "vae_name_or_path" not in text


def test_a_folder_without_comfyuis_folders_is_named(tmp_path):
    from toolkit.errors import UserError

    with pytest.raises(UserError, match="has none of ComfyUI's model folders"):
        report(tmp_path, all_families())


def test_run_py_lists_one_family_or_says_it_reads_no_single_files_yet(tmp_path, layouts, capsys):
    import run

    comfy_installation(tmp_path / "ComfyUI", layouts)
    assert run.main(["--models-from", str(tmp_path / "ComfyUI"), "--arch", "flux"]) == 0
    printed = capsys.readouterr().out
    assert "arch: flux" in printed and "flux_kontext" not in printed
    assert run.main(["--models-from", str(tmp_path / "ComfyUI"), "--arch", "wan"]) == 2
