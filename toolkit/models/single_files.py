"""A base model's parts given as single files (ComfyUI's folders, original releases): what a file holds, read from its
header alone (tensor names, dtypes and shapes; no weight is read), which known variant of a part it is, and where a
tokenizer comes from (no weight file holds one).

Free of torch: `run.py --models-from` and the config checks read files with it before any library loads. Loading
the weights is toolkit/models/stored_weights.py.
"""

from __future__ import annotations

import json
import re
import struct
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from toolkit.errors import UserError

#: the file endings a single part may have
WEIGHT_FILE_SUFFIXES = (".safetensors", ".sft", ".gguf", ".ckpt", ".pt", ".pth", ".bin")

#: the prefixes a denoiser's names may carry: ComfyUI's full checkpoints (`model.diffusion_model.`) and some of its
#: exports (`diffusion_model.`)
DENOISER_PREFIXES = ("model.diffusion_model.", "diffusion_model.")

#: ComfyUI's "scaled fp8" files. The older layout: a marker tensor (`scaled_fp8`, its dtype the fp8 format), and
#: per layer `<layer>.scale_weight` (the stored weight times it is the weight) and `<layer>.scale_input` (for fp8
#: matmuls of activations, unused when dequantizing). The newer one: `<layer>.weight_scale`, `<layer>.input_scale`
#: and `<layer>.comfy_quant` (the layer's format, JSON as uint8 bytes)
SCALED_FP8_MARKER = "scaled_fp8"
WEIGHT_SCALE_SUFFIXES = (".scale_weight", ".weight_scale")
INPUT_SCALE_SUFFIXES = (".scale_input", ".input_scale")
QUANT_CONFIG_SUFFIX = ".comfy_quant"


class UnknownFile(UserError):
    """A file that matches no known variant of the part it was given as."""


@dataclass(frozen=True)
class TensorInfo:
    #: the dtype as the file names it (safetensors: `BF16`, `F8_E4M3`, ...; GGUF: `Q8_0`, `F16`, ...)
    dtype: str
    shape: tuple[int, ...]


@dataclass
class FileHeader:
    """The tensors of one weight file as its header lists them (names as stored), and its metadata."""

    path: Path
    tensors: dict[str, TensorInfo]
    metadata: dict[str, str] = field(default_factory=dict)

    def part(self, prefixes: Iterable[str] = DENOISER_PREFIXES) -> PartNames:
        """The names under the first of `prefixes` some tensor starts with, the prefix removed; all names when none
        does. Tensors of other parts (a full checkpoint's text encoders and VAE) are left out."""
        for prefix in prefixes:
            inside = {name[len(prefix):]: info for name, info in self.tensors.items() if name.startswith(prefix)}
            if inside:
                return PartNames(self.path, prefix, inside)
        return PartNames(self.path, "", dict(self.tensors))


@dataclass
class PartNames:
    """One part's tensors in a file: names without the file's prefix, and what they say."""

    path: Path
    prefix: str
    tensors: dict[str, TensorInfo]

    def has(self, name: str) -> bool:
        return name in self.tensors

    def shape(self, name: str) -> tuple[int, ...] | None:
        info = self.tensors.get(name)
        return info.shape if info else None

    def count(self, pattern: str) -> int:
        """How many distinct indices `N` the names matching `pattern` (a regex with one group, e.g.
        `double_blocks\\.(\\d+)\\.`) have: a model's block count."""
        compiled = re.compile(pattern)
        return len({m.group(1) for name in self.tensors if (m := compiled.match(name))})

    @property
    def stored_dtypes(self) -> set[str]:
        """The dtypes of the part's weights (2-D and larger tensors)."""
        return {info.dtype for info in self.tensors.values() if len(info.shape) >= 2}

    @property
    def fp8(self) -> bool:
        return any(dtype.startswith("F8") for dtype in self.stored_dtypes)

    @property
    def scaled(self) -> bool:
        return any(name.endswith(WEIGHT_SCALE_SUFFIXES) for name in self.tensors)

    @property
    def storage(self) -> str:
        """How the weights are stored, in words: `bf16`, `fp8`, `scaled fp8`, `gguf Q8_0` ..."""
        if self.path.suffix == ".gguf":
            quantized = sorted(d for d in self.stored_dtypes if d not in ("F32", "F16", "BF16"))
            return "gguf " + ("/".join(quantized) if quantized else "/".join(sorted(self.stored_dtypes)))
        if self.fp8:
            return "scaled fp8" if self.scaled else "fp8"
        names = {"F32": "float32", "F16": "fp16", "BF16": "bf16", "F64": "float64"}
        return "/".join(names.get(d, d.lower()) for d in sorted(self.stored_dtypes)) or "empty"


def read_header(path: str | Path) -> FileHeader:
    """A weight file's tensor names, dtypes and shapes, and its metadata, without reading a weight: a
    safetensors file's JSON header, a GGUF file's tensor table; a pickled checkpoint (.ckpt, .pt) is mapped
    (`pickled_tensors`)."""
    path = Path(path)
    if not path.is_file():
        raise FileNotFoundError(f"model file not found: {path}")
    if path.suffix == ".gguf":
        return _gguf_header(path)
    if path.suffix in (".safetensors", ".sft"):
        return _safetensors_header(path)
    return FileHeader(path, {name: TensorInfo(TORCH_DTYPE_NAMES.get(str(t.dtype).removeprefix("torch."),
                                                                    str(t.dtype)), tuple(t.shape))
                             for name, t in pickled_tensors(path).items()})


#: torch dtypes as safetensors names them, for a pickled checkpoint's header
TORCH_DTYPE_NAMES = {"float32": "F32", "float16": "F16", "bfloat16": "BF16", "float8_e4m3fn": "F8_E4M3",
                     "float8_e5m2": "F8_E5M2"}


def pickled_tensors(path: Path) -> dict:
    """A pickled checkpoint's tensors (.ckpt, .pt: its `state_dict` where it has one), mapped from the file rather
    than read (torch is imported for these files only), with nothing but tensors unpickled (`weights_only`)."""
    import torch

    try:
        loaded = torch.load(str(path), map_location="cpu", mmap=True, weights_only=True)
    except Exception as error:  # pickle and zip errors of many kinds
        raise UserError(f"{path}: not a checkpoint torch reads safely ({error}); convert it to safetensors") from None
    for wrapper in ("ema_state_dict", "state_dict", "module"):  # a training checkpoint's averaged weights first
        if isinstance(loaded, dict) and isinstance(loaded.get(wrapper), dict):
            loaded = loaded[wrapper]
            break
    if not isinstance(loaded, dict):
        raise UserError(f"{path}: holds no state dict")
    return {name: value for name, value in loaded.items() if isinstance(name, str) and hasattr(value, "shape")}


def _safetensors_header(path: Path) -> FileHeader:
    with path.open("rb") as handle:
        head = handle.read(8)
        if len(head) < 8:
            raise UserError(f"{path}: not a safetensors file (too short)")
        (size,) = struct.unpack("<Q", head)
        if size > 100 * 2**20:
            raise UserError(f"{path}: not a safetensors file (a header of {size} bytes)")
        try:
            header = json.loads(handle.read(size))
        except ValueError as error:
            raise UserError(f"{path}: not a safetensors file ({error})") from None
    metadata = header.pop("__metadata__", None) or {}
    tensors = {name: TensorInfo(info["dtype"], tuple(info["shape"])) for name, info in header.items()}
    return FileHeader(path, tensors, {str(k): str(v) for k, v in metadata.items()})


def _gguf_header(path: Path) -> FileHeader:
    try:
        from gguf import GGUFReader
    except ImportError:
        raise UserError(f"{path}: GGUF files need the `gguf` package (pip install gguf)") from None
    try:
        reader = GGUFReader(str(path))
    except Exception as error:  # the reader raises ValueError, struct errors ... on a damaged file
        raise UserError(f"{path}: not a readable GGUF file ({error})") from None
    tensors = {}
    for tensor in reader.tensors:
        # GGUF lists shapes innermost first; torch's order is the reverse
        shape = tuple(int(n) for n in reversed(tensor.shape.tolist()))
        tensors[tensor.name] = TensorInfo(tensor.tensor_type.name, shape)
    metadata = {}
    for key, value in reader.fields.items():
        if key.startswith("general.") and value.types and value.types[0].name == "STRING":
            metadata[key] = bytes(value.parts[value.data[0]]).decode("utf-8", "replace")
    return FileHeader(path, tensors, metadata)


# ---- which variant a file is ---------------------------------------------------------------------------------------


@dataclass(frozen=True)
class Variant:
    """A published (or tiny preset) variant of one part: what its names and shapes say (`facts`, compared with what
    the part's reader reads from a file) and the configs difftune ships for it ({component: config dict}, or a
    callable giving them: a tiny preset's are read from its folder)."""

    name: str
    title: str
    facts: Mapping[str, Any]
    configs: Mapping[str, Mapping[str, Any]] | Callable[[], Mapping[str, Mapping[str, Any]]]
    #: a word the files of this variant have in their names where other variants have the same names and shapes
    #: (FLUX.1 Kontext's transformer is FLUX.1 [dev]'s layout): `--models-from` uses it to say which a file is
    hint: str | None = None

    def config(self, component: str) -> dict[str, Any]:
        configs = self.configs() if callable(self.configs) else self.configs
        if component not in configs:
            raise KeyError(f"variant {self.name} ships no {component} config")
        return dict(configs[component])


@dataclass(frozen=True)
class PartKind:
    """One kind of part a family takes as a file (its transformer, a text encoder, its VAE): how to read its facts
    from a file's names (`read`: None when the file is not this kind of part at all), the prefixes its names may
    carry, and its known variants."""

    name: str
    title: str
    read: Callable[[PartNames], dict[str, Any] | None]
    variants: tuple[Variant, ...]
    prefixes: tuple[str, ...] = ()

    def facts(self, header: FileHeader) -> tuple[PartNames, dict[str, Any] | None]:
        part = header.part(self.prefixes)
        return part, self.read(part)

    def variant(self, header: FileHeader) -> tuple[PartNames, Variant]:
        """The known variant `header`'s file is, or a UserError naming the file, what was read from it and the
        known variants."""
        part, facts = self.facts(header)
        if facts is None:
            raise UnknownFile(f"{header.path}: not a {self.title} file ({describe_names(part)})")
        fitting = [v for v in self.variants if all(facts.get(key) == value for key, value in v.facts.items())]
        if fitting:
            # variants of one layout (Z-Image and Z-Image-Turbo): the one whose word the file's name has, else the
            # one that asks for none
            name = header.path.name.lower()
            named = [v for v in fitting if v.hint and v.hint in name]
            return part, (named or [v for v in fitting if not v.hint] or fitting)[0]
        known = "; ".join(f"{v.title}: {format_facts(v.facts)}" for v in self.variants if not v.name.startswith("tiny"))
        raise UnknownFile(f"{header.path}: a {self.title} of no known variant (read: {format_facts(facts)}). "
                          f"Known: {known}. For another variant, set model.single_file_config to a diffusers folder "
                          "of it (its configs are read from there)")


@dataclass(frozen=True)
class FamilyFiles:
    """What a family takes as single files: its denoiser, its text encoders by slot, its VAE, and where a ComfyUI
    installation keeps each of its tokenizers ({pipeline tokenizer subfolder: folder in ComfyUI's source tree})."""

    denoiser: PartKind
    text_encoders: dict[str, PartKind]
    #: None for a family whose images are encoded by another model (the Wuerstchen prior's EfficientNet)
    vae: PartKind | None
    comfy_tokenizers: dict[str, str]

    def kinds(self) -> dict[str, PartKind]:
        """Every part kind by role: `denoiser`, each text encoder's slot, `vae`."""
        return {"denoiser": self.denoiser, **self.text_encoders, **({"vae": self.vae} if self.vae else {})}


def format_facts(facts: Mapping[str, Any]) -> str:
    return ", ".join(f"{key} {value}" for key, value in facts.items())


def describe_names(part: PartNames, shown: int = 3) -> str:
    names = sorted(part.tensors)
    if not names:
        return "no tensors"
    return f"{len(names)} tensors, e.g. {', '.join(names[:shown])}"


def detect(header: FileHeader, kinds: Iterable[PartKind]) -> tuple[PartKind, PartNames, Variant] | None:
    """The first of `kinds` that reads the file as one of its known variants (CLIP-G's file reads as a CLIP model of
    CLIP-L's layout too, of no CLIP-L variant); UnknownFile where kinds recognise the file but none knows its
    variant; None where no kind recognises it."""
    unknown = None
    for kind in kinds:
        part, facts = kind.facts(header)
        if facts is None:
            continue
        try:
            return (kind, *kind.variant(header))
        except UnknownFile as error:
            unknown = unknown or error
    if unknown is not None:
        raise unknown
    return None


def folder_configs(folder: Path) -> dict[str, dict]:
    """{component: config} of a diffusers pipeline folder."""
    return {sub.name: json.loads(next(iter(sorted(sub.glob("*config.json")))).read_text())
            for sub in sorted(Path(folder).iterdir()) if sub.is_dir() and any(sub.glob("*config.json"))}


def preset_variant(name: str, title: str, facts: Mapping[str, Any], folder: Callable[[], Path],
                   components: Mapping[str, str] | None = None, hint: str | None = None) -> Variant:
    """A tiny preset's part as a variant: its facts, and its configs read from the preset's folder when a model is
    built (the folder is made then): all of them, or {role: the folder's component} (a text encoder's config under
    `text_encoder`, whichever subfolder holds it)."""
    def configs() -> dict[str, dict]:
        found = folder_configs(folder())
        return found if components is None else {role: found[sub] for role, sub in components.items()}

    return Variant(name, title, facts, configs, hint)


def load_variants(path: Path, extra: Iterable[Variant] = ()) -> tuple[Variant, ...]:
    """The variants a package ships in a JSON file ({name: {"title", "facts", "configs"}}), then `extra` (the tiny
    presets')."""
    entries = json.loads(path.read_text())
    shipped = tuple(Variant(name, entry["title"], entry["facts"], entry["configs"], entry.get("hint"))
                    for name, entry in entries.items())
    return shipped + tuple(extra)


# ---- tokenizers ----------------------------------------------------------------------------------------------------


def comfy_root(paths: Iterable[str | Path]) -> Path | None:
    """The ComfyUI installation a file lies in (a folder above it with ComfyUI's source tree, `comfy/`), found from
    the first of `paths` that has one: its tokenizer files are what ComfyUI uses with the same weight files."""
    for path in paths:
        for folder in Path(path).resolve().parents:
            source = folder / "comfy"
            if (source / "sd1_tokenizer").is_dir() or (source / "text_encoders").is_dir():
                return folder
    return None


@dataclass(frozen=True)
class TokenizerSource:
    """Where one tokenizer loads from: a folder or hub id, and the subfolder in it (None: the folder itself)."""

    where: str
    subfolder: str | None
    #: what chose it, for messages and describe(): `model.tokenizer`, `ComfyUI`, `the base`
    origin: str


def tokenizer_source(subfolder: str, comfy_folder: str, tokenizer: str | None, files: Iterable[str | Path],
                     components: Callable[[], str], single: bool = False) -> TokenizerSource:
    """Where the pipeline's tokenizer `subfolder` (`tokenizer`, `tokenizer_2`) comes from: `model.tokenizer` (a
    ComfyUI installation: its `comfy_folder`; a pipeline folder: its `subfolder`; for a family with one tokenizer
    (`single`), a tokenizer folder itself; a hub id: its `subfolder`), else the ComfyUI installation `files` lie in,
    else `components()` (the base's folder or `single_file_config`)."""
    if tokenizer:
        folder = Path(tokenizer).expanduser()
        if (folder / "comfy").is_dir():
            if not (folder / comfy_folder).is_dir():
                raise UserError(f"model.tokenizer: {folder} is a ComfyUI installation without {comfy_folder}")
            return TokenizerSource(str(folder / comfy_folder), None, "model.tokenizer")
        if (folder / subfolder).is_dir():
            return TokenizerSource(str(folder), subfolder, "model.tokenizer")
        if folder.is_dir():
            if single:
                return TokenizerSource(str(folder), None, "model.tokenizer")
            raise UserError(f"model.tokenizer: {folder} has no {subfolder}/ folder (nor is it a ComfyUI installation)")
        return TokenizerSource(tokenizer, subfolder, "model.tokenizer")
    root = comfy_root(files)
    if root is not None and (root / comfy_folder).is_dir():
        return TokenizerSource(str(root / comfy_folder), None, "ComfyUI")
    return TokenizerSource(components(), subfolder, "the base")
