"""The SD 1.x adapter: loading forms, noise targets, divisor."""

from __future__ import annotations

import pytest
import torch
from diffusers import DDPMScheduler
from ldm_format import save_as_ldm_checkpoint

from toolkit.diffusion.schedules import DDPMNoiseSchedule
from toolkit.models.registry import get_adapter_class, model_config
from toolkit.models.sd15.adapter import SD15Adapter


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


def test_model_dtype_applies_to_frozen_weights():
    adapter = SD15Adapter.load(model_config(arch="sd15", name_or_path="tiny"), torch.device("cpu"), torch.bfloat16)
    assert adapter.unet.dtype == torch.bfloat16 and adapter.text_encoder.dtype == torch.bfloat16


@pytest.mark.parametrize("prediction_type", ["epsilon", "v_prediction"])
def test_target_follows_the_scheduler_prediction_type(prediction_type):
    scheduler = DDPMScheduler(num_train_timesteps=1000, prediction_type=prediction_type)
    schedule = DDPMNoiseSchedule(scheduler)
    latents, noise = torch.randn(2, 4, 8, 8), torch.randn(2, 4, 8, 8)
    t = schedule.timesteps(torch.tensor([0.0, 0.9999]))
    assert t.tolist() == [0, 999]
    alpha = scheduler.alphas_cumprod[t].sqrt().view(-1, 1, 1, 1)
    sigma = (1 - scheduler.alphas_cumprod[t]).sqrt().view(-1, 1, 1, 1)
    assert torch.allclose(schedule.add_noise(latents, noise, t), alpha * latents + sigma * noise, atol=1e-6)
    expected = noise if prediction_type == "epsilon" else alpha * noise - sigma * latents
    assert torch.allclose(schedule.target(latents, noise, t), expected, atol=1e-6)


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


def test_overlong_prompts_are_found_before_training():
    adapter = SD15Adapter.load(model_config(arch="sd15", name_or_path="tiny"), torch.device("cpu"), torch.float32)
    # the tiny tokenizer is byte level: one token per character, 77 with the start and end tokens
    assert adapter.text.overlong_prompts(["a short caption", "x" * 75, "x" * 76]) == [2]
