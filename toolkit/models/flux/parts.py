"""Where each part of a FLUX.1-layout base comes from: its own file where the config names one (`name_or_path`,
`text_encoder_path`, `vae_name_or_path`, their variants read from their names and shapes and their configs shipped
with difftune), else the base's diffusers folder (`single_file_config`, or the variant's repo, for a single-file
transformer). Tokenizers: `model.tokenizer`, the ComfyUI installation the files lie in, or the base's folder."""

from __future__ import annotations

from pathlib import Path

import torch
from diffusers import AutoencoderKL, FlowMatchEulerDiscreteScheduler, FluxTransformer2DModel
from transformers import AutoTokenizer, CLIPTextConfig, CLIPTextModel, CLIPTokenizer, T5Config, T5EncoderModel

from toolkit.errors import UserError
from toolkit.models.common import is_single_file, pretrained_denoiser
from toolkit.models.flux.files import original_layout
from toolkit.models.flux.layout import to_diffusers
from toolkit.models.single_files import tokenizer_source
from toolkit.models.stored_weights import assign_files, load_part

#: tensors a CLIP text encoder file may hold that CLIPTextModel has no place for (older exports keep the position
#: ids buffer)
CLIP_EXTRAS = ("position_ids",)


class FluxParts:
    """The parts of one FLUX.1-layout base, read as the config says; `origins` records where each came from."""

    def __init__(self, adapter_class, model_cfg, source: str):
        self.adapter_class = adapter_class
        self.cfg = model_cfg
        self.source = source
        self.single = is_single_file(source)
        self.files = adapter_class.single_files()
        self.override = (adapter_class.resolve_source(model_cfg.single_file_config, "model.single_file_config")
                         if model_cfg.single_file_config else None)
        self.variant = None
        self.origins: dict[str, str] = {}
        text = model_cfg.text_encoder_path
        self.text_files = [text] if isinstance(text, str) else list(text or [])
        self.text_files = [adapter_class.resolve_source(p, "model.text_encoder_path") for p in self.text_files]

    def components(self) -> str:
        """The diffusers folder or hub id giving the parts no file was named for."""
        if not self.single:
            return self.source
        if self.override:
            return self.override
        guidance = self.variant.config("transformer")["guidance_embeds"] if self.variant else True
        return self.adapter_class.default_components[guidance]

    def transformer(self, dtype: torch.dtype, empty: bool) -> tuple[torch.nn.Module, FlowMatchEulerDiscreteScheduler]:
        cfg = self.cfg
        if not self.single:
            transformer = pretrained_denoiser(FluxTransformer2DModel, self.source, "transformer", dtype, empty,
                                              variant=cfg.variant, revision=cfg.revision)
            scheduler = FlowMatchEulerDiscreteScheduler.from_pretrained(self.source, subfolder="scheduler",
                                                                        revision=cfg.revision)
            self.origins["transformer"] = self.source
            return transformer, scheduler
        config = (FluxTransformer2DModel.load_config(self.override, subfolder="transformer")
                  if self.override else None)
        loaded = load_part(self.source, self.files.denoiser, "transformer", FluxTransformer2DModel.from_config,
                           dtype, "cpu", converter=lambda part, _: to_diffusers if original_layout(part) else None,
                           config=config)
        transformer, self.variant = loaded.model, loaded.variant
        if self.override:
            scheduler = FlowMatchEulerDiscreteScheduler.from_pretrained(self.override, subfolder="scheduler")
        else:
            scheduler = FlowMatchEulerDiscreteScheduler.from_config(self.variant.config("scheduler"))
        self.origins["transformer"] = loaded.origin(self.source)
        return transformer, scheduler

    def text_encoders(self, dtype: torch.dtype) -> tuple[CLIPTextModel, T5EncoderModel]:
        cfg = self.cfg
        if not self.text_files:
            where = self.components()
            kw = {"variant": cfg.variant, "revision": cfg.revision} if not self.single else {}
            clip = CLIPTextModel.from_pretrained(where, subfolder="text_encoder", dtype=dtype, **kw)
            t5 = T5EncoderModel.from_pretrained(where, subfolder="text_encoder_2", dtype=dtype, **kw)
            self.origins["text_encoders"] = where
            return clip, t5
        kinds = self.files.text_encoders
        files = assign_files(self.text_files, kinds, "model.text_encoder_path")
        clip = load_part(files["clip_l"], kinds["clip_l"], "text_encoder",
                         lambda c: CLIPTextModel(CLIPTextConfig(**c)), dtype, "cpu", key="model.text_encoder_path",
                         ignore=CLIP_EXTRAS)
        t5 = load_part(files["t5xxl"], kinds["t5xxl"], "text_encoder", lambda c: T5EncoderModel(T5Config(**c)),
                       dtype, "cpu", key="model.text_encoder_path", optional=("embed_tokens.weight",))
        t5.model.tie_weights()
        self.origins["text_encoders"] = f"{clip.origin(files['clip_l'])}, {t5.origin(files['t5xxl'])}"
        return clip.model, t5.model

    def vae(self, dtype: torch.dtype) -> AutoencoderKL:
        cfg = self.cfg
        path = cfg.vae_name_or_path
        if path is None:
            where = self.components()
            kw = {"variant": cfg.variant, "revision": cfg.revision} if not self.single else {}
            self.origins["vae"] = where
            return AutoencoderKL.from_pretrained(where, subfolder="vae", torch_dtype=dtype, **kw)
        path = self.adapter_class.resolve_source(path, "model.vae_name_or_path")
        if not is_single_file(path):
            self.origins["vae"] = path
            subfolder = "vae" if (Path(path) / "vae").is_dir() or not Path(path).is_dir() else None
            return AutoencoderKL.from_pretrained(path, subfolder=subfolder, torch_dtype=dtype)
        vae = load_part(path, self.files.vae, "vae", AutoencoderKL.from_config, dtype, "cpu",
                        converter=ldm_vae_converter, key="model.vae_name_or_path")
        self.origins["vae"] = vae.origin(path)
        return vae.model

    def tokenizers(self) -> tuple[CLIPTokenizer, object]:
        files = [self.source, *self.text_files] if self.single else []  # a folder base keeps its own tokenizers
        found = []
        for subfolder, loader in (("tokenizer", CLIPTokenizer), ("tokenizer_2", AutoTokenizer)):
            where = tokenizer_source(subfolder, self.files.comfy_tokenizers[subfolder], self.cfg.tokenizer, files,
                                     self.components)
            kw = {"subfolder": where.subfolder} if where.subfolder else {}
            if where.origin == "the base" and self.single and self.text_files and not self.override:
                kw["local_files_only"] = True  # parts given as files: the default repo only where it is cached
            try:
                found.append(loader.from_pretrained(where.where, **kw))
            except (OSError, ValueError) as error:
                raise UserError(
                    f"the {subfolder} of {self.source} could not be read from {where.where} ({where.origin}: "
                    f"{error}). No weight file holds a tokenizer: set model.tokenizer to a ComfyUI installation "
                    "or a diffusers pipeline folder, or model.single_file_config") from None
            self.origins[subfolder] = f"{where.where} ({where.origin})"
        return found[0], found[1]


def ldm_vae_converter(part, config: dict):
    """diffusers' converter of the original (LDM) VAE names for a file in that layout; none for diffusers' names."""
    if not part.has("encoder.down.0.block.0.conv1.weight"):
        return None
    from diffusers.loaders.single_file_utils import convert_ldm_vae_checkpoint

    return lambda checkpoint: convert_ldm_vae_checkpoint(checkpoint, config)
