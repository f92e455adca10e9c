"""Sample images during training, rendered through the model family's own diffusers pipeline."""

from __future__ import annotations

import os
from pathlib import Path

import torch
from PIL.PngImagePlugin import PngInfo
from tqdm.auto import tqdm

from .config.schema import SampleConfig
from .data.captions import apply_trigger
from .models.base import ModelAdapter


class SampleRenderer:
    """Renders `sample.prompts` with fixed seeds to `samples/step_XXXXXXXXX_<i>.png`."""

    def __init__(self, cfg: SampleConfig, trigger_word: str | None, folder: Path, model_name: str):
        self.cfg = cfg
        self.folder = folder
        self.model_name = model_name
        self.prompts = [apply_trigger(p, trigger_word, is_reg=False) if "[trigger]" in p else p for p in cfg.prompts]

    @property
    def enabled(self) -> bool:
        return bool(self.prompts)

    def check_size(self, divisor: int) -> None:
        for key in ("width", "height"):
            value = getattr(self.cfg, key)
            if value % divisor:
                raise ValueError(f"sample.{key} ({value}) must be a multiple of {divisor} for this model")

    def seed_for(self, index: int) -> int:
        return self.cfg.seed + index if self.cfg.walk_seed else self.cfg.seed

    @torch.no_grad()
    def conditioning(self, adapter: ModelAdapter) -> list[dict | None]:
        """Each prompt's precomputed conditioning where the family offers it (see ModelAdapter)."""
        return [adapter.sampling_conditioning(prompt, self.cfg.neg) for prompt in self.prompts]

    @torch.no_grad()
    def render(self, adapter: ModelAdapter, step: int, progress: bool = False,
               conditioning: list[dict | None] | None = None) -> list[Path]:
        pipe = adapter.sampling_pipeline()
        pipe.set_progress_bar_config(disable=True)
        self.folder.mkdir(parents=True, exist_ok=True)
        written = []
        for index, prompt in enumerate(tqdm(self.prompts, desc="sampling", unit="image", leave=False,
                                            disable=not progress)):
            seed = self.seed_for(index)
            given = conditioning[index] if conditioning else None
            text = given if given is not None else {"prompt": prompt, "negative_prompt": self.cfg.neg or None}
            image = pipe(
                **text,
                num_inference_steps=self.cfg.sample_steps,
                guidance_scale=adapter.default_guidance_scale if self.cfg.guidance_scale is None
                else self.cfg.guidance_scale,
                width=self.cfg.width,
                height=self.cfg.height,
                generator=torch.Generator(device="cpu").manual_seed(seed),
            ).images[0]
            info = PngInfo()
            for key, value in {"prompt": prompt, "negative_prompt": self.cfg.neg, "seed": seed, "step": step,
                               "model": self.model_name}.items():
                info.add_text(key, str(value))
            path = self.folder / f"step_{step:09d}_{index}.png"
            tmp = path.with_name(f".{path.name}.tmp")
            image.save(tmp, format="PNG", pnginfo=info)
            os.replace(tmp, path)
            written.append(path)
        return written
