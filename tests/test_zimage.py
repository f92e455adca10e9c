"""The Z-Image adapter on the tiny model: loading forms, prompt encoding and the flow conventions checked against
ZImagePipeline itself, LoRA files that diffusers loads, sampling, quantization blocks."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from diffusers import FlowMatchEulerDiscreteScheduler, ZImagePipeline
from safetensors.torch import load_file, save_file

from toolkit.config.schema import NetworkConfig, SampleConfig
from toolkit.diffusion.schedules import FlowMatchNoiseSchedule
from toolkit.diffusion.timesteps import ShiftSchedule
from toolkit.models.registry import get_adapter_class, model_config
from toolkit.models.zimage.adapter import ZImageAdapter
from toolkit.network.lora import add_lora, lora_state_dict, write_lora_file
from toolkit.run.sampling import SampleRenderer

CPU = torch.device("cpu")
PROMPTS = ["a cat", "a much longer prompt: a red barn on a hill at dusk, oil painting"]

#: the dtypes the training math is pinned to the pipeline in: float32 and bf16 (what GPU runs train in). ZImagePipeline
#: keeps its latents and steps in float32 as predict does, and both sides run the same ops in the model's dtype, so
#: prompt embeddings and Euler steps are equal bit for bit in bf16 too
DTYPES = [pytest.param(torch.float32, id="float32"), pytest.param(torch.bfloat16, id="bf16")]
#: latents_from_dist works in float32 from the VAE's posterior whatever its dtype: float32 rounding (4.8e-7 measured)
LATENT_ATOL = {torch.float32: 1e-5, torch.bfloat16: 1e-5}


def load_tiny(dtype: torch.dtype = torch.float32) -> ZImageAdapter:
    return ZImageAdapter.load(model_config(arch="zimage", name_or_path="tiny"), CPU, dtype)


@pytest.fixture(scope="session")
def tiny_zimage(tiny_cache) -> Path:
    from toolkit.models.zimage.tiny import ensure_tiny_zimage

    return ensure_tiny_zimage()


@pytest.fixture(scope="session")
def adapter(tiny_zimage) -> ZImageAdapter:
    """Shared: LoRA tests load their own; the sampling test restores the one attribute it sets."""
    return load_tiny()


@pytest.fixture(scope="module")
def bf16_adapter(tiny_zimage) -> ZImageAdapter:
    return load_tiny(torch.bfloat16)


@pytest.fixture
def typed(request, dtype) -> ZImageAdapter:
    """The shared adapter in `dtype` (float32: `adapter`; bf16: `bf16_adapter`)."""
    return request.getfixturevalue("adapter" if dtype == torch.float32 else "bf16_adapter")


def pipeline(adapter: ZImageAdapter) -> ZImagePipeline:
    pipe = adapter.sampling.pipeline()
    pipe.set_progress_bar_config(disable=True)
    return pipe


def test_tiny_preset_loads_through_the_diffusers_folder_code(adapter, tiny_zimage):
    assert get_adapter_class("zimage") is ZImageAdapter
    assert adapter.source == str(tiny_zimage)
    assert adapter.divisor == 16  # VAE /8, patches of 2
    assert isinstance(adapter.noise_schedule, FlowMatchNoiseSchedule)
    assert adapter.files.prefix == "transformer"
    for module in (adapter.transformer, adapter.vae, adapter.text_encoder):
        assert not any(p.requires_grad for p in module.parameters())
    assert adapter.encoder_identity("text") != adapter.encoder_identity("image")


@pytest.mark.parametrize("dtype", DTYPES)
def test_prompt_embeddings_are_the_pipelines(typed, dtype):
    adapter = typed
    prompts = [*PROMPTS, ""]
    embeds = adapter.encode_prompts(prompts)
    # fixed padding: batches, cache entries and the blank prompt stack and concatenate
    assert embeds.embeds.shape == (3, adapter.max_sequence_length, 32)
    theirs, _ = pipeline(adapter).encode_prompt(list(prompts), do_classifier_free_guidance=False)
    ours = adapter.caption_features(embeds, dtype)
    assert [len(t) for t in theirs] == embeds.lengths.tolist()
    assert len(theirs[0]) != len(theirs[1])
    for a, b in zip(ours, theirs):
        assert a.dtype == b.dtype == dtype and torch.equal(a, b)
    blank = adapter.text.blank_prompt_embeds()
    assert torch.equal(adapter.caption_features(blank, dtype)[0], theirs[2])


def test_overlong_prompts_count_the_chat_template(adapter):
    # byte-level tokenizer: one token per character, plus 19 for the template around the prompt
    assert len(adapter.tokenizer(adapter.chat_prompt("")).input_ids) == 19
    assert adapter.text.overlong_prompts(["short", "x" * (512 - 19), "x" * (512 - 18)]) == [2]


@pytest.mark.parametrize("dtype", DTYPES)
def test_latents_invert_the_pipelines_decode_formula(typed, dtype):
    """The posterior comes in the VAE's dtype; the latents are float32 in both dtypes (the formula in float32)."""
    adapter = typed
    pixels = torch.rand(1, 3, 64, 48) * 2 - 1
    dist = adapter.encode_latent_dist(pixels)
    latents = adapter.latents_from_dist(dist, torch.Generator().manual_seed(3))
    assert dist.mean.dtype == dtype
    assert latents.shape == (1, 16, 8, 6) and latents.dtype == torch.float32
    eps = torch.randn(dist.mean.shape, generator=torch.Generator().manual_seed(3))
    vae_sample = dist.mean.float() + dist.std.float() * eps
    config = adapter.vae.config
    assert config.shift_factor != 0 and config.scaling_factor != 1
    # ZImagePipeline.__call__: latents / scaling_factor + shift_factor goes into vae.decode
    assert torch.allclose(latents / config.scaling_factor + config.shift_factor, vae_sample,
                          atol=LATENT_ATOL[dtype])


@pytest.mark.parametrize("dtype", DTYPES)
def test_predict_is_the_velocity_the_pipelines_euler_steps_integrate(typed, dtype):
    """Every step of ZImagePipeline is x_next = x + (sigma_next - sigma) * adapter.predict(x, 1000 sigma), bit for bit
    in float32 and in bf16 (the pipeline keeps float32 latents and a float32 model output, as predict does): the
    timestep conversion (1 - sigma for the transformer) and the sign (negated output) are the pipeline's."""
    adapter = typed
    pipe = pipeline(adapter)
    start = torch.randn(1, 16, 4, 4, generator=torch.Generator().manual_seed(0))
    seen: list[tuple[torch.Tensor, torch.Tensor]] = []

    def record(pipeline, step, t, kwargs):
        seen.append((t.clone(), kwargs["latents"].clone()))
        return {}

    pipe(prompt=PROMPTS[0], num_inference_steps=3, guidance_scale=0.0, width=32, height=32, latents=start.clone(),
         output_type="latent", callback_on_step_end=record)
    sigmas = pipe.scheduler.sigmas
    embeds = adapter.encode_prompts(PROMPTS[:1])
    before = start
    for i, (t, after) in enumerate(seen):
        assert torch.isclose(t, sigmas[i] * 1000)
        velocity = adapter.predict(before, t.reshape(1), embeds)
        assert after.dtype == velocity.dtype == torch.float32
        assert torch.equal(after, before + (sigmas[i + 1] - sigmas[i]) * velocity), i
        flipped_t = adapter.predict(before, (1000 - t).reshape(1), embeds)
        assert not torch.allclose(velocity, flipped_t, atol=1e-3)  # the check can tell the timestep apart
        before = after
    assert len(seen) == 3


def test_flow_target_is_what_the_euler_step_moves_along(adapter):
    """Noising and the target agree with FlowMatchEulerDiscreteScheduler: its scale_noise is add_noise, and an
    Euler step along the target (noise - x) from one noise level lands on the next level's noisy latents."""
    schedule, scheduler = adapter.noise_schedule, FlowMatchEulerDiscreteScheduler.from_config(adapter.scheduler.config)
    scheduler.set_timesteps(4)
    x, noise = torch.randn(1, 16, 4, 4), torch.randn(1, 16, 4, 4)
    t, t_next = scheduler.timesteps[1:2], scheduler.timesteps[2:3]
    noisy = schedule.add_noise(x, noise, t)
    assert torch.allclose(noisy, scheduler.scale_noise(x, t, noise), atol=1e-6)
    scheduler.set_begin_index(1)
    stepped = scheduler.step(schedule.target(x, noise, t), t, noisy, return_dict=False)[0]
    assert torch.allclose(stepped, schedule.add_noise(x, noise, t_next), atol=1e-5)


def test_shift_schedule_only_where_the_scheduler_shifts_dynamically(adapter):
    assert adapter.noise_schedule.shift_schedule is None  # Z-Image(-Turbo): use_dynamic_shifting false, shift 3.0
    dynamic = ZImageAdapter(adapter.transformer, adapter.vae, adapter.text_encoder, adapter.tokenizer,
                            FlowMatchEulerDiscreteScheduler(use_dynamic_shifting=True, base_shift=0.4, max_shift=1.2),
                            source="x")
    assert dynamic.noise_schedule.shift_schedule == ShiftSchedule(base_shift=0.4, max_shift=1.2)
    assert adapter.noise_schedule.image_seq_len(torch.zeros(2, 16, 8, 6)) == 4 * 3  # 64 x 48 px: 2 x 2 patches of latents


def test_lora_trains_saves_and_loads_in_diffusers(tiny_zimage, tmp_path):
    adapter = load_tiny()
    module = adapter.trainable_module()
    params = add_lora(module, NetworkConfig(linear=4, linear_alpha=8), adapter.lora_target_modules())
    with torch.no_grad():
        for param in params:
            param.normal_(std=0.2)
    noisy, t = torch.randn(2, 16, 8, 8), torch.tensor([300.0, 800.0])
    embeds = adapter.encode_prompts(PROMPTS)
    loss = adapter.predict(noisy, t, embeds).square().mean()
    loss.backward()
    assert all(p.grad is not None for p in params) and any(p.grad.abs().sum() > 0 for p in params)
    with torch.no_grad():
        with_lora = adapter.predict(noisy, t, embeds)
        module.disable_adapters()
        base = adapter.predict(noisy, t, embeds)
        module.enable_adapters()
    assert not torch.allclose(with_lora, base, atol=1e-3)

    state = lora_state_dict(module, adapter.files.prefix, torch.float32)
    modules = {key.rsplit(".lora.", 1)[0] for key in state}
    blocks = ["noise_refiner.0", "context_refiner.0", "layers.0", "layers.1"]
    assert modules == {f"transformer.{block}.attention.{target}" for block in blocks
                       for target in ("to_q", "to_k", "to_v", "to_out.0")}
    path = tmp_path / "lora.safetensors"
    write_lora_file(path, state, {}, module, adapter.files.prefix)
    assert torch.allclose(loaded_prediction(tiny_zimage, str(path), adapter, noisy, t, embeds), with_lora, atol=1e-5)
    comfy = comfy_form(state, alpha=8.0)
    assert torch.allclose(loaded_prediction(tiny_zimage, comfy, adapter, noisy, t, embeds), with_lora, atol=1e-5)


def loaded_prediction(folder: Path, lora, adapter: ZImageAdapter, noisy, t, embeds) -> torch.Tensor:
    """The prediction of a fresh pipeline from `folder` after `load_lora_weights(lora)`."""
    pipe = ZImagePipeline.from_pretrained(folder)
    pipe.load_lora_weights(lora)
    with torch.no_grad():
        return adapter.predict(noisy, t, embeds, module=pipe.transformer)


def comfy_form(state: dict[str, torch.Tensor], alpha: float) -> dict[str, torch.Tensor]:
    """The ComfyUI/ai-toolkit form of a Z-Image LoRA: `diffusion_model.<diffusers module path>` with kohya's
    lora_down/lora_up and an alpha per module (what toolkit.network.formats.to_comfy should write for it)."""
    out = {}
    for key, value in state.items():
        module, suffix = key.removeprefix("transformer.").rsplit(".lora.", 1)
        out[f"diffusion_model.{module}.lora_{suffix.replace('.weight', '')}.weight"] = value
        out[f"diffusion_model.{module}.alpha"] = torch.tensor(alpha)
    return out


def test_sampling_pipeline_renders_with_either_transformer(adapter, tmp_path):
    cfg = SampleConfig(prompts=["a cat"], neg="blurry", guidance_scale=2.0, sample_steps=2, width=64, height=48)
    renderer = SampleRenderer(cfg, None, tmp_path / "samples", "tiny")
    renderer.check_size(adapter.divisor)
    [first] = renderer.render(adapter, step=1)
    assert adapter.sampling.only_modules() == []
    adapter.sampling_transformer = ZImageAdapter.load_transformer("tiny-turbo", torch.float32)
    try:
        assert adapter.sampling.only_modules() == [adapter.sampling_transformer]
        [second] = renderer.render(adapter, step=2)
    finally:
        adapter.sampling_transformer = None
    from PIL import Image

    images = [Image.open(p) for p in (first, second)]
    assert all(image.size == (64, 48) for image in images)
    assert images[0].tobytes() != images[1].tobytes()


def test_turbo_preset_is_another_transformer_over_the_same_encoders(tiny_zimage):
    from toolkit.models.zimage.tiny import ensure_tiny_zimage_turbo

    turbo = ensure_tiny_zimage_turbo()
    for part, same in (("text_encoder/model", True), ("vae/diffusion_pytorch_model", True),
                       ("transformer/diffusion_pytorch_model", False)):
        ours, theirs = (load_file(str(folder / f"{part}.safetensors")) for folder in (tiny_zimage, turbo))
        assert all(torch.equal(ours[k], theirs[k]) for k in ours) is same, part


def original_layout(folder: Path, prefix: str) -> dict[str, torch.Tensor]:
    """The tiny transformer's weights in the original Z-Image / ComfyUI layout (the inverse of diffusers'
    convert_z_image_transformer_checkpoint_to_diffusers): fused qkv, attention.out, q_norm/k_norm,
    x_embedder and final_layer without the patch-size key."""
    renames = {".attention.to_out.0.": ".attention.out.", ".attention.norm_q.": ".attention.q_norm.",
               ".attention.norm_k.": ".attention.k_norm.", "all_x_embedder.2-1.": "x_embedder.",
               "all_final_layer.2-1.": "final_layer."}
    state = load_file(str(folder / "transformer" / "diffusion_pytorch_model.safetensors"))
    out = {}
    for key, value in state.items():
        if ".attention.to_k." in key or ".attention.to_v." in key:
            continue
        if ".attention.to_q." in key:
            parts = [state[key.replace(".to_q.", f".to_{p}.")] for p in "qkv"]
            out[prefix + key.replace(".to_q.", ".qkv.")] = torch.cat(parts)
            continue
        for old, new in renames.items():
            key = key.replace(old, new)
        out[prefix + key] = value
    return out


@pytest.mark.parametrize("prefix", ["", "model.diffusion_model."])
def test_single_file_transformer_loads_the_same_weights(adapter, tiny_zimage, tmp_path, prefix):
    path = tmp_path / "z_image_tiny.safetensors"
    save_file(original_layout(tiny_zimage, prefix), str(path))
    cfg = model_config(arch="zimage", name_or_path=str(path), single_file_config=str(tiny_zimage))
    from_file = ZImageAdapter.load(cfg, CPU, torch.float32)
    ours, theirs = from_file.transformer.state_dict(), adapter.transformer.state_dict()
    assert ours.keys() == theirs.keys()
    assert all(torch.equal(ours[k], theirs[k]) for k in ours)
    assert from_file.source == str(path)


def test_missing_single_file_is_named(tmp_path):
    with pytest.raises(FileNotFoundError, match="missing.safetensors"):
        ZImageAdapter.load_transformer(str(tmp_path / "missing.safetensors"), torch.float32, config_source="tiny")


def test_quantization_blocks_and_full_precision_parts(adapter):
    from fnmatch import fnmatch

    from optimum.quanto.nn import QModuleMixin

    from toolkit.quantize import quantize_blockwise

    transformer = ZImageAdapter.load_transformer("tiny", torch.float32)
    blocks = ZImageAdapter.quantization_blocks(transformer)
    names = {id(module): name for name, module in transformer.named_modules()}
    assert [names[id(block)] for block in blocks] == ["noise_refiner.0", "context_refiner.0", "layers.0", "layers.1"]
    quantize_blockwise(transformer, "qint8", blocks, exclude=list(ZImageAdapter.QUANTIZATION_EXCLUDE))
    linears = {name: module for name, module in transformer.named_modules() if isinstance(module, torch.nn.Linear)}
    kept = {name for name in linears if any(fnmatch(name, p) for p in ZImageAdapter.QUANTIZATION_EXCLUDE)}
    assert {"all_x_embedder.2-1", "t_embedder.mlp.0", "cap_embedder.1", "all_final_layer.2-1.linear"} <= kept
    assert all(isinstance(module, QModuleMixin) != (name in kept) for name, module in linears.items())
    embeds = adapter.encode_prompts(["a"])
    noisy, t = torch.randn(1, 16, 4, 4), torch.tensor([500.0])
    quantized = adapter.predict(noisy, t, embeds, module=transformer)
    assert torch.allclose(quantized, adapter.predict(noisy, t, embeds), atol=0.1)


def test_dtype_applies_to_frozen_weights_and_predictions_are_float32(bf16_adapter):
    adapter = bf16_adapter
    assert adapter.transformer.dtype == torch.bfloat16 and adapter.text_encoder.dtype == torch.bfloat16
    embeds = adapter.encode_prompts(["a"])
    assert adapter.predict(torch.randn(1, 16, 4, 4), torch.tensor([500.0]), embeds).dtype == torch.float32


@pytest.fixture(scope="module")
def assistant_files(tmp_path_factory, tiny_zimage):
    """An assistant LoRA in diffusers form and in ComfyUI form, and the output of a model that wears it."""
    from toolkit.network.formats import to_comfy

    folder = tmp_path_factory.mktemp("assistant")
    wearer = load_tiny()
    add_lora(wearer.transformer, NetworkConfig(linear=4, linear_alpha=8), wearer.lora_target_modules())
    torch.manual_seed(3)
    for param in wearer.transformer.parameters():
        if param.requires_grad:
            param.data.normal_(0, 0.3)
    state = lora_state_dict(wearer.transformer, "transformer", torch.float32)
    write_lora_file(folder / "assistant.safetensors", state, {}, wearer.transformer, "transformer")
    save_file(to_comfy(state, {"transformer": "diffusion_model"}, lambda module: 8.0, "."),
              str(folder / "assistant_comfy.safetensors"))
    return folder, wearer


def assistant_probe(adapter: ZImageAdapter, transformer=None) -> torch.Tensor:
    torch.manual_seed(5)
    noisy, t = torch.randn(2, 16, 8, 8), torch.tensor([300.0, 700.0])
    with torch.no_grad():
        return adapter.predict(noisy, t, adapter.encode_prompts(PROMPTS), module=transformer)


@pytest.mark.parametrize("name", ["assistant.safetensors", "assistant_comfy.safetensors"])
def test_assistant_lora_is_merged_into_the_training_transformer_only(assistant_files, name):
    folder, wearer = assistant_files
    cfg = model_config(arch="zimage", name_or_path="tiny", assistant_lora_path=str(folder / name),
                      sampling={"name_or_path": "tiny-turbo"})
    merged = ZImageAdapter.load(cfg, CPU, torch.float32)
    torch.testing.assert_close(assistant_probe(merged), assistant_probe(wearer), atol=1e-5, rtol=1e-5)
    assert not any("lora" in name for name, _ in merged.transformer.named_modules())  # merged, not attached
    turbo = ZImageAdapter.load_transformer("tiny-turbo", torch.float32).state_dict()
    sampling = merged.sampling_transformer.state_dict()
    assert all(torch.equal(sampling[k], turbo[k]) for k in turbo)  # the sampling transformer is untouched


def test_missing_assistant_lora_is_named(tmp_path):
    cfg = model_config(arch="zimage", name_or_path="tiny", assistant_lora_path=str(tmp_path / "absent.safetensors"))
    with pytest.raises(FileNotFoundError, match="model.assistant_lora_path"):
        ZImageAdapter.load(cfg, CPU, torch.float32)


def test_token_shuffling_span_is_the_caption_inside_the_chat_template(adapter):
    """Cached-embedding token shuffling moves only the caption's tokens, never the template around them."""
    caption = "red circle, blue square, green"
    ids = adapter.tokenizer(adapter.chat_prompt(caption)).input_ids
    first, stop = adapter.text.caption_token_span(len(ids))
    assert adapter.tokenizer.decode(ids[first:stop]) == caption


def test_only_the_rendering_process_loads_the_sampling_transformer(tiny_cache):
    """`sampling_models=False` (every process but the main one): the separate sampling transformer is neither
    loaded nor quantized, and nothing mirrors the LoRA onto it."""
    cfg = model_config(arch="zimage", name_or_path="tiny", sampling={"name_or_path": "tiny-turbo"})
    without = ZImageAdapter.load(cfg, CPU, torch.float32, sampling_models=False)
    assert without.sampling_transformer is None and without.sampling.mirrors() == []
    with_it = ZImageAdapter.load(cfg, CPU, torch.float32)
    assert with_it.sampling_transformer is not None
    assert with_it.sampling.mirrors() == [with_it.sampling_transformer]
