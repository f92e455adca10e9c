"""The SDXL family on its tiny preset: conditioning exactly as StableDiffusionXLPipeline computes it, size
conditioning from the real crop, v-prediction with zero terminal SNR, single-file and VAE loading, config checks."""

from __future__ import annotations

import pytest
import torch
from helpers import inline_job, make_image
from ldm_format import convert_vae, save_as_sgm_checkpoint
from safetensors.torch import load_file, save_file

from toolkit.config.loader import ConfigError, load_config
from toolkit.config.sections import DatasetConfig
from toolkit.data.dataset import build_dataset, image_sizes, load_pixels
from toolkit.models.base import PromptEmbeds
from toolkit.models.registry import get_adapter_class, model_config
from toolkit.models.sdxl.adapter import SDXLAdapter

CPU = torch.device("cpu")

#: the dtypes the conditioning is pinned to the pipeline in: float32 and bf16 (what GPU runs train in). The UNet
#: predicts in the model's dtype in both (no float32 cast), and both sides run the same ops in the same dtype, so
#: prompt embeddings, size conditioning and the prediction are equal bit for bit in bf16 too
DTYPES = [pytest.param(torch.float32, id="float32"), pytest.param(torch.bfloat16, id="bf16")]


@pytest.fixture(scope="module")
def adapter(tiny_sdxl) -> SDXLAdapter:
    return SDXLAdapter.load(model_config(arch="sdxl", name_or_path="tiny"), CPU, torch.float32)


@pytest.fixture(scope="module")
def bf16_adapter(tiny_sdxl) -> SDXLAdapter:
    return SDXLAdapter.load(model_config(arch="sdxl", name_or_path="tiny"), CPU, torch.bfloat16)


@pytest.fixture
def typed(request, dtype) -> SDXLAdapter:
    """The module's adapter in `dtype` (float32: `adapter`; bf16: `bf16_adapter`)."""
    return request.getfixturevalue("adapter" if dtype == torch.float32 else "bf16_adapter")


def test_registry_finds_the_sdxl_adapter_and_the_tiny_preset_loads(adapter, tiny_sdxl):
    assert get_adapter_class("sdxl") is SDXLAdapter
    assert adapter.source == str(tiny_sdxl)
    assert adapter.divisor == 32  # VAE /8, UNet /4
    assert not any(p.requires_grad for module in (adapter.unet, adapter.vae, adapter.text_encoder,
                                                  adapter.text_encoder_2) for p in module.parameters())


@pytest.mark.parametrize("dtype", DTYPES)
def test_prompt_embeddings_are_the_pipelines(typed, dtype):
    """Hidden layer -2 of both encoders side by side and the second encoder's pooled projection, as
    StableDiffusionXLPipeline.encode_prompt computes them (the empty prompt included)."""
    adapter = typed
    prompts = ["a photo of a cat, sitting", ""]
    ours = adapter.encode_prompts(prompts)
    embeds, _, pooled, _ = adapter.sampling.pipeline().encode_prompt(prompts, device=CPU,
                                                                     do_classifier_free_guidance=False)
    assert ours.embeds.shape == (2, 77, 32 + 48) and ours.pooled.shape == (2, 32)
    assert ours.embeds.dtype == embeds.dtype == ours.pooled.dtype == pooled.dtype == dtype
    assert torch.equal(ours.embeds, embeds) and torch.equal(ours.pooled, pooled)
    assert ours.lengths.tolist()[1] == 2  # start and end token


@pytest.mark.parametrize("dtype", DTYPES)
def test_size_conditioning_is_the_crop_the_data_made(tmp_path, typed, dtype):
    """A wide image: its original size, the crop offset the resize-and-centre-crop produced, and the bucket,
    in the order of the pipeline's `_get_add_time_ids`; the training forward with them equals the UNet called
    with the pipeline's own conditioning (in the model's dtype, as the pipeline gives its latents and ids)."""
    adapter = typed
    pipe = adapter.sampling.pipeline()
    make_image(tmp_path / "wide.png", (150, 61), caption="wide")
    dataset = build_dataset([DatasetConfig(folder_path=str(tmp_path), resolution=[64])], None, adapter.divisor,
                            sizes=True)
    item = dataset.items[0]
    width, height = item.bucket
    sizes = image_sizes(item)
    scale = max(width / 150, height / 61)
    left, top = (round(150 * scale) - width) // 2, (round(61 * scale) - height) // 2
    assert (left, top) != (0, 0)
    ids = pipe._get_add_time_ids((61, 150), (top, left), (height, width), dtype, text_encoder_projection_dim=32)
    assert torch.equal(sizes.to(dtype).unsqueeze(0), ids)
    assert load_pixels(item).shape == (3, height, width)
    # the dataset hands the same sizes with the sample
    assert torch.equal(dataset[0]["image_sizes"], sizes)

    embeds = adapter.encode_prompts(["wide"])
    _, _, pooled, _ = pipe.encode_prompt(["wide"], device=CPU, do_classifier_free_guidance=False)
    noisy = torch.randn(1, 4, height // 8, width // 8, generator=torch.Generator().manual_seed(0))
    t = torch.tensor([400])
    ours = adapter.predict(noisy, t, embeds, image_sizes=sizes.unsqueeze(0))
    theirs = adapter.unet(noisy.to(dtype), t, encoder_hidden_states=embeds.embeds,
                          added_cond_kwargs={"text_embeds": pooled, "time_ids": ids}).sample
    assert ours.dtype == theirs.dtype == dtype and torch.equal(ours, theirs)
    other = adapter.predict(noisy, t, embeds, image_sizes=torch.tensor([[height, width, 0, 0, height, width]]))
    assert not torch.allclose(ours, other)  # the sizes do condition the model


@pytest.mark.parametrize("dtype", DTYPES)
def test_v_prediction_with_zero_terminal_snr(tiny_sdxl, dtype):
    """The target is v (diffusers' own get_velocity, bit for bit on latents in the model's dtype too), the last
    alpha-bar is 0, and the sampling scheduler has the same settings (v-prediction, rescaled betas, trailing
    timesteps)."""
    adapter = SDXLAdapter.load(model_config(arch="sdxl", name_or_path="tiny", prediction_type="v_prediction"), CPU,
                               dtype)
    adapter.use_zero_terminal_snr()
    schedule = adapter.noise_schedule
    assert schedule.prediction_type == "v_prediction"
    assert adapter.scheduler.alphas_cumprod[-1].item() == 0.0
    generator = torch.Generator().manual_seed(0)
    latents, noise = (torch.randn(3, 4, 8, 8, generator=generator).to(dtype) for _ in range(2))
    t = schedule.timesteps(torch.tensor([0.1, 0.5, 0.9999]))
    assert t[-1].item() == 999
    assert torch.equal(schedule.target(latents, noise, t), adapter.scheduler.get_velocity(latents, noise, t))
    assert torch.equal(schedule.add_noise(latents, noise, t)[-1], noise[-1])  # pure noise at the last step
    assert schedule.snr(t)[-1].item() == 0.0
    sampler = adapter.sampling.pipeline().scheduler
    assert sampler.config.prediction_type == "v_prediction"
    assert sampler.config.rescale_betas_zero_snr and sampler.config.timestep_spacing == "trailing"


def test_prediction_type_defaults_to_the_schedulers(adapter):
    assert adapter.noise_schedule.prediction_type == "epsilon"
    assert adapter.describe()["prediction_type"] == "epsilon"


def test_single_file_checkpoint_loads_the_same_weights(tiny_sdxl, tmp_path, adapter):
    """An original-layout SDXL checkpoint (SGM UNet, OpenCLIP bigG with fused attention), as fine-tunes ship."""
    checkpoint = save_as_sgm_checkpoint(tiny_sdxl, tmp_path / "tiny_sdxl.safetensors")
    cfg = model_config(arch="sdxl", name_or_path=str(checkpoint), single_file_config=str(tiny_sdxl))
    from_file = SDXLAdapter.load(cfg, CPU, torch.float32)
    for name in ("unet", "vae", "text_encoder", "text_encoder_2"):
        ours, theirs = getattr(from_file, name).state_dict(), getattr(adapter, name).state_dict()
        assert ours.keys() == theirs.keys(), name
        assert all(torch.equal(ours[k], theirs[k]) for k in ours), name
    assert from_file.noise_schedule.num_train_timesteps == 1000


def test_missing_single_file_is_named(tmp_path):
    cfg = model_config(arch="sdxl", name_or_path=str(tmp_path / "missing.safetensors"))
    with pytest.raises(FileNotFoundError, match="missing.safetensors"):
        SDXLAdapter.load(cfg, CPU, torch.float32)


def scaled_vae_folder(tiny_sdxl, tmp_path, force_upcast: bool):
    """The tiny VAE with its weights changed (as another VAE would be), saved as its own folder."""
    from diffusers import AutoencoderKL

    vae = AutoencoderKL.from_pretrained(tiny_sdxl, subfolder="vae", force_upcast=force_upcast)
    with torch.no_grad():
        vae.encoder.conv_in.weight.mul_(1.5)
    vae.save_pretrained(tmp_path / "vae_fix")
    return tmp_path / "vae_fix", vae


def test_vae_swap_from_a_folder_and_from_a_single_file(tiny_sdxl, tmp_path, adapter):
    folder, vae = scaled_vae_folder(tiny_sdxl, tmp_path, force_upcast=False)
    swapped = SDXLAdapter.load(model_config(arch="sdxl", name_or_path="tiny", vae_name_or_path=str(folder)), CPU,
                               torch.float32)
    assert torch.equal(swapped.vae.encoder.conv_in.weight, vae.encoder.conv_in.weight)
    assert swapped.encoder_identity("image") != adapter.encoder_identity("image")  # latent caches follow the VAE
    assert swapped.encoder_identity("text") == adapter.encoder_identity("text")

    single = tmp_path / "vae.safetensors"
    save_file({k.removeprefix("first_stage_model."): v.contiguous()
               for k, v in convert_vae(vae.state_dict(), dict(vae.config)).items()}, str(single))
    from_file = SDXLAdapter.load(model_config(arch="sdxl", name_or_path="tiny", vae_name_or_path=str(single)), CPU,
                                 torch.float32)
    ours, theirs = from_file.vae.state_dict(), vae.state_dict()
    assert all(torch.equal(ours[k], theirs[k]) for k in theirs)


def test_float16_runs_the_stock_vae_in_float32_and_the_fp16_fix_in_float16(tiny_sdxl, tmp_path):
    """The stock VAE says `force_upcast`: in a float16 run it is float32 (finite latents), and still decodes the
    float16 latents the pipeline hands it; a VAE without the flag (the fp16-fix one) stays float16."""
    stock = SDXLAdapter.load(model_config(arch="sdxl", name_or_path="tiny"), CPU, torch.float16)
    assert stock.vae.dtype == torch.float32 and stock.unet.dtype == torch.float16
    pixels = torch.rand(1, 3, 64, 64) * 2 - 1
    latents = stock.encode_images(pixels, torch.Generator().manual_seed(0))
    assert latents.dtype == torch.float32 and torch.isfinite(latents).all()
    decoded = stock.vae.decode(latents.half() / stock.vae.config.scaling_factor).sample
    assert decoded.dtype == torch.float32 and torch.isfinite(decoded).all()

    folder, _ = scaled_vae_folder(tiny_sdxl, tmp_path, force_upcast=False)
    fixed = SDXLAdapter.load(model_config(arch="sdxl", name_or_path="tiny", vae_name_or_path=str(folder)), CPU,
                             torch.float16)
    assert fixed.vae.dtype == torch.float16


def test_predict_without_sizes_uses_the_uncropped_latent_size(adapter):
    noisy = torch.randn(2, 4, 8, 12, generator=torch.Generator().manual_seed(1))
    embeds = adapter.encode_prompts(["a", "b"])
    t = torch.tensor([10, 900])
    assert torch.equal(adapter.predict(noisy, t, embeds),
                       adapter.predict(noisy, t, embeds, image_sizes=torch.tensor([[64, 96, 0, 0, 64, 96]] * 2)))


@pytest.mark.parametrize("dtype", DTYPES)
def test_sampling_conditioning_is_the_pipelines_with_zero_negative(typed, dtype):
    adapter = typed
    given = adapter.sampling.conditioning("a red circle", "")
    embeds, negative, pooled, negative_pooled = adapter.sampling.pipeline().encode_prompt(
        "a red circle", device=CPU, do_classifier_free_guidance=True)
    assert given["prompt_embeds"].dtype == embeds.dtype == dtype
    assert torch.equal(given["prompt_embeds"], embeds) and torch.equal(given["pooled_prompt_embeds"], pooled)
    assert not given["negative_prompt_embeds"].any() and not given["negative_pooled_prompt_embeds"].any()


@pytest.mark.parametrize("model, train, sample, message", [
    ("arch: zimage, name_or_path: tiny", ", zero_terminal_snr: true", "",
     "train.zero_terminal_snr: the zimage family"),
    ("arch: zimage, name_or_path: tiny", "", ", guidance_rescale: 0.7",
     "sample.guidance_rescale: the zimage sampling pipeline"),
    ("arch: zimage, name_or_path: tiny, prediction_type: v_prediction", "", "", "prediction_type"),
    ("arch: wan, name_or_path: tiny, vae_name_or_path: x", "", "", "vae_name_or_path"),
])
def test_config_refuses_what_the_family_cannot_do(tmp_path, registry, model, train, sample, message):
    path = inline_job(tmp_path / "job.yaml", model, train, "prompts: [a]" + sample)
    with pytest.raises(ConfigError, match=message):
        load_config(str(path), registry)


def test_config_takes_the_sdxl_keys(tmp_path, registry):
    path = inline_job(tmp_path / "job.yaml",
                      "arch: sdxl, name_or_path: tiny, prediction_type: v_prediction, vae_name_or_path: vae",
                      ", zero_terminal_snr: true", "prompts: [a], guidance_rescale: 0.7")
    config, _ = load_config(str(path), registry)
    process = config.config.process[0]
    assert process.model.prediction_type == "v_prediction" and process.train.zero_terminal_snr
    assert process.sample.guidance_rescale == 0.7


def test_cached_entries_keep_the_size_conditioning(tmp_path, adapter):
    from toolkit.data.latent_cache import LatentCache

    make_image(tmp_path / "data" / "tall.png", (40, 130), caption="tall")
    dataset = build_dataset([DatasetConfig(folder_path=str(tmp_path / "data"), resolution=[64])], None,
                            adapter.divisor, sizes=True)
    cache = LatentCache(dataset, {0: tmp_path / "cache"}, {0: True}, adapter.encoder_identity("image"))

    class OneProcess:
        process_index, num_processes, is_main_process = 0, 1, True

        def wait_for_everyone(self):
            pass

    cache.build(adapter, OneProcess())
    item = dataset.items[0]
    width, height = item.bucket
    scale = max(width / 40, height / 130)
    expected = [130, 40, (round(130 * scale) - height) // 2, (round(40 * scale) - width) // 2, height, width]
    assert expected[2] + expected[3] > 0  # the bucket crops the image: the offset is real
    written = load_file(str(cache.path(0)))
    assert written["image_sizes"].tolist() == expected
    dataset.latents = cache
    assert dataset[0]["image_sizes"].tolist() == expected and "pixels" not in dataset[0]

    # an entry written before entries kept the sizes: the same crop plan gives them
    save_file({"mean": written["mean"], "std": written["std"]}, str(cache.path(0)))
    assert dataset[0]["image_sizes"].tolist() == expected
    # families without size conditioning do without them
    plain = build_dataset([DatasetConfig(folder_path=str(tmp_path / "data"), resolution=[64])], None, adapter.divisor)
    assert "image_sizes" not in plain[0]


def test_prompt_embeds_move_their_pooled_embedding():
    embeds = PromptEmbeds(torch.zeros(1, 2, 3), pooled=torch.zeros(1, 4))
    assert embeds.to("cpu", torch.float16).pooled.dtype == torch.float16
