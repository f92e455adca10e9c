"""The SD 1.x adapter: loading forms, noise targets, divisor."""

from __future__ import annotations

import pytest
import torch
from diffusers import DDPMScheduler
from ldm_format import save_as_ldm_checkpoint

from toolkit.diffusion.schedules import DDPMNoiseSchedule
from toolkit.models.registry import get_adapter_class, model_config
from toolkit.models.sd15.adapter import SD15Adapter

CPU = torch.device("cpu")

#: the dtypes the training math is pinned in: float32 and bf16 (what GPU runs train in)
DTYPES = [pytest.param(torch.float32, id="float32"), pytest.param(torch.bfloat16, id="bf16")]
#: DDPM noising and targets against their closed form in float32: bf16 (8 significant bits) rounds both roots, both
#: products and their sum; 0.034 measured here, 0.044 the most over 300 seeds (diffusers' own bf16 values are
#: matched bit for bit below, which also tells a timestep read one step off, under bf16's resolution here)
TARGET_ATOL = {torch.float32: 1e-6, torch.bfloat16: 0.07}


@pytest.fixture(scope="module")
def loaded(tiny_sd15):
    """The tiny SD 1.x adapter per dtype, each loaded once, when a test first asks for it."""
    adapters: dict[torch.dtype, SD15Adapter] = {}

    def get(dtype: torch.dtype) -> SD15Adapter:
        if dtype not in adapters:
            adapters[dtype] = SD15Adapter.load(model_config(arch="sd15", name_or_path="tiny"), CPU, dtype)
        return adapters[dtype]

    return get


def test_registry_finds_the_sd15_adapter():
    assert get_adapter_class("sd15") is SD15Adapter
    with pytest.raises(ValueError, match="unknown model.arch 'nope'"):
        get_adapter_class("nope")


def test_tiny_preset_loads_through_the_diffusers_folder_code(tiny_sd15):
    adapter = SD15Adapter.load(model_config(arch="sd15", name_or_path="tiny"), torch.device("cpu"), torch.float32)
    assert adapter.source == str(tiny_sd15)
    assert adapter.divisor == 16  # VAE /8, UNet /2
    assert not any(p.requires_grad for p in adapter.unet.parameters())
    assert adapter.encode_prompts(["a", "b"]).embeds.shape == (2, 77, 32)


def test_single_file_checkpoint_loads_the_same_weights(tiny_sd15, tmp_path):
    checkpoint = save_as_ldm_checkpoint(tiny_sd15, tmp_path / "tiny.safetensors")
    cfg = model_config(arch="sd15", name_or_path=str(checkpoint), single_file_config=str(tiny_sd15))
    from_file = SD15Adapter.load(cfg, torch.device("cpu"), torch.float32)
    from_folder = SD15Adapter.load(model_config(arch="sd15", name_or_path=str(tiny_sd15)),
                                   torch.device("cpu"), torch.float32)
    for name in ("unet", "vae", "text_encoder"):
        ours, theirs = getattr(from_file, name).state_dict(), getattr(from_folder, name).state_dict()
        assert ours.keys() == theirs.keys()
        assert all(torch.equal(ours[k], theirs[k]) for k in ours), name
    assert from_file.noise_schedule.num_train_timesteps == 1000


def test_missing_single_file_is_named(tmp_path):
    cfg = model_config(arch="sd15", name_or_path=str(tmp_path / "missing.safetensors"))
    with pytest.raises(FileNotFoundError, match="missing.safetensors"):
        SD15Adapter.load(cfg, torch.device("cpu"), torch.float32)


def test_model_dtype_applies_to_frozen_weights(loaded):
    adapter = loaded(torch.bfloat16)
    assert adapter.unet.dtype == torch.bfloat16 and adapter.text_encoder.dtype == torch.bfloat16


@pytest.mark.parametrize("dtype", DTYPES)
def test_prompt_embeddings_and_prediction_are_the_pipelines(loaded, dtype):
    """The CLIP encoder's last hidden state as StableDiffusionPipeline.encode_prompt gives it (the empty prompt
    included), and the prediction is the UNet called as the pipeline calls it (latents and embeddings in the model's
    dtype, the timestep as it is): bit for bit in float32 and in bf16, where the UNet predicts in bf16."""
    adapter = loaded(dtype)
    prompts = ["a photo of a cat, sitting", ""]
    ours = adapter.encode_prompts(prompts)
    theirs, _ = adapter.sampling.pipeline().encode_prompt(prompts, CPU, 1, do_classifier_free_guidance=False)
    assert ours.embeds.dtype == theirs.dtype == dtype and torch.equal(ours.embeds, theirs)
    noisy = torch.randn(2, 4, 8, 8, generator=torch.Generator().manual_seed(0))
    t = torch.tensor([10, 900])
    prediction = adapter.predict(noisy, t, ours)
    assert prediction.dtype == dtype
    assert torch.equal(prediction, adapter.unet(noisy.to(dtype), t, encoder_hidden_states=theirs).sample)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("prediction_type", ["epsilon", "v_prediction"])
def test_target_follows_the_scheduler_prediction_type(prediction_type, dtype):
    """Noisy latents and targets in the latents' dtype are the closed form (computed in float32 on the same values)."""
    scheduler = DDPMScheduler(num_train_timesteps=1000, prediction_type=prediction_type)
    schedule = DDPMNoiseSchedule(scheduler)
    generator = torch.Generator().manual_seed(0)
    latents, noise = (torch.randn(3, 4, 8, 8, generator=generator).to(dtype) for _ in range(2))
    t = schedule.timesteps(torch.tensor([0.0, 0.5, 0.9999]))
    assert t.tolist() == [0, 500, 999]
    alpha = scheduler.alphas_cumprod[t].sqrt().view(-1, 1, 1, 1)
    sigma = (1 - scheduler.alphas_cumprod[t]).sqrt().view(-1, 1, 1, 1)
    noisy = schedule.add_noise(latents, noise, t)
    latents, noise = latents.float(), noise.float()
    assert noisy.dtype == dtype
    assert torch.allclose(noisy.float(), alpha * latents + sigma * noise, atol=TARGET_ATOL[dtype])
    expected = noise if prediction_type == "epsilon" else alpha * noise - sigma * latents
    target = schedule.target(latents.to(dtype), noise.to(dtype), t)
    assert target.dtype == dtype
    assert torch.allclose(target.float(), expected, atol=TARGET_ATOL[dtype])


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("zero_terminal_snr", [False, True])
def test_noise_and_velocity_equal_diffusers_bit_for_bit(dtype, zero_terminal_snr):
    """The roots are made once per device and dtype; the noisy latents and v targets stay diffusers' own values,
    at every timestep (a resumed run of an older version draws the same examples)."""
    scheduler = DDPMScheduler(num_train_timesteps=1000, prediction_type="v_prediction",
                              rescale_betas_zero_snr=zero_terminal_snr)
    schedule = DDPMNoiseSchedule(scheduler)
    reference = DDPMScheduler.from_config(scheduler.config)
    for t in (torch.arange(1000), torch.tensor([0]), torch.tensor([999, 3, 500])):
        latents = torch.randn(len(t), 4, 6, 6).to(dtype)
        noise = torch.randn(len(t), 4, 6, 6).to(dtype)
        assert torch.equal(schedule.add_noise(latents, noise, t), reference.add_noise(latents, noise, t))
        assert torch.equal(schedule.target(latents, noise, t), reference.get_velocity(latents, noise, t))
    assert len(schedule._coefficients) == 1  # one table for the device and dtype, not one per call


def test_unsupported_prediction_type_is_refused():
    with pytest.raises(ValueError, match="sample"):
        DDPMNoiseSchedule(DDPMScheduler(prediction_type="sample"))


def test_overlong_prompts_are_found_before_training(loaded):
    adapter = loaded(torch.float32)
    # the tiny tokenizer is byte level: one token per character, 77 with the start and end tokens
    assert adapter.text.overlong_prompts(["a short caption", "x" * 75, "x" * 76]) == [2]


def test_a_tiny_preset_keeps_its_folder_when_its_builder_changes_the_preset(tmp_path, monkeypatch):
    """A builder that changes the dict it is given (transformers' configs add keys to nested dicts) must not change the
    preset's folder name: the same process asking again (the next job of a launch) finds the folder it built instead
    of building another under a new name."""
    from toolkit.models.tiny import ensure_tiny

    monkeypatch.setenv("DIFFTUNE_CACHE", str(tmp_path))
    builds = []

    def build(folder, preset):
        builds.append(folder)
        preset["nested"]["added"] = 1
        (folder / "config.json").write_text("{}")
        (folder / "weights.safetensors").write_bytes(b"")

    preset = {"nested": {"width": 4}}
    first = ensure_tiny("mutating", preset, build)
    assert ensure_tiny("mutating", preset, build) == first and len(builds) == 1
    assert preset == {"nested": {"width": 4}}
