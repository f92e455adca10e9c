"""Signal-to-noise ratio per sample, and the min-SNR-gamma loss weight built on it."""

from __future__ import annotations

from typing import Literal, get_args

import torch

from toolkit.device import to_device

PredictionType = Literal["epsilon", "v_prediction", "flow_matching"]
PREDICTION_TYPES: tuple[str, ...] = get_args(PredictionType)


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
