"""`run.py --models-from COMFY_MODELS_DIR [--arch ARCH]`: which files of a ComfyUI models folder make a complete base
for each family, and the `model:` section to paste. Only file headers are read (names, dtypes, shapes); free of
torch."""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass, field
from pathlib import Path

from toolkit.errors import UserError
from toolkit.models.single_files import (
    FamilyFiles,
    FileHeader,
    PartKind,
    UnknownFile,
    Variant,
    comfy_root,
    format_facts,
    read_header,
)

#: ComfyUI's folders for each part (older installations: `unet`, `clip`); checkpoints may hold a denoiser too
DENOISER_FOLDERS = ("diffusion_models", "unet", "checkpoints")
TEXT_ENCODER_FOLDERS = ("text_encoders", "clip")
VAE_FOLDERS = ("vae",)
READABLE = (".safetensors", ".sft", ".gguf")


@dataclass
class Match:
    """A file read as one part of a family: the variant it is and how it is stored."""

    path: Path
    variant: Variant
    storage: str


@dataclass
class FamilyBases:
    """One family's candidates in a models folder."""

    arch: str
    files: FamilyFiles
    denoisers: list[Match] = field(default_factory=list)
    slots: dict[str, list[Match]] = field(default_factory=dict)
    vaes: list[Match] = field(default_factory=list)
    #: files read as the family's denoiser but of no known variant, with what was read
    unknown: list[str] = field(default_factory=list)

    @property
    def missing(self) -> list[str]:
        """The parts no file was found for."""
        gaps = [self.files.text_encoders[slot].title for slot, found in self.slots.items() if not found]
        return gaps + ([self.files.vae.title] if not self.vaes else [])


def models_folder(given: str | Path) -> Path:
    """The `models` folder: the one given, or a ComfyUI installation's `models`."""
    folder = Path(given).expanduser()
    if not folder.is_dir():
        raise UserError(f"--models-from: folder not found: {folder}")
    if (folder / "models").is_dir() and not any((folder / name).is_dir() for name in DENOISER_FOLDERS):
        folder = folder / "models"
    if not any((folder / name).is_dir() for name in DENOISER_FOLDERS + TEXT_ENCODER_FOLDERS + VAE_FOLDERS):
        raise UserError(f"--models-from: {folder} has none of ComfyUI's model folders "
                        f"({', '.join(DENOISER_FOLDERS + TEXT_ENCODER_FOLDERS + VAE_FOLDERS)})")
    return folder


def weight_files(folder: Path, names: Iterable[str]) -> list[Path]:
    found = []
    for name in names:
        if (folder / name).is_dir():
            found += sorted(p for p in (folder / name).rglob("*") if p.suffix.lower() in READABLE and p.is_file())
    return found


def headers(paths: list[Path]) -> list[FileHeader]:
    """The readable headers; a file that does not read is skipped (it may be anything a user keeps there)."""
    read = []
    for path in paths:
        try:
            read.append(read_header(path))
        except (UserError, OSError, ValueError):
            continue
    return read


def matches(kind: PartKind, files: list[FileHeader], unknown: list[str] | None = None) -> list[Match]:
    found = []
    for header in files:
        part, facts = kind.facts(header)
        if facts is None:
            continue
        try:
            _, variant = kind.variant(header)
        except UnknownFile:
            if unknown is not None:
                unknown.append(f"{header.path.name}: {format_facts(facts)}")
            continue
        found.append(Match(header.path, variant, part.storage))
    return found


def hinted_elsewhere(match: Match, others: dict[str, list[Variant]]) -> bool:
    """A file whose name has the hint of another family's variant of the same layout (FLUX.1 Kontext's `kontext`):
    it is that family's, not this one's."""
    name = match.path.name.lower()
    return any(v.hint and v.hint in name and v.facts == match.variant.facts for vs in others.values() for v in vs)


def survey(folder: Path, families: dict[str, FamilyFiles], only: list[str] | None = None) -> list[FamilyBases]:
    """Each family's candidates among the folder's files (those of `only`, where given; the others' file-name hints
    still say which family a file of a shared layout is)."""
    denoisers = headers(weight_files(folder, DENOISER_FOLDERS))
    encoders = headers(weight_files(folder, TEXT_ENCODER_FOLDERS + DENOISER_FOLDERS))
    vaes = headers(weight_files(folder, VAE_FOLDERS + DENOISER_FOLDERS))
    hinted = {arch: [v for v in files.denoiser.variants if v.hint] for arch, files in families.items()}
    bases = []
    for arch, files in families.items():
        if only is not None and arch not in only:
            continue
        base = FamilyBases(arch, files)
        others = {a: vs for a, vs in hinted.items() if a != arch}
        for match in matches(files.denoiser, denoisers, base.unknown):
            hint = match.variant.hint
            if (hint and hint not in match.path.name.lower()) or hinted_elsewhere(match, others):
                continue
            base.denoisers.append(match)
        base.slots = {slot: matches(kind, encoders) for slot, kind in files.text_encoders.items()}
        base.vaes = matches(files.vae, vaes)
        bases.append(base)
    return bases


def preferred(found: list[Match], like: Match) -> list[Match]:
    """Candidates ordered: the denoiser's storage first (an fp8 base with fp8 text encoders), then full precision,
    then by name."""
    def rank(match: Match) -> tuple:
        return (match.storage != like.storage, "fp8" in match.storage or "gguf" in match.storage, match.path.name)

    return sorted(found, key=rank)


def model_section(base: FamilyBases, denoiser: Match, tokenizer_root: Path | None) -> list[str]:
    """The `model:` section for one denoiser, each part's first choice written and the others named in comments."""
    lines = [f"# {denoiser.variant.title}: {denoiser.path.name} ({denoiser.storage})", "model:",
             f"  arch: {base.arch}", f"  name_or_path: {denoiser.path}"]
    if base.missing:
        lines.insert(1, f"# incomplete: no {', no '.join(base.missing)} in this folder")
    inside = [slot for slot, found in base.slots.items() if any(m.path == denoiser.path for m in found)]
    if inside:  # a full checkpoint: the loader reads these parts from the denoiser's own file
        lines.append(f"  # {', '.join(base.files.text_encoders[s].title for s in inside)}: in {denoiser.path.name}")
    chosen = {slot: preferred(found, denoiser) for slot, found in base.slots.items() if found and slot not in inside}
    if chosen and len(chosen) < len(base.slots):  # some text encoders from the file, some named: name them all
        chosen = {slot: preferred(found, denoiser) for slot, found in base.slots.items() if found}
    if chosen:
        lines.append("  text_encoder_path:")
        for slot, ordered in chosen.items():
            others = f"  # or: {', '.join(m.path.name for m in ordered[1:])}" if len(ordered) > 1 else ""
            lines.append(f"    - {ordered[0].path}{others}")
    if any(m.path == denoiser.path for m in base.vaes):
        lines.append(f"  # {base.files.vae.title}: in {denoiser.path.name} (vae_name_or_path for another)")
    elif base.vaes:
        ordered = preferred(base.vaes, denoiser)
        others = f"  # or: {', '.join(m.path.name for m in ordered[1:])}" if len(ordered) > 1 else ""
        lines.append(f"  vae_name_or_path: {ordered[0].path}{others}")
    tokenizers = [folder for folder in base.files.comfy_tokenizers.values()]
    if tokenizer_root is not None and all((tokenizer_root / t).is_dir() for t in tokenizers):
        lines.append(f"  tokenizer: {tokenizer_root}")
    else:
        lines.append(f"  # tokenizer: a ComfyUI installation (with {', '.join(tokenizers)}) or a diffusers folder")
    return lines


def report(given: str | Path, families: dict[str, FamilyFiles], only: list[str] | None = None) -> str:
    """What `--models-from` prints: the bases of each family (of `only`, where given)."""
    folder = models_folder(given)
    root = comfy_root([folder / "x"])
    out = [f"# ComfyUI models in {folder}" + (f" (installation {root})" if root else "")]
    for base in survey(folder, families, only):
        title = base.files.denoiser.title
        out.append("")
        if not base.denoisers:
            out.append(f"# {base.arch}: no {title} file" + (f" of a known variant ({'; '.join(base.unknown)})"
                                                             if base.unknown else ""))
            continue
        complete = "complete" if not base.missing else f"missing {', '.join(base.missing)}"
        out.append(f"# {base.arch}: {len(base.denoisers)} {title} file(s), {complete}")
        for denoiser in base.denoisers:
            out += model_section(base, denoiser, root)
            out.append("")
        for line in base.unknown:
            out.append(f"# not of a known variant: {line}")
    return "\n".join(out).rstrip() + "\n"
