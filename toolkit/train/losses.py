"""Losses of one micro-batch, and the per-sample weights applied to them.

Losses come back per sample (shape [batch]) so that timestep weights, min-SNR weights and masks can be
applied per sample before the batch mean. Everything is computed in float32 whatever the autocast dtype,
because the small differences of a late-training loss vanish in bf16.
"""

from __future__ import annotations

from typing import Literal, get_args

import torch
import torch.nn.functional as F

from ..device import to_device

LossType = Literal["mse", "mae", "pseudo_huber"]
PredictionType = Literal["epsilon", "v_prediction", "flow_matching"]
LOSS_TYPES: tuple[str, ...] = get_args(LossType)
PREDICTION_TYPES: tuple[str, ...] = get_args(PredictionType)


def mse_loss(prediction: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    """Mean squared error computed in float32 whatever the autocast dtype."""
    return F.mse_loss(prediction.float(), target.float(), reduction="mean")


def per_sample_loss(prediction: torch.Tensor, target: torch.Tensor, loss_type: LossType = "mse",
                    huber_c: float = 0.1) -> torch.Tensor:
    """Element loss of residual r = prediction - target, averaged over all but the batch dim: [batch].

    mse: r^2. mae: |r|. pseudo_huber: 2c (sqrt(r^2 + c^2) - c) with c = huber_c (kohya's form): about
    r^2 for |r| << c, so it keeps MSE's scale and learning rate, and about 2c|r| for |r| >> c, so
    outliers pull linearly instead of quadratically.
    """
    if prediction.shape != target.shape:
        shapes = f"{tuple(prediction.shape)} and target {tuple(target.shape)}"
        raise ValueError(f"prediction {shapes} differ in shape")
    residual = prediction.float() - target.float()
    if loss_type == "mse":
        element = residual**2
    elif loss_type == "mae":
        element = residual.abs()
    elif loss_type == "pseudo_huber":
        if not huber_c > 0:
            raise ValueError(f"huber_c must be > 0, got {huber_c}")
        element = 2.0 * huber_c * (torch.sqrt(residual**2 + huber_c**2) - huber_c)
    else:
        raise ValueError(f"loss_type must be one of {LOSS_TYPES}, got {loss_type!r}")
    return element.reshape(element.shape[0], -1).mean(dim=1)


def weighted_mean(per_sample: torch.Tensor, *weights: torch.Tensor | None) -> torch.Tensor:
    """mean_i(loss_i * prod_k weight_k,i): the micro-batch loss; None weights are skipped."""
    total = per_sample.float()
    for weight in weights:
        if weight is not None:
            total = total * to_device(weight, total.device, torch.float32)
    return total.mean()


# --- signal-to-noise ratio per sample ---------------------------------------------------------------


def snr_from_alphas_cumprod(alphas_cumprod: torch.Tensor, timesteps: torch.Tensor) -> torch.Tensor:
    """DDPM: SNR(t) = alpha_bar_t / (1 - alpha_bar_t), one value per sample's integer t."""
    alpha_bar = to_device(alphas_cumprod, timesteps.device).float()[timesteps.long()]
    return alpha_bar / (1.0 - alpha_bar)


def snr_from_flow_sigmas(sigmas: torch.Tensor) -> torch.Tensor:
    """Flow matching, x_t = (1 - sigma) x_0 + sigma noise: SNR = ((1 - sigma) / sigma)^2 per sample."""
    sigmas = sigmas.float()
    return ((1.0 - sigmas) / sigmas) ** 2


# --- min-SNR-gamma (Hang et al. 2023, arXiv 2303.09556) ------------------------------------------------


def min_snr_weights(snr: torch.Tensor, gamma: float, prediction_type: PredictionType) -> torch.Tensor:
    """Per-sample loss weight that turns the plain target MSE into min(SNR, gamma) * ||x0 error||^2.

    The paper weights the x0 error by min(SNR, gamma); dividing by what each target's error already
    carries gives the weight on that target's loss:
      epsilon:       min(SNR, gamma) / SNR             (||eps err||^2 = SNR ||x0 err||^2)
      v_prediction:  min(SNR, gamma) / (SNR + 1)       (||v err||^2 = (SNR + 1) ||x0 err||^2)
      flow_matching: min(SNR, gamma) / (sqrt(SNR) + 1)^2 = min(SNR, gamma) * sigma^2
                     (target noise - x0: ||v err||^2 = ||x0 err||^2 / sigma^2, 1/sigma = sqrt(SNR) + 1)
    `snr` holds one value per sample (snr_from_alphas_cumprod or snr_from_flow_sigmas).
    """
    if not gamma > 0:
        raise ValueError(f"min_snr_gamma must be > 0, got {gamma}")
    snr = snr.float()
    if prediction_type == "epsilon":
        # written as min(1, gamma / SNR): the same value, and finite at SNR = 0 (pure noise), where it is 1
        return torch.clamp(gamma / snr, max=1.0)
    if prediction_type == "v_prediction":
        return torch.clamp(snr, max=gamma) / (snr + 1.0)
    if prediction_type == "flow_matching":
        return torch.clamp(snr, max=gamma) / (snr.sqrt() + 1.0) ** 2
    raise ValueError(f"prediction_type must be one of {PREDICTION_TYPES}, got {prediction_type!r}")


# --- noise -----------------------------------------------------------------------------------------------


def noise_offset(noise: torch.Tensor, offset: float, generator: torch.Generator) -> torch.Tensor:
    """noise + offset * n, n ~ N(0, 1) of shape [batch, channels, 1, 1]: one shift per sample and channel,
    which lets the model learn overall brightness (Guttenberg 2023). n is drawn on the CPU generator so
    the draw does not depend on the device; offset 0 returns the noise unchanged and draws nothing."""
    if offset == 0:
        return noise
    shift = torch.randn(noise.shape[0], noise.shape[1], *([1] * (noise.dim() - 2)), generator=generator)
    return noise + offset * shift.to(device=noise.device, dtype=noise.dtype)
