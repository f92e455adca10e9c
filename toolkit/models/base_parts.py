"""Where each part of a base comes from, for a family that takes every part as a single file (its `FamilyFiles`):
the denoiser from `name_or_path` (a diffusers folder, hub id or file), each text encoder and the VAE from the file
the config names (`text_encoder_path`, `vae_name_or_path`), else from the denoiser's own file where it holds them (a
full checkpoint), else from the base's folder (`single_file_config`, or the variant's repo, for a single-file
denoiser); tokenizers from `model.tokenizer`, the ComfyUI installation a single-file denoiser lies in, or the base's
folder. A family's loader asks for each part with its own classes; `origins` records where each came from."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import torch

from toolkit.errors import UserError
from toolkit.models.common import is_single_file, pretrained_denoiser
from toolkit.models.single_files import FamilyFiles, Variant, read_header, tokenizer_source
from toolkit.models.stored_weights import assign_files, empty_model, load_part


#: tensors a CLIP text encoder file may hold that CLIPTextModel has no place for (older exports keep the position
#: ids buffer)
CLIP_EXTRAS = ("position_ids",)


def ldm_vae_converter(part, config: dict):
    """diffusers' converter of the original (LDM) VAE names, for a file in that layout; none for diffusers' names."""
    if not part.has("encoder.down.0.block.0.conv1.weight"):
        return None
    from diffusers.loaders.single_file_utils import convert_ldm_vae_checkpoint

    return lambda checkpoint: convert_ldm_vae_checkpoint(checkpoint, config)


class BaseParts:
    """The parts of one base, read as its `model` config says."""

    def __init__(self, files: FamilyFiles, model_cfg, source: str | None, resolve: Callable[[str, str], str],
                 default_components: Callable[[Variant | None], str], meta: bool = False):
        #: build every part on the meta device from its config alone, no weight read, no tokenizer: the module
        #: names a LoRA file's names are resolved against (`run.py --convert-lora`); a `source` of None stands for
        #: the family's first published variant
        self.meta = meta
        self.files = files
        self.cfg = model_cfg
        self.source = source
        self.resolve = resolve
        self.default_components = default_components
        self.single = source is not None and is_single_file(source)
        self.override = (resolve(model_cfg.single_file_config, "model.single_file_config")
                         if getattr(model_cfg, "single_file_config", None) else None)
        #: the denoiser's variant (None: a folder base, or configs from `single_file_config`)
        self.variant: Variant | None = None
        self.origins: dict[str, str] = {}
        text = getattr(model_cfg, "text_encoder_path", None)
        self.text_files = [resolve(p, "model.text_encoder_path")
                           for p in ([text] if isinstance(text, str) else list(text or []))]
        self._header = None
        #: the text encoders came from files (so nothing is fetched for the tokenizers either)
        self.text_from_files = False

    def components(self) -> str:
        """The diffusers folder or hub id giving the parts no file was named for."""
        if not self.single:
            return self.source
        return self.override or self.default_components(self.variant)

    def folder_kw(self) -> dict:
        return {"variant": self.cfg.variant, "revision": self.cfg.revision} if not self.single else {}

    def header(self):
        """The single-file denoiser's header (read once)."""
        if self._header is None:
            self._header = read_header(self.source)
        return self._header

    def in_denoiser_file(self, kind) -> bool:
        """The denoiser's file holds this part too (a full checkpoint: UNet, CLIP and VAE in one file)."""
        return self.single and kind.facts(self.header())[1] is not None

    # ---- the parts ---------------------------------------------------------------------------------------------

    def published(self, kind) -> Variant:
        """The kind's first published variant (what a part of no given file is taken as, in meta mode)."""
        return next(v for v in kind.variants if not v.name.startswith("tiny"))

    def meta_config(self, kind, component: str, path: str | None, folder_config: Callable[[], dict]) -> dict:
        """A part's config without its weights: from its file's variant (header only), the base's folder, or the
        kind's first published variant."""
        if path is not None:
            return kind.variant(read_header(path))[1].config(component)
        if self.source is not None and not self.single:
            return folder_config()
        return self.published(kind).config(component)

    def denoiser(self, model_class, subfolder: str, dtype: torch.dtype, empty: bool,
                 converter: Callable | None = None) -> torch.nn.Module:
        if self.meta:
            config = self.meta_config(self.files.denoiser, subfolder, self.source if self.single else None,
                                      lambda: model_class.load_config(self.source, subfolder=subfolder))
            if self.source is None or self.single:
                path = self.source
                self.variant = (self.files.denoiser.variant(read_header(path))[1] if path
                                else self.published(self.files.denoiser))
            return empty_model(lambda: model_class.from_config(config), dtype)
        if not self.single:
            self.origins[subfolder] = self.source
            return pretrained_denoiser(model_class, self.source, subfolder, dtype, empty, **self.folder_kw())
        config = model_class.load_config(self.override, subfolder=subfolder) if self.override else None
        loaded = load_part(self.source, self.files.denoiser, subfolder, model_class.from_config, dtype, "cpu",
                           converter=converter, config=config)
        self.variant = loaded.variant
        self.origins[subfolder] = loaded.origin(self.source)
        return loaded.model

    def scheduler(self, scheduler_class):
        """The training scheduler's class from the base's folder, `single_file_config`, or the variant's config."""
        if self.meta and self.variant is not None:
            return scheduler_class.from_config(self.variant.config("scheduler"))
        if not self.single or self.override:
            return scheduler_class.from_pretrained(self.components(), subfolder="scheduler",
                                                   revision=self.cfg.revision if not self.single else None)
        return scheduler_class.from_config(self.variant.config("scheduler"))

    def text_encoders(self, builders: dict[str, tuple[str, Callable[[dict], torch.nn.Module], Callable]],
                      dtype: torch.dtype, ignore: dict[str, tuple[str, ...]] | None = None,
                      optional: dict[str, tuple[str, ...]] | None = None,
                      converters: dict[str, Callable] | None = None,
                      skip: dict[str, tuple[str, ...]] | None = None) -> dict[str, torch.nn.Module]:
        """Each text encoder by slot: `builders[slot]` = (its pipeline subfolder, a builder from its config, the
        class that loads it from a folder); `converters[slot]` for a layout other than transformers' names; `skip`,
        `ignore`, `optional`: as `load_part` takes them."""
        ignore, optional, converters, skip = ignore or {}, optional or {}, converters or {}, skip or {}
        kinds = self.files.text_encoders
        if self.meta:
            paths = assign_files(self.text_files, kinds, "model.text_encoder_path") if self.text_files else {}
            if not paths and all(self.in_denoiser_file(kind) for kind in kinds.values()):
                paths = dict.fromkeys(kinds, self.source)
            return {slot: empty_model(lambda: build(self.meta_config(
                        kinds[slot], "text_encoder", paths.get(slot),
                        lambda: loader.config_class.from_pretrained(self.source, subfolder=subfolder).to_dict())),
                        dtype)
                    for slot, (subfolder, build, loader) in builders.items()}
        if self.text_files:
            paths = assign_files(self.text_files, kinds, "model.text_encoder_path")
            key = "model.text_encoder_path"
        elif all(self.in_denoiser_file(kind) for kind in kinds.values()):
            paths, key = dict.fromkeys(kinds, self.source), "model.name_or_path"
        else:
            where = self.components()
            self.origins["text_encoders"] = where
            return {slot: loader.from_pretrained(where, subfolder=subfolder, dtype=dtype, **self.folder_kw())
                    for slot, (subfolder, _, loader) in builders.items()}
        self.text_from_files = True
        loaded, origins = {}, []
        for slot, (subfolder, build, _) in builders.items():
            part = load_part(paths[slot], kinds[slot], "text_encoder", build, dtype, "cpu", key=key,
                             converter=converters.get(slot), ignore=ignore.get(slot, ()),
                             optional=optional.get(slot, ()), skip=skip.get(slot, ()))
            loaded[slot] = part.model
            origins.append(part.origin(paths[slot]))
        self.origins["text_encoders"] = ", ".join(origins)
        return loaded

    def vae(self, model_class, dtype: torch.dtype, converter: Callable | None = None) -> torch.nn.Module:
        path = getattr(self.cfg, "vae_name_or_path", None)
        if self.meta:
            given = self.resolve(path, "model.vae_name_or_path") if path else None
            file = given if given and is_single_file(given) else (
                self.source if self.in_denoiser_file(self.files.vae) else None)
            config = self.meta_config(self.files.vae, "vae", file,
                                      lambda: model_class.load_config(self.source, subfolder="vae"))
            return empty_model(lambda: model_class.from_config(config), dtype)
        if path is None and self.in_denoiser_file(self.files.vae):
            path, key = self.source, "model.name_or_path"
        elif path is None:
            where = self.components()
            self.origins["vae"] = where
            return model_class.from_pretrained(where, subfolder="vae", torch_dtype=dtype, **self.folder_kw())
        else:
            path, key = self.resolve(path, "model.vae_name_or_path"), "model.vae_name_or_path"
            if not is_single_file(path):
                self.origins["vae"] = path
                subfolder = "vae" if (Path(path) / "vae").is_dir() or not Path(path).is_dir() else None
                return model_class.from_pretrained(path, subfolder=subfolder, torch_dtype=dtype)
        vae = load_part(path, self.files.vae, "vae", model_class.from_config, dtype, "cpu", converter=converter,
                        key=key)
        self.origins["vae"] = vae.origin(path)
        return vae.model

    def tokenizers(self, loaders: dict[str, Callable]) -> dict[str, object]:
        """Each tokenizer by its pipeline subfolder (`loaders[subfolder]`: the class that loads it), after the text
        encoders."""
        if self.meta:
            return dict.fromkeys(loaders)
        files = [self.source, *self.text_files] if self.single else []  # a folder base keeps its own tokenizers
        found = {}
        for subfolder, loader in loaders.items():
            where = tokenizer_source(subfolder, self.files.comfy_tokenizers[subfolder],
                                     getattr(self.cfg, "tokenizer", None), files, self.components,
                                     single=len(loaders) == 1)
            kw = {"subfolder": where.subfolder} if where.subfolder else {}
            if where.origin == "the base" and self.single and self.text_from_files and not self.override:
                kw["local_files_only"] = True  # parts given as files: the default repo only where it is cached
            try:
                tokenizer = loader.from_pretrained(where.where, **kw)
                if len(tokenizer) <= len(tokenizer.all_special_tokens):
                    # transformers builds an empty tokenizer of some classes (CLIP's) where no file is found
                    raise OSError("no tokenizer files there")
                found[subfolder] = tokenizer
            except (OSError, ValueError) as error:
                raise UserError(
                    f"the {subfolder} of {self.source} could not be read from {where.where} ({where.origin}: "
                    f"{error}). No weight file holds a tokenizer: set model.tokenizer to a ComfyUI installation "
                    "or a diffusers pipeline folder, or model.single_file_config") from None
            self.origins[subfolder] = f"{where.where} ({where.origin})"
        return found
