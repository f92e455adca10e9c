"""FLUX.1 Kontext on its tiny preset: the training math against FluxKontextPipeline with a reference image (its
latents packed as extra tokens with their own position ids, the Euler steps the prediction drives, no loss on the
reference's tokens), and what the config lets it do."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from diffusers import FluxKontextPipeline, FluxPipeline
from helpers import euler_step, pipeline_timestep, shifted_outputs
from PIL import Image

from toolkit.models.flux_kontext.adapter import FluxKontextAdapter
from toolkit.models.registry import get_adapter_class, model_config

CPU = torch.device("cpu")
PROMPT = "make the circle red"
DTYPES = [pytest.param(torch.float32, id="float32"), pytest.param(torch.bfloat16, id="bf16")]


@pytest.fixture(scope="module")
def loaded(tiny_cache):
    adapters: dict[torch.dtype, FluxKontextAdapter] = {}

    def get(dtype: torch.dtype = torch.float32) -> FluxKontextAdapter:
        if dtype not in adapters:
            adapters[dtype] = FluxKontextAdapter.load(model_config(arch="flux_kontext", name_or_path="tiny"), CPU,
                                                      dtype)
        return adapters[dtype]

    return get


def picture(seed: int, size: tuple[int, int] = (32, 32)) -> Image.Image:
    values = np.random.default_rng(seed).integers(0, 256, (size[1], size[0], 3), dtype=np.uint8)
    return Image.fromarray(values)


def reference_latents(adapter: FluxKontextAdapter, pipe: FluxKontextPipeline, image: Image.Image) -> torch.Tensor:
    """The reference as training makes its latents: the pipeline's preprocessing of the picture, then the adapter's
    encoder mean, scaled (`reference_latents`)."""
    pixels = pipe.image_processor.preprocess(image, image.height, image.width).to(adapter.compute_dtype)
    return adapter.reference_latents(adapter.encode_latent_dist(pixels).mean)


def test_the_family_is_registered_with_one_reference_slot():
    assert get_adapter_class("flux_kontext") is FluxKontextAdapter
    rules = FluxKontextAdapter.facts.references
    assert (rules.slots, rules.optional, rules.size) == (1, True, "target")
    assert FluxKontextAdapter.files.prefix == "transformer" and FluxKontextAdapter.files.comfy_peft_names


@pytest.mark.parametrize("dtype", DTYPES)
def test_predict_with_a_reference_is_the_velocity_the_pipelines_euler_steps_integrate(loaded, dtype):
    """Every step of FluxKontextPipeline given a reference image is x_next = x + (sigma_next - sigma) predict(x,
    references=[its latents]), bit for bit in float32 and bf16; without the reference the prediction differs (the
    check can tell whether the reference reached the transformer)."""
    adapter = loaded(dtype)
    pipe = adapter.sampling.pipeline()
    pipe.set_progress_bar_config(disable=True)
    image = picture(1)
    start = torch.randn(1, 16, 4, 4, generator=torch.Generator().manual_seed(0))
    seen = []

    def record(pipeline, step, t, kwargs):
        seen.append((t.clone(), kwargs["latents"].clone()))
        return {}

    pipe(prompt=PROMPT, image=image, _auto_resize=False, num_inference_steps=3, guidance_scale=2.5,
         **adapter.sampling.size_arguments(32, 32), latents=FluxPipeline._pack_latents(start.clone().to(dtype), 1, 16, 4, 4), output_type="latent",
         max_sequence_length=adapter.max_sequence_length, callback_on_step_end=record)
    sigmas = pipe.scheduler.sigmas
    embeds = adapter.encode_prompts([PROMPT])
    references = [reference_latents(adapter, pipe, image)]
    adapter.train_guidance_scale = 2.5
    try:
        before = start.to(dtype)
        for i, (t, after) in enumerate(seen):
            after = FluxPipeline._unpack_latents(after, 32, 32, 8)
            velocity = adapter.predict(before, pipeline_timestep(t, dtype).reshape(1), embeds, references=references)
            assert torch.equal(after, euler_step(before, sigmas[i + 1] - sigmas[i], velocity)), i
            alone = adapter.predict(before, pipeline_timestep(t, dtype).reshape(1), embeds)
            assert not torch.allclose(velocity, alone, atol=1e-3)
            before = after
    finally:
        adapter.train_guidance_scale = 1.0
    assert len(seen) == 3


def test_reference_tokens_carry_no_loss(loaded):
    """What the transformer outputs at the reference's tokens never reaches the prediction (so no loss): changing
    those rows leaves it bit for bit, changing a target row does not; the prediction has the target's shape."""
    adapter = loaded()
    noisy = torch.randn(2, 16, 4, 4, generator=torch.Generator().manual_seed(2))
    reference = torch.randn(2, 16, 6, 4, generator=torch.Generator().manual_seed(3))  # another size than the target
    embeds = adapter.encode_prompts([PROMPT, PROMPT])
    t = torch.tensor([400.0, 700.0])
    plain = adapter.predict(noisy, t, embeds, references=[reference])
    assert plain.shape == noisy.shape
    target_tokens = 4  # 4 x 4 latents, packed 2 x 2

    for rows, same in ((slice(target_tokens, None), True), (slice(0, 1), False)):
        handle = shifted_outputs(adapter.transformer.proj_out, rows)
        try:
            result = adapter.predict(noisy, t, embeds, references=[reference])
        finally:
            handle.remove()
        assert torch.equal(result, plain) == same


def test_reference_position_ids_are_the_pipelines(loaded):
    """The reference's ids are the pipeline's: its own grid with the first coordinate 1."""
    adapter = loaded()
    pipe = adapter.sampling.pipeline()
    latents = torch.randn(1, 16, 6, 4)
    _, _, _, theirs = pipe.prepare_latents(latents, 1, 16, 32, 32, torch.float32, CPU)
    tokens, ours = adapter.reference_tokens([latents], torch.float32, CPU)
    assert torch.equal(ours, theirs)
    assert torch.equal(tokens, FluxPipeline._pack_latents(latents, 1, 16, 6, 4))
