"""The Wan family on its tiny presets (Wan 2.1, Wan 2.2 TI2V-5B): the training math against WanPipeline (prompt
embeddings, latent normalisation over clips and images, the Euler steps the prediction drives, per-token timesteps),
the LoRA targets and their ComfyUI names, quantized loading, video samples and config checks."""

from __future__ import annotations

import re

import pytest
import torch
import yaml
from diffusers import FlowMatchEulerDiscreteScheduler, WanPipeline

from toolkit.config.loader import ConfigError, load_config
from toolkit.models.registry import get_adapter_class, model_config
from toolkit.models.wan import adapter as wan
from toolkit.models.wan.adapter import WanAdapter

CPU = torch.device("cpu")
PROMPTS = ["a red circle rolls over a blue floor", "", "stripes"]
PRESETS = ["tiny", "tiny-wan2.2-5b"]

#: the dtypes the training math is pinned to the pipeline in: float32 and bf16 (what GPU runs train in)
DTYPES = [pytest.param(torch.float32, id="float32"), pytest.param(torch.bfloat16, id="bf16")]
#: UMT5 (2 blocks) runs over the prompts' own tokens here and over 512 padded ones in the pipeline, the same sums in
#: another order: 7.2e-7 measured in float32; in bf16 (8 significant bits) 0.031, two bf16 steps at |x| < 4
PROMPT_ATOL = {torch.float32: 1e-5, torch.bfloat16: 0.0625}
#: latents_from_dist works in float32 from the VAE's posterior whatever its dtype: float32 rounding (4.8e-7 measured)
LATENT_TOLERANCE = {torch.float32: 1e-5, torch.bfloat16: 1e-5}


def load(name: str, dtype: torch.dtype = torch.float32, **keys) -> WanAdapter:
    return WanAdapter.load(model_config(arch="wan", name_or_path=name, **keys), CPU, dtype)


@pytest.fixture(scope="module")
def loaded(tiny_cache):
    """Wan adapters by (preset, dtype), each loaded once, when a test first asks for it."""
    adapters: dict[tuple[str, torch.dtype], WanAdapter] = {}

    def get(preset: str, dtype: torch.dtype = torch.float32) -> WanAdapter:
        if (preset, dtype) not in adapters:
            adapters[preset, dtype] = load(preset, dtype)
        return adapters[preset, dtype]

    return get


@pytest.fixture(scope="module", params=PRESETS)
def adapter(request, loaded) -> WanAdapter:
    return loaded(request.param)


def pipeline(adapter: WanAdapter) -> WanPipeline:
    """The sampling pipeline with the text encoder (which sampling leaves out), to encode prompts as WanPipeline."""
    sampling = adapter.sampling.pipeline()
    assert sampling.text_encoder is None
    pipe = WanPipeline(**{**sampling.components, "text_encoder": adapter.text_encoder},
                       boundary_ratio=sampling.config.boundary_ratio, expand_timesteps=sampling.config.expand_timesteps)
    pipe.set_progress_bar_config(disable=True)
    return pipe


@pytest.fixture(scope="module")
def pipe(adapter) -> WanPipeline:
    return pipeline(adapter)


def test_layouts_and_sizes_are_the_pipelines(adapter, pipe):
    assert get_adapter_class("wan") is WanAdapter
    assert adapter.divisor == pipe.vae_scale_factor_spatial * 2  # 16 (2.1), 32 (2.2 TI2V-5B)
    channels = adapter.transformer.config.in_channels
    assert (adapter.version, channels) in {("2.1", 16), ("2.2 TI2V-5B", 48)}
    assert adapter.expand_timesteps == (adapter.version == "2.2 TI2V-5B") == pipe.config.expand_timesteps
    assert adapter.sampling.default_fps == (24.0 if adapter.expand_timesteps else 16.0)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("preset", PRESETS)
def test_prompt_embeddings_are_the_pipelines(loaded, preset, dtype):
    adapter = loaded(preset, dtype)
    ours = adapter.encode_prompts(PROMPTS)
    theirs = pipeline(adapter).encode_prompt(PROMPTS, do_classifier_free_guidance=False, max_sequence_length=512,
                                             device=CPU)[0]
    padded = adapter.padded_embeds(ours)
    assert padded.shape == theirs.shape == (3, 512, 32) and padded.dtype == theirs.dtype == dtype
    torch.testing.assert_close(padded, theirs, rtol=0, atol=PROMPT_ATOL[dtype])
    # each prompt's own tokens with `</s>`; the rest zeros, as the pipeline pads them
    assert ours.lengths.tolist() == [int(theirs[i].abs().sum(dim=1).gt(0).sum()) for i in range(3)]
    assert adapter.text.caption_token_span(int(ours.lengths[2])) == (0, int(ours.lengths[2]) - 1)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("preset", PRESETS)
def test_latents_are_normalised_as_the_pipeline_denormalises(loaded, preset, dtype):
    """The posterior comes in the VAE's dtype; the latents are float32 in both dtypes (the formula in float32)."""
    adapter = loaded(preset, dtype)
    clip = torch.rand(1, 3, 5, 64, 64) * 2 - 1
    dist = adapter.encode_latent_dist(clip)
    assert dist.mean.shape[2] == 2  # 5 frames -> 1 + 4 / 4 latent frames
    assert dist.mean.dtype == dtype
    latents = adapter.latents_from_dist(dist, torch.Generator().manual_seed(0))
    assert latents.dtype == torch.float32
    config = adapter.vae.config
    mean = torch.tensor(config.latents_mean).view(1, -1, 1, 1, 1)
    inverse_std = 1.0 / torch.tensor(config.latents_std).view(1, -1, 1, 1, 1)
    denormalised = latents / inverse_std + mean  # exactly WanPipeline.__call__'s decode input
    sample = dist.mean.float() + dist.std.float() * torch.randn(dist.mean.shape,
                                                                generator=torch.Generator().manual_seed(0))
    tolerance = LATENT_TOLERANCE[dtype]
    torch.testing.assert_close(denormalised, sample, rtol=tolerance, atol=tolerance)
    # an image is a one-frame clip: the same latent as the clip of that frame alone (the same VAE ops on it)
    image = clip[:, :, 0]
    assert torch.equal(adapter.encode_latent_dist(image).mean, adapter.encode_latent_dist(clip[:, :, :1]).mean)


def euler_step(latents: torch.Tensor, dt: torch.Tensor, velocity: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """FlowMatchEulerDiscreteScheduler.step as WanPipeline calls it, the model output in the model's `dtype`: predict
    returns float32 by contract, so its output is cast back to compare like with like; the 0-dim dt times it stays in
    that dtype (a 0-dim tensor does not promote), the sum is float32, and the latents come back in the model's
    dtype (bf16 after the first step of a bf16 run)."""
    return (latents.float() + dt * velocity.to(dtype)).to(dtype)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("preset", PRESETS)
def test_predict_is_the_velocity_the_pipelines_euler_steps_integrate(loaded, preset, dtype):
    """Three Euler steps of WanPipeline (its own loop, per-token timesteps included) equal
    x + (sigma_next - sigma) predict(x), bit for bit in float32 and in bf16; with the timestep flipped they do not.
    The pipeline takes predict's own prompt embeddings (their match to the pipeline's encoder is the test above)."""
    adapter = loaded(preset, dtype)
    pipe = pipeline(adapter)
    shift = adapter.scheduler.config.flow_shift
    pipe.scheduler = FlowMatchEulerDiscreteScheduler(shift=shift)
    seen = []

    def record(_, i, t, kwargs):
        seen.append(kwargs["latents"].clone())
        return kwargs

    size = adapter.divisor * 2
    embeds = adapter.encode_prompts(["a red circle"])
    result = pipe(prompt_embeds=adapter.padded_embeds(embeds), num_frames=5, height=size, width=size,
                  num_inference_steps=3, guidance_scale=1.0, output_type="latent",
                  generator=torch.Generator().manual_seed(0), callback_on_step_end=record)
    x = pipe.prepare_latents(1, adapter.transformer.config.in_channels, size, size, 5, torch.float32, CPU,
                             torch.Generator().manual_seed(0))
    scheduler = FlowMatchEulerDiscreteScheduler(shift=shift)
    scheduler.set_timesteps(3)
    sigmas = scheduler.sigmas
    flipped = x.clone()
    for i in range(3):
        x = euler_step(x, sigmas[i + 1] - sigmas[i], adapter.predict(x, sigmas[i:i + 1] * 1000, embeds), dtype)
        assert torch.equal(x, seen[i]), i
        flipped = euler_step(flipped, sigmas[i + 1] - sigmas[i],
                             adapter.predict(flipped, (1 - sigmas[i:i + 1]) * 1000, embeds), dtype)
    assert torch.equal(x, result.frames)
    assert (flipped.float() - result.frames.float()).abs().max() > 1e-3


def test_a_prompt_predicts_the_same_whatever_it_is_batched_with(adapter):
    """Prompts keep their own lengths in caches and batches; the transformer always sees them padded to 512 with
    zeros, so a short prompt predicts the same alone and beside a long one."""
    from toolkit.models.base import PromptEmbeds

    noisy = torch.randn(1, adapter.transformer.config.in_channels, 2, 4, 4)
    t = torch.tensor([400.0])
    alone = adapter.predict(noisy, t, adapter.encode_prompts(["dog"]))
    both = adapter.encode_prompts(["dog", "a very long prompt about a dog running over a wide green field"])
    first = PromptEmbeds(both.embeds[:1], both.attention_mask[:1], both.lengths[:1])
    torch.testing.assert_close(adapter.predict(noisy, t, first), alone, rtol=1e-5, atol=1e-5)


def test_lora_targets_and_their_comfyui_names(adapter):
    targets = adapter.lora_target_modules()
    blocks = len(adapter.transformer.blocks)
    assert len(targets) == blocks * len(wan.BLOCK_TARGETS)
    names = {name for name, _ in adapter.transformer.named_modules()}
    assert set(targets) <= names
    renames = wan.original_wan_names(sorted(names))
    assert renames["blocks.1.attn1.to_q"] == "blocks.1.self_attn.q"
    assert renames["blocks.0.attn2.to_out.0"] == "blocks.0.cross_attn.o"
    assert renames["blocks.0.ffn.net.0.proj"] == "blocks.0.ffn.0"
    assert renames["blocks.0.ffn.net.2"] == "blocks.0.ffn.2"
    assert all(target in renames for target in targets)  # every trained layer has its ComfyUI name


def test_quantized_loading_keeps_the_edges_in_full_precision(tiny_cache):
    from optimum.quanto import QLinear

    quantized = load("tiny", quantize=True, qtype="qint8", quantize_te=True, qtype_te="qint8")
    transformer = quantized.transformer
    assert isinstance(transformer.blocks[0].attn1.to_q, QLinear)
    assert isinstance(transformer.blocks[1].ffn.net[2], QLinear)
    assert not isinstance(transformer.condition_embedder.time_embedder.linear_1, QLinear)
    assert not isinstance(transformer.proj_out, QLinear)
    assert any(isinstance(m, QLinear) for m in quantized.text_encoder.modules())
    noisy = torch.randn(1, 16, 2, 4, 4)
    assert torch.isfinite(quantized.predict(noisy, torch.tensor([500.0]), quantized.encode_prompts(["x"]))).all()


def test_a_video_sample_has_the_asked_frames_and_its_metadata(tmp_path, tiny_cache):
    from toolkit.config.sections import SampleConfig
    from toolkit.data.clips import clip_info
    from toolkit.run.sampling import SampleRenderer
    from toolkit.run.video import video_metadata

    adapter = load("tiny")
    cfg = SampleConfig(prompts=["a red ball"], width=32, height=32, num_frames=9, fps=8, sample_steps=2)
    renderer = SampleRenderer(cfg, None, tmp_path, "tiny")
    [path] = renderer.render(adapter, step=3, conditioning=renderer.conditioning(adapter))
    assert path.name == "step_000000003_0.mp4"
    info = clip_info(path)
    assert (info.frames, info.fps, info.width, info.height) == (9, 8.0, 32, 32)
    record = video_metadata(path)
    assert (record["prompt"], record["seed"], record["step"], record["num_frames"]) == ("a red ball", "42", "3", "9")


def job_file(folder, model: dict, dataset: dict, sample: dict):
    (folder / "data").mkdir(exist_ok=True)
    process = {"type": "sd_trainer", "model": model, "train": {"steps": 1}, "sample": sample,
               "datasets": [{"folder_path": str(folder / "data"), **dataset}]}
    path = folder / "job.yaml"
    path.write_text(yaml.safe_dump({"config": {"name": "t", "process": [process]}}))
    return path


@pytest.mark.parametrize("dataset, sample, message", [
    ({"num_frames": 8}, {}, "datasets[0].num_frames: Wan takes 4k + 1 frames (e.g. 5 or 9), not 8"),
    ({}, {"num_frames": 16}, "sample.num_frames: Wan takes 4k + 1 frames (e.g. 13 or 17), not 16"),
])
def test_config_refuses_frame_counts_wan_cannot_take(tmp_path, registry, dataset, sample, message):
    path = job_file(tmp_path, {"arch": "wan", "name_or_path": "tiny"}, dataset, sample)
    with pytest.raises(ConfigError, match=re.escape(message)):
        load_config(str(path), registry)


def test_image_families_refuse_frames(tmp_path, registry):
    path = job_file(tmp_path, {"arch": "sd15", "name_or_path": "tiny"}, {"num_frames": 5, "fps": 8},
                    {"num_frames": 5})
    with pytest.raises(ConfigError) as error:
        load_config(str(path), registry)
    text = str(error.value)
    assert "datasets[0].num_frames: Stable Diffusion" in text and "images only" in text
    assert "datasets[0].fps" in text and "sample.num_frames" in text


def test_move_frozen_moves_the_base_and_leaves_the_lora(tiny_cache):
    """What an idle expert parks under low_vram: every frozen tensor (block weights, a block's own modulation table,
    buffers) moves; the LoRA the optimizer holds stays."""
    from toolkit.config.sections import NetworkConfig
    from toolkit.device import move_frozen
    from toolkit.network.lora import add_lora

    transformer = load("tiny").transformer
    lora = add_lora(transformer, NetworkConfig(linear=2, linear_alpha=2), wan.BLOCK_TARGETS)
    move_frozen(transformer, "meta")
    assert all(p.device.type == "cpu" for p in lora)
    frozen = [(n, p) for n, p in transformer.named_parameters() if not p.requires_grad]
    assert frozen and all(p.device.type == "meta" for _, p in frozen), [n for n, p in frozen if p.device.type != "meta"]
    assert transformer.blocks[0].scale_shift_table.device.type == "meta"
    assert all(b.device.type == "meta" for b in transformer.buffers())


def test_low_vram_keeps_one_expert_on_the_accelerator(tiny_cache, monkeypatch):
    """Two experts with low_vram: whichever runs (through the trainer's expert module or the pipeline's own calls)
    is brought first and the other parked, once per switch."""
    moves: list[tuple[str, str]] = []
    adapter = load("tiny-wan2.2-a14b", low_vram=True)
    names = {id(adapter.transformer): "high_noise", id(adapter.transformer_2): "low_noise"}
    monkeypatch.setattr(wan, "move_frozen", lambda module, device: moves.append((names[id(module)], str(device))))
    adapter.swap.device = torch.device("meta")  # where the running expert goes, told apart from the CPU
    embeds = adapter.encode_prompts(["a cat"])
    noisy = torch.randn(1, 16, 2, 4, 4)
    for t in (950.0, 990.0, 300.0, 100.0, 900.0):
        adapter.predict(noisy, torch.tensor([t]), embeds)
    assert moves == [("low_noise", "cpu"), ("high_noise", "meta"),  # the first run: high noise arrives
                     ("high_noise", "cpu"), ("low_noise", "meta"),  # switch to low noise
                     ("low_noise", "cpu"), ("high_noise", "meta")]  # and back
    assert adapter.swap is not None and adapter.sample_only == []


def test_expert_files_are_found_beside_either_in_any_form():
    from pathlib import Path

    from toolkit.network.files import part_file

    parts = list(wan.EXPERTS)
    assert part_file(Path("/r/x_high_noise.safetensors"), "low_noise", parts) == Path("/r/x_low_noise.safetensors")
    assert part_file(Path("/r/x_low_noise.diffusers.safetensors"), "high_noise", parts) == Path(
        "/r/x_high_noise.diffusers.safetensors")
    assert part_file(Path("/r/x.safetensors"), "low_noise", parts) == Path("/r/x.safetensors")  # one file for both


def test_a_one_transformer_wan_refuses_expert_keys(tiny_cache):
    from toolkit.errors import UserError

    with pytest.raises(UserError, match="model.experts: tiny has one transformer"):
        load("tiny", experts=["low_noise"])
    with pytest.raises(UserError, match="model.expert_switch_every: tiny has one transformer"):
        load("tiny", expert_switch_every=3)


def test_an_assistant_lora_per_expert_merges_into_its_expert(tmp_path, tiny_cache):
    """Two experts take one assistant LoRA each (`x_high_noise` / `x_low_noise`, the path naming either): each merges
    into its own expert; a path naming no expert is refused, naming the convention."""
    from safetensors.torch import save_file

    from toolkit.errors import UserError

    reference = load("tiny-wan2.2-a14b")
    for expert, scale in (("high_noise", 1.0), ("low_noise", -2.0)):
        state = {}
        for target in ("attn1.to_q", "ffn.net.2"):
            module = reference.transformer.blocks[0].get_submodule(target)
            state[f"transformer.blocks.0.{target}.lora_A.weight"] = torch.full((2, module.in_features), 0.01)
            state[f"transformer.blocks.0.{target}.lora_B.weight"] = torch.full((module.out_features, 2), scale)
        save_file(state, str(tmp_path / f"assist_{expert}.safetensors"))
    merged = load("tiny-wan2.2-a14b", assistant_lora_path=str(tmp_path / "assist_low_noise.safetensors"))
    for name, scale in (("transformer", 1.0), ("transformer_2", -2.0)):
        before = getattr(reference, name).blocks[0].attn1.to_q.weight
        after = getattr(merged, name).blocks[0].attn1.to_q.weight
        torch.testing.assert_close(after - before, torch.full_like(before, 2 * 0.01 * scale), rtol=1e-4, atol=1e-6)
    (tmp_path / "plain.safetensors").write_bytes((tmp_path / "assist_high_noise.safetensors").read_bytes())
    with pytest.raises(UserError, match="_high_noise.safetensors and <x>_low_noise"):
        load("tiny-wan2.2-a14b", assistant_lora_path=str(tmp_path / "plain.safetensors"))


def test_the_validation_loss_covers_the_noise_levels_of_the_trained_experts(tiny_cache):
    both = load("tiny-wan2.2-a14b")
    boundary = both.boundary_ratio
    assert both.trains_noise_level(boundary + 0.01) and both.trains_noise_level(0.01)
    low_only = load("tiny-wan2.2-a14b", experts=["low_noise"])
    assert low_only.trains_noise_level(boundary - 0.01) and not low_only.trains_noise_level(boundary + 0.01)
    assert load("tiny").trains_noise_level(0.99)
