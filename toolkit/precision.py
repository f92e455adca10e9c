"""The one rule for the dtype of each thing in a run (docs/architecture.md, "Precision").

- the frozen base (denoiser, encoders, VAE): `model.dtype`, quantized where asked (quanto dequantizes to it);
- the trained weights (LoRA), their gradients, the optimizer's state and the EMA: float32, always;
- the denoiser's forward: under autocast in `train.dtype` wherever it runs, in training, in the validation loss and
  in samples, so a sample shows what training computes. Its outputs are float32 in training (the loss is float32)
  and the base's dtype inside a sampling pipeline (what the pipeline's scheduler and VAE expect of a denoiser of
  that dtype). Encoders run in the base's dtype without autocast, in training, caching and sampling alike; the VAE
  decodes in its own dtype (the base's, or float32 where the pipeline upcasts it);
- `auto`: float32 and no autocast on the CPU; on CUDA bf16, or the other key's half precision where it names one;
- fp16 scales the loss with a GradScaler (accelerate's; on the CPU, where accelerate turns fp16 off without a word,
  `toolkit.run.accelerator.enable_cpu_fp16` gives accelerate torch's CPU autocast and GradScaler);
- caches: latents as the family's `latents_from_dist` makes them (float32), text embeddings as the text encoder
  made them (the base's dtype);
- files: `save.dtype` for the final LoRA files; checkpoints keep float32.

What cannot run together is refused at config time by key, before anything loads
(`SDTrainerConfig._precision_problems` in toolkit/config/schema.py)."""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import AbstractContextManager, ExitStack, contextmanager, nullcontext
from dataclasses import dataclass
from types import MethodType

import torch

from toolkit.config.base import HALF_PRECISIONS
from toolkit.device import DTYPES


@dataclass(frozen=True)
class Precision:
    """What a run computes in: `base` is the frozen weights' dtype, `compute` the autocast dtype of the denoiser's
    forward (None: no autocast, everything in the base's dtype), on `device_type`."""

    base: torch.dtype
    compute: torch.dtype | None
    device_type: str

    #: the trained weights, their gradients and optimizer state
    trained: torch.dtype = torch.float32

    @classmethod
    def of(cls, model_dtype: str, train_dtype: str, device: torch.device) -> Precision:
        """`model.dtype` and `train.dtype` on `device`; `auto` is float32 on the CPU, and on CUDA the other key's half
        precision where it names one (`train.dtype: fp16` alone gives an fp16 base: a bf16 base's norms cannot take
        fp16 activations), else bf16."""
        compute = resolved_dtype(train_dtype, model_dtype, device)
        return cls(base=resolved_dtype(model_dtype, train_dtype, device),
                   compute=None if compute == torch.float32 else compute, device_type=device.type)

    @property
    def mixed_precision(self) -> str:
        """accelerate's `mixed_precision` value."""
        return {None: "no", torch.bfloat16: "bf16", torch.float16: "fp16"}[self.compute]

    @property
    def scales_loss(self) -> bool:
        """fp16 gradients underflow without loss scaling (a GradScaler)."""
        return self.compute == torch.float16

    def autocast(self) -> AbstractContextManager:
        """The denoiser's compute precision (as accelerate applies it to the trained module's forward)."""
        if self.compute is None:
            return nullcontext()
        return torch.autocast(self.device_type, dtype=self.compute)

    @contextmanager
    def denoisers_for_pipeline(self, modules: list[torch.nn.Module]) -> Iterator[None]:
        """While a pipeline renders samples: each denoiser in `modules` computes under the training autocast and
        returns its floating outputs in the base's dtype, whatever accelerate made of its forward (its training
        wrapper returns float32, which a pipeline would hand on to a VAE of the base's dtype) and whether or not
        accelerate prepared it at all (experts and sampling copies that share the LoRA are not). Restored after."""
        with ExitStack() as stack:
            for module in dict.fromkeys(modules):  # once each, in order
                stack.enter_context(self._forward_for_pipeline(module))
            yield

    @contextmanager
    def _forward_for_pipeline(self, module: torch.nn.Module) -> Iterator[None]:
        own = module.__dict__.get("forward")  # accelerate's wrapper, where it put one on the instance
        plain = type(module).forward
        base, autocast = self.base, self.autocast

        def forward(self_, *args, **kwargs):
            with autocast():
                outputs = plain(self_, *args, **kwargs)
            return floats_as(outputs, base)

        module.forward = MethodType(forward, module)
        try:
            yield
        finally:
            if own is None:
                del module.forward
            else:
                module.forward = own


def resolved_dtype(name: str, other: str, device: torch.device) -> torch.dtype:
    """The dtype config key value `name` stands for, `other` being the other precision key's value (see `Precision.of`)."""
    if name != "auto":
        return DTYPES[name]
    if device.type != "cuda":
        return torch.float32
    return DTYPES[other] if other in HALF_PRECISIONS else torch.bfloat16


def floats_as(data, dtype: torch.dtype):
    """`data` (a tensor, or tuples, lists, dicts and diffusers' output classes of them) with each floating tensor in
    `dtype`."""
    from accelerate.utils.operations import recursively_apply

    def cast(tensor: torch.Tensor) -> torch.Tensor:
        return tensor if tensor.dtype == dtype else tensor.to(dtype)

    return recursively_apply(cast, data, test_type=lambda t: isinstance(t, torch.Tensor) and t.is_floating_point())
