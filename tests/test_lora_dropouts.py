"""Rank and module dropout on top of peft's LoRA layers: training-mode statistics, eval mode untouched."""

from __future__ import annotations

import pytest
import torch

from toolkit.config.schema import NetworkConfig
from toolkit.network.lora import add_lora


class Tiny(torch.nn.Module):
    """A module with one `to_q` projection, adapted the way the UNet's attention is."""

    def __init__(self):
        super().__init__()
        self.to_q = torch.nn.Linear(16, 16, bias=False)

    def forward(self, x):
        return self.to_q(x)


def adapted(**dropouts) -> torch.nn.Module:
    from peft import inject_adapter_in_model

    torch.manual_seed(0)
    model = Tiny()
    cfg = NetworkConfig(linear=8, linear_alpha=8, **dropouts)
    model.add_adapter = lambda config: inject_adapter_in_model(config, model)  # diffusers' hook, minimal
    add_lora(model, cfg, ["to_q"])
    with torch.no_grad():
        model.to_q.lora_B["default"].weight.normal_()  # a trained-looking LoRA: its output is not zero
    return model


def lora_output(model, x):
    base = x @ model.to_q.base_layer.weight.T
    return (model(x) - base).detach()


def test_module_dropout_skips_the_whole_lora_at_its_rate_in_training_only():
    model, x = adapted(module_dropout=0.3), torch.randn(4, 10, 16)
    model.train()
    skipped = sum(bool(lora_output(model, x).abs().max() == 0) for _ in range(2000)) / 2000
    assert skipped == pytest.approx(0.3, abs=0.04)
    model.eval()
    reference = lora_output(model, x)
    assert reference.abs().max() > 0
    assert all(torch.equal(lora_output(model, x), reference) for _ in range(20))


def test_rank_dropout_zeroes_channels_per_sample_and_keeps_the_mean():
    model, x = adapted(rank_dropout=0.5), torch.randn(2, 6, 16)
    seen = []
    model.to_q.lora_A["default"].register_forward_hook(lambda m, i, out: seen.append(out.detach()))
    model.eval()
    reference = lora_output(model, x)
    model.train()
    draws = torch.stack([lora_output(model, x) for _ in range(4000)])
    masks = torch.stack([(down == 0) for down in seen[1:]])  # [draw, sample, token, rank]
    assert masks.float().mean().item() == pytest.approx(0.5, abs=0.02)
    assert torch.equal(masks.all(dim=2), masks.any(dim=2))  # a channel is dropped for all of a sample's tokens
    assert (masks[:, 0] != masks[:, 1]).any()  # independently per sample
    assert torch.allclose(draws.mean(0), reference, atol=0.08 * float(reference.abs().max()))
    model.eval()
    assert torch.equal(lora_output(model, x), reference)
