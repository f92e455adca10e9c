"""Which trainer a job file was written for, from its keys alone: a difftune job, an ai-toolkit job (its example
files' `sd_trainer` form or the `diffusion_trainer` form its web UI writes), a kohya sd-scripts configuration (the
arguments saved as toml/json, or a dataset toml), a kohya_ss GUI preset, or a musubi-tuner dataset. A foreign file
run directly gets one message naming what gave it away and the command that imports it, before any model loads."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

#: ai-toolkit process types (its LoRA trainers and the rest); difftune's only type is `sd_trainer`
AITOOLKIT_PROCESS_TYPES = frozenset({
    "diffusion_trainer", "ui_trainer", "textual_inversion_trainer", "concept_slider", "slider",
    "ultimate_slider_trainer", "image_reference_slider_trainer", "concept_replacer", "extract", "generate", "mod",
})

#: ai-toolkit jobs that train no LoRA (its top-level `job:`), with what each does and what in difftune covers some
#: of it; `train` is also difftune's, so only its legacy process types tell (ai-toolkit's toolkit/job.py,
#: jobs/*Job.py at 27a03a9)
AITOOLKIT_OTHER_JOBS = {
    "extract": ("extracts the difference between two checkpoints as LoRA / LoCon files (no training)",
                "difftune has no extraction command: it trains LoRAs from images (python run.py JOB.yaml)"),
    "mod": ("rescales a LoRA file's weights (rescale_lora)",
            "difftune does not rescale a LoRA; `python run.py --convert-lora IN OUT --to comfy|diffusers|peft` "
            "rewrites an adapter file in another tool's form with its deltas unchanged"),
    "generate": ("renders prompts with a model into a folder",
                 "difftune renders prompts while it trains (sample.prompts, sample.sample_every)"),
    "train": ("runs one of ai-toolkit's legacy trainers (slider, VAE, ESRGAN, rescale_sd)",
              "difftune trains LoRAs of diffusion models; it has none of these trainers"),
}
#: process types of ai-toolkit's legacy `job: train` (jobs/TrainJob.py)
AITOOLKIT_LEGACY_TRAINERS = frozenset({"vae", "slider", "slider_old", "rescale_sd", "esrgan", "lora_hack",
                                       "reference"})

#: keys only ai-toolkit has, by section of a process (none is a typo of a difftune key or another trainer's name
#: for one: tests/test_importers.py checks that)
AITOOLKIT_KEYS: dict[str, frozenset[str]] = {
    "": frozenset({"sqlite_db_path", "performance_log_every", "training_seed", "first_sample", "log_dir"}),
    "model": frozenset({"is_flux", "is_xl", "is_v2", "is_v3", "is_lumina2", "is_pixart", "is_pixart_sigma",
                        "is_auraflow", "is_ssd", "is_vega", "is_v_pred", "extras_name_or_path",
                        "te_name_or_path", "model_kwargs", "layer_offloading", "vae_path"}),
    "network": frozenset({"lokr_full_rank", "lokr_factor", "network_kwargs", "transformer_only"}),
    "train": frozenset({"noise_scheduler", "train_unet", "ema_config", "linear_timesteps", "linear_timesteps2",
                        "skip_first_sample", "force_first_sample", "disable_sampling",
                        "diff_output_preservation", "unload_text_encoder", "switch_boundary_every",
                        "do_differential_guidance", "cfg_scale", "validation_config", "min_denoising_steps",
                        "max_denoising_steps"}),
    "sample": frozenset({"sampler", "sample_start_step", "samples"}),
    "save": frozenset({"push_to_hub", "hf_repo_id", "hf_private", "save_format"}),
}

#: top-level keys of kohya sd-scripts' saved arguments (argparse names), any two of which mark such a file
KOHYA_KEYS = frozenset({
    "pretrained_model_name_or_path", "network_module", "network_dim", "network_alpha", "output_dir", "output_name",
    "train_data_dir", "dataset_config", "max_train_steps", "max_train_epochs", "train_batch_size", "learning_rate",
    "save_every_n_steps", "save_every_n_epochs", "optimizer_type", "mixed_precision", "save_precision",
    "caption_extension", "sample_prompts",
})


#: the trainers whose files `--import-config` reads
IMPORTED = frozenset({"ai-toolkit job", "kohya sd-scripts configuration", "kohya sd-scripts dataset config"})


@dataclass(frozen=True)
class Foreign:
    """A file of another trainer: which, and the keys that tell (for the message)."""

    trainer: str
    evidence: tuple[str, ...]
    #: an ai-toolkit job of another kind than LoRA training (a key of AITOOLKIT_OTHER_JOBS)
    job_kind: str | None = None

    @property
    def importable(self) -> bool:
        return self.trainer in IMPORTED and self.job_kind is None

    def message(self, path: str) -> str:
        shown = ", ".join(f"`{key}`" for key in self.evidence[:3])
        article = "an" if self.trainer[0] in "aeiou" else "a"
        if self.job_kind is not None:
            does, covered = AITOOLKIT_OTHER_JOBS[self.job_kind]
            return (f"{path} is an ai-toolkit `job: {self.job_kind}` file ({shown}), not a training job: it {does}. "
                    f"Nothing to import; {covered}")
        if not self.importable:
            return (f"{path} is {article} {self.trainer} file ({shown}), not a difftune job, and difftune does not "
                    "import these: write the job from its keys (docs/config.md)")
        return (f"{path} is {article} {self.trainer} file ({shown}), not a difftune job; import it first: "
                f"python run.py --import-config {path} -o <new job>.yaml (it says what each key became)")


#: ai-toolkit arch strings that are no difftune arch (its own names, or a `name:tag`)
AITOOLKIT_ARCHS = frozenset({"sd1", "sd2", "sd3", "flex1", "flex2", "wan21", "wan22_5b", "wan22_14b", "chroma",
                             "flux2", "qwen_image_edit_plus", "lumina2",
                             "hidream", "omnigen2", "pixart", "pixart_sigma", "auraflow", "ssd", "vega", "zimage_l2p",
                             "wan21_i2v", "wan22_14b_i2v", "cogview4"})


def detect(data: dict[str, Any], own_types: frozenset[str] = frozenset({"sd_trainer"})) -> Foreign | None:
    """The foreign trainer `data` (a parsed job file) was written for; None for a difftune job (or anything else,
    left to the schema to explain). `own_types`: the process types difftune has (extensions included), never taken
    for another trainer's."""
    if not isinstance(data, dict):
        return None
    gui = [key for key in ("LoRA_type", "model_list", "flux1_checkbox", "sdxl_checkbox") if key in data]
    if gui:
        return Foreign("kohya_ss GUI preset", tuple(gui))
    datasets = data.get("datasets")
    if isinstance(datasets, list) and datasets and all(isinstance(d, dict) for d in datasets):
        musubi = sorted({k for d in datasets for k in ("image_directory", "video_directory") if k in d})
        if musubi:
            return Foreign("musubi-tuner dataset", tuple(musubi))
        if any("subsets" in d for d in datasets) or "general" in data:
            return Foreign("kohya sd-scripts dataset config", ("datasets[].subsets",) if any(
                "subsets" in d for d in datasets) else ("general",))
    # kohya reads its tables (`[model_arguments]`, ...) as one flat namespace
    flat = set(data) | {k for v in data.values() if isinstance(v, dict) for k in v}
    kohya = sorted(KOHYA_KEYS & flat)
    if "config" not in data and len(kohya) >= 2:
        return Foreign("kohya sd-scripts configuration", tuple(kohya))
    return _aitoolkit(data, own_types)


def _aitoolkit(data: dict[str, Any], own_types: frozenset[str]) -> Foreign | None:
    """A job kind, process type or arch of ai-toolkit's alone tells; its other keys only two or more together (one
    stray key in a difftune job gets the schema's own message)."""
    config = data.get("config")
    processes = config.get("process") if isinstance(config, dict) else None
    kind = data.get("job")
    if isinstance(config, dict) and isinstance(kind, str) and kind in AITOOLKIT_OTHER_JOBS:
        listed = processes if isinstance(processes, list) else []
        types = sorted({str(p.get("type")) for p in listed if isinstance(p, dict)})
        if kind != "train" or AITOOLKIT_LEGACY_TRAINERS & set(types):
            return Foreign("ai-toolkit job", (f"job: {kind}", *(f"process type: {t}" for t in types)), kind)
    if not isinstance(processes, list):
        return None
    strong: list[str] = []
    evidence: list[str] = []
    for index, process in enumerate(processes):
        if not isinstance(process, dict) or not isinstance(process.get("type", ""), str):
            continue  # the schema names a type that is not text
        if process.get("type") in own_types and process.get("type") != "sd_trainer":
            continue
        where = f"config.process[{index}]"
        if process.get("type") in AITOOLKIT_PROCESS_TYPES:
            strong.append(f"{where}.type: {process['type']}")
        model = process.get("model")
        arch = str(model.get("arch", "")) if isinstance(model, dict) else ""
        if arch and (arch.split(":")[0] in AITOOLKIT_ARCHS or ":" in arch):
            strong.append(f"{where}.model.arch: {arch}")
        if isinstance(model, dict) and any(model.get(flag) for flag in ("is_flux", "is_xl", "is_v2", "is_v3")):
            strong.append(f"{where}.model.is_*")
        for section, keys in AITOOLKIT_KEYS.items():
            block = process if not section else process.get(section)
            if isinstance(block, dict):
                evidence += [f"{where}.{section + '.' if section else ''}{key}" for key in sorted(keys & set(block))]
        datasets = process.get("datasets")
        if isinstance(datasets, list) and any(isinstance(d, dict) and "network_weight" in d for d in datasets):
            evidence.append(f"{where}.datasets[].network_weight")
    if strong or len(evidence) >= 2:
        return Foreign("ai-toolkit job", tuple(strong + evidence))
    return None
