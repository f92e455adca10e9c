"""kohya sd-scripts configurations (the training arguments saved as TOML or JSON, flat or in tables, with the dataset
TOML they name) as difftune jobs that mean the same training: SD 1.x (`train_network.py`), SDXL
(`sdxl_train_network.py`) and FLUX.1 (`flux_train_network.py`). A missing argument means kohya's default, written out
where difftune's differs; what kohya does differently goes to the "check these" list (docs/dev/foreign-configs.md,
sections D and E.2)."""

from __future__ import annotations

import ast
import json
import math
import re
from pathlib import Path
from typing import Any

from toolkit.config.importers.conversion import (
    MISSING,
    PRECISION_ON_DEVICES,
    Conversion,
    ImportRefused,
    Row,
    Rules,
    Source,
)
from toolkit.models.registry import config_class, family_facts

#: network modules by the family they train (None: another script's family, refused by name)
MODULES = {"networks.lora": "sd", "networks.dylora": None, "networks.lora_fa": None, "networks.oft": None,
           "lycoris.kohya": "sd", "networks.lora_flux": "flux", "networks.oft_flux": None,
           "networks.lora_sd3": "Stable Diffusion 3", "networks.lora_lumina": "Lumina 2",
           "networks.lora_hunyuan_image": "HunyuanImage", "networks.lora_anima": "Anima"}
#: arguments a dataset config's subsets inherit, and what each becomes
INHERITED = {"train_batch_size": "train.batch_size", "resolution": "datasets[].resolution",
             "caption_extension": "datasets[].caption_ext", "shuffle_caption": "datasets[].shuffle_tokens",
             "keep_tokens": "datasets[].keep_tokens", "flip_aug": "datasets[].flip_x",
             "random_crop": "datasets[].random_crop", "cache_latents": "datasets[].cache_latents",
             "cache_latents_to_disk": "datasets[].cache_latents_to_disk",
             "caption_dropout_rate": "datasets[].caption_dropout_rate",
             "caption_tag_dropout_rate": "datasets[].token_dropout_rate", "enable_bucket": "datasets[].resolution"}
FLUX_KEYS = ("ae", "t5xxl", "guidance_scale", "timestep_sampling", "discrete_flow_shift", "model_prediction_type",
             "t5xxl_max_token_length", "apply_t5_attn_mask", "split_mode")
SD3_KEYS = ("clip_g", "training_shift", "apply_lg_attn_mask", "t5_dropout_rate")
SDXL_NAMES = re.compile(r"xl|pony|illustrious|noob", re.IGNORECASE)
SD15_NAMES = re.compile(r"v1[-_.]?5|sd[-_]?15|stable-diffusion-v1|sd[-_]?1\.", re.IGNORECASE)
OPTIMIZERS = {"adamw": "adamw", "adamw8bit": "adamw8bit", "pagedadamw8bit": "adamw8bit", "lion8bit": "lion8bit",
              "adafactor": "adafactor", "prodigy": "prodigy", "adamwschedulefree": "schedulefree_adamw"}
SCHEDULES = ("linear", "cosine", "cosine_with_restarts", "polynomial", "constant", "constant_with_warmup")
PRECISION = {"no": "fp32", "fp16": "fp16", "bf16": "bf16"}
SAVE_DTYPES = {"float": "float32", "fp16": "float16", "bf16": "bfloat16"}
#: arguments that change only speed, memory, logging or files beside the LoRA
QUIET = ("xformers", "sdpa", "mem_eff_attn", "torch_compile", "dynamo_backend", "lowram", "highvram",
         "cache_latents_to_disk", "vae_batch_size", "text_encoder_batch_size", "skip_cache_check", "logging_dir",
         "log_prefix", "log_tracker_name", "wandb_run_name", "save_model_as", "save_state", "save_state_on_train_end",
         "training_comment", "no_metadata", "metadata_title", "metadata_author", "metadata_description",
         "metadata_license", "metadata_tags", "huggingface_repo_id", "ddp_timeout", "blocks_to_swap",
         "cpu_offload_checkpointing", "disable_mmap_load_safetensors", "tokenizer_cache_dir", "sample_sampler",
         "output_config", "config_file", "dataset_config", "enable_bucket")


def flat_arguments(data: dict[str, Any]) -> dict[str, Any]:
    """kohya reads every table of its config file into one namespace, one level deep."""
    flat: dict[str, Any] = {}
    for key, value in data.items():
        if isinstance(value, dict):
            flat.update(value)
        else:
            flat[key] = value
    return flat


def import_kohya(data: dict[str, Any], path: Path, family: str | None = None,
                 datasets: dict[str, Any] | None = None) -> Conversion:
    """The difftune job for kohya arguments `data` read from `path` (a dataset TOML it names is read too, unless
    `datasets` gives its content); `family` (sd15, sdxl, flux) where the file cannot tell SD 1.x from SDXL."""
    from toolkit.config.loader import read_raw

    args = flat_arguments(data)
    family = family_of(args, fallback=family)
    name = str(args.get("output_name") or path.stem)
    out = Conversion("kohya", job={"job": "extension", "config": {"name": name, "process": [{"type": "sd_trainer"}]}})
    if datasets is None and args.get("dataset_config"):
        dataset_path = Path(str(args["dataset_config"]))
        if not dataset_path.is_absolute() and not dataset_path.is_file():
            dataset_path = path.parent / dataset_path
        if not dataset_path.is_file():
            raise ImportRefused(f"dataset_config {args['dataset_config']}: not found (looked beside {path} too)")
        datasets = read_raw(dataset_path)
    job = KohyaJob(Source(args, leaves=("network_args", "optimizer_args", "text_encoder_lr", "resolution")), out,
                   family, datasets, path)
    try:
        job.convert()
    except ImportRefused:
        raise
    except (TypeError, ValueError, SyntaxError) as err:
        raise ImportRefused(f"{job.src.last or path}: {job.src.values.get(job.src.last)!r} is not a value this "
                            f"argument takes ({err})") from err
    return out


def family_of(args: dict[str, Any], fallback: str | None = None) -> str:
    """sd15, sdxl or flux from the arguments (kohya's configs name no model family): explicit flags, the network
    module, arguments only one script has, the base checkpoint's own keys, then its name; `fallback` (`--family`)
    only where none of these tells, and never against them."""
    if args.get("model_type") == "chroma":
        raise ImportRefused("model_type chroma: Chroma has no difftune family")
    if args.get("v2"):
        raise ImportRefused("v2: Stable Diffusion 2.x has no difftune family")
    module = str(args.get("network_module") or "networks.lora")
    kind = MODULES.get(module, "sd")
    if kind is None or kind not in ("sd", "flux"):
        raise ImportRefused(f"network_module {module}: {kind or 'this network'} has no difftune equivalent")
    if any(key in args for key in SD3_KEYS):
        raise ImportRefused("arguments of sd3_train_network.py: Stable Diffusion 3 has no difftune family")
    found = None
    if kind == "flux" or any(key in args for key in FLUX_KEYS):
        found = "flux"
    elif "cache_text_encoder_outputs" in args or "cache_text_encoder_outputs_to_disk" in args:
        found = "sdxl"
    else:
        found = checkpoint_family(str(args.get("pretrained_model_name_or_path", "")))
    if found is None:
        name = Path(str(args.get("pretrained_model_name_or_path", ""))).name
        found = "sdxl" if SDXL_NAMES.search(name) else "sd15" if SD15_NAMES.search(name) else None
    if found and fallback and found != fallback:
        raise ImportRefused(f"--family {fallback}, but the arguments are {found}'s")
    if found or fallback:
        return found or fallback
    raise ImportRefused("cannot tell SD 1.x from SDXL from these arguments: pass --family sd15 or --family sdxl")


def checkpoint_family(model: str) -> str | None:
    """sd15 or sdxl from a local base model: a single file's keys, or a diffusers folder's pipeline class."""
    path = Path(model).expanduser()
    if path.is_dir() and (path / "model_index.json").is_file():
        kind = json.loads((path / "model_index.json").read_text()).get("_class_name", "")
        return "sdxl" if "XL" in kind else "sd15" if "StableDiffusion" in kind else None
    if path.is_file() and path.suffix == ".safetensors":
        from safetensors import safe_open

        with safe_open(str(path), "pt") as handle:
            keys = list(handle.keys())
        if any(k.startswith("conditioner.embedders.1") for k in keys):
            return "sdxl"
        if any(k.startswith("cond_stage_model.transformer") for k in keys):
            return "sd15"
    return None


def folder_subsets(folder: Any, main: dict, is_reg: bool) -> list[tuple[dict, dict]]:
    """kohya's DreamBooth folders without a dataset config: each `<repeats>_<class tokens>` subfolder a subset."""
    root = Path(str(folder)).expanduser()
    found = []
    for child in sorted(root.iterdir()) if root.is_dir() else []:
        repeats, _, tokens = child.name.partition("_")
        if child.is_dir() and repeats.isdigit():
            found.append(({"image_dir": str(child), "num_repeats": int(repeats), "class_tokens": tokens,
                           "is_reg": is_reg}, main))
    return found


#: dataset-config keys the import maps, and where each goes (each subset's row says its value)
DATASET_TARGETS = {"image_dir": "datasets[].folder_path", "num_repeats": "datasets[].num_repeats",
                   "is_reg": "datasets[].is_reg", "class_tokens": "datasets[].default_caption",
                   "caption_extension": "datasets[].caption_ext", "keep_tokens": "datasets[].keep_tokens",
                   "shuffle_caption": "datasets[].shuffle_tokens", "flip_aug": "datasets[].flip_x",
                   "random_crop": "datasets[].random_crop", "cache_latents": "datasets[].cache_latents",
                   "cache_latents_to_disk": "datasets[].cache_latents_to_disk",
                   "caption_dropout_rate": "datasets[].caption_dropout_rate",
                   "caption_tag_dropout_rate": "datasets[].token_dropout_rate", "resolution": "datasets[].resolution",
                   "batch_size": "train.batch_size"}
#: dataset-config keys with no difftune equivalent: dropped (with a check where a subset turns them on)
DATASET_UNSUPPORTED = ("caption_prefix", "caption_suffix", "color_aug", "face_crop_aug_range", "alpha_mask",
                       "conditioning_data_dir", "keep_tokens_separator", "secondary_separator", "enable_wildcard",
                       "token_warmup_min", "token_warmup_step", "caption_dropout_every_n_epochs")
#: kohya's bucket grid (difftune makes its own from the resolution), with kohya's defaults (config_util.py)
BUCKET_KEYS = {"min_bucket_reso": 256, "max_bucket_reso": 1024, "bucket_reso_steps": 64, "bucket_no_upscale": False}
#: other dataset keys whose default means what difftune does
DATASET_DEFAULTS = {"caption_separator": ",", "network_multiplier": 1.0, "validation_split": 0.0}


class KohyaJob(Rules):
    """One configuration's arguments, group by group, into `out`."""

    def __init__(self, source: Source, out: Conversion, family: str, datasets: dict | None, path: Path):
        super().__init__(source, out)
        self.family, self.datasets_file, self.path = family, datasets, path
        self.facts = family_facts(family)
        self.model_keys = set(config_class(family).model_fields)

    def same(self, key: str, target: str, convert=None) -> Any:
        """`key` to `target` (through `convert`) when the file gives it a value (kohya reads null as unset)."""
        value = self.take(key)
        if value is MISSING or value is None:
            return MISSING
        value = convert(value) if convert else value
        self.out.mapped(key, target, value)
        return value

    def convert(self) -> None:
        self.model()
        self.network()
        self.data()
        self.train()
        self.outputs()
        self.rest()

    def model(self) -> None:
        out = self.out
        out.put("model.arch", self.family)
        out.rows.append(Row("(script)", f"-> model.arch = '{self.family}'"))
        self.same("pretrained_model_name_or_path", "model.name_or_path")
        for key in ("v2", "model_type"):
            if self.take(key) is not MISSING:
                out.dropped(key, f"{self.src.values[key]!r}: read with the script above (model.arch)")
        precision = PRECISION.get(str(self.take("mixed_precision", "no")), "fp32")
        out.put("train.dtype", precision)
        out.put("model.dtype", precision)
        note = f"kohya casts the frozen base to it too: {PRECISION_ON_DEVICES[precision]}"
        out.wrote(self.named("mixed_precision"), "train.dtype", note)
        out.wrote(self.named("mixed_precision"), "model.dtype")
        for key in ("full_fp16", "full_bf16"):
            if self.take(key, False):
                out.dropped(key, "difftune keeps the LoRA and its gradients in float32")
        if self.facts.ddpm_noise:
            if self.take("v_parameterization", False):
                out.mapped("v_parameterization", "model.prediction_type", "v_prediction")
            elif self.src.has("v_parameterization"):
                out.mapped("v_parameterization", "model.prediction_type", "epsilon",
                           "false: kohya trains epsilon whatever the base's scheduler says")
            else:
                out.assumed("model.prediction_type", "epsilon", "kohya trains epsilon unless v_parameterization, "
                                                                "whatever the base's scheduler says")
        elif self.take("v_parameterization") is not MISSING:
            out.dropped("v_parameterization", "kohya ignores it for FLUX.1")
        self.same("zero_terminal_snr", "train.zero_terminal_snr", bool)
        vae = self.take("vae")
        if vae not in (MISSING, None):
            if "vae_name_or_path" in self.model_keys:
                out.mapped("vae", "model.vae_name_or_path", vae)
            else:
                out.dropped("vae", "no other VAE for this family in difftune")
                out.check(f"vae {vae!r}: difftune uses the model's own VAE for this family")
        if self.facts.guidance_embedding:
            self.part_files(out)
            if self.take("fp8_base", False) or self.take("fp8_base_unet", False):
                out.mapped("fp8_base", "model.quantize", True)
                out.put("model.qtype", "qfloat8")
                out.check("fp8_base: kohya stores the base in float8_e4m3fn; difftune quantizes it with quanto "
                          "qfloat8")
            self.same("t5xxl_max_token_length", "model.max_sequence_length", int)
        clip_skip = self.take("clip_skip")
        if clip_skip not in (MISSING, None, 1):
            out.dropped("clip_skip", "no difftune equivalent")
            out.check(f"clip_skip {clip_skip}: difftune conditions on the text encoder's last layer")

    def part_files(self, out: Conversion) -> None:
        """FLUX.1's other parts as files (`--ae`, `--clip_l`, `--t5xxl`): difftune takes them as they are."""
        vae = self.take("ae")
        if vae not in (MISSING, None):
            out.mapped("ae", "model.vae_name_or_path", str(vae))
        encoders = [(key, value) for key in ("clip_l", "t5xxl") if (value := self.take(key)) not in (MISSING, None)]
        if encoders:
            out.put("model.text_encoder_path", [str(value) for _, value in encoders])
            for key, _ in encoders:
                out.wrote(key, "model.text_encoder_path")

    def network(self) -> None:
        out = self.out
        module = str(self.take("network_module", "networks.lora"))
        args = self.network_args()
        kind = "lora"
        if module == "lycoris.kohya":
            algo = str(args.pop("algo", "lora")).lower()
            kind = {"lora": "lora", "locon": "lora", "loha": "loha", "lokr": "lokr"}.get(algo)
            if kind is None:
                raise ImportRefused(f"network_args algo={algo}: no difftune equivalent (lora, locon, loha, lokr)")
        if self.src.has("network_module"):
            out.mapped("network_module", "network.type", kind)
        else:
            out.assumed("network.type", kind, "kohya's default network_module, networks.lora")
        rank = self.value_or_default("network_dim", "network.linear", 4, int)
        alpha = self.value_or_default("network_alpha", "network.linear_alpha", 1.0, float)
        if module == "lycoris.kohya" and self.facts.conv_layers:
            args.setdefault("conv_dim", rank)
            args.setdefault("conv_alpha", alpha)
        elif "conv_dim" in args and "conv_alpha" not in args:
            out.assumed("network.conv_alpha", 1.0, "kohya's default conv_alpha")
        for key, target, convert in (("conv_dim", "network.conv", int), ("conv_alpha", "network.conv_alpha", float),
                                     ("rank_dropout", "network.rank_dropout", float),
                                     ("module_dropout", "network.module_dropout", float)):
            if key in args:
                out.mapped(f"network_args {key}", target, convert(args.pop(key)))
        blocks = args.pop("train_blocks", "all")
        if blocks != "all" and module != "networks.lora_flux":
            out.dropped("network_args train_blocks", f"{module} ignores it")
        elif blocks == "single":
            out.mapped("network_args train_blocks", "network.only_if_contains", ["single_transformer_blocks"])
        elif blocks == "double":
            out.mapped("network_args train_blocks", "network.ignore_if_contains", ["single_transformer_blocks"])
        for key, value in args.items():
            if key != key.strip():
                out.dropped(f"network_args {key!r}", "kohya ignores it too (spaces around its name)")
                out.check(f"network_args {key!r}: kohya does not strip spaces, so it ignored this setting; so does "
                          "the import")
                continue
            out.dropped(f"network_args {key}", "no difftune equivalent")
            out.check(f"network_args {key}={value}: no difftune equivalent; dropped")
        dropout = self.take("network_dropout")
        if dropout not in (MISSING, None, 0):
            out.dropped("network_dropout", "kohya drops the LoRA's hidden units")
            out.check(f"network_dropout {dropout}: kohya drops the LoRA's hidden units, difftune's network.dropout "
                      "its inputs; set it yourself if you want it")
        self.same("network_weights", "network.pretrained_lora_path")
        if self.take("network_train_text_encoder_only", False):
            raise ImportRefused("network_train_text_encoder_only: text-encoder-only training has no difftune "
                                "equivalent")
        unet_only = bool(self.take("network_train_unet_only", False))
        text_lr = self.take("text_encoder_lr")
        if isinstance(text_lr, list):
            if len(set(text_lr)) > 1:
                out.check(f"text_encoder_lr {text_lr}: difftune trains both text encoders at one LR, the first")
            text_lr = text_lr[0] if text_lr else MISSING
        trains_text = not unet_only and text_lr != 0
        if trains_text and self.facts.text_encoder_lora:
            out.assumed("network.train_text_encoder", True, "kohya trains the text encoder's LoRA unless "
                                                            "network_train_unet_only")
            if text_lr not in (MISSING, None):
                out.mapped("text_encoder_lr", "train.text_encoder_lr", float(text_lr))
        elif trains_text:
            if text_lr not in (MISSING, None):
                out.dropped("text_encoder_lr", "difftune trains no text-encoder LoRA for this model (see the check)")
            out.check("kohya also trains FLUX.1's CLIP-L LoRA unless network_train_unet_only; difftune trains the "
                      "transformer's only")
        elif unet_only:
            out.rows.append(Row("network_train_unet_only", "-> network.train_text_encoder = False"))
        if not trains_text and text_lr not in (MISSING, None):
            out.dropped("text_encoder_lr", "the text encoder does not train (network_train_unet_only)" if unet_only
                        else "0: kohya then trains no text-encoder LoRA")
        out.check("LoRA coverage: kohya adapts every linear layer of the transformer blocks (FLUX.1: its fused "
                  "layers, modulation included); difftune's default targets are the attention projections (and MLPs "
                  "for some families): set network.target_modules to widen them (docs/networks.md)")

    def network_args(self) -> dict[str, Any]:
        """`network_args = ["conv_dim=4", ...]` as a mapping (values as kohya parses them)."""
        listed = self.take("network_args", []) or []
        parsed = {}
        for item in listed:
            key, _, value = str(item).partition("=")  # kohya splits on "=" and strips nothing
            try:
                parsed[key] = ast.literal_eval(value)
            except (ValueError, SyntaxError):
                parsed[key] = value
        return parsed

    def subsets(self) -> list[tuple[dict, dict]]:
        """Each subset with the keys it inherits: subset, then its dataset, then [general], then the arguments."""
        main = {k: v for k, v in self.src.values.items()}
        if self.datasets_file is None:
            folder = self.take("train_data_dir")
            if folder in (MISSING, None):
                raise ImportRefused("no dataset_config and no train_data_dir: nothing to train on")
            found = folder_subsets(self.folder(folder), main, is_reg=False)
            if not found:
                raise ImportRefused(f"train_data_dir {folder}: no <repeats>_<name> folders found here; give the "
                                    "dataset_config")
            self.out.rows.append(Row("train_data_dir", f"-> datasets[0..{len(found) - 1}]: one per <repeats>_<class "
                                                       "tokens> folder in it"))
            reg = self.take("reg_data_dir")
            regs = folder_subsets(self.folder(reg), main, is_reg=True) if reg not in (MISSING, None) else []
            if reg not in (MISSING, None):
                self.out.rows.append(Row("reg_data_dir", f"-> datasets[{len(found)}..{len(found) + len(regs) - 1}]: "
                                                         "one per folder in it, is_reg true" if regs else
                                         "dropped: no <repeats>_<class tokens> folders in it"))
            return found + regs
        general = self.datasets_file.get("general", {}) or {}
        out = []
        for dataset in self.datasets_file.get("datasets", []) or []:
            inherited = {**main, **general, **{k: v for k, v in dataset.items() if k != "subsets"}}
            for subset in dataset.get("subsets", []) or []:
                out.append((subset, inherited))
        if not out:
            raise ImportRefused("the dataset config has no [[datasets.subsets]]")
        return out

    def folder(self, value: Any) -> Path:
        """A folder the arguments name: as kohya reads it (from the working directory), else beside the file."""
        path = Path(str(value)).expanduser()
        return path if path.is_absolute() or path.is_dir() else self.path.parent / path

    def data(self) -> None:
        out = self.out
        if self.take("dataset_config") not in (MISSING, None):
            out.rows.append(Row("dataset_config", "-> datasets[]: one per subset of that file"))
        subsets = self.subsets()
        out.process["datasets"] = [{} for _ in subsets]
        batch_sizes = set()
        for i, (subset, inherited) in enumerate(subsets):
            def value(key: str, default: Any = None) -> Any:
                return subset.get(key, inherited.get(key, default))

            at = f"datasets[{i}]"
            if "metadata_file" in subset or "metadata_file" in inherited:
                raise ImportRefused(f"subset {subset.get('image_dir')}: captions in metadata_file (json) cannot be "
                                    "imported; difftune reads caption files beside the images")
            out.mapped(f"subset {i} image_dir", f"{at}.folder_path", subset.get("image_dir"))
            out.mapped(f"subset {i} num_repeats", f"{at}.num_repeats", int(value("num_repeats", 1)))
            if value("is_reg", False):
                out.mapped(f"subset {i} is_reg", f"{at}.is_reg", True)
                out.check(f"{at}.is_reg: kohya repeats or cuts regularisation images to the training images' count "
                          "and weights them by prior_loss_weight; difftune mixes them in as they are")
            if value("class_tokens"):
                out.mapped(f"subset {i} class_tokens", f"{at}.default_caption", str(value("class_tokens")),
                           "kohya's caption for images without a caption file")
            ext = str(value("caption_extension", ".caption")).lstrip(".")
            out.mapped(f"subset {i} caption_extension", f"{at}.caption_ext", ext,
                       "" if value("caption_extension") else "kohya's default")
            out.mapped(f"subset {i} keep_tokens", f"{at}.keep_tokens", int(value("keep_tokens", 0)))
            for key, target in (("shuffle_caption", "shuffle_tokens"), ("flip_aug", "flip_x"),
                                ("random_crop", "random_crop"), ("cache_latents", "cache_latents"),
                                ("cache_latents_to_disk", "cache_latents_to_disk")):
                if value(key, False):
                    out.mapped(f"subset {i} {key}", f"{at}.{target}", True)
            for key, target in (("caption_dropout_rate", "caption_dropout_rate"),
                                ("caption_tag_dropout_rate", "token_dropout_rate")):
                if value(key):
                    out.mapped(f"subset {i} {key}", f"{at}.{target}", float(value(key)))
            resolution = value("resolution", 512)
            if isinstance(resolution, str):
                sides = [int(x) for x in resolution.split(",")]
            elif isinstance(resolution, (list, tuple)):
                sides = [int(x) for x in resolution]
            else:
                sides = [int(resolution)]
            width, height = sides[0], sides[-1]
            side = round(math.sqrt(width * height))
            out.mapped(f"subset {i} resolution", f"{at}.resolution", [side])
            if width != height or not value("enable_bucket", False):
                out.check(f"{at}.resolution {width}x{height}: difftune buckets every image by aspect ratio at an "
                          f"area of {side}x{side}" + ("" if value("enable_bucket", False) else
                                                       "; kohya without enable_bucket crops every image to exactly "
                                                       "that size"))
            batch_sizes.add(int(value("batch_size", inherited.get("train_batch_size", 1))))
            if value("enable_bucket", False):
                out.rows.append(Row(f"subset {i} enable_bucket", f"-> {at}.resolution: difftune buckets every image by "
                                                                 "aspect ratio at that area, as kohya's buckets do"))
            for key in DATASET_UNSUPPORTED:
                if value(key):
                    out.dropped(f"subset {i} {key}", "no difftune equivalent")
                    out.check(f"{at}: {key} = {value(key)!r} has no difftune equivalent; dropped")
            if value("cache_latents", False) and (value("color_aug", False) or value("random_crop", False)):
                raise ImportRefused(f"{self.path}: subset {subset.get('image_dir')}: cache_latents with color_aug or "
                                    "random_crop, which kohya refuses too (\"when caching latents, either color_aug or "
                                    "random_crop cannot be used\")")
        if self.datasets_file is not None:
            self.dataset_config_rows()
        size = max(batch_sizes)
        out.put("train.batch_size", size)
        out.rows.append(Row("train_batch_size / batch_size", f"-> train.batch_size = {size}"))
        if len(batch_sizes) > 1:
            out.check(f"batch sizes {sorted(batch_sizes)} per dataset: difftune has one, {size}")
        for key, target in INHERITED.items():
            if self.src.has(key):
                self.take(key)
                out.rows.append(Row(key, f"-> {target} = (every subset's that does not set its own)"))

    def bucket_key(self, source: str, key: str, value: Any) -> None:
        """kohya's bucket grid keys: dropped, with a check where the value is not kohya's default."""
        self.out.dropped(source, "kohya's bucket grid; difftune makes its own from the resolution")
        if value != BUCKET_KEYS[key]:
            self.out.check(f"{source} = {value!r}: difftune's buckets follow the resolution; dropped")

    def dataset_config_rows(self) -> None:
        """A row for every key of every table of the dataset config: where a mapped key went (each subset's own row
        has the value it took), what bucketing became, and what was dropped, with a check where a dropped value is
        not kohya's default."""
        tables = [("general", self.datasets_file.get("general") or {})]
        for d, dataset in enumerate(self.datasets_file.get("datasets") or []):
            tables.append((f"datasets[{d}]", {k: v for k, v in dataset.items() if k != "subsets"}))
            tables += [(f"datasets[{d}].subsets[{i}]", sub) for i, sub in enumerate(dataset.get("subsets") or [])]
        out = self.out
        for where, table in tables:
            for key, value in table.items():
                source = f"dataset config {where}.{key}"
                if key in DATASET_TARGETS and not value and key not in ("image_dir", "keep_tokens"):
                    out.dropped(source, f"{value!r}: off, for each subset that takes it")
                elif key in DATASET_TARGETS:
                    out.rows.append(Row(source, f"-> {DATASET_TARGETS[key]} of each subset that takes it (the 'subset "
                                                f"N {key}' rows)"))
                elif key == "enable_bucket":
                    out.rows.append(Row(source, "-> datasets[].resolution: difftune always buckets by aspect ratio"
                                        if value else "dropped: false; difftune always buckets (see the check)"))
                elif key in BUCKET_KEYS:
                    self.bucket_key(source, key, value)
                elif key in DATASET_UNSUPPORTED:
                    out.dropped(source, "no difftune equivalent" if value else f"{value!r}: off")
                else:
                    out.dropped(source, "no difftune equivalent")
                    if DATASET_DEFAULTS.get(key, object()) != value:
                        out.check(f"{source} = {value!r}: no difftune equivalent; dropped")

    def train(self) -> None:
        out = self.out
        epochs = self.take("max_train_epochs")
        if epochs not in (MISSING, None):
            out.mapped("max_train_epochs", "train.epochs", int(epochs))
            if self.take("max_train_steps") is not MISSING:
                out.dropped("max_train_steps", "max_train_epochs wins over it in kohya")
        else:
            self.value_or_default("max_train_steps", "train.steps", 1600, int)
        self.same("gradient_accumulation_steps", "train.gradient_accumulation", int)
        lr = self.take("unet_lr")
        if lr in (MISSING, None):
            self.value_or_default("learning_rate", "train.lr", 2e-6, float)
        else:
            out.mapped("unet_lr", "train.lr", float(lr), "the denoiser's LR")
            base = float(self.take("learning_rate", 2e-6) or 2e-6)
            text = out.process.get("network", {}).get("train_text_encoder")
            if text and "text_encoder_lr" not in out.process.get("train", {}):
                out.mapped("learning_rate", "train.text_encoder_lr", base, "kohya's text encoders train at "
                                                                           "learning_rate when unet_lr is set")
            elif self.src.has("learning_rate"):
                out.dropped("learning_rate", "unet_lr and text_encoder_lr set both LRs")
        self.optimizer()
        self.schedule()
        self.same("max_grad_norm", "train.max_grad_norm", float)
        seed = self.take("seed")
        if seed in (MISSING, None):
            out.check("seed: kohya draws a random seed when none is given; the job uses difftune's train.seed 42")
        else:
            out.mapped("seed", "train.seed", int(seed))
        self.same("gradient_checkpointing", "train.gradient_checkpointing", bool)
        self.same("noise_offset", "train.noise_offset", float)
        self.same("max_data_loader_n_workers", "train.num_workers", int)
        self.same("persistent_data_loader_workers", "train.persistent_workers", bool)
        cached = [key for key in ("cache_text_encoder_outputs", "cache_text_encoder_outputs_to_disk")
                  if self.take(key, False)]
        for key in cached:
            out.mapped(key, "train.cache_text_embeddings", True)
        if cached and out.get("network.train_text_encoder") is True:
            raise ImportRefused(
                f"{self.path}: {cached[0]} with the text encoder's LoRA trained (no network_train_unet_only): "
                "kohya refuses this combination too (\"network for Text Encoder cannot be trained with caching Text "
                "Encoder outputs\"); set network_train_unet_only = true, or remove "
                f"{' and '.join(cached)}, and import again")
        self.objective()

    def optimizer(self) -> None:
        out = self.out
        name = str(self.take("optimizer_type", "AdamW") or "AdamW")
        if self.src.has("use_8bit_adam"):
            out.rows.append(Row("use_8bit_adam", "-> train.optimizer (kohya's old spelling of AdamW8bit)"))
        if self.take("use_8bit_adam", False):
            name = "AdamW8bit"
        if self.take("use_lion_optimizer", False):
            name = "Lion"
        key = name.split(".")[-1].lower()
        if key not in OPTIMIZERS:
            raise ImportRefused(f"optimizer_type {name}: no difftune equivalent ({', '.join(sorted(OPTIMIZERS))})")
        out.mapped("optimizer_type", "train.optimizer", OPTIMIZERS[key])
        if key == "pagedadamw8bit":
            out.check("optimizer_type PagedAdamW8bit: imported as adamw8bit (not paged)")
        params = {}
        for item in self.take("optimizer_args", []) or []:
            k, _, v = str(item).partition("=")
            params[k.strip()] = ast.literal_eval(v.strip())
        if params:
            out.put("train.optimizer_params", params)
            out.rows.append(Row("optimizer_args", f"-> train.optimizer_params = {params}"))
        if key == "adafactor":
            out.check("optimizer_type AdaFactor: difftune bounds the LR relative-step Adafactor picks "
                      "(optimizer_params max_lr, default 1e-4); kohya does not")

    def schedule(self) -> None:
        out = self.out
        name = str(self.take("lr_scheduler", "constant") or "constant")
        if name == "adafactor":
            name = "constant"
        if name not in SCHEDULES:
            raise ImportRefused(f"lr_scheduler {name}: no difftune equivalent ({', '.join(SCHEDULES)})")
        out.mapped("lr_scheduler", "train.lr_scheduler", name)
        warmup = self.take("lr_warmup_steps", 0)
        if warmup:
            if isinstance(warmup, float) and warmup < 1:
                out.mapped("lr_warmup_steps", "train.lr_warmup_ratio", float(warmup))
            else:
                out.mapped("lr_warmup_steps", "train.lr_warmup_steps", int(warmup))
        params = {}
        if self.src.has("lr_scheduler_num_cycles"):
            params["num_cycles"] = int(self.take("lr_scheduler_num_cycles"))
        if self.src.has("lr_scheduler_power"):
            params["power"] = float(self.take("lr_scheduler_power"))
        if name == "polynomial":
            params["lr_end"] = 1e-7
        if params:
            out.put("train.lr_scheduler_params", params)
        for key, field in (("lr_scheduler_num_cycles", "num_cycles"), ("lr_scheduler_power", "power")):
            if field in params and self.src.has(key):
                out.rows.append(Row(key, f"-> train.lr_scheduler_params.{field} = {params[field]}"))

    def objective(self) -> None:
        out = self.out
        low, high = self.take("min_timestep", 0) or 0, self.take("max_timestep", 1000) or 1000
        if (low, high) != (0, 1000) and self.facts.ddpm_noise:
            for key in ("min_timestep", "max_timestep"):
                if self.src.has(key):
                    out.mapped(key, "train.timestep_range", [int(low) / 1000, int(high) / 1000])
        else:
            for key in ("min_timestep", "max_timestep"):
                if self.src.has(key):
                    out.dropped(key, "the whole range" if self.facts.ddpm_noise else "kohya ignores it for FLUX.1")
        gamma = self.take("min_snr_gamma")
        if gamma not in (MISSING, None):
            if self.facts.ddpm_noise:
                out.mapped("min_snr_gamma", "train.min_snr_gamma", float(gamma))
            else:
                out.dropped("min_snr_gamma", "kohya ignores it for FLUX.1")
        loss = str(self.take("loss_type", "l2") or "l2")
        if loss in ("l2", "l1"):
            out.put("train.loss_type", "mse" if loss == "l2" else "mae")
            out.rows.append(Row("loss_type", f"-> train.loss_type = '{'mse' if loss == 'l2' else 'mae'}'"))
        elif loss == "huber":
            c = float(self.take("huber_c", 0.1) or 0.1) * float(self.take("huber_scale", 1.0) or 1.0)
            for key in ("huber_c", "huber_scale"):
                if self.src.has(key):
                    out.rows.append(Row(key, f"-> train.huber_c = {c}"))
            out.put("train.loss_type", "pseudo_huber")
            out.put("train.huber_c", c)
            out.rows.append(Row("loss_type", f"-> train.loss_type = 'pseudo_huber', huber_c = {c}"))
            if self.take("huber_schedule", "snr") != "constant":
                out.check("loss_type huber: kohya varies c with the timestep (huber_schedule); difftune keeps it")
        else:
            raise ImportRefused(f"loss_type {loss}: no difftune equivalent")
        if self.facts.guidance_embedding:
            self.value_or_default("guidance_scale", "train.guidance_scale", 3.5, float)
            self.out.assumed("train.bypass_guidance_embedding", False, "kohya feeds the guidance embedding whatever "
                                                                       "the base; difftune bypasses it for Flex.1")
            self.flux_timesteps()

    def flux_timesteps(self) -> None:
        out = self.out
        sampling = str(self.take("timestep_sampling", "sigma") or "sigma")
        shift = float(self.take("discrete_flow_shift", 3.0) or 3.0)
        scheme = str(self.take("weighting_scheme", "uniform") or "uniform")
        scale = float(self.take("sigmoid_scale", 1.0) or 1.0)
        prediction = str(self.src.values.get("model_prediction_type") or "sigma_scaled")
        # which of these keys kohya reads for this timestep_sampling (library/flux_train_utils.py); weighting_scheme
        # also weights the loss under model_prediction_type sigma_scaled, whatever the sampling
        reads = {"sigmoid_scale": sampling in ("sigmoid", "shift", "flux_shift"),
                 "discrete_flow_shift": sampling in ("shift", "sigma"), "weighting_scheme": sampling == "sigma"}
        for key, read in reads.items():
            if not self.src.has(key):
                continue
            if read:
                out.rows.append(Row(key, "-> train.timestep_type / timestep_params (with timestep_sampling)"))
            elif key == "weighting_scheme" and prediction == "sigma_scaled" and scheme in ("sigma_sqrt", "cosmap"):
                out.dropped(key, "kohya weights the loss by it under model_prediction_type sigma_scaled (see the "
                                 "check)")
            else:
                out.dropped(key, f"kohya ignores it with timestep_sampling {sampling}")
        if prediction == "sigma_scaled" and scheme in ("sigma_sqrt", "cosmap"):  # the others weigh 1
            out.check(f"weighting_scheme {scheme}: kohya weights the loss by it (model_prediction_type sigma_scaled); "
                      "difftune does not")
        if sampling == "uniform":
            out.mapped("timestep_sampling", "train.timestep_type", "uniform")
        elif sampling == "sigmoid":
            out.mapped("timestep_sampling", "train.timestep_type", "sigmoid")
            out.put("train.timestep_params", {"std": scale})
        elif sampling in ("shift", "flux_shift"):
            # kohya: s = sigmoid(sigmoid_scale * randn), then shifted: by discrete_flow_shift (shift), or by
            # exp(mu) with mu from the latent size and FLUX.1's 0.5 / 1.15 line (flux_shift: difftune's dynamic
            # shift, from the scheduler's own base/max shift)
            params = {"shift_base": "sigmoid", "std": scale}
            params.update({"dynamic_shift": True} if sampling == "flux_shift" else {"shift": shift})
            out.put("train.timestep_params", params)
            out.mapped("timestep_sampling", "train.timestep_type", "shift",
                       "from the image size, as kohya's flux_shift: 1.88 at 512 px, 3.16 at 1024"
                       if sampling == "flux_shift" else f"shift {shift}")
            out.wrote("timestep_sampling", "train.timestep_params", "the sigmoid draws kohya shifts")
            if sampling == "flux_shift":
                out.check("timestep_sampling flux_shift: difftune takes the shift's line from the base's scheduler "
                          "(FLUX.1 [dev]'s is kohya's 0.5 at 256 tokens to 1.15 at 4096); a [schnell] base has none "
                          "and the run refuses dynamic_shift: give timestep_params.shift there")
        elif sampling == "sigma" and scheme in ("uniform", "none"):
            if self.src.has("timestep_sampling"):
                out.mapped("timestep_sampling", "train.timestep_type", "shift", f"shift {shift}")
            else:
                out.assumed("train.timestep_type", "shift", f"kohya's default timestep_sampling sigma: shift {shift}")
            out.put("train.timestep_params", {"shift": shift})
        else:
            out.mapped("timestep_sampling", "train.timestep_type", "shift")
            out.put("train.timestep_params", {"shift": shift})
            out.check(f"timestep_sampling {sampling} (weighting {scheme}): kohya draws sigmoid-then-shift or weighted "
                      "timesteps; imported as the nearest, shift")
        prediction = str(self.take("model_prediction_type", "sigma_scaled") or "sigma_scaled")
        if self.src.has("model_prediction_type"):
            out.rows.append(Row("model_prediction_type", "-> (difftune trains raw velocity)" if prediction == "raw"
                                else "dropped: another objective, see the check"))
        if prediction != "raw":
            out.check(f"model_prediction_type {prediction}: a different training objective from difftune's (kohya's "
                      "'raw'); its docs recommend raw")

    def outputs(self) -> None:
        out = self.out
        self.same("output_dir", "training_folder")
        if self.take("output_name") is not MISSING:
            out.rows.append(Row("output_name", f"-> config.name = {out.job['config']['name']!r}"))
        dtype = str(self.take("save_precision", "float") or "float")
        out.put("save.dtype", SAVE_DTYPES.get(dtype, "float32"))
        out.rows.append(Row(self.named("save_precision"), f"-> save.dtype = {SAVE_DTYPES.get(dtype, 'float32')!r}"))
        every = self.take("save_every_n_steps")
        out.put("save.save_every", int(every) if every not in (MISSING, None) else 0)
        out.rows.append(Row(self.named("save_every_n_steps"),
                            f"-> save.save_every = {out.process['save']['save_every']}"))
        last = self.take("save_last_n_steps")
        keep = int(last) // int(every) + 1 if last not in (MISSING, None) and every not in (MISSING, None) else 100
        out.put("save.max_step_saves_to_keep", keep)
        out.rows.append(Row(self.named("save_last_n_steps"), f"-> save.max_step_saves_to_keep = {keep}"))
        for key in ("save_every_n_epochs", "sample_every_n_epochs"):
            if self.take(key) not in (MISSING, None):
                out.dropped(key, "difftune counts updates")
                out.check(f"{key}: give the period in updates (save.save_every / sample.sample_every)")
        self.samples()
        if str(self.take("log_with", "")) in ("tensorboard", "all"):
            out.mapped("log_with", "logging.tensorboard", True)

    def samples(self) -> None:
        out = self.out
        prompts_file = self.take("sample_prompts")
        if prompts_file in (MISSING, None):
            for key in ("sample_every_n_steps", "sample_at_first"):
                if self.take(key) is not MISSING:
                    out.dropped(key, "no sample_prompts: nothing to render")
            return
        path = Path(str(prompts_file)).expanduser()
        if not path.is_absolute() and not path.is_file():
            path = self.path.parent / path
        if not path.is_file() or path.suffix != ".txt":
            out.dropped("sample_prompts", "not a readable .txt prompts file")
            out.check(f"sample_prompts {prompts_file}: write the prompts into sample.prompts")
            return
        lines = [line.strip() for line in path.read_text(encoding="utf-8").splitlines()
                 if line.strip() and not line.strip().startswith("#")]
        prompts, options = [], {}
        for line in lines:
            text, *flags = re.split(r"\s+--", line)
            prompts.append(text.strip())
            for flag in flags:
                key, _, value = flag.partition(" ")
                options.setdefault(key, value.strip())
        out.mapped("sample_prompts", "sample.prompts", prompts)
        # FLUX.1: --g is the guidance embedding's value (difftune's sample.guidance_scale), --l a CFG scale
        guidance = "g" if self.facts.guidance_embedding else "l"
        known = {"w": ("width", int), "h": ("height", int), "d": ("seed", int), "s": ("sample_steps", int),
                 guidance: ("guidance_scale", float), "n": ("neg", str)}
        for flag, (target, convert) in known.items():
            if flag in options and (flag != "n" or self.facts.negative_prompt):
                out.put(f"sample.{target}", convert(options[flag]))
        if options:
            unused = sorted(set(options) - set(known))
            out.check("sample prompts' --options: the first value of each is used for every prompt"
                      + (f"; not imported: {', '.join('--' + f for f in unused)}" if unused else ""))
        every = self.take("sample_every_n_steps")
        if every not in (MISSING, None):
            out.mapped("sample_every_n_steps", "sample.sample_every", int(every))
        if self.take("sample_at_first", False):
            out.mapped("sample_at_first", "sample.sample_at_start", True)

    def rest(self) -> None:
        self.read_without_rows()
        for key in self.src.unread():
            value = self.src.values[key]
            if key in QUIET:
                self.out.dropped(key, "speed, memory, logging or files only")
            elif key in BUCKET_KEYS:
                self.bucket_key(key, key, value)
            else:
                self.out.dropped(key, "no difftune equivalent")
                if value not in (None, False, 0, "", [], {}):
                    self.out.check(f"{key} = {value!r}: no difftune equivalent; dropped")
