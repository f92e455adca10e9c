"""Running out of memory, told as one message: the phase the run was in (and, in training, the bucket and batch),
the memory figures at that moment, and the keys that would lower it for this job, ranked by what each would save
(estimated from the loaded model's own sizes and the memory in use). The accelerator's out-of-memory error and the
host's MemoryError are both caught; a sampling one only skips those samples (toolkit.run.sampling's caller)."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from toolkit.device import accelerator_memory, process_rss_bytes
from toolkit.errors import UserError

#: the run's phases, by the name faults and messages use
PHASES = {"loading": "loading the model", "caching": "caching latents and text embeddings",
          "validation": "computing the validation loss", "training": "training", "sampling": "rendering samples",
          "saving": "saving a checkpoint", "final": "writing the final LoRA files"}

#: share of a transformer's or UNet's training activations that gradient checkpointing gives back (it keeps each
#: block's input, recomputing the rest in the backward): a planning figure, not a measurement of this job
CHECKPOINTING_SAVES = 0.6


class OutOfMemory(UserError):
    """The run ran out of memory; the message names the phase and what to change."""


def is_out_of_memory(error: BaseException) -> bool:
    """The accelerator's out-of-memory error (also as the RuntimeError older paths raise) or the host's."""
    if isinstance(error, (torch.OutOfMemoryError, MemoryError)):
        return True
    text = str(error).lower()
    return isinstance(error, RuntimeError) and ("out of memory" in text or "cudnn_status_alloc_failed" in text)


def module_bytes(modules) -> int:
    """The bytes of the modules' parameters and buffers (quantized weights as they are stored)."""
    seen, total = set(), 0
    for module in modules:
        for tensor in [*module.parameters(), *module.buffers()]:
            if id(tensor) not in seen:
                seen.add(id(tensor))
                total += tensor.numel() * tensor.element_size()
    return total


@dataclass(frozen=True)
class JobMemory:
    """What the suggestions weigh: the job's settings and the loaded model's sizes, in bytes."""

    denoiser_bytes: int
    text_encoder_bytes: int
    image_encoder_bytes: int
    has_quantize: bool
    quantized: bool
    has_low_vram: bool
    low_vram: bool
    gradient_checkpointing: bool
    batch_size: int
    resolution: int
    cache_latents: bool
    cache_text: bool
    sample_size: tuple[int, int]
    on_accelerator: bool


def memory_now() -> dict[str, int]:
    """The memory in use now, in bytes: the accelerator's allocated / reserved / peak and its free and total where
    there is one, the process RSS and the host's total."""
    figures = dict(accelerator_memory())
    if figures:
        free, total = torch.cuda.mem_get_info()
        figures.update(free=free, total=total)
    rss = process_rss_bytes()
    if rss is not None:
        figures["rss"] = rss
    try:
        import os

        figures["host_total"] = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    except (ValueError, OSError, AttributeError):
        pass
    return figures


def gib(value: float) -> str:
    return f"{value / 2**30:.1f} GiB"


def size(value: float) -> str:
    """A size in GiB, or MiB below one GiB."""
    return gib(value) if value >= 2**30 else f"{max(1, round(value / 2**20))} MiB"


def suggestions(phase: str, job: JobMemory, used: int) -> list[tuple[float | None, str]]:
    """(bytes it would save or None where it cannot be told, the change) for this phase, most first."""
    weights = job.denoiser_bytes + (0 if job.low_vram or job.cache_text else job.text_encoder_bytes) + (
        0 if job.low_vram or job.cache_latents else job.image_encoder_bytes)
    activations = max(0, used - weights)
    found: list[tuple[float | None, str]] = []
    if phase in ("training", "validation"):
        if not job.gradient_checkpointing and phase == "training":
            found.append((CHECKPOINTING_SAVES * activations, "train.gradient_checkpointing: true (the backward "
                          "recomputes each block's activations instead of keeping them)"))
        if job.batch_size > 1:
            found.append((activations * (job.batch_size - 1) / job.batch_size,
                          f"train.batch_size: 1 with train.gradient_accumulation: {job.batch_size} (the same "
                          "batch per update, one sample at a time)"))
        lower = job.resolution * 3 // 4 // 64 * 64
        if lower >= 256:
            found.append((activations * (1 - (lower / job.resolution) ** 2),
                          f"datasets[].resolution: {lower} (now {job.resolution}: activations grow with the area)"))
    if phase in ("loading", "training", "validation", "caching", "sampling") and job.has_quantize \
            and not job.quantized:
        found.append((job.denoiser_bytes / 2, "model.quantize: true (qint8 or qfloat8: half the denoiser's 16-bit "
                                              "weights)"))
    if job.has_low_vram and not job.low_vram and job.on_accelerator:
        found.append((job.text_encoder_bytes + job.image_encoder_bytes, "model.low_vram: true (the text encoders "
                      "and VAE wait on the CPU outside their phase)"))
    if phase in ("training", "validation") and not job.cache_text and not job.low_vram and job.on_accelerator:
        found.append((job.text_encoder_bytes, "train.cache_text_embeddings: true (the text encoders leave the "
                                              "accelerator once the captions are encoded)"))
    if phase in ("training", "validation") and not job.cache_latents and not job.low_vram and job.on_accelerator:
        found.append((job.image_encoder_bytes, "datasets[].cache_latents: true (the VAE leaves the accelerator once "
                                               "the images are encoded)"))
    if phase == "caching":
        found.append((None, "datasets[].cache_latents_to_disk: true (latents kept on disk, not in memory)"))
        found.append((None, "a lower datasets[].resolution (the VAE encodes each image at its bucket's size)"))
    if phase == "sampling":
        width, height = job.sample_size
        found.append((None, f"a smaller sample.width / sample.height (now {width}x{height})"))
    if phase in ("saving", "final"):
        found.append((None, "free host memory (other programs), or fewer save.formats"))
    return sorted(found, key=lambda item: -1.0 if item[0] is None else -item[0])


def out_of_memory_message(phase: str, detail: str, job: JobMemory, error: BaseException,
                          figures: dict[str, int] | None = None) -> str:
    """The one message of an out-of-memory stop (or, for samples, warning)."""
    figures = memory_now() if figures is None else figures
    used = figures.get("allocated", figures.get("rss", 0)) if job.on_accelerator else figures.get("rss", 0)
    where = PHASES.get(phase, phase) + (f" ({detail})" if detail else "")
    host = isinstance(error, MemoryError)
    lines = [f"out of {'host' if host else 'accelerator'} memory while {where}."]
    shown = []
    if "allocated" in figures:
        shown.append(f"accelerator: {gib(figures['allocated'])} allocated, {gib(figures['reserved'])} reserved, "
                     f"peak {gib(figures['peak'])}" + (f", {gib(figures['free'])} free of {gib(figures['total'])}"
                                                        if "total" in figures else ""))
    if "rss" in figures:
        shown.append(f"process: {gib(figures['rss'])} resident" + (f" of {gib(figures['host_total'])} on the host"
                                                                    if "host_total" in figures else ""))
    lines.append("  memory now: " + ("; ".join(shown) or "not readable"))
    ranked = suggestions(phase, job, used)
    if ranked:
        lines.append("  what would lower it for this job, most first:")
        lines += [f"  - {text}" + (f": about {size(saving)} less" if saving else "") for saving, text in ranked]
    return "\n".join(lines)
