"""Losses of one micro-batch, and the per-sample weights applied to them.

Losses come back per sample (shape [batch]) so that timestep weights, min-SNR weights and masks can be
applied per sample before the batch mean. Everything is computed in float32 whatever the autocast dtype,
because the small differences of a late-training loss vanish in bf16.
"""

from __future__ import annotations

from typing import Literal, get_args

import torch
import torch.nn.functional as F

from toolkit.device import as_dtype, to_device

LossType = Literal["mse", "mae", "pseudo_huber"]
LOSS_TYPES: tuple[str, ...] = get_args(LossType)


def mse_loss(prediction: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    """Mean squared error computed in float32 whatever the autocast dtype."""
    return F.mse_loss(prediction.float(), target.float(), reduction="mean")


def per_sample_loss(prediction: torch.Tensor, target: torch.Tensor, loss_type: LossType = "mse",
                    huber_c: float = 0.1, weights: torch.Tensor | None = None) -> torch.Tensor:
    """Element loss of residual r = prediction - target, averaged over all but the batch dim: [batch].

    mse: r^2. mae: |r|. pseudo_huber: 2c (sqrt(r^2 + c^2) - c) with c = huber_c (kohya's form): about
    r^2 for |r| << c, so it keeps MSE's scale and learning rate, and about 2c|r| for |r| >> c, so
    outliers pull linearly instead of quadratically.

    `weights` (a loss mask, broadcastable to the elements: `mask_weights`): each sample's loss is the weighted mean
    sum(w e) / sum(w), the mean over the area it trains, so a mask changes where a sample learns, not how strongly.
    """
    if prediction.shape != target.shape:
        shapes = f"{tuple(prediction.shape)} and target {tuple(target.shape)}"
        raise ValueError(f"prediction {shapes} differ in shape")
    prediction, target = as_dtype(prediction, torch.float32), as_dtype(target, torch.float32)
    if loss_type == "mse":
        element = (prediction - target).square()  # F.mse_loss would broadcast the pair first, an operation more
    elif loss_type == "mae":
        element = (prediction - target).abs()
    elif loss_type == "pseudo_huber":
        if not huber_c > 0:
            raise ValueError(f"huber_c must be > 0, got {huber_c}")
        element = 2.0 * huber_c * (torch.sqrt((prediction - target) ** 2 + huber_c**2) - huber_c)
    else:
        raise ValueError(f"loss_type must be one of {LOSS_TYPES}, got {loss_type!r}")
    if weights is None:
        return element.mean(dim=tuple(range(1, element.dim()))) if element.dim() > 1 else element
    return weighted_element_mean(element, weights)


def batch_mean_loss(prediction: torch.Tensor, target: torch.Tensor, loss_type: LossType = "mse",
                    huber_c: float = 0.1) -> torch.Tensor:
    """The micro-batch loss where no sample is weighted (no mask, sampler or min-SNR weight): the mean of
    `per_sample_loss` over its samples (all of one size), taken over every element at once. For mse that is torch's
    own loss, one autograd node where per-sample means and then their mean are four for backward to run at every
    update."""
    if loss_type == "mse" and prediction.shape == target.shape:
        return F.mse_loss(as_dtype(prediction, torch.float32), as_dtype(target, torch.float32))
    return per_sample_loss(prediction, target, loss_type, huber_c).mean()


def weighted_element_mean(element: torch.Tensor, weights: torch.Tensor) -> torch.Tensor:
    """sum(w e) / sum(w) per sample, [batch]: a sample whose weights are all 0 gives 0 and no gradient (not NaN)."""
    weights = to_device(weights, element.device, torch.float32).expand_as(element)
    total = (element * weights).reshape(element.shape[0], -1).sum(dim=1)
    area = weights.reshape(element.shape[0], -1).sum(dim=1)
    return total / area.clamp_min(torch.finfo(torch.float32).tiny)


def mask_to_grid(mask: torch.Tensor, grid: tuple[int, int] | torch.Size) -> torch.Tensor:
    """Masks [..., H, W] on a latent grid (h, w), by area: each latent cell weighs the mean of the mask over the
    pixels it was encoded from (a cell half inside the mask trains at half weight; area, not bilinear, so a thin
    masked-out line still counts). Returned as is when already on the grid."""
    grid = tuple(grid)
    if tuple(mask.shape[-2:]) == grid:
        return mask
    flat = mask.float().reshape(-1, 1, *mask.shape[-2:])
    return F.interpolate(flat, size=grid, mode="area").reshape(*mask.shape[:-2], *grid)


def mask_weights(mask: torch.Tensor, latents: torch.Tensor) -> torch.Tensor:
    """A batch's loss masks [B, 1, H, W] (pixels, or already on the latent grid from the latent cache) as weights
    for `latents` [B, C, h, w] or, video families, [B, C, F, h, w]: on the latent grid (`mask_to_grid`), shaped to
    broadcast over the channels and a clip's frames (a clip has one mask for all its frames)."""
    grid = mask_to_grid(mask, latents.shape[-2:])
    return grid.reshape(grid.shape[0], 1, *([1] * (latents.dim() - 4)), *grid.shape[-2:])


def weighted_mean(per_sample: torch.Tensor, *weights: torch.Tensor | None) -> torch.Tensor:
    """mean_i(loss_i * prod_k weight_k,i): the micro-batch loss; None weights are skipped."""
    total = as_dtype(per_sample, torch.float32)
    for weight in weights:
        if weight is not None:
            total = total * to_device(weight, total.device, torch.float32)
    return total.mean()
