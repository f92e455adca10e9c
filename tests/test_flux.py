"""The FLUX.1 family on its tiny [dev] and [schnell] presets: the training math against FluxPipeline (prompt
embeddings, packing and position ids, the Euler steps the prediction drives, the dynamic shift), variant detection,
LoRA targets and file names, config checks."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from diffusers import FlowMatchEulerDiscreteScheduler, FluxPipeline
from diffusers.pipelines.flux.pipeline_flux import calculate_shift
from helpers import euler_step, inline_job, pipeline_timestep

from toolkit.config.loader import ConfigError, load_config
from toolkit.diffusion.timesteps import shift_u
from toolkit.models.base import PromptEmbeds
from toolkit.models.flux.adapter import FluxAdapter, flux_lora_targets, is_flex
from toolkit.models.registry import get_adapter_class, model_config

CPU = torch.device("cpu")
PROMPTS = ["a red circle on a blue background", ""]

#: the dtypes the training math is pinned to the pipeline in: float32 and bf16 (what GPU runs train in). In bf16
#: both sides run the same ops in the same dtype, so prompt embeddings, packing and Euler steps are equal bit for bit
DTYPES = [pytest.param(torch.float32, id="float32"), pytest.param(torch.bfloat16, id="bf16")]
#: latents_from_dist works in float32 from the VAE's posterior whatever its dtype: float32 rounding (2.4e-7 measured)
LATENT_ATOL = {torch.float32: 1e-5, torch.bfloat16: 1e-5}


@pytest.fixture(scope="module")
def loaded(tiny_cache):
    """FLUX.1 adapters by (preset, dtype), each loaded once, when a test first asks for it."""
    adapters: dict[tuple[str, torch.dtype], FluxAdapter] = {}

    def get(preset: str, dtype: torch.dtype = torch.float32) -> FluxAdapter:
        if (preset, dtype) not in adapters:
            adapters[preset, dtype] = FluxAdapter.load(model_config(arch="flux", name_or_path=preset), CPU, dtype)
        return adapters[preset, dtype]

    return get


@pytest.fixture(scope="module")
def dev(loaded) -> FluxAdapter:
    return loaded("tiny")


@pytest.fixture(scope="module")
def schnell(loaded) -> FluxAdapter:
    return loaded("tiny-schnell")


def pipeline(adapter: FluxAdapter) -> FluxPipeline:
    pipe = adapter.sampling.pipeline()
    pipe.set_progress_bar_config(disable=True)
    return pipe


def test_the_variant_is_read_from_the_transformer(dev, schnell):
    assert get_adapter_class("flux") is FluxAdapter
    assert dev.guidance_embeds and not schnell.guidance_embeds
    assert (dev.max_sequence_length, schnell.max_sequence_length) == (512, 256)
    assert (dev.sampling.default_guidance_scale, dev.sampling.default_steps) == (3.5, 20)
    assert (schnell.sampling.default_guidance_scale, schnell.sampling.default_steps) == (0.0, 4)
    assert dev.files.modelspec_architecture == "flux-1-dev/lora"
    assert schnell.files.modelspec_architecture == "flux-1-schnell/lora"
    assert dev.divisor == 16  # VAE /8, 2x2 packing
    assert dev.noise_schedule.shift_schedule is not None and schnell.noise_schedule.shift_schedule is None
    short = FluxAdapter.load(model_config(arch="flux", name_or_path="tiny", max_sequence_length=64), CPU,
                             torch.float32)
    assert short.encode_prompts(PROMPTS).embeds.shape[1] == 64


@pytest.mark.parametrize("dtype", DTYPES)
def test_prompt_embeddings_are_the_pipelines(loaded, dtype):
    dev = loaded("tiny", dtype)
    ours = dev.encode_prompts(PROMPTS)
    embeds, pooled, text_ids = pipeline(dev).encode_prompt(PROMPTS, prompt_2=None, device=CPU,
                                                           max_sequence_length=512)
    assert ours.embeds.shape == (2, 512, 32) and ours.pooled.shape == (2, 32)
    assert ours.embeds.dtype == embeds.dtype == dtype
    assert torch.equal(ours.embeds, embeds) and torch.equal(ours.pooled, pooled)
    assert not text_ids.any()  # the text position ids the prediction passes (zeros)
    assert ours.lengths[1].item() == 1  # the empty prompt: `</s>` alone


@pytest.mark.parametrize("dtype", DTYPES)
def test_latents_invert_the_pipelines_decode_formula(loaded, dtype):
    """The posterior comes in the VAE's dtype; the latents are float32 in both dtypes (the formula in float32)."""
    dev = loaded("tiny", dtype)
    pixels = torch.rand(1, 3, 32, 32) * 2 - 1
    dist = dev.encode_latent_dist(pixels)
    latents = dev.latents_from_dist(dist, torch.Generator().manual_seed(0))
    assert dist.mean.dtype == dtype and latents.dtype == torch.float32
    sample = dist.mean.float() + dist.std.float() * torch.randn(dist.mean.shape,
                                                                generator=torch.Generator().manual_seed(0))
    config = dev.vae.config
    assert torch.allclose(latents / config.scaling_factor + config.shift_factor, sample, atol=LATENT_ATOL[dtype])


@pytest.mark.parametrize("dtype", DTYPES)
def test_prediction_packs_as_the_pipeline_does(loaded, dtype):
    """The transformer called on FluxPipeline's own prepared latents and ids (in the model's dtype, as the pipeline
    hands them) gives the prediction, unpacked; predict returns float32, the transformer the model's dtype."""
    dev = loaded("tiny", dtype)
    embeds = dev.encode_prompts(PROMPTS[:1])
    generator = torch.Generator().manual_seed(3)
    packed, image_ids = pipeline(dev).prepare_latents(1, 16, 32, 48, dtype, CPU, generator)
    assert packed.shape == (1, (32 // 16) * (48 // 16), 64)
    unpacked = FluxPipeline._unpack_latents(packed, 32, 48, 8)
    assert torch.equal(FluxPipeline._pack_latents(unpacked, 1, 16, 4, 6), packed)
    sigma = torch.tensor([0.7])
    theirs = dev.transformer(hidden_states=packed, timestep=sigma.to(dtype), guidance=torch.tensor([1.0]),
                             pooled_projections=embeds.pooled, encoder_hidden_states=embeds.embeds,
                             txt_ids=torch.zeros(512, 3, dtype=dtype), img_ids=image_ids, return_dict=False)[0]
    ours = dev.predict(unpacked, sigma * 1000, embeds)
    assert ours.dtype == torch.float32
    assert torch.equal(ours, FluxPipeline._unpack_latents(theirs, 32, 48, 8).float())


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("variant", ["dev", "schnell"])
def test_predict_is_the_velocity_the_pipelines_euler_steps_integrate(variant, dtype, loaded):
    """Every step of FluxPipeline is x_next = x + (sigma_next - sigma) * adapter.predict(x, 1000 sigma), with the
    guidance the pipeline gives [dev]'s guidance embedding, bit for bit in float32 and in bf16: fails with the sign
    or the timestep scale flipped, or the timestep one bf16 step off."""
    adapter = loaded("tiny" if variant == "dev" else "tiny-schnell", dtype)
    pipe = pipeline(adapter)
    start = torch.randn(1, 16, 4, 4, generator=torch.Generator().manual_seed(0))
    seen: list[tuple[torch.Tensor, torch.Tensor]] = []

    def record(pipeline, step, t, kwargs):
        seen.append((t.clone(), kwargs["latents"].clone()))
        return {}

    guidance = 3.5 if variant == "dev" else 0.0
    pipe(prompt=PROMPTS[0], num_inference_steps=3, guidance_scale=guidance, width=32, height=32,
         latents=FluxPipeline._pack_latents(start.clone(), 1, 16, 4, 4), output_type="latent",
         max_sequence_length=adapter.max_sequence_length, callback_on_step_end=record)
    sigmas = pipe.scheduler.sigmas
    embeds = adapter.encode_prompts(PROMPTS[:1])
    adapter.train_guidance_scale = guidance
    try:
        before = start.to(dtype)  # prepare_latents hands the pipeline's latents over in the model's dtype
        for i, (t, after) in enumerate(seen):
            after = FluxPipeline._unpack_latents(after, 32, 32, 8)
            assert torch.isclose(t, sigmas[i] * 1000)
            velocity = adapter.predict(before, pipeline_timestep(t, dtype).reshape(1), embeds)
            assert torch.equal(after, euler_step(before, sigmas[i + 1] - sigmas[i], velocity)), i
            flipped = adapter.predict(before, (1000 - t).reshape(1), embeds)
            assert not torch.allclose(velocity, flipped, atol=1e-3)  # the check can tell the timestep apart
            before = after
    finally:
        adapter.train_guidance_scale = 1.0
    assert len(seen) == 3


def test_guidance_reaches_devs_embedding_only(dev, schnell):
    noisy = torch.randn(1, 16, 4, 4, generator=torch.Generator().manual_seed(1))
    t = torch.tensor([500.0])
    for adapter, changes in ((dev, True), (schnell, False)):
        embeds = adapter.encode_prompts(PROMPTS[:1])
        one = adapter.predict(noisy, t, embeds)
        adapter.train_guidance_scale = 4.0
        four = adapter.predict(noisy, t, embeds)
        adapter.train_guidance_scale = 1.0
        assert (not torch.allclose(one, four)) == changes


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("pixels", [512, 1024])
def test_dynamic_shift_is_the_pipelines_calculate_shift(loaded, pixels, dtype):
    """[dev]'s sigma schedule at 512 and 1024 px: the shift from the packed sequence length is the pipeline's
    `calculate_shift` with the scheduler's base/max shift, and shifting u gives the scheduler's own sigmas. The shift
    and the sigmas are float64/float32 whatever the model's dtype, so bf16 holds them to float32 rounding too."""
    dev = loaded("tiny", dtype)
    latents = torch.zeros(1, 16, pixels // 8, pixels // 8, dtype=dtype)
    seq_len = dev.noise_schedule.image_seq_len(latents)
    assert seq_len == (pixels // 16) ** 2
    config = dev.scheduler.config
    mu = calculate_shift(seq_len, config.base_image_seq_len, config.max_image_seq_len, config.base_shift,
                         config.max_shift)
    shift = dev.noise_schedule.shift_schedule.shift_for(seq_len)
    assert shift == pytest.approx(np.exp(mu), rel=1e-12)
    scheduler = FlowMatchEulerDiscreteScheduler.from_config(config)
    u = np.linspace(1.0, 1 / 8, 8)
    scheduler.set_timesteps(sigmas=u, mu=mu)
    assert torch.allclose(shift_u(torch.tensor(u), shift).float(), scheduler.sigmas[:-1], atol=1e-6)


def test_lora_targets_are_the_communitys(dev):
    targets = flux_lora_targets(dev.transformer)
    assert "transformer_blocks.0.attn.add_q_proj" in targets and "transformer_blocks.0.ff_context.net.2" in targets
    assert "single_transformer_blocks.1.proj_mlp" in targets and "single_transformer_blocks.1.proj_out" in targets
    assert "proj_out" not in targets  # the final projection shares the single blocks' name
    names = dict(dev.transformer.named_modules())
    assert all(isinstance(names[t], torch.nn.Linear) for t in targets)
    assert len(targets) == 1 * 12 + 2 * 5


def test_quantization_keeps_embedders_norms_and_final_layer(tiny_cache):
    from optimum.quanto import QModuleMixin

    adapter = FluxAdapter.load(model_config(arch="flux", name_or_path="tiny", quantize=True, qtype="qint8",
                                            quantize_te=True, qtype_te="qint8"), CPU, torch.float32)
    modules = dict(adapter.transformer.named_modules())
    assert isinstance(modules["transformer_blocks.0.attn.to_q"], QModuleMixin)
    assert isinstance(modules["single_transformer_blocks.0.proj_mlp"], QModuleMixin)
    for kept in ("x_embedder", "context_embedder", "proj_out", "norm_out.linear",
                 "time_text_embed.guidance_embedder.linear_1"):
        assert not isinstance(modules[kept], QModuleMixin), kept
    for modulation in ("transformer_blocks.0.norm1.linear", "single_transformer_blocks.0.norm.linear"):
        assert isinstance(modules[modulation], QModuleMixin), modulation  # about a quarter of FLUX.1's weights
    assert any(isinstance(m, QModuleMixin) for m in adapter.text_encoder_2.modules())
    embeds = adapter.encode_prompts(PROMPTS[:1])
    assert torch.isfinite(adapter.predict(torch.randn(1, 16, 4, 4), torch.tensor([300.0]), embeds)).all()


def test_prompt_embeds_of_the_blank_prompt_stack_with_captions(dev):
    blank = dev.text.blank_prompt_embeds()
    caption = dev.encode_prompts(PROMPTS[:1])
    assert blank.embeds.shape == caption.embeds.shape and blank.pooled.shape == caption.pooled.shape
    assert dev.text.caption_token_span(int(caption.lengths[0])) == (0, int(caption.lengths[0]) - 1)
    assert isinstance(blank, PromptEmbeds)


@pytest.mark.parametrize("model, train, sample, message", [
    ("arch: sd15, name_or_path: tiny", ", guidance_scale: 1.0", "", "train.guidance_scale: the sd15 family"),
    ("arch: flux, name_or_path: tiny, max_sequence_length: 600", "", "", "max_sequence_length"),
    ("arch: flux, name_or_path: tiny", ", zero_terminal_snr: true", "", "train.zero_terminal_snr: the flux family"),
    ("arch: flux, name_or_path: tiny", "", "neg: blurry", "sample.neg: FLUX.1 samples without classifier-free"),
    ("arch: sd15, name_or_path: tiny", ", bypass_guidance_embedding: false",
     "", "train.bypass_guidance_embedding: the sd15 family"),
    ("arch: flux, name_or_path: tiny", ", bypass_guidance_embedding: true, guidance_scale: 3.5", "",
     "train.guidance_scale: train.bypass_guidance_embedding leaves"),
])
def test_config_refuses_what_flux_cannot_do(tmp_path, registry, model, train, sample, message):
    path = inline_job(tmp_path / "job.yaml", model, train, sample)
    with pytest.raises(ConfigError, match=message):
        load_config(str(path), registry)


def test_config_takes_the_flux_keys(tmp_path, registry):
    path = inline_job(tmp_path / "job.yaml",
                      "arch: flux, name_or_path: tiny, quantize: true, qtype: qint4, max_sequence_length: 256",
                      ", guidance_scale: 3.5")
    process = load_config(str(path), registry)[0].config.process[0]
    assert process.model.max_sequence_length == 256 and process.train.guidance_scale == 3.5


def test_assistant_lora_is_merged_into_the_training_transformer(tmp_path, dev):
    """An assistant LoRA (e.g. the [schnell] training adapter) in the primary form is merged before training: the
    model predicts as one wearing it, with no adapter left attached."""
    from toolkit.config.sections import NetworkConfig
    from toolkit.models.base import denoiser_component
    from toolkit.network.files import write_comfy_file
    from toolkit.network.lora import add_lora

    wearer = FluxAdapter.load(model_config(arch="flux", name_or_path="tiny"), CPU, torch.float32)
    add_lora(wearer.transformer, NetworkConfig(linear=4, linear_alpha=8), wearer.lora_target_modules())
    torch.manual_seed(3)
    for param in wearer.transformer.parameters():
        if param.requires_grad:
            param.data.normal_(0, 0.3)
    path = tmp_path / "assistant.safetensors"
    write_comfy_file(path, [denoiser_component(wearer.transformer, wearer.files)], torch.float32, {})
    merged = FluxAdapter.load(model_config(arch="flux", name_or_path="tiny", assistant_lora_path=str(path)), CPU,
                              torch.float32)
    torch.manual_seed(5)
    noisy, t = torch.randn(2, 16, 4, 4), torch.tensor([300.0, 700.0])
    embeds = dev.encode_prompts(PROMPTS)
    with torch.no_grad():
        ours, theirs, plain = (a.predict(noisy, t, embeds) for a in (merged, wearer, dev))
    torch.testing.assert_close(ours, theirs, atol=1e-5, rtol=1e-5)
    assert not torch.allclose(ours, plain, atol=1e-3)
    assert not any("lora" in name for name, _ in merged.transformer.named_modules())


def test_missing_assistant_lora_is_named(tmp_path):
    cfg = model_config(arch="flux", name_or_path="tiny", assistant_lora_path=str(tmp_path / "absent.safetensors"))
    with pytest.raises(FileNotFoundError, match="model.assistant_lora_path"):
        FluxAdapter.load(cfg, CPU, torch.float32)


@pytest.fixture(scope="module")
def flex(loaded) -> FluxAdapter:
    return loaded("tiny-flex")


def test_flex_is_told_apart_from_its_block_counts(dev, schnell, flex):
    """Flex.1 (8 double- and 38 single-stream blocks, a guidance embedding) against FLUX.1's released configs (19
    and 38, [schnell] without the embedding), and on the tiny presets: the bypass is Flex.1's default only."""
    from types import SimpleNamespace as Config

    pruned = Config(guidance_embeds=True, num_layers=8, num_single_layers=38)
    assert is_flex(pruned, "ostris/Flex.1-alpha") and is_flex(pruned, "/models/Flex.1-alpha.safetensors")
    assert not is_flex(pruned, "Freepik/flux.1-lite-8B")  # the same block counts, its guidance embedding used
    assert not is_flex(pruned, "/home/flexuser/models/flux-lite")  # the name, not the folders above it
    assert not is_flex(Config(guidance_embeds=True, num_layers=19, num_single_layers=38), "my-flex-finetune")
    assert not is_flex(Config(guidance_embeds=False, num_layers=19, num_single_layers=38), "flex")
    assert (flex.flex, flex.bypass_guidance, flex.describe()["variant"]) == (True, True, "flex.1")
    assert (dev.flex, dev.bypass_guidance, dev.describe()["variant"]) == (False, False, "dev")
    assert not schnell.flex and schnell.describe()["guidance_in_training"] == "none"


def hand_prediction(transformer, packed, sigma, embeds, text_ids, image_ids) -> torch.Tensor:
    """FluxTransformer2DModel's forward written out from its parts, with the conditioning made of the timestep and
    pooled-text embeddings alone (what ai-toolkit's bypass_guidance_embedding computes)."""
    embed = transformer.time_text_embed
    timestep = sigma.to(packed.dtype) * 1000
    temb = embed.timestep_embedder(embed.time_proj(timestep).to(embeds.pooled.dtype)) + embed.text_embedder(
        embeds.pooled)
    hidden = transformer.x_embedder(packed)
    context = transformer.context_embedder(embeds.embeds)
    rotary = transformer.pos_embed(torch.cat((text_ids, image_ids), dim=0))
    for block in [*transformer.transformer_blocks, *transformer.single_transformer_blocks]:
        context, hidden = block(hidden_states=hidden, encoder_hidden_states=context, temb=temb,
                                image_rotary_emb=rotary)
    return transformer.proj_out(transformer.norm_out(hidden, temb))


@pytest.mark.parametrize("dtype", DTYPES)
def test_the_bypassed_prediction_leaves_the_guidance_embedding_out(loaded, dtype):
    """With the bypass, the prediction is the transformer's forward computed by hand with timestep + pooled-text
    conditioning (bit for bit), differs from the [dev] path (the guidance embedded), and no training guidance value
    moves it; the sampling pipeline, which passes a guidance, still embeds it."""
    flex = loaded("tiny-flex", dtype)
    noisy = torch.randn(1, 16, 4, 4, generator=torch.Generator().manual_seed(3))
    t = torch.tensor([600.0])
    embeds = flex.encode_prompts(PROMPTS[:1])
    bypassed = flex.predict(noisy, t, embeds)
    with torch.no_grad():
        packed = FluxPipeline._pack_latents(noisy.to(dtype), 1, 16, 4, 4)
        text_ids = torch.zeros(embeds.embeds.shape[1], 3, dtype=dtype)
        image_ids = FluxPipeline._prepare_latent_image_ids(1, 2, 2, "cpu", dtype)
        by_hand = hand_prediction(flex.transformer, packed, t / 1000, PromptEmbeds(
            embeds.embeds.to(dtype), pooled=embeds.pooled.to(dtype)), text_ids, image_ids)
    assert torch.equal(bypassed, FluxPipeline._unpack_latents(by_hand, 32, 32, 8).float())
    flex.train_guidance_scale = 4.0
    try:
        assert torch.equal(flex.predict(noisy, t, embeds), bypassed)
        flex.set_guidance_bypass(False)
        embedded = flex.predict(noisy, t, embeds)
    finally:
        flex.train_guidance_scale, flex.bypass_guidance = 1.0, True
    assert not torch.allclose(embedded, bypassed, atol=1e-3)
    pipe = pipeline(flex)
    renders = [pipe(prompt=PROMPTS[0], num_inference_steps=1, guidance_scale=g, width=32, height=32,
                    output_type="latent", generator=torch.Generator().manual_seed(0)).images for g in (1.0, 4.0)]
    assert not torch.equal(*renders)


def test_a_pruned_base_without_flex_in_its_name_is_fed_the_guidance(tiny_cache, tmp_path, caplog):
    """The Flex.1 shape under another name (as FLUX.1-Lite has it) trains with its guidance embedding fed, saying
    why; asked for, the bypass keeps LoRA off the guidance embedding, which then takes no part in training."""
    import logging
    import shutil

    from toolkit.models.flux.tiny import ensure_tiny_flex

    lite = tmp_path / "flux-lite"
    shutil.copytree(ensure_tiny_flex(), lite)
    adapter = FluxAdapter.load(model_config(arch="flux", name_or_path=str(lite)), CPU, torch.float32)
    assert not adapter.flex and adapter.describe()["variant"] == "dev"
    with caplog.at_level(logging.INFO, logger="difftune"):
        adapter.use_training_guidance(None, None)
    assert not adapter.bypass_guidance and "pruned FLUX.1 layout" in caplog.text
    assert adapter.modules_without_gradients() == []
    adapter.use_training_guidance(None, True)
    assert adapter.modules_without_gradients() == ["time_text_embed.guidance_embedder"]


def test_the_bypass_is_refused_where_it_cannot_apply(loaded, schnell):
    """[schnell] has no guidance embedding to bypass; a Flex.1 base bypasses it by default, so a training guidance
    value given with it would be unused: both are errors naming the key. Turning the bypass off feeds the value."""
    from toolkit.errors import UserError

    with pytest.raises(UserError, match="train.bypass_guidance_embedding: .* has no guidance embedding"):
        schnell.use_training_guidance(None, True)
    flex = FluxAdapter.load(model_config(arch="flux", name_or_path="tiny-flex"), CPU, torch.float32)
    with pytest.raises(UserError, match="train.guidance_scale 2.0: .* Flex.1 base"):
        flex.use_training_guidance(2.0, None)
    flex.use_training_guidance(2.0, False)
    assert not flex.bypass_guidance and flex.train_guidance_scale == 2.0
    dev = FluxAdapter.load(model_config(arch="flux", name_or_path="tiny"), CPU, torch.float32)
    dev.use_training_guidance(None, True)
    assert dev.bypass_guidance and dev.describe()["guidance_in_training"] == "bypassed"
