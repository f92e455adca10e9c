"""Losses and loss weights: per-sample values, each checked against numbers computed by hand."""

from __future__ import annotations

import math

import pytest
import torch
import torch.nn.functional as F

from toolkit.diffusion.noise import noise_offset
from toolkit.diffusion.snr import min_snr_weights, snr_from_alphas_cumprod, snr_from_flow_sigmas
from toolkit.train.losses import batch_mean_loss, mse_loss, per_sample_loss, weighted_mean

# two samples of shape [1, 1, 2]; residuals prediction - target: sample 0 (1, 2), sample 1 (2, -2)
PRED = torch.tensor([[[[1.0, 2.0]]], [[[3.0, -1.0]]]])
TARGET = torch.tensor([[[[0.0, 0.0]]], [[[1.0, 1.0]]]])


def test_mse_loss_is_unchanged_batch_mean():
    assert mse_loss(PRED, TARGET).item() == pytest.approx(F.mse_loss(PRED, TARGET).item())
    assert mse_loss(PRED, TARGET).item() == pytest.approx((2.5 + 4.0) / 2)


def test_per_sample_mse_and_mae_are_hand_computed_means_over_each_sample():
    torch.testing.assert_close(per_sample_loss(PRED, TARGET, "mse"), torch.tensor([2.5, 4.0]))
    torch.testing.assert_close(per_sample_loss(PRED, TARGET, "mae"), torch.tensor([1.5, 2.0]))


def test_pseudo_huber_is_2c_times_sqrt_r2_plus_c2_minus_c():
    # c = 1: r = 1 -> 2 (sqrt 2 - 1) = 0.828427; r = 2 -> 2 (sqrt 5 - 1) = 2.472136
    expected = torch.tensor([(0.828427 + 2.472136) / 2, 2.472136])
    torch.testing.assert_close(per_sample_loss(PRED, TARGET, "pseudo_huber", huber_c=1.0), expected)


def test_pseudo_huber_is_mse_for_small_residuals_and_linear_for_large_ones():
    small, large = torch.full((1, 4), 1e-3), torch.full((1, 4), 100.0)
    zero = torch.zeros(1, 4)
    assert per_sample_loss(small, zero, "pseudo_huber", 0.1).item() == pytest.approx(1e-6, rel=1e-3)
    linear = 2 * 0.1 * 100.0  # 2c |r|
    assert per_sample_loss(large, zero, "pseudo_huber", 0.1).item() == pytest.approx(linear, rel=1e-2)


def test_losses_are_computed_in_float32_from_half_precision_inputs():
    for loss_type in ("mse", "mae", "pseudo_huber"):
        loss = per_sample_loss(PRED.bfloat16(), TARGET.bfloat16(), loss_type)
        assert loss.dtype == torch.float32 and loss.shape == (2,)


def test_bad_loss_inputs_raise():
    with pytest.raises(ValueError, match="loss_type"):
        per_sample_loss(PRED, TARGET, "l2")
    with pytest.raises(ValueError, match="huber_c"):
        per_sample_loss(PRED, TARGET, "pseudo_huber", huber_c=0.0)
    with pytest.raises(ValueError, match="shape"):
        per_sample_loss(PRED, TARGET[:1])


def test_weighted_mean_multiplies_every_weight_per_sample():
    losses = torch.tensor([1.0, 2.0, 3.0])
    value = weighted_mean(losses, torch.tensor([1.0, 0.5, 2.0]), None, torch.tensor([2.0, 2.0, 1.0]))
    assert value.item() == pytest.approx((2.0 + 2.0 + 6.0) / 3)


# --- min-SNR-gamma per prediction type, per sample -------------------------------------------------------

GAMMA = 5.0
# alpha_bar at t = 0..3; the batch visits t = 0, 2, 1, 3 so every sample has its own SNR
ALPHAS_CUMPROD = torch.tensor([0.9, 0.5, 0.2, 0.01])
TIMESTEPS = torch.tensor([0, 2, 1, 3])
DDPM_SNR = [9.0, 0.25, 1.0, 1.0 / 99.0]  # alpha_bar / (1 - alpha_bar)


def test_ddpm_snr_is_alpha_bar_over_one_minus_alpha_bar_per_sample():
    torch.testing.assert_close(snr_from_alphas_cumprod(ALPHAS_CUMPROD, TIMESTEPS), torch.tensor(DDPM_SNR))


def test_ddpm_snr_matches_diffusers_compute_snr():
    from diffusers import DDPMScheduler
    from diffusers.training_utils import compute_snr

    scheduler = DDPMScheduler(beta_schedule="scaled_linear", beta_start=0.00085, beta_end=0.012)
    t = torch.tensor([0, 10, 500, 999])
    ours = snr_from_alphas_cumprod(scheduler.alphas_cumprod, t)
    torch.testing.assert_close(ours, compute_snr(scheduler, t))


def test_min_snr_epsilon_weight_is_min_snr_gamma_over_snr():
    # min(SNR, 5) / SNR: 5/9, then 1 for every SNR below gamma
    weights = min_snr_weights(torch.tensor(DDPM_SNR), GAMMA, "epsilon")
    torch.testing.assert_close(weights, torch.tensor([5.0 / 9.0, 1.0, 1.0, 1.0]))


def test_min_snr_v_prediction_weight_is_min_snr_gamma_over_snr_plus_one():
    # min(SNR, 5) / (SNR + 1): 5/10, 0.25/1.25, 1/2, (1/99)/(100/99) = 0.01
    weights = min_snr_weights(torch.tensor(DDPM_SNR), GAMMA, "v_prediction")
    torch.testing.assert_close(weights, torch.tensor([0.5, 0.2, 0.5, 0.01]))


def test_flow_snr_uses_each_samples_own_sigma():
    sigmas = torch.tensor([0.1, 0.5, 0.8, 1.0 / 3.0])
    # ((1 - sigma) / sigma)^2: (0.9/0.1)^2, 1, (0.2/0.8)^2, (2/3 / 1/3)^2
    torch.testing.assert_close(snr_from_flow_sigmas(sigmas), torch.tensor([81.0, 1.0, 0.0625, 4.0]))


def test_min_snr_flow_matching_weight_is_min_snr_gamma_times_sigma_squared():
    sigmas = torch.tensor([0.1, 0.5, 0.8, 1.0 / 3.0])
    weights = min_snr_weights(snr_from_flow_sigmas(sigmas), GAMMA, "flow_matching")
    # min(SNR, 5) * sigma^2: 5 * 0.01, 1 * 0.25, 0.0625 * 0.64, 4 / 9
    torch.testing.assert_close(weights, torch.tensor([0.05, 0.25, 0.04, 4.0 / 9.0]))
    assert len(set(weights.tolist())) == 4  # per sample, not the batch's first sigma


def test_min_snr_weights_are_finite_at_pure_noise_and_at_clean_latents():
    snr = torch.tensor([0.0, math.inf])  # sigma = 1 (zero-terminal-SNR schedules) and sigma = 0
    torch.testing.assert_close(min_snr_weights(snr, GAMMA, "epsilon"), torch.tensor([1.0, 0.0]))
    torch.testing.assert_close(min_snr_weights(snr, GAMMA, "v_prediction"), torch.tensor([0.0, 0.0]))
    torch.testing.assert_close(min_snr_weights(snr, GAMMA, "flow_matching"), torch.tensor([0.0, 0.0]))


def test_bad_min_snr_inputs_raise():
    with pytest.raises(ValueError, match="prediction_type"):
        min_snr_weights(torch.ones(2), GAMMA, "sample")
    with pytest.raises(ValueError, match="gamma"):
        min_snr_weights(torch.ones(2), 0.0, "epsilon")


# --- noise offset -----------------------------------------------------------------------------------------


def test_noise_offset_adds_one_seeded_shift_per_sample_and_channel():
    noise = torch.randn(3, 4, 5, 6, generator=torch.Generator().manual_seed(1))
    shifted = noise_offset(noise, 0.1, torch.Generator().manual_seed(7))
    expected_shift = 0.1 * torch.randn(3, 4, 1, 1, generator=torch.Generator().manual_seed(7))
    torch.testing.assert_close(shifted, noise + expected_shift)
    delta = shifted - noise
    assert torch.allclose(delta, delta[:, :, :1, :1].expand_as(delta))  # constant over the image
    assert delta[:, :, 0, 0].unique().numel() == 12  # different for every sample and channel


def test_noise_offset_zero_returns_the_noise_unchanged():
    noise = torch.randn(2, 4, 3, 3)
    assert noise_offset(noise, 0.0, torch.Generator().manual_seed(0)) is noise


@pytest.mark.parametrize("loss_type", ["mse", "mae", "pseudo_huber"])
def test_an_unweighted_batch_loss_is_the_mean_of_its_per_sample_losses_with_the_same_gradient(loss_type):
    """Without per-sample weights the batch loss is taken over every element at once (one autograd node for mse);
    value and gradient are those of the per-sample losses' mean."""
    prediction = torch.randn(3, 4, 5, 5, generator=torch.Generator().manual_seed(1)).requires_grad_()
    target = torch.randn(3, 4, 5, 5, generator=torch.Generator().manual_seed(2))
    whole = batch_mean_loss(prediction, target, loss_type, huber_c=0.5)
    (whole_grad,) = torch.autograd.grad(whole, prediction)
    per_sample = weighted_mean(per_sample_loss(prediction, target, loss_type, huber_c=0.5))
    (per_sample_grad,) = torch.autograd.grad(per_sample, prediction)
    torch.testing.assert_close(whole, per_sample)
    torch.testing.assert_close(whole_grad, per_sample_grad)
    if loss_type == "mse":
        assert type(whole.grad_fn).__name__ == "MseLossBackward0"
    with pytest.raises(ValueError, match="differ in shape"):
        batch_mean_loss(prediction, target[:2], loss_type)
