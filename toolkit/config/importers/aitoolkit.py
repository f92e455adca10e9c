"""ai-toolkit jobs (the `sd_trainer` form of its examples, the `diffusion_trainer` form its web UI writes) as difftune
jobs that mean the same training. The rules follow what ai-toolkit does with each key, not what its name suggests
(docs/dev/foreign-configs.md has the sources): a key ai-toolkit ignores for the model is dropped, saying so; a value
ai-toolkit assumes where the file is silent is written out where difftune's default differs; a key whose meaning
differs goes to the "check these" list."""

from __future__ import annotations

import math
import re
from typing import Any

from toolkit.config.importers.conversion import (
    MISSING,
    PRECISION_ON_DEVICES,
    Conversion,
    ImportRefused,
    Row,
    Rules,
    Source,
    general_key,
)
from toolkit.models.registry import config_class, family_facts

#: the process types that train a LoRA the same way (the UI's type only adds its database hooks)
TRAINING_TYPES = ("sd_trainer", "diffusion_trainer", "ui_trainer")

#: ai-toolkit arch (without its `:tag`) -> difftune family
FAMILIES = {"sd1": "sd15", "sd15": "sd15", "sdxl": "sdxl", "ssd": "sdxl", "vega": "sdxl", "flux": "flux",
            "flex1": "flux", "flux_kontext": "flux_kontext", "qwen_image_edit": "qwen_image_edit",
            "qwen_image_edit_plus": "qwen_image_edit", "qwen_image": "qwen_image", "zimage": "zimage", "wan21": "wan", "wan22_5b": "wan",
            "wan22_14b": "wan"}
#: ai-toolkit archs difftune has no family for, by name
UNSUPPORTED = {"sd2": "Stable Diffusion 2.x", "sd3": "Stable Diffusion 3/3.5", "flex2": "Flex.2", "chroma": "Chroma", "chroma_radiance": "Chroma Radiance", "flux2": "FLUX.2",
               "flux2_klein_4b": "FLUX.2 klein", "flux2_klein_9b": "FLUX.2 klein", "zimage_l2p": "Z-Image pixel space",
               "wan21_i2v": "Wan 2.1 image-to-video", "wan22_14b_i2v": "Wan 2.2 image-to-video",
               "lumina2": "Lumina-Image 2.0", "pixart": "PixArt", "pixart_sigma": "PixArt-Sigma",
               "auraflow": "AuraFlow", "hidream": "HiDream", "hidream_e1": "HiDream-E1", "omnigen2": "OmniGen2",
               "cogview4": "CogView4"}
#: legacy model flags -> arch, in ai-toolkit's order
FLAGS = (("is_v2", "sd2"), ("is_v3", "sd3"), ("is_xl", "sdxl"), ("is_pixart", "pixart"),
         ("is_pixart_sigma", "pixart_sigma"), ("is_auraflow", "auraflow"), ("is_flux", "flux"),
         ("is_lumina2", "lumina2"), ("is_vega", "vega"), ("is_ssd", "ssd"))
#: the static time shift of ai-toolkit's training scheduler, by its arch; the others' shift is dynamic
STATIC_SHIFT = {"zimage": 3.0, "wan21": 3.0, "wan22_5b": 5.0, "wan22_14b": 5.0}
#: ai-toolkit archs imported as a family they derive from, and what differs
VARIANTS = {"ssd": "SSD-1B, a distilled SDXL: difftune loads it as sdxl from its diffusers config",
            "vega": "Vega, a distilled SDXL: difftune loads it as sdxl from its diffusers config",
            "flex1": "Flex.1 trains as flux; ai-toolkit leaves its guidance embedding out of training only where the "
                     "job says bypass_guidance_embedding: true (its Flex example and UI do), and the import writes what "
                     "this job says. difftune's own default bypasses it for a Flex.1 base"}
#: ai-toolkit's Qwen-Image-Edit archs: the first version (its reference resized to its target), and the Plus models
#: (2509 or 2511, read from the model's files; their references at the pipelines' size unless match_target_res)
EDIT_FIRST, EDIT_PLUS = "qwen_image_edit", "qwen_image_edit_plus"
EDIT_ARCHS = frozenset({EDIT_FIRST, EDIT_PLUS})
#: ai-toolkit archs whose training scheduler stretches its shifted schedule to a terminal value
TERMINAL_SHIFT = frozenset({"qwen_image", "qwen_image_edit", "qwen_image_edit_plus"})
#: ai-toolkit Wan archs whose samples round a frame count down to 4k + 1 (diffusers' pipelines round 40 up to 41),
#: always or with model.low_vram (its own pipeline then), and how
FRAMES_ROUNDED_DOWN = {"wan22_5b": "its Wan 2.2 5B model rounds down"}
LOW_VRAM_FRAMES = {"wan21": "its low_vram Wan pipeline encodes the 4k + 1 below"}
#: ai-toolkit archs with two experts (`model_kwargs.train_high_noise` / `train_low_noise`)
EXPERT_ARCHS = frozenset({"wan22_14b"})

#: mappings and lists kept whole (their keys are not job keys)
LEAVES = ("optimizer_params", "lr_scheduler_params", "model_kwargs", "quantize_kwargs", "validation_config",
          "network_kwargs", "samples", "prompts", "resolution", "controls", "control_path")

OPTIMIZERS = {"adamw": "adamw", "adamw8bit": "adamw8bit", "lion8bit": "lion8bit", "adafactor": "adafactor",
              "prodigy": "prodigy"}
SCHEDULES = ("constant", "cosine", "cosine_with_restarts", "constant_with_warmup")
DTYPES = {"fp32": "fp32", "float32": "fp32", "bf16": "bf16", "bfloat16": "bf16", "fp16": "fp16", "float16": "fp16",
          "float": "fp32", "half": "fp16"}
QTYPES = {"qfloat8": "qfloat8", "qint8": "qint8", "qint4": "qint4", "float8": "qfloat8", "int8": "qint8"}

#: what a key nothing reads is dropped as, by its place
UI_ONLY = {"sqlite_db_path": "UI-only (its job database)", "performance_log_every": "console timing only",
           "logging.use_ui_logger": "UI-only", "logging.verbose": "logging only", "logging.use_wandb": "logging only",
           "logging.project_name": "logging only", "logging.run_name": "logging only", "log_dir": "logging only",
           "save.push_to_hub": "upload, not training", "save.hf_repo_id": "upload, not training",
           "save.hf_private": "upload, not training", "save.save_format": "full-model folder format; LoRA files "
           "are safetensors", "model.compile": "see train.compile", "model.quantize_kwargs": "quantization details",
           "network.lokr_full_rank": "only with network.type lokr", "network.lokr_factor": "only with lokr",
           "sample.sampler": "difftune samples with the family's own scheduler", "sample.format": "image format",
           "datasets[].controls": "control images (none here)", "datasets[].shrink_video_to_frames": "images only",
           "datasets[].network_weight": "1 (the default)", "datasets[].num_workers": "loader performance",
           "datasets[].prefetch_factor": "loader performance", "train.xformers": "attention kernel (performance)",
           "train.sdp": "attention kernel (performance)", "train.attention_backend": "attention kernel (performance)"}


#: ai-toolkit keys whose value means what difftune's default does (see Rules.same_as_difftune; checked against the
#: schema by tests/test_import_examples.py)
SAME_AS_DIFFTUNE: dict[str, tuple[Any, str, Any]] = {
    "datasets[].default_caption": ("", "datasets[].default_caption", ""),
    "datasets[].mask_path": (None, "datasets[].mask_path", None),
    "sample.neg": ("", "sample.neg", ""),
    "train.min_denoising_steps": (0, "train.timestep_range", [0.0, 1.0]),
    "train.max_denoising_steps": (999, "train.timestep_range", [0.0, 1.0]),
    "train.blank_prompt_preservation": (False, "train.blank_prompt_preservation", False),
}

#: ai-toolkit's defaults of keys without a difftune equivalent: such a key is worth a check only when it differs
DEFAULTS: dict[str, Any] = {
    "datasets[].buckets": True, "datasets[].bucket_tolerance": 64, "datasets[].square_crop": False,
    "datasets[].random_scale": False, "datasets[].scale": 1.0, "datasets[].loss_multiplier": 1.0,
    "datasets[].prior_reg": False, "datasets[].alpha_mask": False, "datasets[].invert_mask": False,
    "network.transformer_only": True, "model.use_text_encoder_1": True, "model.use_text_encoder_2": True,
    "train.next_sample_timesteps": 8, "train.num_train_timesteps": 1000, "train.snr_gamma": None,
    "train.learnable_snr_gos": False, "train.force_first_sample": False, "train.xformers": False,
    "train.sdp": False, "sample.network_multiplier": 1, "sample.sample_start_step": 0, "sample.format": "jpg",
}


def import_aitoolkit(data: dict[str, Any], name: str = "") -> Conversion:
    """The difftune job for an ai-toolkit job file's parsed `data`."""
    config = data.get("config") if isinstance(data.get("config"), dict) else {}
    processes = [p for p in config.get("process") or [] if isinstance(p, dict)]
    training = [p for p in processes if p.get("type") in TRAINING_TYPES]
    if not training:
        types = ", ".join(sorted({str(p.get("type")) for p in processes})) or "none"
        raise ImportRefused(f"no LoRA training process to import (process types: {types}; difftune imports "
                            f"{', '.join(TRAINING_TYPES)})")
    if len(processes) > 1:
        raise ImportRefused(f"the file has {len(processes)} processes; import one job per file (split it)")
    process = training[0]
    if not isinstance(process.get("network"), dict):
        raise ImportRefused("no `network` block: ai-toolkit fine-tunes the whole model then; difftune trains LoRAs")
    job_name = str(config.get("name") or name or "imported")
    out = Conversion("ai-toolkit", job={"job": "extension", "config": {"name": job_name, "process": [
        {"type": "sd_trainer"}]}})
    out.rows.append(Row("job", f"-> job = 'extension'  (was {data.get('job', 'extension')!r})"))
    out.rows.append(Row("config.name", f"-> config.name = {job_name!r}"))
    if isinstance(data.get("meta"), dict):
        out.job["meta"] = data["meta"]
        out.rows.append(Row("meta", "-> meta (copied as it is)"))
    source = Source(process, leaves=LEAVES)
    family, arch = family_of(source)
    tag = str(source.values.get("model.arch", "")).partition(":")[2] or None  # e.g. qwen_image_edit_plus:2511
    job = AiToolkitJob(source, out, family, arch, tag)
    try:
        job.convert()
    except ImportRefused:
        raise
    except (TypeError, ValueError) as err:  # a value of the wrong kind (null, a list where a number goes)
        where = job.src.last or "the file"
        raise ImportRefused(f"{where}: {job.src.values.get(where)!r} is not a value this key takes ({err})") from err
    return out


def frames_at_or_below(count: int, step: int) -> int:
    """The step k + 1 frame count at or below `count` (what a video VAE with temporal factor `step` encodes)."""
    return (count - 1) // step * step + 1


#: a sample item's reference image keys (ai-toolkit: `ctrl_img`, and the Plus models' `ctrl_img_1..3`, the first
#: defaulting to `ctrl_img`)
SAMPLE_REFERENCE_KEYS = ("ctrl_img", "ctrl_img_1", "ctrl_img_2", "ctrl_img_3")
#: a prompt string's reference image flag
CTRL_IMG_FLAG = re.compile(r"\s*--ctrl_img\s+(\S+)")


def with_references(prompt: str) -> str | dict:
    """A prompt string, or where it carries `--ctrl_img <file>` (ai-toolkit's flag for its reference image) the
    prompt without the flag and its reference: `{prompt, references}`."""
    files = CTRL_IMG_FLAG.findall(prompt)
    if not files:
        return prompt
    return {"prompt": CTRL_IMG_FLAG.sub("", prompt).strip(), "references": files}


def item_with_references(item: dict) -> str | dict:
    """A `sample.samples` item as a difftune prompt: its prompt, with its `ctrl_img` / `ctrl_img_1..3` (in order,
    `ctrl_img_1` standing for `ctrl_img`) as references."""
    prompt = with_references(str(item.get("prompt", "")))
    first = item.get("ctrl_img_1") or item.get("ctrl_img")
    files = [str(f) for f in (first, item.get("ctrl_img_2"), item.get("ctrl_img_3")) if f]
    if not files:
        return prompt
    text = prompt if isinstance(prompt, str) else prompt["prompt"]
    return {"prompt": text, "references": (prompt["references"] if isinstance(prompt, dict) else []) + files}


def family_of(source: Source) -> tuple[str, str]:
    """(difftune family, ai-toolkit arch) from `model.arch` or the legacy flags (SD 1.x when neither says)."""
    arch = source.take("model.arch", None)
    flags = [value for flag, value in FLAGS if source.take(f"model.{flag}", False)]
    if arch is None:
        arch = flags[0] if flags else "sd1"
    arch = str(arch).split(":")[0]
    if arch in FAMILIES:
        return FAMILIES[arch], arch
    if arch.startswith("http") or "civitai" in arch:
        raise ImportRefused(f"model.arch '{arch}' is not an arch name")
    known = ", ".join(sorted(set(FAMILIES.values())))
    title = UNSUPPORTED.get(arch, "a model")
    raise ImportRefused(f"model.arch '{arch}' ({title}) has no difftune family; difftune trains {known} and "
                        "wuerstchen")


class AiToolkitJob(Rules):
    """One process's keys, section by section, into `out`."""

    same_as_difftune = SAME_AS_DIFFTUNE

    def __init__(self, source: Source, out: Conversion, family: str, arch: str, tag: str | None = None):
        super().__init__(source, out)
        self.family, self.arch, self.tag = family, arch, tag
        self.facts = family_facts(family)
        #: a flow-matching family: ai-toolkit builds its LoRA with alpha = rank (ignoring `linear_alpha`) and reads
        #: `timestep_type` for it (with `noise_scheduler: flowmatch`); the DDPM UNets it trains the other way
        self.flow = not self.facts.ddpm_noise
        self.model_keys = set(config_class(family).model_fields)

    # ---- helpers -----------------------------------------------------------------------------------------

    def same(self, path: str, target: str | None = None, convert=None, note: str = "") -> Any:
        """`path` to `target` (default: the same key) unchanged or through `convert`, when the file has it."""
        value = self.take(path)
        if value is MISSING:
            return MISSING
        value = convert(value) if convert else value
        self.out.mapped(path, target or path, value, note)
        return value

    def ignored(self, path: str, why: str = "ai-toolkit ignores it for this model") -> None:
        if self.take(path) is not MISSING:
            self.out.dropped(path, why)

    # ---- sections ----------------------------------------------------------------------------------------

    def convert(self) -> None:
        self.process()
        self.model()
        self.network()
        self.datasets()
        self.train()
        self.save()
        self.sample()
        self.logging()
        self.rest()

    def process(self) -> None:
        kind = self.take("type")
        same = "" if kind == "sd_trainer" else "  (the same training; the UI's type adds only its database hooks)"
        self.out.rows.append(Row("type", f"-> type = 'sd_trainer'{same}"))
        self.same("training_folder")
        device = self.take("device")
        if device is not MISSING:
            text = str(device)
            fits = text in ("cpu", "cuda", "auto") or (text.startswith("cuda:") and text[5:].isdigit())
            self.out.mapped("device", "device", text if fits else "auto", "" if fits else f"{text}: difftune picks")
        trigger = self.same("trigger_word")
        if trigger not in (MISSING, None):
            self.out.check("trigger_word: ai-toolkit adds it to a caption as 'trigger caption' (a space), difftune as "
                           "'trigger, caption' (a comma segment, which keep_tokens and shuffling respect)")
        seed = self.take("training_seed")
        if seed is MISSING or seed is None:
            self.out.rows.append(Row("training_seed", "absent: ai-toolkit runs unseeded; difftune's train.seed 42"))
        else:
            self.out.mapped("training_seed", "train.seed", int(seed))

    def model(self) -> None:
        out, family = self.out, self.family
        out.put("model.arch", family)
        if self.arch in VARIANTS:
            out.check(f"model.arch {self.arch}: {VARIANTS[self.arch]}")
        said = [p for p in ["model.arch", *(f"model.{flag}" for flag, _ in FLAGS)] if p in self.src.values]
        for path in said or ["(default)"]:
            out.rows.append(Row(path, f"-> model.arch = '{family}'  (ai-toolkit arch '{self.arch}')"))
        self.same("model.name_or_path")
        dtype = self.value_or_default("train.dtype", "train.dtype", "fp32", lambda v: DTYPES.get(str(v), str(v)))
        out.put("model.dtype", dtype)
        out.wrote(self.named("train.dtype"), "model.dtype", "ai-toolkit loads the base model in train.dtype too: "
                  f"{PRECISION_ON_DEVICES.get(dtype, dtype)}")
        self.ignored("model.dtype", "ai-toolkit replaces it with train.dtype")
        if self.facts.ddpm_noise:  # ai-toolkit trains epsilon unless is_v_pred, whatever the base's scheduler says
            v_pred = bool(self.take("model.is_v_pred", False))
            prediction = "v_prediction" if v_pred else "epsilon"
            if self.src.has("model.is_v_pred"):
                out.mapped("model.is_v_pred", "model.prediction_type", prediction)
            else:
                out.assumed("model.prediction_type", prediction, "ai-toolkit trains epsilon unless model.is_v_pred, "
                                                                 "whatever the base's scheduler says")
        else:
            self.ignored("model.is_v_pred", "ai-toolkit ignores it for this model")
        if "quantize" in self.model_keys:
            quantize = self.same("model.quantize")
            te = self.same("model.quantize_te")
            if te is MISSING and quantize not in (MISSING, None):
                out.assumed("model.quantize_te", bool(quantize), "ai-toolkit: quantize_te follows quantize")
            for key in ("qtype", "qtype_te"):
                self.quantization_type(key)
            assistant = self.same("model.assistant_lora_path")
            if assistant not in (MISSING, None) and not str(assistant).endswith(".safetensors"):
                out.check(f"model.assistant_lora_path {assistant!r}: difftune reads a local .safetensors file; "
                          "download the adapter and give its path")
            elif assistant not in (MISSING, None) and str(assistant).count("/") >= 2 and \
                    not str(assistant).startswith(("/", ".", "~")):
                out.check(f"model.assistant_lora_path {assistant!r}: a file inside a hub repository; download it and "
                          "give its local path")
        else:  # ai-toolkit loads the SD UNets unquantized whatever the file says
            for key in ("quantize", "quantize_te", "qtype", "qtype_te"):
                self.ignored(f"model.{key}")
        self.same("model.low_vram")
        offloading = self.take("model.layer_offloading", False)
        percents = [p for p in self.src.values if p.startswith("model.layer_offloading_")]
        if self.src.has("model.layer_offloading"):
            out.dropped("model.layer_offloading", "memory placement (difftune: model.low_vram)" if offloading else
                        "off")
        for path in percents:
            self.take(path)
            out.dropped(path, "ai-toolkit reads it only with model.layer_offloading" if not offloading else
                        "memory placement (difftune: model.low_vram)")
        if offloading:
            out.check("model.layer_offloading: ai-toolkit streams that share of the weights from the CPU; difftune "
                      "has no partial offload (model.low_vram keeps the frozen parts it can off the accelerator)")
        if self.src.has("model.vae_path"):
            if "vae_name_or_path" in self.model_keys:
                self.same("model.vae_path", "model.vae_name_or_path")
            else:
                vae = self.take("model.vae_path")
                if vae:
                    out.dropped("model.vae_path", "no other VAE for this family in difftune")
                    out.check(f"model.vae_path {vae!r}: difftune uses the model's own VAE for this family")
        for key in ("extras_name_or_path", "te_name_or_path"):
            value = self.take(f"model.{key}")
            if value not in (MISSING, None):
                out.dropped(f"model.{key}", "difftune reads every part from model.name_or_path (a full model folder "
                                            "or hub id; a single file takes model.single_file_config)")
                out.check(f"model.{key} ({value}): point model.name_or_path at a complete model (folder or hub id)")
        if self.arch in EDIT_ARCHS:
            self.edit_model()
        self.experts()
        compile_ = self.take("model.compile")
        if compile_ is not MISSING:
            out.mapped("model.compile", "train.compile", bool(compile_))

    def edit_model(self) -> None:
        """Qwen-Image-Edit: ai-toolkit's `qwen_image_edit` is the first version, `qwen_image_edit_plus` the Plus ones
        (difftune reads 2509 or 2511 from the model's files; a single file takes the arch's `:2511` tag, else 2509).
        ai-toolkit sizes the first version's reference to its target, and the Plus ones' to 1024 x 1024 unless
        `model_kwargs.match_target_res` asks for the target's area."""
        out = self.out
        kwargs = self.take("model.model_kwargs", {}) or {}
        name = str(self.src.values.get("model.name_or_path", ""))
        if self.arch == EDIT_FIRST:
            out.put("model.version", "edit")
            out.rows.append(Row("model.arch", "-> model.version = 'edit'  (ai-toolkit arch 'qwen_image_edit')"))
            out.put("model.reference_pixels", "target")
            out.rows.append(Row("(default)", "-> model.reference_pixels = 'target'  (ai-toolkit resizes the first "
                                "version's reference to its target)"))
        elif name.endswith((".safetensors", ".ckpt")):
            tag = str(self.tag or "")
            version = "2511" if "2511" in tag or "2511" in name else "2509"
            out.put("model.version", version)
            out.rows.append(Row("model.arch", f"-> model.version = '{version}'  (a single file: from the arch's tag "
                                "or the file's name)"))
        if self.arch == EDIT_PLUS and kwargs.get("match_target_res"):
            out.mapped("model.model_kwargs", "model.reference_pixels", "target", "match_target_res")
        elif self.src.has("model.model_kwargs"):
            out.dropped("model.model_kwargs", "no option of this model in difftune" if kwargs else "empty")
        if self.arch == EDIT_PLUS:
            out.check("model.arch qwen_image_edit_plus: ai-toolkit gives the Plus models' text encoder and VAE each "
                      "reference as its file is (uncropped, unmirrored); difftune crops and mirrors it with its target "
                      "(flip_x, random_crop)")

    def quantization_type(self, key: str) -> None:
        value = self.take(f"model.{key}")
        if value is MISSING:
            return
        text = str(value).split("|")[0]
        if text in QTYPES:
            self.out.mapped(f"model.{key}", f"model.{key}", QTYPES[text])
            return
        bits = int(text[4:]) if text.startswith("uint") and text[4:].isdigit() else 8
        nearest = "qint4" if bits <= 4 else "qint8"
        self.out.mapped(f"model.{key}", f"model.{key}", nearest, f"nearest to {value}")
        self.out.check(f"model.{key}: '{value}' has no difftune equivalent (quanto only; no accuracy-recovery "
                       f"adapter): imported as {nearest}")

    def experts(self) -> None:
        if "model.model_kwargs" in self.src.read:  # read for this model already (edit_model)
            high = {}
        else:
            high = self.take("model.model_kwargs", {}) or {}
        every = self.take("train.switch_boundary_every")
        if self.arch not in EXPERT_ARCHS:
            if high:
                self.out.dropped("model.model_kwargs", "no options of this kind for this model in difftune")
            elif self.src.has("model.model_kwargs") and not any(r.source == "model.model_kwargs" for r in self.out.rows):
                self.out.dropped("model.model_kwargs", "empty")
            if every is not MISSING:
                self.out.dropped("train.switch_boundary_every", "ai-toolkit ignores it for this model")
            return
        experts = [name for key, name in (("train_high_noise", "high_noise"), ("train_low_noise", "low_noise"))
                   if high.get(key, True)]
        if self.src.has("model.model_kwargs"):
            self.out.mapped("model.model_kwargs", "model.experts", experts)
        else:
            self.out.assumed("model.experts", experts, "ai-toolkit trains both experts unless model_kwargs says not")
        if every is not MISSING:
            self.out.mapped("train.switch_boundary_every", "model.expert_switch_every", int(every))

    def network(self) -> None:
        out = self.out
        kind = str(self.take("network.type", "lora")).lower()
        if kind in ("lora", "locon", "lycoris"):
            out.put("network.type", "lora")
            out.rows.append(Row("network.type", f"-> network.type = 'lora'  (ai-toolkit '{kind}')"))
        elif kind == "lokr":
            out.put("network.type", "lokr")
            out.rows.append(Row("network.type", "-> network.type = 'lokr'"))
            for key in ("lokr_full_rank", "lokr_factor"):
                if self.src.has(f"network.{key}"):
                    self.take(f"network.{key}")
                    out.dropped(f"network.{key}", "no difftune equivalent (peft LoKr of rank network.linear)")
            if self.src.values.get("network.lokr_full_rank", True):
                out.check("network.type lokr: ai-toolkit's full-rank LoKr (lokr_full_rank, lokr_factor) is not "
                          "difftune's (peft LoKr of rank network.linear)")
        else:
            raise ImportRefused(f"network.type '{kind}' has no difftune equivalent (lora, lokr)")
        rank = self.value_or_default("network.linear", "network.linear", 4, int) if not self.src.has(
            "network.rank") else self.same("network.rank", "network.linear", int)
        alpha_key = "network.linear_alpha" if self.src.has("network.linear_alpha") else "network.alpha"
        if alpha_key == "network.linear_alpha":
            self.ignored("network.alpha", "network.linear_alpha wins over it in ai-toolkit")
        if self.flow:
            self.ignored(alpha_key, "ai-toolkit ignores it for this model (alpha = rank)")
            out.assumed("network.linear_alpha", float(rank), "ai-toolkit builds this family's LoRA with alpha = rank")
            for key in ("conv", "conv_alpha"):
                self.ignored(f"network.{key}", "no convolution layers adapted in this model")
        else:
            self.value_or_default(alpha_key, "network.linear_alpha", 1.0, float)
            self.same("network.conv", convert=int)
            self.same("network.conv_alpha", convert=float)
        dropout = self.take("network.dropout")
        if dropout not in (MISSING, None, 0):
            out.dropped("network.dropout", "ai-toolkit's dropout acts after the LoRA's down projection")
            out.check(f"network.dropout {dropout}: ai-toolkit drops the LoRA's hidden units, difftune's dropout "
                      "drops its inputs; set network.dropout yourself if you want it")
        kwargs = self.take("network.network_kwargs", {}) or {}
        if not kwargs and self.src.has("network.network_kwargs"):
            out.dropped("network.network_kwargs", "empty")
        for key, value in kwargs.items():
            if key in ("ignore_if_contains", "only_if_contains", "rank_dropout", "module_dropout"):
                if value:
                    out.mapped(f"network.network_kwargs.{key}", f"network.{key}", value)
                else:
                    out.dropped(f"network.network_kwargs.{key}", f"{value!r}: nothing to filter or drop")
            else:
                out.dropped(f"network.network_kwargs.{key}", "no difftune equivalent")
                out.check(f"network.network_kwargs.{key} = {value!r}: no difftune equivalent; it is dropped")
        self.same("network.pretrained_lora_path")
        text = self.take("train.train_text_encoder")
        if text is not MISSING and text and not self.facts.text_encoder_lora:
            out.dropped("train.train_text_encoder", "ai-toolkit cannot train this model's text encoder either")
        elif text is not MISSING:
            out.mapped("train.train_text_encoder", "network.train_text_encoder", bool(text))
        if self.take("train.train_unet", True) is False:
            raise ImportRefused("train.train_unet: false (text-encoder-only training) has no difftune equivalent")
        if self.src.has("train.train_unet"):
            out.dropped("train.train_unet", "true: every difftune job trains the denoiser's LoRA")
        out.check("LoRA coverage: ai-toolkit adapts every linear layer of the model's blocks; difftune's default "
                  "targets are the attention projections (and MLPs for some families): set network.target_modules "
                  "to widen them (docs/networks.md)")

    def datasets(self) -> None:
        count = len({p.split("]")[0] for p in self.src.values if p.startswith("datasets[")})
        self.out.process["datasets"] = [{} for _ in range(count)]
        for index in range(count):
            self.dataset(index)

    def dataset(self, i: int) -> None:
        out, at = self.out, f"datasets[{i}]"
        folder = self.take(f"{at}.folder_path")
        if folder is MISSING:
            raise ImportRefused(f"{at}: no folder_path (a json caption file, dataset_path, cannot be imported)")
        out.mapped(f"{at}.folder_path", f"{at}.folder_path", folder)
        self.value_or_default(f"{at}.caption_ext", f"{at}.caption_ext", "txt", lambda v: str(v).lstrip("."))
        caption = self.take(f"{at}.default_caption")
        if caption not in (MISSING, None, ""):
            out.mapped(f"{at}.default_caption", f"{at}.default_caption", caption)
        sizes = self.value_or_default(f"{at}.resolution", f"{at}.resolution", 512, lambda r: sorted(
            {int(x) for x in (r if isinstance(r, list) else [r])}))
        if len(sizes) > 1:
            out.check(f"{at}.resolution {sizes}: ai-toolkit trains every image at every size (upscaling small "
                      "ones); difftune skips the sizes larger than an image (but always the smallest)")
        self.same(f"{at}.num_repeats", convert=int)
        for key in ("is_reg", "cache_latents", "cache_latents_to_disk", "random_crop"):
            self.same(f"{at}.{key}", convert=bool)
        if self.facts.video:
            self.dataset_frames(at)
        else:
            self.ignored(f"{at}.num_frames", "this model trains on images")
        if self.src.values.get(f"{at}.is_reg"):
            out.check(f"{at}.is_reg: ai-toolkit alternates regularisation and training batches (weighted by "
                      "train.reg_weight); difftune mixes them into each epoch")
        self.value_or_default(f"{at}.keep_tokens", f"{at}.keep_tokens", 0, int)
        if self.same(f"{at}.shuffle_tokens") is True:
            out.check(f"{at}.shuffle_tokens: ai-toolkit shuffles every segment, the trigger word included; "
                      "difftune keeps the first keep_tokens segments and the trigger in place")
        rate = self.same(f"{at}.caption_dropout_rate", convert=float)
        if rate not in (MISSING, 0.0) and self.src.values.get("trigger_word"):
            out.check(f"{at}.caption_dropout_rate: ai-toolkit's dropped caption keeps the trigger word; difftune's "
                      "is the blank prompt")
        self.same(f"{at}.token_dropout_rate", convert=float)
        for axis in ("flip_x", "flip_y"):
            if self.same(f"{at}.{axis}") is True:
                out.check(f"{at}.{axis}: ai-toolkit adds a mirrored copy of every image (the epoch doubles); "
                          "difftune mirrors each sample with probability 1/2 per epoch")
        mask = self.take(f"{at}.mask_path")
        if mask not in (MISSING, None, ""):
            out.mapped(f"{at}.mask_path", f"{at}.mask_path", mask)
            self.same(f"{at}.mask_min_value", convert=float)
            out.check(f"{at}.mask_path: ai-toolkit averages the masked loss over the whole image, difftune over "
                      "the masked area")
        else:
            self.ignored(f"{at}.mask_min_value", "no mask_path")
        trigger = self.take(f"{at}.trigger_word")
        job_trigger = self.src.values.get("trigger_word")
        if trigger not in (MISSING, None) and job_trigger in (None, trigger) and self.dataset_triggers() == {trigger}:
            out.mapped(f"{at}.trigger_word", "trigger_word", trigger, "every dataset has it")
        elif trigger not in (MISSING, None) and trigger != job_trigger:
            out.dropped(f"{at}.trigger_word", "difftune has one trigger word per job")
            out.check(f"{at}.trigger_word '{trigger}': only the job's trigger_word is used")
        shrink = self.take(f"{at}.shrink_video_to_frames", True)
        fps = self.take(f"{at}.fps")
        if self.facts.video and shrink:
            out.check(f"{at}: ai-toolkit spreads num_frames over the whole clip; difftune takes them from its "
                      "start at datasets[].fps")
            if fps is not MISSING:
                out.dropped(f"{at}.fps", "ai-toolkit ignores it with shrink_video_to_frames")
        elif self.facts.video:
            out.mapped(f"{at}.fps", f"{at}.fps", float(24 if fps in (MISSING, None) else fps))
        elif fps is not MISSING:
            out.dropped(f"{at}.fps", "this model trains on images")
        if self.src.has(f"{at}.shrink_video_to_frames"):
            out.dropped(f"{at}.shrink_video_to_frames", "read with num_frames and fps above")
        weight = self.take(f"{at}.network_weight", 1)
        if weight != 1:
            out.dropped(f"{at}.network_weight", "no difftune equivalent")
            out.check(f"{at}.network_weight {weight}: difftune applies the LoRA at full strength to every dataset")
        elif self.src.has(f"{at}.network_weight"):
            out.dropped(f"{at}.network_weight", "1: full strength, as in difftune")
        self.dataset_references(at)
        controls = self.take(f"{at}.controls", [])
        if controls:
            raise ImportRefused(f"{at}.controls: control images have no difftune equivalent")
        if self.src.has(f"{at}.controls"):
            out.dropped(f"{at}.controls", "none given")

    def dataset_references(self, at: str) -> None:
        """ai-toolkit's `control_path` (a folder, or a list: one per reference) and its `control_path_1..3` (the UI's
        slots, appended in order) are difftune's `control_path`, for the families that take reference images."""
        out = self.out
        value = self.take(f"{at}.control_path")
        folders = [] if value in (MISSING, None, "") else [str(value)] if isinstance(value, str) else [
            str(v) for v in value if v]
        sources = [f"{at}.control_path"] if folders else []
        for slot in (1, 2, 3):
            extra = self.take(f"{at}.control_path_{slot}")
            if extra not in (MISSING, None, ""):
                folders.append(str(extra))
                sources.append(f"{at}.control_path_{slot}")
            elif self.src.has(f"{at}.control_path_{slot}"):
                out.dropped(f"{at}.control_path_{slot}", "empty")
        if self.src.has(f"{at}.control_path") and not sources[:1] == [f"{at}.control_path"]:
            out.dropped(f"{at}.control_path", "empty")
        if self.take(f"{at}.control_from_same_folder", False):
            raise ImportRefused(f"{at}.control_from_same_folder: reference images must be in folders of their own "
                                "(datasets[].control_path)")
        for key in ("control_from_same_folder", "num_controls_from_same_folder", "control_transparent_color"):
            if self.src.has(f"{at}.{key}"):
                self.take(f"{at}.{key}")
                out.dropped(f"{at}.{key}", "references come from control_path folders")
        if not folders:
            return
        if self.facts.references is None:
            raise ImportRefused(f"{at}.control_path: {self.facts.title} takes no reference images in difftune "
                                "(image-editing families: flux_kontext, qwen_image_edit)")
        target = folders[0] if len(folders) == 1 else folders
        for source in sources:
            out.mapped(source, f"{at}.control_path", target)
        out.check(f"{at}.control_path: ai-toolkit trains a target whose reference is missing anyway (Kontext with a "
                  "blank one, the Plus models with fewer); difftune names every such target and stops, unless "
                  "datasets[].control_optional: true (then they train without one)")

    def dataset_frames(self, at: str) -> None:
        """ai-toolkit extracts a clip's num_frames as they are, and Wan's VAE encodes the 4k + 1 at or below that
        count (1 + (n - 1) // 4 latent frames): those are the frames it trains on, which the import writes."""
        frames = self.take(f"{at}.num_frames")
        if frames is MISSING:
            return
        step = self.facts.frame_step
        trained = frames_at_or_below(int(frames), step)
        self.out.mapped(f"{at}.num_frames", f"{at}.num_frames", trained,
                        "" if trained == int(frames) else f"ai-toolkit extracts {frames}; the VAE encodes the first "
                        f"{trained} ({step}k + 1 frames), which is what it trains on")

    def dataset_triggers(self) -> set:
        return {v for p, v in self.src.values.items() if p.startswith("datasets[") and p.endswith(".trigger_word")}

    def train(self) -> None:
        out = self.out
        accumulation = self.take("train.gradient_accumulation", 1)
        legacy = self.take("train.gradient_accumulation_steps", 1)
        if accumulation not in (None, 1) and legacy not in (None, 1):
            raise ImportRefused("train.gradient_accumulation and train.gradient_accumulation_steps are both above 1, "
                                "which ai-toolkit refuses")
        if accumulation not in (None, 1) or (self.src.has("train.gradient_accumulation") and legacy in (None, 1)):
            out.mapped("train.gradient_accumulation", "train.gradient_accumulation", int(accumulation or 1))
        elif self.src.has("train.gradient_accumulation"):
            out.dropped("train.gradient_accumulation", "1: ai-toolkit then counts by gradient_accumulation_steps")
        accumulation = MISSING if accumulation in (None, 1) else accumulation
        steps = self.take("train.steps", 1000)
        scale = 1
        if accumulation is MISSING and legacy == 1 and self.src.has("train.gradient_accumulation_steps"):
            out.mapped("train.gradient_accumulation_steps", "train.gradient_accumulation", 1)
        if accumulation is MISSING and legacy not in (None, 1):
            if int(legacy) < 1:
                raise ImportRefused("train.gradient_accumulation_steps -1 (a whole epoch per update) has no "
                                    "difftune equivalent")
            scale = int(legacy)
            out.mapped("train.gradient_accumulation_steps", "train.gradient_accumulation", scale)
            out.check("train.gradient_accumulation_steps: ai-toolkit counts steps, save_every and sample_every in "
                      f"micro-batches; they were divided by {scale} into optimizer updates")
        updates = max(1, math.ceil(int(steps) / scale))
        self.updates = updates
        if self.src.has("train.steps"):
            out.mapped("train.steps", "train.steps", updates)
        else:
            out.assumed("train.steps", updates, "ai-toolkit's default for train.steps")
        self.scale = scale
        self.same("train.batch_size", convert=int)
        self.optimizer()
        self.schedule()
        self.value_or_default("train.gradient_checkpointing", "train.gradient_checkpointing", True, bool)
        if self.src.values.get("train.optimizer") == "adafactor":
            self.ignored("train.max_grad_norm", "ai-toolkit does not clip Adafactor's gradients")
        else:
            self.same("train.max_grad_norm", convert=float)
        self.timesteps()
        self.objective()
        self.same("train.cache_text_embeddings", convert=bool)
        unload = self.take("train.unload_text_encoder", False)
        caching = bool(self.src.values.get("train.cache_text_embeddings"))
        if unload and not caching:
            raise ImportRefused("train.unload_text_encoder without cache_text_embeddings trains on the trigger word "
                                "alone, which difftune does not do")
        if self.src.has("train.unload_text_encoder"):
            out.dropped("train.unload_text_encoder", "the text encoder leaves once captions are cached, as in "
                                                      "difftune" if unload else "off")
        if caching and any(self.src.values.get(p) for p in self.src.values
                           if p.endswith((".shuffle_tokens", ".token_dropout_rate"))):
            out.check("train.cache_text_embeddings: ai-toolkit freezes caption shuffling and token dropout at "
                      "caching time; difftune applies them to the cached captions every epoch")
        paths = self.src.under("train.ema_config")
        ema = {k.split(".")[-1]: self.take(k) for k in paths}
        if ema.get("use_ema"):
            decay = float(ema.get("ema_decay") or 0.999)
            out.mapped("train.ema_config.use_ema", "sample.use_ema", True, "ai-toolkit samples with the EMA")
            if "ema_decay" in ema:
                out.mapped("train.ema_config.ema_decay", "train.ema", {"decay": decay})
            else:
                out.assumed("train.ema", {"decay": decay}, "ai-toolkit's default ema_decay")
            for path in paths:
                if path.split(".")[-1] not in ("use_ema", "ema_decay"):
                    out.dropped(path, "no difftune equivalent")
            out.check("train.ema_config: ai-toolkit's <name>.safetensors and samples ARE the EMA weights; difftune "
                      "writes the EMA as <name>.ema.safetensors beside the trained LoRA (samples use it: "
                      "sample.use_ema)")
        else:
            for path in paths:
                out.dropped(path, "use_ema is off")

    def optimizer(self) -> None:
        out = self.out
        name = str(self.take("train.optimizer", "adamw")).lower()
        if name not in OPTIMIZERS:
            raise ImportRefused(f"train.optimizer '{name}' has no difftune equivalent ({', '.join(OPTIMIZERS)}, "
                                "schedulefree_adamw)")
        out.mapped("train.optimizer", "train.optimizer", OPTIMIZERS[name])
        params = dict(self.take("train.optimizer_params", {}) or {})
        if name in ("adamw", "adamw8bit", "prodigy"):
            params.setdefault("eps", 1e-6)
        if name == "adafactor":
            for key in ("relative_step", "scale_parameter", "warmup_init"):
                params.setdefault(key, False)
            out.assumed("train.max_grad_norm", 0.0, "ai-toolkit does not clip Adafactor's gradients")
        out.put("train.optimizer_params", params)
        out.rows.append(Row("train.optimizer_params", f"-> train.optimizer_params = {params}  (with ai-toolkit's "
                                                       "own defaults for this optimizer)"))
        lr = self.take("train.lr", 1e-6)
        lr = float(lr)
        if name == "prodigy" and lr < 0.1:
            out.mapped("train.lr", "train.lr", 1.0, f"ai-toolkit replaces a Prodigy lr below 0.1 ({lr}) by 1.0")
        elif self.src.has("train.lr"):
            out.mapped("train.lr", "train.lr", lr)
        else:
            out.assumed("train.lr", lr, "ai-toolkit's default for train.lr")
        for key in ("unet_lr", "text_encoder_lr", "refiner_lr"):
            self.ignored(f"train.{key}", "ai-toolkit trains a LoRA at train.lr")

    def schedule(self) -> None:
        out = self.out
        name = str(self.take("train.lr_scheduler", "constant"))
        params = dict(self.take("train.lr_scheduler_params", {}) or {})
        if name == "linear":
            raise ImportRefused("train.lr_scheduler 'linear' in ai-toolkit ramps the LR up from lr/3 to lr over the "
                                "run; difftune has no such schedule (its 'linear' decays). Choose another")
        if name not in SCHEDULES:
            raise ImportRefused(f"train.lr_scheduler '{name}' has no difftune equivalent")
        if name == "cosine_with_restarts":  # torch's CosineAnnealingWarmRestarts over the whole run: one cosine
            out.mapped("train.lr_scheduler", "train.lr_scheduler", "cosine", "ai-toolkit runs it as one cosine")
        else:
            out.mapped("train.lr_scheduler", "train.lr_scheduler", name)
        if name == "constant_with_warmup":
            warmup = math.ceil(int(params.pop("num_warmup_steps", 1000)) / self.scale)
            if warmup >= self.updates:
                raise ImportRefused(f"train.lr_scheduler constant_with_warmup warms up over {warmup} updates of "
                                    f"{self.updates}: ai-toolkit never reaches lr; give lr_scheduler_params."
                                    "num_warmup_steps below train.steps")
            out.put("train.lr_warmup_steps", warmup)
            out.rows.append(Row("train.lr_scheduler_params", f"-> train.lr_warmup_steps = {warmup}"))
        eta = params.pop("eta_min", 0)
        if eta:
            out.check(f"train.lr_scheduler_params.eta_min {eta}: difftune's cosine ends at 0")
        if params:
            out.check(f"train.lr_scheduler_params {params}: no difftune equivalent; dropped")

    def timesteps(self) -> None:
        """`timestep_type` acts only with `noise_scheduler: flowmatch` on a flow-matching family; elsewhere
        ai-toolkit uses the DDPM draws (SD) or its scheduler's static shift."""
        out = self.out
        scheduler = str(self.take("train.noise_scheduler", "ddpm"))
        kind = self.take("train.timestep_type", "sigmoid")
        weighted = self.take("train.linear_timesteps", False)
        if not self.flow:
            if scheduler == "flowmatch":
                raise ImportRefused("train.noise_scheduler flowmatch on an SD UNet trains it as a flow-matching model, "
                                    "which difftune does not do")
            out.dropped("train.noise_scheduler", "ai-toolkit's training noise schedule (DDPM for this model: "
                                                 "difftune's too); not an LR schedule")
            for key in ("timestep_type", "linear_timesteps", "linear_timesteps2"):
                if self.src.has(f"train.{key}"):
                    out.dropped(f"train.{key}", "ai-toolkit ignores it for this model (DDPM draws)")
            out.assumed("train.timestep_type", "uniform", "what ai-toolkit draws for this model")
            self.content_or_style(uniform=True)
            return
        out.dropped("train.noise_scheduler", "flow matching, the family's own (not an LR schedule)")
        if scheduler != "flowmatch":
            for key in ("timestep_type", "linear_timesteps", "linear_timesteps2"):
                if self.src.has(f"train.{key}"):
                    out.dropped(f"train.{key}", "ai-toolkit draws timesteps without it unless noise_scheduler is "
                                                "flowmatch")
            if weighted or kind == "weighted":
                out.check("train.linear_timesteps / timestep_type weighted: ai-toolkit still weights this model's "
                          "loss by them without flowmatch; difftune does not")
            shift = STATIC_SHIFT.get(self.arch)
            if shift is None:
                raise ImportRefused(f"train.noise_scheduler '{scheduler}' with {self.arch}: ai-toolkit cannot train "
                                    "it without flowmatch")
            out.assumed("train.timestep_type", "shift", f"ai-toolkit ignores timestep_type without flowmatch and "
                                                        f"draws through its scheduler's shift {shift}")
            out.put("train.timestep_params", {"shift": shift})
            self.content_or_style(uniform=False)
            return
        if self.take("train.linear_timesteps2", False):
            raise ImportRefused("train.linear_timesteps2 (a half-bell weighting) has no difftune equivalent")
        if weighted:
            out.mapped("train.linear_timesteps", "train.timestep_type", "weighted", "the same bell-shaped weighting")
            if self.src.has("train.timestep_type"):
                out.dropped("train.timestep_type", "linear_timesteps replaces it")
            self.content_or_style(uniform=True)
            return
        if self.src.has("train.linear_timesteps"):
            out.dropped("train.linear_timesteps", "off")
        kind = str(kind)
        if kind == "sigmoid" and not self.src.has("train.timestep_type"):
            out.assumed("train.timestep_type", "sigmoid", "ai-toolkit's default for train.timestep_type")
        elif kind == "sigmoid":
            out.mapped("train.timestep_type", "train.timestep_type", "sigmoid")
        elif kind == "linear":
            out.mapped("train.timestep_type", "train.timestep_type", "uniform", "ai-toolkit's linear draws uniformly")
        elif kind in ("shift", "flux_shift", "lumina2_shift"):
            if self.arch in TERMINAL_SHIFT:
                out.check("train.timestep_type shift on Qwen-Image: ai-toolkit's scheduler also stretches the shifted "
                          "schedule to a terminal value (shift_terminal 0.02); difftune's dynamic shift does not")
            if self.arch not in STATIC_SHIFT:
                out.mapped("train.timestep_type", "train.timestep_type", "shift", "dynamic, from the image size")
                out.put("train.timestep_params", {"dynamic_shift": True})
            else:
                out.mapped("train.timestep_type", "train.timestep_type", "shift")
                out.put("train.timestep_params", {"shift": STATIC_SHIFT[self.arch]})
        elif kind == "weighted":
            out.mapped("train.timestep_type", "train.timestep_type", "uniform")
            out.check("train.timestep_type weighted: ai-toolkit weights the loss by a table measured on Flex.1 "
                      "(peak at high noise); difftune's 'weighted' is another (symmetric) curve: imported as uniform")
        elif kind == "lognorm_blend":
            out.mapped("train.timestep_type", "train.timestep_type", "lognorm_blend")
            out.check("train.timestep_type lognorm_blend: difftune's blend approximates ai-toolkit's")
        else:
            raise ImportRefused(f"train.timestep_type '{kind}' has no difftune equivalent")
        self.content_or_style(uniform=kind in ("linear", "weighted"))

    def content_or_style(self, uniform: bool) -> None:
        value = self.same("train.content_or_style")
        if value not in (MISSING, "balanced") and not uniform:
            self.out.check("train.content_or_style: ai-toolkit bends the sampler's quantiles, difftune bends u")

    def objective(self) -> None:
        out = self.out
        low, high = self.take("train.min_denoising_steps", 0), self.take("train.max_denoising_steps", 999)
        if (low, high) != (0, 999):
            # ai-toolkit's timestep tables run from pure noise (index 0) down: indices low..high are u from
            # 1 - (high + 1)/1000 up to 1 - low/1000
            span = [round(1 - (int(high) + 1) / 1000, 6), round(1 - int(low) / 1000, 6)]
            for key in ("min_denoising_steps", "max_denoising_steps"):
                if self.src.has(f"train.{key}"):
                    out.mapped(f"train.{key}", "train.timestep_range", span, "ai-toolkit indexes from high noise")
            if self.src.values.get("train.timestep_type", "sigmoid") not in ("linear",) and self.flow:
                out.check("train.min/max_denoising_steps: ai-toolkit takes them as indices into its (non-uniform) "
                          "timestep table; difftune's timestep_range is a range of u, the same only for uniform draws")
        gamma = self.take("train.min_snr_gamma")
        if gamma not in (MISSING, None):
            if self.facts.ddpm_noise:
                out.mapped("train.min_snr_gamma", "train.min_snr_gamma", float(gamma))
                if self.src.values.get("model.is_v_pred"):
                    out.check("train.min_snr_gamma with v-prediction: ai-toolkit weights by min(gamma/SNR, 1) (the "
                              "epsilon form); difftune uses the v-prediction form")
            else:
                out.dropped("train.min_snr_gamma", "ai-toolkit cannot apply it to a flow-matching model")
        self.same("train.noise_offset", convert=float)
        loss = str(self.take("train.loss_type", "mse"))
        if loss in ("mse", "mae"):
            if self.src.has("train.loss_type"):
                out.mapped("train.loss_type", "train.loss_type", loss)
        elif loss == "pseudo_huber":
            out.mapped("train.loss_type", "train.loss_type", "pseudo_huber")
            out.put("train.huber_c", 0.01)
            out.check("train.loss_type pseudo_huber: ai-toolkit uses c = 0.01 without the 2c factor; imported with "
                      "huber_c 0.01 (difftune's loss is 0.02 x ai-toolkit's scale)")
        else:
            raise ImportRefused(f"train.loss_type '{loss}' has no difftune equivalent")
        if self.take("train.blank_prompt_preservation", False):
            out.mapped("train.blank_prompt_preservation", "train.blank_prompt_preservation", True)
            self.same("train.blank_prompt_preservation_multiplier", convert=float)
        if self.take("train.diff_output_preservation", False):
            out.dropped("train.diff_output_preservation", "no difftune equivalent")
            out.check("train.diff_output_preservation: difftune has no class-word preservation (its "
                      "blank_prompt_preservation keeps the blank prompt's prediction, which is another thing)")
        elif self.src.has("train.diff_output_preservation"):
            out.dropped("train.diff_output_preservation", "off")
        for key in ("diff_output_preservation_multiplier", "diff_output_preservation_class"):
            on = self.src.values.get("train.diff_output_preservation")
            self.ignored(f"train.{key}", "with diff_output_preservation, dropped" if on else
                         "only with diff_output_preservation")
        if self.take("train.do_differential_guidance", False):
            out.mapped("train.do_differential_guidance", "train.differential_guidance_scale",
                       float(self.take("train.differential_guidance_scale", 3.0)))
            if self.src.has("train.differential_guidance_scale"):
                out.wrote("train.differential_guidance_scale", "train.differential_guidance_scale")
        else:
            self.ignored("train.differential_guidance_scale", "only with do_differential_guidance")
        self.guidance()
        reg = self.take("train.reg_weight", 1.0)
        if reg != 1.0:
            out.dropped("train.reg_weight", "no difftune equivalent")
            out.check(f"train.reg_weight {reg}: difftune weights regularisation images like the others")
        elif self.src.has("train.reg_weight"):
            out.dropped("train.reg_weight", "1.0: regularisation images at full weight (difftune has no other)")

    def guidance(self) -> None:
        """FLUX.1's training guidance: ai-toolkit feeds `cfg_scale` to the guidance embedding, or leaves the embedding
        out with `bypass_guidance_embedding` (Flex.1's setting). Written out either way: difftune's default bypass
        follows the base (on for Flex.1), ai-toolkit's is off whatever the base."""
        out = self.out
        cfg = self.take("train.cfg_scale")
        if not self.facts.guidance_embedding:
            if cfg is not MISSING:
                out.dropped("train.cfg_scale", "ai-toolkit ignores it for this model")
            self.ignored("train.bypass_guidance_embedding", "ai-toolkit ignores it for this model (no guidance "
                                                            "embedding)")
            return
        if self.take("model.use_flux_cfg", False):  # ai-toolkit then forces the bypass (config_modules.py)
            self.out.mapped("model.use_flux_cfg", "train.bypass_guidance_embedding", True,
                            "ai-toolkit bypasses the embedding in training with it")
            self.out.check("model.use_flux_cfg: ai-toolkit samples with true classifier-free guidance then; difftune "
                           "samples through the guidance embedding (sample.guidance_scale)")
            bypass = True
            self.ignored("train.bypass_guidance_embedding", "model.use_flux_cfg forces it on in ai-toolkit")
        else:
            bypass = self.value_or_default("train.bypass_guidance_embedding", "train.bypass_guidance_embedding",
                                           False, bool)
        if bypass and cfg is not MISSING:
            out.dropped("train.cfg_scale", "unused: the guidance embedding is bypassed in training")
        elif cfg is not MISSING:
            out.mapped("train.cfg_scale", "train.guidance_scale", float(cfg))
        name = str(self.src.values.get("model.name_or_path", ""))
        if "flex" in name.lower() and not self.arch.startswith("flex"):  # is_flux with a Flex.1 checkpoint
            out.check(f"model.name_or_path {name!r} looks like Flex.1: difftune tells it from the transformer's block "
                      "counts and logs `variant: flex.1` when the model loads")

    def save(self) -> None:
        self.same("save.dtype", convert=lambda v: {"fp16": "float16", "bf16": "bfloat16", "fp32": "float32"}.get(
            str(v), str(v)))
        every = max(1, math.ceil(int(self.take("save.save_every", 1000)) / self.scale))
        if self.src.has("save.save_every"):
            self.out.mapped("save.save_every", "save.save_every", every)
        else:
            self.out.assumed("save.save_every", every, "ai-toolkit's default for save.save_every")
        self.value_or_default("save.max_step_saves_to_keep", "save.max_step_saves_to_keep", 5, int)

    def sample(self) -> None:
        out = self.out
        disabled = bool(self.take("train.disable_sampling", False))
        prompts = [with_references(str(p)) for p in self.take("sample.prompts", []) or []]
        items = self.take("sample.samples", []) or []
        if self.src.has("train.disable_sampling") and not disabled:
            out.dropped("train.disable_sampling", "false: the sample keys are imported")
        if disabled:
            out.rows.append(Row("train.disable_sampling", "-> no sample.prompts"))
            for path in self.src.under("sample"):
                self.take(path)
                out.dropped(path, "sampling is disabled")
            return
        if items:
            prompts = [item_with_references(item) for item in items if isinstance(item, dict)]
            out.mapped("sample.samples", "sample.prompts", prompts)
            if self.src.has("sample.prompts"):
                out.dropped("sample.prompts", "ai-toolkit renders sample.samples when it has them")
        elif self.src.has("sample.prompts"):
            out.mapped("sample.prompts", "sample.prompts", prompts)
        overrides = sorted({k for item in items if isinstance(item, dict) for k in item
                            if k != "prompt" and k not in SAMPLE_REFERENCE_KEYS})
        if overrides:
            out.check(f"sample.samples: per-prompt {', '.join(overrides)} dropped; difftune renders every prompt "
                      "with the sample-level settings")
        if any(isinstance(p, dict) for p in prompts) and self.facts.references is None:
            raise ImportRefused(f"sample prompts with control images (ctrl_img): {self.facts.title} samples take no "
                                "reference images in difftune")
        if any(" --" in (p if isinstance(p, str) else p["prompt"]) for p in prompts):
            out.check("sample prompts carry --flags (e.g. --w, --seed): difftune renders them as text")
        every = max(1, math.ceil(int(self.take("sample.sample_every", 100)) / self.scale))
        if self.src.has("sample.sample_every"):
            out.mapped("sample.sample_every", "sample.sample_every", every)
        else:
            out.assumed("sample.sample_every", every, "ai-toolkit's default for sample.sample_every")
        for key in ("width", "height", "sample_steps"):
            self.value_or_default(f"sample.{key}", f"sample.{key}", {"width": 512, "height": 512,
                                                                       "sample_steps": 20}[key], int)
        self.value_or_default("sample.seed", "sample.seed", 0, int)
        self.value_or_default("sample.walk_seed", "sample.walk_seed", False, bool)
        self.value_or_default("sample.guidance_scale", "sample.guidance_scale", 7.0, float)
        neg = self.take("sample.neg")
        if neg not in (MISSING, None, "", False):
            if not self.facts.negative_prompt:
                out.dropped("sample.neg", "ai-toolkit does not use it for this model either")
            else:
                out.mapped("sample.neg", "sample.neg", str(neg))
        rescale = self.take("sample.guidance_rescale", 0.0)
        if rescale and self.facts.guidance_rescale:
            out.mapped("sample.guidance_rescale", "sample.guidance_rescale", float(rescale))
        elif rescale:
            out.dropped("sample.guidance_rescale", "ai-toolkit ignores it for this model")
        elif self.src.has("sample.guidance_rescale"):
            out.dropped("sample.guidance_rescale", f"{rescale!r}: off")
        if self.facts.video:
            self.sample_frames()
            self.same("sample.fps", convert=float)
        else:
            for key in ("num_frames", "fps"):
                self.ignored(f"sample.{key}", "this model renders images")
        at_start = not (self.take("train.skip_first_sample", False) or False)
        out.put("sample.sample_at_start", at_start)
        said = "train.skip_first_sample" if self.src.has("train.skip_first_sample") else "(default)"
        out.rows.append(Row(said, f"-> sample.sample_at_start = {at_start}"
                            + ("" if self.src.has("train.skip_first_sample") else "  (ai-toolkit samples before "
                                                                                   "training unless told not to)")))

    def sample_frames(self) -> None:
        """The frames ai-toolkit renders for sample.num_frames, which the import writes: WanPipeline (Wan 2.1) and
        its Wan 2.2 14B pipeline round a count that is not 4k + 1 to num_frames // 4 * 4 + 1 (40 -> 41); its Wan 2.2
        5B model rounds down first, and Wan 2.1 with low_vram samples through its own pipeline, which makes
        (n - 1) // 4 + 1 latent frames (both: 40 -> 37)."""
        frames = self.take("sample.num_frames")
        if frames is MISSING:
            return
        step, count = self.facts.frame_step, int(frames)
        low_vram = bool(self.src.values.get("model.low_vram"))
        how = FRAMES_ROUNDED_DOWN.get(self.arch) or (LOW_VRAM_FRAMES.get(self.arch) if low_vram else None)
        rendered = frames_at_or_below(count, step) if how or count % step == 1 else count // step * step + 1
        how = how or "the pipeline rounds to 4k + 1"
        self.out.mapped("sample.num_frames", "sample.num_frames", rendered,
                        "" if rendered == count else f"ai-toolkit asks for {frames}; {how}: it renders {rendered}")

    def logging(self) -> None:
        every = self.take("logging.log_every")
        if every is not MISSING:
            self.out.mapped("logging.log_every", "logging.log_every", int(every))

    def rest(self) -> None:
        """Every key no rule read: dropped, with the reason where it is known; every key a rule read without a row
        of its own: said to need nothing written."""
        self.read_without_rows()
        for path in self.src.unread():
            general = general_key(path)
            reason = UI_ONLY.get(general) or UI_ONLY.get(path)
            value = self.src.values[path]
            if reason is None:
                reason = "no difftune equivalent"
                default = DEFAULTS.get(general, None)
                if value != default and value not in ([], {}) and not (default is None and value in (False, 0, "")):
                    self.out.check(f"{path} = {value!r}: no difftune equivalent; it is dropped")
                elif general in DEFAULTS:
                    reason = "ai-toolkit's default for a key difftune does not have"
            self.out.dropped(path, reason)

