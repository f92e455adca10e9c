"""Sample images during training, rendered through the model family's own diffusers pipeline."""

from __future__ import annotations

import io
import json
from collections.abc import Callable
from contextlib import AbstractContextManager, ExitStack, contextmanager, nullcontext
from pathlib import Path

import numpy as np
import torch
from PIL import Image, ImageOps
from PIL.PngImagePlugin import PngInfo
from tqdm.auto import tqdm

from toolkit.config.sections import SampleConfig
from toolkit.data.captions import apply_trigger
from toolkit.device import ModulePlacement, flush, memory_debug, modules_on
from toolkit.errors import UserError
from toolkit.files import write_atomic
from toolkit.models.base import ModelAdapter
from toolkit.precision import Precision
from toolkit.run.video import write_video
from toolkit.train.weights import in_eval_mode


#: the reference image types the samples folder keeps under their own suffix (the report embeds them as they are)
REFERENCE_SUFFIXES = (".png", ".jpg", ".jpeg", ".webp")


class SampleRenderer:
    """Renders `sample.prompts` with fixed seeds to `samples/step_XXXXXXXXX_<i>.png` (video families:
    `.mp4`, or `.webp` where no H.264 encoder is available; toolkit.run.video), what rendered each in its metadata."""

    def __init__(self, cfg: SampleConfig, trigger_word: str | None, folder: Path, model_name: str):
        self.cfg = cfg
        self.folder = folder
        self.model_name = model_name
        self.prompts = [apply_trigger(p, trigger_word, is_reg=False) if "[trigger]" in p else p for p in cfg.texts]
        #: each prompt's reference image files (image-editing families), in slot order
        self.references = cfg.references

    @property
    def enabled(self) -> bool:
        return bool(self.prompts)

    def check_size(self, divisor: int) -> None:
        for key in ("width", "height"):
            value = getattr(self.cfg, key)
            if value % divisor:
                raise UserError(f"sample.{key} ({value}) must be a multiple of {divisor} for this model")

    def steps(self, adapter: ModelAdapter) -> int:
        return adapter.sampling.default_steps if self.cfg.sample_steps is None else self.cfg.sample_steps

    def reproduction(self, pipe, prompt: str, seed: int, guidance: dict, step: int, steps: int,
                     extras: dict | None = None, references: list[str] = ()) -> dict:
        """What a sample's PNG text records: enough to render it again in diffusers (docs/networks.md): the
        pipeline and scheduler (class and config), steps, the guidance arguments (as the family's pipeline names
        them), size, the CPU generator's seed, the LoRA at scale 1 (the run's <name>.safetensors, or the checkpoint
        of `step`), the reference image files (a JSON list) where the prompt has them, and the family's `extras`
        (pipeline arguments such as FLUX.1's `max_sequence_length`)."""
        return {"prompt": prompt, "negative_prompt": self.cfg.neg, "seed": seed, "step": step,
                "model": self.model_name, "pipeline": type(getattr(pipe, "pipe", pipe)).__name__,
                "scheduler": type(pipe.scheduler).__name__ if hasattr(pipe, "scheduler") else "",
                "scheduler_config": json.dumps(dict(pipe.scheduler.config)) if hasattr(pipe, "scheduler") else "",
                **({"references": json.dumps(references)} if references else {}),
                "num_inference_steps": steps, **guidance, "width": self.cfg.width,
                "height": self.cfg.height, "generator": "torch.Generator('cpu').manual_seed(seed)", "lora_scale": 1.0,
                **self.rescale(), **(extras or {})}

    def rescale(self) -> dict:
        """`guidance_rescale`, only when set: pipelines without it would refuse the argument."""
        return {} if self.cfg.guidance_rescale is None else {"guidance_rescale": self.cfg.guidance_rescale}

    def seed_for(self, index: int) -> int:
        return self.cfg.seed + index if self.cfg.walk_seed else self.cfg.seed

    def frames(self, adapter: ModelAdapter) -> int:
        """Frames per sample video (video families)."""
        return adapter.sampling.default_frames if self.cfg.num_frames is None else self.cfg.num_frames

    def fps(self, adapter: ModelAdapter) -> float:
        return adapter.sampling.default_fps if self.cfg.fps is None else self.cfg.fps

    @staticmethod
    def write_image(stem: Path, image, record: dict[str, str]) -> Path:
        info = PngInfo()
        for key, value in record.items():
            info.add_text(key, value)
        return write_atomic(stem.with_suffix(".png"), lambda tmp: image.save(tmp, format="PNG", pnginfo=info))

    @staticmethod
    def write_video(stem: Path, frames, fps: float, record: dict[str, str]) -> Path:
        """A pipeline's video (float [F, H, W, 3] in [0, 1]) as `.mp4` (or `.webp` without an H.264 encoder)."""
        pixels = (np.asarray(frames, dtype=np.float32) * 255).round().clip(0, 255).astype(np.uint8)
        return write_video(stem, pixels, fps, record)

    def keep_references(self) -> None:
        """Each prompt's reference images copied into the samples folder (`reference_<prompt>_<slot>.<ext>`), where the
        report and the dashboard show them beside the prompt's samples: the run folder stays the whole record. A copy
        is written again only where its file changed."""
        for index, files in enumerate(self.references):
            for slot, file in enumerate(files):
                source = Path(file)
                suffix = source.suffix.lower()
                if suffix in REFERENCE_SUFFIXES:
                    data = source.read_bytes()
                else:  # another type PIL reads: kept as a PNG, which every browser shows
                    suffix, buffer = ".png", io.BytesIO()
                    with Image.open(source) as opened:
                        ImageOps.exif_transpose(opened).convert("RGB").save(buffer, format="PNG")
                    data = buffer.getvalue()
                copy = self.folder / f"reference_{index}_{slot}{suffix}"
                if not copy.is_file() or copy.read_bytes() != data:
                    write_atomic(copy, lambda tmp, data=data: tmp.write_bytes(data))

    def reference_arguments(self, adapter: ModelAdapter, references: list[str]) -> dict:
        """The pipeline arguments that give a sample its reference images (none for a plain prompt): each file read
        upright, in RGB."""
        if not references:
            return {}
        images = []
        for file in references:
            with Image.open(file) as opened:
                images.append(ImageOps.exif_transpose(opened).convert("RGB"))
        return adapter.sampling.reference_arguments(images, self.cfg.width, self.cfg.height)

    @torch.no_grad()
    def conditioning(self, adapter: ModelAdapter) -> list[dict | None]:
        """Each prompt's precomputed conditioning where the family offers it (see ModelAdapter)."""
        return [adapter.sampling.conditioning(prompt, self.cfg.neg) for prompt in self.prompts]

    @torch.no_grad()
    def render(self, adapter: ModelAdapter, step: int, progress: bool = False,
               conditioning: list[dict | None] | None = None, write: bool = True) -> list[Path]:
        """Every prompt rendered; written unless `write` is off (a sharded run's other processes render with the main
        one, each taking part in every forward, and write nothing)."""
        pipe = adapter.sampling.pipeline()
        pipe.set_progress_bar_config(disable=True)
        if write:
            self.folder.mkdir(parents=True, exist_ok=True)
            self.keep_references()
        written = []
        for index, prompt in enumerate(tqdm(self.prompts, desc="sampling", unit="image", leave=False,
                                            disable=not progress)):
            seed = self.seed_for(index)
            given = conditioning[index] if conditioning else None
            text = given if given is not None else {
                "prompt": prompt, "negative_prompt": adapter.sampling.negative_prompt(self.cfg.neg) or None}
            guidance = (adapter.sampling.default_guidance_scale if self.cfg.guidance_scale is None
                        else self.cfg.guidance_scale)
            steps = self.steps(adapter)
            arguments = adapter.sampling.pipeline_arguments(text, guidance)
            references = self.references[index]
            shown = self.reference_arguments(adapter, references)
            sized = adapter.sampling.size_arguments(self.cfg.width, self.cfg.height)
            video = {"num_frames": self.frames(adapter), "output_type": "np"} if adapter.facts.video else {}
            result = pipe(
                **arguments,
                **shown,
                **self.rescale(),
                **video,
                **sized,
                num_inference_steps=steps,
                generator=torch.Generator(device="cpu").manual_seed(seed),
            )
            if not write:
                continue
            guidance_record = {k: v for k, v in arguments.items() if k not in text}
            extras = {"negative_prompt": adapter.sampling.negative_prompt(self.cfg.neg),
                      **adapter.sampling.reproduction(),
                      **{key: value for key, value in (shown | sized).items()
                         if key not in ("width", "height") and not holds_images(value)}}
            if video:
                extras.update(num_frames=video["num_frames"], fps=self.fps(adapter))
            record = {key: str(value) for key, value in
                      self.reproduction(pipe, prompt, seed, guidance_record, step, steps, extras, references).items()}
            stem = self.folder / f"step_{step:09d}_{index}"
            if video:
                written.append(self.write_video(stem, result.frames[0], self.fps(adapter), record))
            else:
                written.append(self.write_image(stem, result.images[0], record))
        return written


class Sampler:
    """The samples part of a run: renders `sample.prompts` on the main process (sharded: on every process, the main
    one writing) with the encoders and sample-only
    models brought to the accelerator just for that (an offloaded text encoder visits alone, first, and has left
    again before the sampling model arrives), the trained modules in eval mode, the weights `weights()` puts in
    place (the EMA, schedule-free's average; the trained ones by default) and the global RNG untouched."""

    def __init__(self, renderer: SampleRenderer, adapter: ModelAdapter, placement: ModulePlacement,
                 trained_modules: list[torch.nn.Module], mirrors: list, is_main: bool, debug_memory: bool = False,
                 weights: Callable[[], AbstractContextManager] = nullcontext, precision: Precision | None = None,
                 every_process_renders: bool = False):
        self.weights = weights
        #: the run's dtypes: the pipeline's denoisers compute as in training (None: as they are, e.g. in tests)
        self.precision = precision
        self.renderer = renderer
        self.adapter = adapter
        self.placement = placement
        self.trained_modules = trained_modules
        self.mirrors = mirrors
        self.is_main = is_main
        #: a sharded denoiser computes on every process together, so every process renders
        self.every_process_renders = every_process_renders
        self.debug_memory = debug_memory

    @property
    def enabled(self) -> bool:
        return self.renderer.enabled

    def render(self, step: int, progress: bool = False) -> list[Path]:
        """Main process only (the caller keeps the other processes waiting); sharded, every process, the main one
        writing."""
        if not (self.enabled and (self.is_main or self.every_process_renders)):
            return []
        device = self.placement.device
        try:
            # fork_rng: whatever a pipeline draws from the global RNG is not taken from training's stream
            with (in_eval_mode(self.trained_modules), memory_debug("sampling", self.debug_memory),
                  torch.random.fork_rng(devices=cuda_devices(device)), self.weights()):
                conditioning = self.conditioning()
                with (modules_on(self.modules_for(conditioning), device, while_moving=self.mirrors_detached),
                      self.denoisers_as_in_training()):
                    return self.renderer.render(self.adapter, step, progress and self.is_main, conditioning,
                                                write=self.is_main)
        finally:
            flush()

    def denoisers_as_in_training(self) -> AbstractContextManager:
        """The denoisers a pipeline calls (the trained ones and the sampling copies sharing their LoRA) under the
        training autocast, returning the base's dtype (toolkit/precision.py)."""
        if self.precision is None:
            return nullcontext()
        return self.precision.denoisers_for_pipeline([*self.adapter.denoisers(), *self.adapter.sampling.mirrors()])

    def conditioning(self) -> list[dict | None]:
        """The prompts' conditioning, computed first where the family can, with an offloaded text encoder
        visiting alone."""
        text_encoders = [m for m in self.adapter.text_encoder_modules() if self.placement.is_offloaded(m)]
        with modules_on(text_encoders, self.placement.device):
            return self.renderer.conditioning(self.adapter)

    def modules_for(self, conditioning: list[dict | None]) -> list[torch.nn.Module]:
        """What rendering needs on the accelerator: the offloaded modules (minus the text encoders when the
        prompts are already encoded) and the sample-only models."""
        encoded = all(c is not None for c in conditioning)
        text_encoders = self.adapter.text_encoder_modules()
        needed = [m for m in self.placement.offloaded if not (encoded and any(m is t for t in text_encoders))]
        return needed + self.adapter.sampling.only_modules()

    @contextmanager
    def mirrors_detached(self):
        """While models that share the trained LoRA move, the LoRA stays where training keeps it."""
        with ExitStack() as stack:
            for mirror in self.mirrors:
                stack.enter_context(mirror.detached())
            yield


def holds_images(value) -> bool:
    """A pipeline argument that is an image or a list of them (not written into a sample's metadata)."""
    return isinstance(value, Image.Image) or (isinstance(value, (list, tuple))
                                              and any(isinstance(v, Image.Image) for v in value))


def cuda_devices(device: torch.device) -> list[int]:
    return [device.index or 0] if device.type == "cuda" else []
