"""The run folder `<training_folder>/<name>/`: where everything of a run lives, what a fresh start would
overwrite, and which checkpoint a rerun continues from."""

from __future__ import annotations

import logging
import shutil
from dataclasses import dataclass
from pathlib import Path

import yaml

from toolkit.errors import UserError
from toolkit.files import write_text_atomic
from toolkit.run import checkpoint

log = logging.getLogger("difftune")


class RunFolderError(UserError, RuntimeError):
    """The run folder holds work this run would overwrite."""


@dataclass(frozen=True)
class RunFolder:
    root: Path
    name: str
    #: the family's components with files of their own (`FamilyFacts.file_parts`: Wan 2.2 A14B's experts)
    file_parts: tuple[str, ...] = ()

    @property
    def checkpoints(self) -> Path:
        return self.root / "checkpoints"

    @property
    def final_lora(self) -> Path:
        return self.root / f"{self.name}.safetensors"

    def final_lora_form(self, form: str, primary: str, part: str = "", ema: bool = False) -> Path:
        """Where the finished LoRA in `form` goes: <name>.safetensors for the family's primary form,
        <name>.<form>.safetensors for the others, the folder <name>_peft/ for peft's own; a component with a file of
        its own (an expert, `part`) <name>_<part>.safetensors and so on; the EMA of the weights (`ema`) beside each
        as <name>.ema.safetensors, <name>.ema.<form>.safetensors, <name>.ema_peft/."""
        stem = f"{self.name}_{part}" if part else self.name
        if ema:
            stem += ".ema"
        if form == "peft":
            return self.root / f"{stem}_peft"
        return self.root / (f"{stem}.safetensors" if form == primary else f"{stem}.{form}.safetensors")

    def final_loras(self) -> list[Path]:
        """The finished LoRA files there are: <name>.safetensors, its other forms, the peft folder, and those of the
        family's components with files of their own (<name>_<part>..., only for its known parts: another file
        named like the run is not taken for one), and the EMA's (<name>.ema...)."""
        found = []
        for stem in [self.name, *(f"{self.name}_{part}" for part in self.file_parts)]:
            found += [*self.root.glob(f"{stem}.safetensors"), *self.root.glob(f"{stem}.*.safetensors"),
                      *[p for p in [self.root / f"{stem}_peft", self.root / f"{stem}.ema_peft"] if p.is_dir()]]
        return sorted(found)

    @property
    def metrics(self) -> Path:
        return self.root / "metrics.jsonl"

    @property
    def samples(self) -> Path:
        return self.root / "samples"

    def saved_work(self) -> list[Path]:
        """What a fresh start would overwrite: complete checkpoints and the final LoRA."""
        complete, _ = checkpoint.scan_checkpoints(self.checkpoints)
        return complete + self.final_loras()

    def resume_point(self, resume: bool | str, overwrite: bool) -> Path | None:
        """The checkpoint to continue from (`train.resume`), or None to start fresh. Reads only; refuses to
        overwrite saved work unless `overwrite`."""
        if overwrite:
            return None
        if resume not in (False, "auto"):
            folder = Path(resume)
            if not (folder / checkpoint.COMPLETE_MARKER).is_file():
                raise checkpoint.CheckpointError(f"train.resume: {folder} is not a complete checkpoint folder")
            return folder
        complete, incomplete = checkpoint.scan_checkpoints(self.checkpoints)
        for folder in incomplete:
            log.warning("ignoring incomplete checkpoint %s (its save did not finish)", folder)
        if resume == "auto" and complete:
            return complete[-1]
        if self.saved_work():
            names = ", ".join(str(p) for p in self.saved_work()[-2:])
            reason = "train.resume is false" if resume is False else "there is no checkpoint to resume from"
            raise RunFolderError(f"run folder {self.root} already holds saved work ({names}) and {reason}; set "
                                 "train.overwrite: true to start over, or choose another config.name")
        return None

    def open(self, overwrite: bool, resolved_config: dict) -> None:
        """Remove what `train.overwrite` replaces, then write the resolved config (one process calls this)."""
        if overwrite:
            for path in [self.checkpoints, *self.final_loras(), self.metrics, self.samples]:
                if path.exists():
                    log.warning("train.overwrite: removing %s", path)
                    shutil.rmtree(path) if path.is_dir() else path.unlink()
        self.root.mkdir(parents=True, exist_ok=True)
        write_text_atomic(self.root / "config.yaml", yaml.safe_dump(resolved_config, sort_keys=False))

    def set_aside_after(self, step: int) -> Path | None:
        """Continuing from an older checkpoint abandons the newer ones: they move aside, not away."""
        aside = checkpoint.set_aside_newer(self.checkpoints, step, self.final_loras())
        if aside is not None:
            log.warning("continuing from step %d: the newer checkpoints of the earlier run were moved to %s", step,
                        aside)
        return aside
