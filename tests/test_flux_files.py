"""FLUX.1 (and Kontext) from the files a ComfyUI installation keeps: the transformer in BFL's layout (with or without
`model.diffusion_model.`), clip_l, t5xxl and ae.safetensors, stored in float32, bf16, fp8 and both scaled-fp8
layouts, tokenizers from the installation's source tree; nothing from a diffusers folder or the network. Variants
are told from names and shapes of the full-size layouts built on the meta device."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
import torch
from comfy_files import dequantized_state, flux_original_layout, write_flux_comfy
from diffusers import AutoencoderKL, FluxTransformer2DModel
from helpers import run_job, trainer_process, two_bucket_data
from transformers import CLIPTextConfig, CLIPTextModel, T5Config, T5EncoderModel

from toolkit.errors import UserError
from toolkit.models.flux.adapter import FluxAdapter
from toolkit.models.flux.files import flux_files
from toolkit.models.flux.layout import to_diffusers
from toolkit.models.flux_kontext.files import kontext_files
from toolkit.models.part_kinds import VARIANTS as SHARED_VARIANTS
from toolkit.models.registry import get_adapter_class, model_config
from toolkit.models.single_files import FileHeader, TensorInfo, UnknownFile
from toolkit.models.stored_weights import FP8_DTYPES
from toolkit.run.metrics import read_metrics

CPU = torch.device("cpu")
PROMPTS = ["a red circle on a blue background", ""]
FLUX_VARIANTS = json.loads((Path(__file__).parents[1] / "toolkit/models/flux/variants.json").read_text())
KONTEXT_VARIANTS = json.loads((Path(__file__).parents[1] / "toolkit/models/flux_kontext/variants.json").read_text())
DTYPES = [pytest.param(torch.float32, id="float32"), pytest.param(torch.bfloat16, id="bf16")]


def meta_state(build) -> dict[str, torch.Tensor]:
    """A model's state dict on the meta device (full-size layouts without their weights)."""
    from accelerate import init_empty_weights

    with init_empty_weights():
        model = build()
    return dict(model.state_dict())


def header_of(state: dict[str, torch.Tensor], prefix: str = "", name: str = "model.safetensors") -> FileHeader:
    return FileHeader(Path(name), {prefix + k: TensorInfo("BF16", tuple(v.shape)) for k, v in state.items()})


def full_transformer(config: dict) -> dict[str, torch.Tensor]:
    return meta_state(lambda: FluxTransformer2DModel.from_config(config))


# ---- the layout converter, against diffusers' own on the full-size layout -------------------------------------------


def test_the_converter_moves_every_row_where_diffusers_moves_it_on_the_full_size_layout():
    """Each tensor of a full-size FLUX.1 [dev] file in BFL's layout stands as a column of (tensor, row) codes;
    diffusers' converter (written for the full-size widths) and difftune's (widths read from the tensors) must put
    every row of every tensor in the same place."""
    from diffusers.loaders.single_file_utils import convert_flux_transformer_checkpoint_to_diffusers

    original = flux_original_layout(full_transformer(FLUX_VARIANTS["flux1-dev"]["configs"]["transformer"]))
    codes = {name: torch.arange(t.shape[0], dtype=torch.int64) + (index << 32)
             for index, (name, t) in enumerate(sorted(original.items()))}
    theirs = convert_flux_transformer_checkpoint_to_diffusers(dict(codes))
    ours = to_diffusers(dict(codes))
    assert sorted(ours) == sorted(theirs)
    for name in theirs:
        assert torch.equal(ours[name], theirs[name]), name


def test_the_converter_names_tensors_of_no_flux_module():
    original = flux_original_layout(full_transformer(FLUX_VARIANTS["flux1-schnell"]["configs"]["transformer"]))
    original["lora_unet_stray.weight"] = torch.empty(1, device="meta")
    with pytest.raises(KeyError, match="lora_unet_stray.weight"):
        to_diffusers(original)


# ---- variants from names and shapes ----------------------------------------------------------------------------------


@pytest.mark.parametrize("name", sorted(FLUX_VARIANTS))
@pytest.mark.parametrize("layout", ["bfl", "comfy_checkpoint", "diffusers"])
def test_every_published_flux_variant_is_told_from_its_names_and_shapes(name, layout):
    state = full_transformer(FLUX_VARIANTS[name]["configs"]["transformer"])
    header = {"bfl": lambda: header_of(flux_original_layout(state)),
              "comfy_checkpoint": lambda: header_of(flux_original_layout(state), "model.diffusion_model."),
              "diffusers": lambda: header_of(state)}[layout]()
    part, variant = flux_files().denoiser.variant(header)
    assert variant.name == name
    assert part.prefix == ("model.diffusion_model." if layout == "comfy_checkpoint" else "")


def test_kontext_is_its_own_familys_variant():
    state = full_transformer(KONTEXT_VARIANTS["flux1-kontext-dev"]["configs"]["transformer"])
    _, variant = kontext_files().denoiser.variant(header_of(flux_original_layout(state)))
    assert variant.name == "flux1-kontext-dev"


def test_a_transformer_of_no_known_variant_is_named_with_what_was_read():
    config = {**FLUX_VARIANTS["flux1-dev"]["configs"]["transformer"], "num_layers": 12}
    header = header_of(flux_original_layout(full_transformer(config)), name="/models/odd.safetensors")
    with pytest.raises(UnknownFile, match=r"odd\.safetensors: a FLUX.1 transformer of no known variant \(read: double "
                                          r"blocks 12, single blocks 38, width 3072.*single_file_config"):
        flux_files().denoiser.variant(header)


def test_a_file_of_another_part_is_not_taken_for_a_transformer():
    state = meta_state(lambda: T5EncoderModel(T5Config(**published_config("text_encoders.json", "t5-xxl"))))
    with pytest.raises(UnknownFile, match="not a FLUX.1 transformer file"):
        flux_files().denoiser.variant(header_of(state))


def published_config(file: str, name: str) -> dict:
    entry = json.loads((SHARED_VARIANTS / file).read_text())[name]
    return next(iter(entry["configs"].values()))


def test_the_full_size_text_encoders_and_vae_are_told_apart():
    kinds = flux_files().kinds()
    clip = meta_state(lambda: CLIPTextModel(CLIPTextConfig(**published_config("text_encoders.json", "clip-l"))))
    t5 = meta_state(lambda: T5EncoderModel(T5Config(**published_config("text_encoders.json", "t5-xxl"))))
    vae = meta_state(lambda: AutoencoderKL.from_config(published_config("vaes.json", "flux-vae")))
    assert kinds["clip_l"].variant(header_of(clip, "text_model."))[1].name == "clip-l"
    assert kinds["clip_l"].variant(header_of(clip, "text_encoders.clip_l.transformer.text_model."))[1].name == "clip-l"
    assert kinds["t5xxl"].variant(header_of(t5))[1].name == "t5-xxl"
    assert kinds["vae"].variant(header_of(vae))[1].name == "flux-vae"  # diffusers' names
    assert kinds["clip_l"].facts(header_of(t5))[1] is None and kinds["t5xxl"].facts(header_of(clip))[1] is None


# ---- the tiny model from ComfyUI's files ----------------------------------------------------------------------------


@pytest.fixture(scope="module")
def reference(tiny_cache):
    """The tiny [dev] preset from its diffusers folder, by dtype."""
    loaded = {}

    def get(dtype: torch.dtype) -> FluxAdapter:
        if dtype not in loaded:
            loaded[dtype] = FluxAdapter.load(model_config(arch="flux", name_or_path="tiny"), CPU, dtype)
        return loaded[dtype]

    return get


@pytest.fixture(scope="module")
def comfy_install(reference, tmp_path_factory):
    """ComfyUI installations of the tiny preset, one per storage (written once)."""
    made = {}

    def get(storage: str) -> dict[str, Path]:
        if storage not in made:
            root = tmp_path_factory.mktemp(f"ComfyUI_{storage}")
            prefix = "model.diffusion_model." if storage == "fp8" else ""
            made[storage] = write_flux_comfy(reference(torch.float32), root, storage, prefix)
        return made[storage]

    return get


def files_config(paths: dict[str, Path], arch: str = "flux", **extra):
    return model_config(arch=arch, name_or_path=str(paths["transformer"]), vae_name_or_path=str(paths["vae"]),
                        text_encoder_path=[str(paths["t5xxl"]), str(paths["clip_l"])], **extra)


def predictions(adapter: FluxAdapter) -> tuple[torch.Tensor, torch.Tensor]:
    generator = torch.Generator().manual_seed(0)
    noisy = torch.randn(2, 16, 4, 4, generator=generator)
    embeds = adapter.encode_prompts(PROMPTS)
    with torch.no_grad():
        return embeds.embeds.float(), adapter.predict(noisy, torch.tensor([300.0, 700.0]), embeds).float()


@pytest.mark.parametrize("dtype", DTYPES)
def test_the_files_of_the_same_weights_give_the_same_model_as_the_folder(reference, comfy_install, dtype):
    """float32 files: every part (BFL layout, ComfyUI's clip_l and t5xxl, the original VAE names) is the folder's
    model: the same embeddings, prediction and latents, bit for bit, in float32 and in bf16."""
    paths = comfy_install("float32")
    ours = FluxAdapter.load(files_config(paths), CPU, dtype)
    theirs = reference(dtype)
    for a, b in zip(predictions(ours), predictions(theirs)):
        assert torch.equal(a, b)
    pixels = torch.rand(1, 3, 32, 32, generator=torch.Generator().manual_seed(1)) * 2 - 1
    assert torch.equal(ours.encode_latent_dist(pixels).mean, theirs.encode_latent_dist(pixels).mean)
    assert ours.parts_from["tokenizer"].endswith("sd1_tokenizer (ComfyUI)")
    assert ours.parts_from["tokenizer_2"].endswith("t5_tokenizer (ComfyUI)")
    assert "tiny FLUX.1 preset" in ours.parts_from["transformer"]


def dequantized_reference(paths: dict[str, Path], reference: FluxAdapter, dtype: torch.dtype,
                          prefix: str) -> FluxAdapter:
    """The folder's adapter with the fp8 files' weights as ComfyUI computes with them: stored values times their
    scales, in the compute dtype (the definition fp8 files are held to)."""
    adapter = FluxAdapter.load(model_config(arch="flux", name_or_path="tiny"), CPU, dtype)
    transformer = to_diffusers(dequantized_state(paths["transformer"], prefix, dtype))
    t5 = dequantized_state(paths["t5xxl"], dtype=dtype)
    t5["encoder.embed_tokens.weight"] = t5["shared.weight"]
    for module, state in ((adapter.transformer, transformer), (adapter.text_encoder_2, t5)):
        missing, unexpected = module.load_state_dict(state, strict=False)
        assert not unexpected and not missing
    return adapter


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("storage", ["fp8", "scaled_fp8", "comfy_quant"])
def test_fp8_files_compute_with_their_stored_weights_dequantized(reference, comfy_install, storage, dtype):
    """An fp8 file (plain, ComfyUI's older scaled layout, its newer one) loads with its Linear weights still in fp8 and
    computes what the same network with the stored weights dequantized (times their scales) computes; against the
    full-precision folder it differs by fp8's rounding only."""
    paths = comfy_install(storage)
    ours = FluxAdapter.load(files_config(paths), CPU, dtype)
    stored = [m for m in ours.transformer.modules() if hasattr(m, "weight") and hasattr(m.weight, "_data")]
    assert stored and all(m.weight._data.dtype in FP8_DTYPES for m in stored)
    assert any(hasattr(m.weight, "_data") for m in ours.text_encoder_2.modules() if hasattr(m, "weight"))
    prefix = "model.diffusion_model." if storage == "fp8" else ""
    exact = dequantized_reference(paths, reference(dtype), dtype, prefix)
    tolerance = {torch.float32: 1e-5, torch.bfloat16: 2e-2}[dtype]
    for a, b in zip(predictions(ours), predictions(exact)):
        torch.testing.assert_close(a, b, atol=tolerance, rtol=tolerance)
    _, full = predictions(reference(dtype))
    _, mine = predictions(ours)
    assert (mine - full).abs().mean() < 0.1 * full.abs().mean()  # fp8's 3 mantissa bits, through the network


@pytest.mark.parametrize("dtype", DTYPES)
def test_a_gguf_transformer_computes_with_its_quantized_weights_dequantized(reference, comfy_install, dtype):
    """A GGUF transformer (Q8_0 blocks, BFL names, as ComfyUI-GGUF writes FLUX.1) keeps its Linear weights quantized
    and computes what the network with them dequantized computes."""
    from comfy_files import gguf_dequantized
    from diffusers.quantizers.gguf.utils import GGUFLinear

    paths = comfy_install("gguf")
    assert paths["transformer"].suffix == ".gguf"
    ours = FluxAdapter.load(files_config(paths), CPU, dtype)
    assert isinstance(ours.transformer.get_submodule("transformer_blocks.0.attn.to_q"), GGUFLinear)
    assert ours.parts_from["transformer"].endswith("(tiny FLUX.1 preset (tiny), gguf Q8_0)")
    exact = FluxAdapter.load(model_config(arch="flux", name_or_path="tiny"), CPU, dtype)
    exact.transformer.load_state_dict(to_diffusers(gguf_dequantized(paths["transformer"], dtype)))
    tolerance = {torch.float32: 1e-5, torch.bfloat16: 2e-2}[dtype]
    for a, b in zip(predictions(ours), predictions(exact)):
        torch.testing.assert_close(a, b, atol=tolerance, rtol=tolerance)


def qtypes(module: torch.nn.Module) -> set[str]:
    return {m.weight.qtype.name for m in module.modules() if hasattr(getattr(m, "weight", None), "qtype")}


def test_quantizing_an_fp8_file_keeps_its_stored_layers_and_quantizes_the_rest(comfy_install):
    paths = comfy_install("scaled_fp8")
    adapter = FluxAdapter.load(files_config(paths, quantize=True, qtype="qint8", quantize_te=True, qtype_te="qint8"),
                               CPU, torch.float32)
    # every block linear was stored fp8; the excluded layers stay full precision
    assert qtypes(adapter.transformer) == {"qfloat8_e4m3fn"}
    assert adapter.transformer.x_embedder.weight.dtype == torch.float32
    assert qtypes(adapter.text_encoder_2) == {"qfloat8_e4m3fn"}


def test_a_folder_base_takes_its_text_encoders_and_vae_from_files(reference, comfy_install, tiny_cache):
    """Parts named as files replace the folder's (an fp8 T5 beside a full-precision base, to save memory)."""
    from toolkit.models.flux.tiny import ensure_tiny_flux

    paths = comfy_install("fp8")
    cfg = model_config(arch="flux", name_or_path=str(ensure_tiny_flux()), vae_name_or_path=str(paths["vae"]),
                       text_encoder_path=[str(paths["clip_l"]), str(paths["t5xxl"])])
    mixed = FluxAdapter.load(cfg, CPU, torch.float32)
    assert qtypes(mixed.text_encoder_2) == {"qfloat8_e4m3fn"} and not qtypes(mixed.transformer)
    assert mixed.parts_from["vae"].startswith(str(paths["vae"]))
    assert mixed.parts_from["tokenizer"].endswith("(the base)")
    embeds, _ = predictions(mixed)
    assert not torch.equal(embeds, predictions(reference(torch.float32))[0])  # the fp8 T5's


def test_kontext_loads_from_comfyuis_files(comfy_install, tiny_cache):
    """FLUX.1 Kontext's files are FLUX.1's layout; `arch: flux_kontext` reads them as Kontext's variants."""
    from toolkit.models.flux_kontext.tiny import ensure_tiny_flux_kontext

    kontext = get_adapter_class("flux_kontext")
    folder = kontext.load(model_config(arch="flux_kontext", name_or_path="tiny"), CPU, torch.float32)
    root = Path(ensure_tiny_flux_kontext()).parent / "ComfyUI_kontext"
    paths = write_flux_comfy(folder, root, "float32")
    files = kontext.load(files_config(paths, arch="flux_kontext"), CPU, torch.float32)
    for a, b in zip(predictions(files), predictions(folder)):
        assert torch.equal(a, b)
    assert "tiny FLUX.1 preset" in files.parts_from["transformer"]


# ---- tokenizers and files given wrong ------------------------------------------------------------------------------


def test_model_tokenizer_names_where_tokenizers_come_from(reference, comfy_install, tmp_path, tiny_cache):
    """Files outside a ComfyUI installation take their tokenizers from `model.tokenizer`: an installation, or a
    pipeline folder; without either, the message says what to set."""
    import shutil

    paths = comfy_install("float32")
    loose = tmp_path / "loose"
    loose.mkdir()
    moved = {part: Path(shutil.copy(path, loose / path.name)) for part, path in paths.items()}
    comfy_root = paths["transformer"].parents[2]
    by_install = FluxAdapter.load(files_config(moved, tokenizer=str(comfy_root)), CPU, torch.float32)
    assert by_install.parts_from["tokenizer"] == f"{comfy_root / 'comfy/sd1_tokenizer'} (model.tokenizer)"
    from toolkit.models.flux.tiny import ensure_tiny_flux

    by_folder = FluxAdapter.load(files_config(moved, tokenizer=str(ensure_tiny_flux())), CPU, torch.float32)
    assert by_folder.parts_from["tokenizer_2"].endswith("(model.tokenizer)")
    for a, b in zip(predictions(by_install), predictions(by_folder)):
        assert torch.equal(a, b)
    with pytest.raises(UserError, match="No weight file holds a tokenizer: set model.tokenizer"):
        FluxAdapter.load(files_config(moved), CPU, torch.float32)  # the default repo, not in the offline cache


def test_a_cut_short_file_is_named(comfy_install, tmp_path):
    """A download that stopped: the header reads (the variant is known), the weights do not."""
    paths = dict(comfy_install("float32"))
    data = paths["transformer"].read_bytes()
    paths["transformer"] = tmp_path / "flux1-dev.safetensors"
    paths["transformer"].write_bytes(data[: len(data) // 2])
    with pytest.raises(UserError, match=r"flux1-dev.safetensors: the weights cannot be read"):
        FluxAdapter.load(files_config(paths), CPU, torch.float32)


def test_text_encoder_files_are_told_apart_and_wrong_sets_are_named(comfy_install):
    paths = comfy_install("float32")
    cfg = lambda *files: model_config(arch="flux", name_or_path=str(paths["transformer"]),  # noqa: E731
                                      vae_name_or_path=str(paths["vae"]), text_encoder_path=[str(f) for f in files])
    with pytest.raises(UserError, match=r"both a CLIP-L text encoder; give one of each"):
        FluxAdapter.load(cfg(paths["clip_l"], paths["clip_l"]), CPU, torch.float32)
    with pytest.raises(UserError, match=r"no T5-XXL text encoder among .*clip_l.safetensors"):
        FluxAdapter.load(cfg(paths["clip_l"]), CPU, torch.float32)
    with pytest.raises(UserError, match=r"ae.safetensors is not a CLIP-L text encoder or T5-XXL text encoder file"):
        FluxAdapter.load(cfg(paths["clip_l"], paths["vae"]), CPU, torch.float32)


# ---- training on the stored base ---------------------------------------------------------------------------------


def files_process(tmp_path: Path, paths: dict[str, Path], dtype: str, steps: int = 6) -> dict:
    model = {"arch": "flux", "name_or_path": str(paths["transformer"]), "vae_name_or_path": str(paths["vae"]),
             "text_encoder_path": [str(paths["clip_l"]), str(paths["t5xxl"])], "dtype": dtype}
    return trainer_process(tmp_path, model=model, network={"linear": 4, "linear_alpha": 8},
                           datasets=[{"folder_path": str(two_bucket_data(tmp_path / "data", lambda i: f"blob {i}")),
                                      "resolution": [64]}],
                           train={"batch_size": 2, "steps": steps, "lr": 3e-3, "dtype": dtype, "seed": 42},
                           sample={"prompts": ["shp, a blob"], "width": 64, "height": 64, "sample_steps": 2,
                                   "sample_every": steps})


@pytest.mark.slow
def test_a_lora_trained_on_a_scaled_fp8_file_applies_as_comfyui_applies_it(comfy_install, reference, tmp_path,
                                                                             registry):
    """A job on ComfyUI's scaled-fp8 files trains its LoRA on the stored weights (still fp8 after training); the saved
    LoRA, unmerged on top of the stored weights dequantized (how ComfyUI samples with it), predicts what the trained
    model predicts, and it loads in diffusers' FluxPipeline."""
    from diffusers import FluxPipeline

    paths = comfy_install("scaled_fp8")
    trainer, run_dir = run_job(tmp_path, registry, "fp8", files_process(tmp_path, paths, "fp32"))
    trained = trainer.adapter
    stored = trained.transformer.get_submodule("transformer_blocks.0.attn.to_q").base_layer
    assert stored.weight._data.dtype == torch.float8_e4m3fn
    exact = dequantized_reference(paths, reference(torch.float32), torch.float32, "")
    exact.sampling.pipeline().load_lora_weights(str(run_dir), weight_name="fp8.safetensors")
    trained.transformer.eval()
    for a, b in zip(predictions(trained), predictions(exact)):
        torch.testing.assert_close(a, b, atol=1e-4, rtol=1e-4)
    _, plain = predictions(dequantized_reference(paths, reference(torch.float32), torch.float32, ""))
    assert (predictions(exact)[1] - plain).abs().max() > 1e-3  # the LoRA changed something
    pipe = FluxPipeline.from_pretrained(reference(torch.float32).source)
    pipe.load_lora_weights(str(run_dir), weight_name="fp8.safetensors")
    assert (run_dir / "samples" / "step_000000006_0.png").is_file()


@pytest.mark.slow
@pytest.mark.parametrize("storage", ["comfy_quant", "gguf"])
def test_a_bf16_run_on_stored_weights_trains_and_samples(comfy_install, tmp_path, registry, storage):
    """bf16, as GPU users train: ComfyUI's newer scaled-fp8 files, and a GGUF transformer."""
    paths = comfy_install(storage)
    trainer, run_dir = run_job(tmp_path, registry, "bf16", files_process(tmp_path, paths, "bf16"))
    records = read_metrics(run_dir / "metrics.jsonl")
    assert len(records) == 6 and all(np.isfinite(r["loss"]) for r in records)
    lora = trainer.adapter.transformer.get_submodule("single_transformer_blocks.0.attn.to_q")
    assert lora.lora_A["default"].weight.dtype == torch.float32
    stored = lora.base_layer.weight
    assert stored._data.dtype in FP8_DTYPES if storage == "comfy_quant" else type(stored).__name__ == "GGUFParameter"
    assert (run_dir / "bf16.safetensors").is_file() and (run_dir / "samples" / "step_000000006_0.png").is_file()


