"""Qwen-Image-Edit on its tiny presets (the first version, 2509 and 2511): the training math against
QwenImageEditPipeline and QwenImageEditPlusPipeline with reference images (the text embedding of the instruction read
with the references, the reference latents as extra tokens with their own shapes, the Euler steps the prediction
drives, no loss on the reference's tokens), and which model a folder holds."""

from __future__ import annotations


import numpy as np
import pytest
import torch
from diffusers import QwenImagePipeline
from helpers import euler_step, pipeline_timestep, shifted_outputs
from PIL import Image

from toolkit.errors import UserError
from toolkit.models.qwen_image_edit.adapter import (
    FIRST_CONDITION_AREA,
    QwenImageEditAdapter,
    calculate_dimensions,
)
from toolkit.models.registry import get_adapter_class, model_config

CPU = torch.device("cpu")
PROMPT = "make the circle red"
DTYPES = [pytest.param(torch.float32, id="float32", marks=pytest.mark.slow), pytest.param(torch.bfloat16, id="bf16")]
VERSIONS = {"tiny": "edit", "tiny-2509": "2509", "tiny-2511": "2511"}


@pytest.fixture(scope="module")
def loaded(tiny_cache):
    adapters: dict[tuple[str, torch.dtype], QwenImageEditAdapter] = {}

    def get(name: str = "tiny-2509", dtype: torch.dtype = torch.float32) -> QwenImageEditAdapter:
        if (name, dtype) not in adapters:
            adapters[name, dtype] = QwenImageEditAdapter.load(
                model_config(arch="qwen_image_edit", name_or_path=name), CPU, dtype)
        return adapters[name, dtype]

    return get


def picture(seed: int, size: tuple[int, int] = (64, 48)) -> Image.Image:
    return Image.fromarray(np.random.default_rng(seed).integers(0, 256, (size[1], size[0], 3), dtype=np.uint8))


def test_the_family_is_registered_and_each_folder_says_its_version(loaded):
    assert get_adapter_class("qwen_image_edit") is QwenImageEditAdapter
    for name, version in VERSIONS.items():
        adapter = loaded(name)
        assert adapter.version.name == version and adapter.describe()["version"] == version
        assert adapter.reference_rules.slots == (1 if version == "edit" else 3)
        assert adapter.reference_rules.size == "budget" and adapter.reference_rules.area == 1024 * 1024
    assert loaded("tiny-2511").transformer.config.zero_cond_t


def test_a_version_the_folder_contradicts_is_refused(tiny_cache):
    with pytest.raises(UserError, match=r"model.version: .* is Qwen-Image-Edit 2509 .*not 2511"):
        QwenImageEditAdapter.load(model_config(arch="qwen_image_edit", name_or_path="tiny-2509", version="2511"),
                                  CPU, torch.float32)


def test_another_pipeline_is_not_taken_for_an_editing_one(tmp_path, tiny_cache):
    from toolkit.models.qwen_image.tiny import ensure_tiny_qwen_image

    with pytest.raises(UserError, match="holds a QwenImagePipeline, not a Qwen-Image-Edit pipeline"):
        QwenImageEditAdapter.load(model_config(arch="qwen_image_edit", name_or_path=str(ensure_tiny_qwen_image())),
                                  CPU, torch.float32)


def test_a_single_file_needs_its_version_in_the_config(tmp_path, registry):
    from helpers import inline_job

    from toolkit.config.loader import ConfigError, load_config

    (tmp_path / "data").mkdir()
    path = inline_job(tmp_path / "job.yaml", "arch: qwen_image_edit, name_or_path: edit.safetensors")
    with pytest.raises(ConfigError, match="model.version: a single transformer file does not say"):
        load_config(str(path), registry)


@pytest.mark.parametrize("name", list(VERSIONS))
def test_the_instruction_is_read_with_its_references_as_the_pipeline_reads_it(loaded, name):
    """The embedding equals the pipeline's `encode_prompt` given the same pictures (sized as the pipeline sizes them:
    384 x 384 for Plus, 1024 x 1024 for the first version) bit for bit, and changes when a reference changes."""
    adapter = loaded(name)
    pipe = adapter.sampling.pipeline()
    pictures = [picture(1), picture(2, (48, 64))][:adapter.version.slots]
    ours = adapter.encode_prompts([PROMPT], [pictures])
    condition = adapter.condition_images(pictures)
    if not adapter.version.plus:
        assert condition[0].size == calculate_dimensions(FIRST_CONDITION_AREA, 64 / 48)
    theirs, _ = pipe.encode_prompt(prompt=PROMPT, image=condition if adapter.version.plus else condition[0],
                                   device=CPU)
    assert torch.equal(ours.embeds, theirs)
    changed = adapter.encode_prompts([PROMPT], [[picture(3)] + pictures[1:]])
    assert not torch.equal(changed.embeds, ours.embeds)
    batched = adapter.encode_prompts([PROMPT, "another instruction"], [pictures, pictures])
    assert torch.allclose(batched.embeds[0, :ours.embeds.shape[1]], ours.embeds[0], atol=1e-5)


def euler_check(adapter, pictures: list[Image.Image], dtype: torch.dtype, monkeypatch) -> None:
    """The pipeline's Euler steps against `predict`. The Plus pipelines size their VAE references by a module
    constant (1024 x 1024 pixels), set smaller here: the check is the same at any size, and 1024 x 1024 references
    make it the slowest test of the suite (the first version's pipeline has the area written in)."""
    area = 1024 * 1024
    if adapter.version.plus:
        from diffusers.pipelines.qwenimage import pipeline_qwenimage_edit_plus

        area = 128 * 128
        monkeypatch.setattr(pipeline_qwenimage_edit_plus, "VAE_IMAGE_SIZE", area)
    pipe = adapter.sampling.pipeline()
    pipe.set_progress_bar_config(disable=True)
    start = torch.randn(1, 16, 4, 4, generator=torch.Generator().manual_seed(0))
    seen = []

    def record(pipeline, step, t, kwargs):
        seen.append((t.clone(), kwargs["latents"].clone()))
        return {}

    pipe(image=pictures if adapter.version.plus else pictures[0], prompt=PROMPT, num_inference_steps=3,
         true_cfg_scale=1.0, width=32, height=32, output_type="latent", callback_on_step_end=record,
         latents=QwenImagePipeline._pack_latents(start.clone().to(dtype), 1, 16, 4, 4))
    sigmas = pipe.scheduler.sigmas
    embeds = adapter.encode_prompts([PROMPT], [pictures])
    references = []
    for image in pictures:  # the pipeline's VAE images: `area` pixels at each picture's aspect ratio
        width, height = calculate_dimensions(area, image.width / image.height)
        pixels = pipe.image_processor.preprocess(image, height, width).to(dtype)
        references.append(adapter.reference_latents(adapter.encode_latent_dist(pixels).mean))
    before = start.to(dtype)
    for i, (t, after) in enumerate(seen):
        after = QwenImagePipeline._unpack_latents(after, 32, 32, 8).squeeze(2)
        velocity = adapter.predict(before, pipeline_timestep(t, dtype).reshape(1), embeds, references=references)
        assert torch.equal(after, euler_step(before, sigmas[i + 1] - sigmas[i], velocity)), i
        alone = adapter.predict(before, pipeline_timestep(t, dtype).reshape(1), embeds)
        assert not torch.allclose(velocity, alone, atol=1e-4)  # the references reached the transformer
        before = after
    assert len(seen) == 3


@pytest.mark.slow  # a 1024 x 1024 reference through the VAE and the transformer, three times
@pytest.mark.parametrize("name, count", [("tiny", 1), ("tiny-2509", 2)])
def test_predict_with_references_is_the_velocity_the_pipelines_euler_steps_integrate(loaded, name, count,
                                                                                    monkeypatch):
    """Every step of the version's pipeline given its references (for Plus two, of different aspect ratios) is
    x_next = x + (sigma_next - sigma) predict(x, references=[their latents]), bit for bit."""
    euler_check(loaded(name), [picture(1), picture(2, (48, 64))][:count], torch.float32, monkeypatch)


@pytest.mark.parametrize("dtype", DTYPES)
def test_2511s_euler_steps_hold_in_float32_and_bf16(loaded, dtype, monkeypatch):
    """2511's transformer modulates the reference tokens as at timestep 0 from their shapes (`zero_cond_t`): the same
    check, in both dtypes."""
    euler_check(loaded("tiny-2511", dtype), [picture(4)], dtype, monkeypatch)


def test_reference_tokens_carry_no_loss(loaded):
    adapter = loaded("tiny-2509")
    noisy = torch.randn(2, 16, 4, 4, generator=torch.Generator().manual_seed(2))
    references = [torch.randn(2, 16, 6, 4, generator=torch.Generator().manual_seed(s)) for s in (3, 4)]
    embeds = adapter.encode_prompts([PROMPT, PROMPT])
    t = torch.tensor([400.0, 700.0])
    plain = adapter.predict(noisy, t, embeds, references=references)
    assert plain.shape == noisy.shape

    for rows, same in ((slice(4, None), True), (slice(0, 1), False)):
        handle = shifted_outputs(adapter.transformer.proj_out, rows)
        try:
            result = adapter.predict(noisy, t, embeds, references=references)
        finally:
            handle.remove()
        assert torch.equal(result, plain) == same
