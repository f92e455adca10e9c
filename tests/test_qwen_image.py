"""The Qwen-Image family on its tiny preset: the training math against QwenImagePipeline (prompt embeddings and
masks, latent normalisation, packing, the Euler steps the prediction drives, the dynamic shift), prompts of their
own lengths, LoRA targets, block-by-block quantized loading, sampling arguments and config checks."""

from __future__ import annotations

import copy

import numpy as np
import pytest
import torch
from diffusers import FlowMatchEulerDiscreteScheduler, QwenImagePipeline
from diffusers.pipelines.qwenimage.pipeline_qwenimage import calculate_shift
from helpers import euler_step, inline_job, pipeline_timestep

from toolkit.config.loader import ConfigError, load_config
from toolkit.diffusion.timesteps import shift_u
from toolkit.models.base import PromptEmbeds
from toolkit.models.qwen_image import adapter as qwen
from toolkit.models.qwen_image.adapter import QwenImageAdapter
from toolkit.models.registry import get_adapter_class, model_config
from toolkit.train.objective import concat_embeds

CPU = torch.device("cpu")
PROMPTS = ["a red circle on a blue background", "", "stripes"]


#: the dtypes the training math is pinned to the pipeline in: float32 and bf16 (what GPU runs train in). In bf16
#: both sides run the same ops in the same dtype, so prompt embeddings, packing and Euler steps are equal bit for bit
DTYPES = [pytest.param(torch.float32, id="float32"), pytest.param(torch.bfloat16, id="bf16")]
#: latents_from_dist works in float32 from the VAE's posterior whatever its dtype: float32 rounding (4.8e-7 measured)
LATENT_ATOL = {torch.float32: 1e-5, torch.bfloat16: 1e-5}


@pytest.fixture(scope="module")
def loaded(tiny_cache):
    """The tiny Qwen-Image adapter per dtype, each loaded once, when a test first asks for it."""
    adapters: dict[torch.dtype, QwenImageAdapter] = {}

    def get(dtype: torch.dtype = torch.float32) -> QwenImageAdapter:
        if dtype not in adapters:
            adapters[dtype] = QwenImageAdapter.load(model_config(arch="qwen_image", name_or_path="tiny"), CPU, dtype)
        return adapters[dtype]

    return get


@pytest.fixture(scope="module")
def adapter(loaded) -> QwenImageAdapter:
    return loaded()


def pipeline(adapter: QwenImageAdapter) -> QwenImagePipeline:
    pipe = adapter.sampling.pipeline()
    pipe.set_progress_bar_config(disable=True)
    return pipe


@pytest.fixture(scope="module")
def pipe(adapter) -> QwenImagePipeline:
    return pipeline(adapter)


def test_template_and_sizes_are_the_pipelines(adapter, pipe):
    assert get_adapter_class("qwen_image") is QwenImageAdapter
    assert qwen.PROMPT_TEMPLATE == pipe.prompt_template_encode
    assert qwen.TEMPLATE_DROP == pipe.prompt_template_encode_start_idx
    assert qwen.MAX_TOKENS == pipe.tokenizer_max_length
    # the tiny tokenizer makes the template's prefix 34 tokens, as Qwen's own does: the drop removes exactly it
    prefix = qwen.PROMPT_TEMPLATE.split("{}")[0]
    assert len(adapter.tokenizer(prefix).input_ids) == qwen.TEMPLATE_DROP
    assert adapter.divisor == 16 == pipe.vae_scale_factor * 2
    assert (adapter.sampling.default_guidance_scale, adapter.sampling.default_steps) == (4.0, 20)


@pytest.mark.parametrize("dtype", DTYPES)
def test_prompt_embeddings_and_masks_are_encode_prompts(loaded, dtype):
    adapter = loaded(dtype)
    ours = adapter.encode_prompts(PROMPTS)
    embeds, mask = pipeline(adapter).encode_prompt(PROMPTS, device=CPU)
    assert ours.embeds.dtype == embeds.dtype == dtype
    assert ours.embeds.shape == embeds.shape and torch.equal(ours.embeds, embeds)
    assert torch.equal(ours.attention_mask.long(), mask)
    assert ours.lengths.tolist() == mask.sum(dim=1).tolist()
    # the caption's own tokens come first; the template's tail (<|im_end|>, the assistant turn) stays in place
    assert adapter.text.caption_token_span(int(ours.lengths[1])) == (0, 0)  # "": the tail alone
    first, stop = adapter.text.caption_token_span(int(ours.lengths[2]))
    assert (first, stop) == (0, int(ours.lengths[2]) - int(ours.lengths[1]))
    short = QwenImageAdapter.load(model_config(arch="qwen_image", name_or_path="tiny", max_sequence_length=8), CPU,
                                  dtype)
    cut = short.encode_prompts(PROMPTS[:1])
    assert cut.embeds.shape[1] == 8 and torch.equal(cut.embeds, ours.embeds[:1, :8])
    assert short.text.overlong_prompts(PROMPTS) == [0, 2]  # "stripes" is 7 byte tokens + the 5 of the tail


@pytest.mark.parametrize("dtype", DTYPES)
def test_latents_are_normalised_as_the_pipeline_denormalises(loaded, dtype):
    """The posterior comes in the VAE's dtype; the latents are float32 in both dtypes (the formula in float32)."""
    adapter = loaded(dtype)
    pixels = torch.rand(2, 3, 32, 48) * 2 - 1
    dist = adapter.encode_latent_dist(pixels)
    assert dist.mean.shape == (2, 16, 4, 6) and dist.mean.dtype == dtype
    latents = adapter.latents_from_dist(dist, torch.Generator().manual_seed(0))
    assert latents.dtype == torch.float32
    sample = dist.mean.float() + dist.std.float() * torch.randn(dist.mean.shape,
                                                                generator=torch.Generator().manual_seed(0))
    config = adapter.vae.config
    mean = torch.tensor(config.latents_mean).view(1, 16, 1, 1)
    std = torch.tensor(config.latents_std).view(1, 16, 1, 1)
    # the pipeline's `latents / (1/std) + mean`
    assert torch.allclose(latents * std + mean, sample, atol=LATENT_ATOL[dtype])
    five_d = adapter.vae.encode(pixels.unsqueeze(2).to(dtype)).latent_dist.mean
    assert torch.equal(five_d.squeeze(2), dist.mean)


@pytest.mark.parametrize("dtype", DTYPES)
def test_prediction_packs_as_the_pipeline_does(loaded, dtype):
    """The transformer on QwenImagePipeline's own prepared latents (in the model's dtype, as the pipeline hands them)
    gives the prediction, unpacked; predict returns float32, the transformer the model's dtype."""
    adapter = loaded(dtype)
    embeds = adapter.encode_prompts(PROMPTS[:1])
    packed = pipeline(adapter).prepare_latents(1, 16, 32, 48, dtype, CPU, torch.Generator().manual_seed(3))
    assert packed.shape == (1, 2 * 3, 64)
    unpacked = QwenImagePipeline._unpack_latents(packed, 32, 48, 8).squeeze(2)
    assert torch.equal(QwenImagePipeline._pack_latents(unpacked, 1, 16, 4, 6), packed)
    sigma = torch.tensor([0.7])
    theirs = adapter.transformer(hidden_states=packed, timestep=sigma.to(dtype), encoder_hidden_states=embeds.embeds,
                                 encoder_hidden_states_mask=None, img_shapes=[[(1, 2, 3)]], return_dict=False)[0]
    ours = adapter.predict(unpacked, sigma * 1000, embeds)
    assert ours.dtype == torch.float32
    assert torch.equal(ours, QwenImagePipeline._unpack_latents(theirs, 32, 48, 8).squeeze(2).float())


@pytest.mark.parametrize("dtype", DTYPES)
def test_predict_is_the_velocity_the_pipelines_euler_steps_integrate(loaded, dtype):
    """Every step of QwenImagePipeline (no guidance) is x_next = x + (sigma_next - sigma) * predict(x, 1000 sigma),
    bit for bit in float32 and in bf16: fails with the sign or the timestep scale flipped, or the timestep one bf16
    step off."""
    adapter = loaded(dtype)
    pipe = pipeline(adapter)
    start = torch.randn(1, 16, 4, 4, generator=torch.Generator().manual_seed(0))
    seen: list[tuple[torch.Tensor, torch.Tensor]] = []

    def record(pipeline, step, t, kwargs):
        seen.append((t.clone(), kwargs["latents"].clone()))
        return {}

    pipe(prompt=PROMPTS[0], num_inference_steps=3, true_cfg_scale=1.0, width=32, height=32,
         latents=QwenImagePipeline._pack_latents(start.clone(), 1, 16, 4, 4), output_type="latent",
         callback_on_step_end=record)
    sigmas = pipe.scheduler.sigmas
    embeds = adapter.encode_prompts(PROMPTS[:1])
    before = start.to(dtype)  # prepare_latents hands the pipeline's latents over in the model's dtype
    for i, (t, after) in enumerate(seen):
        after = QwenImagePipeline._unpack_latents(after, 32, 32, 8).squeeze(2)
        assert torch.isclose(t, sigmas[i] * 1000)
        velocity = adapter.predict(before, pipeline_timestep(t, dtype).reshape(1), embeds)
        assert torch.equal(after, euler_step(before, sigmas[i + 1] - sigmas[i], velocity)), i
        flipped = adapter.predict(before, (1000 - t).reshape(1), embeds)
        assert not torch.allclose(velocity, flipped, atol=1e-3)  # the check can tell the timestep apart
        before = after
    assert len(seen) == 3


def test_a_prompt_predicts_the_same_whatever_it_is_batched_with(adapter):
    """Prompts keep their own lengths: padded to a longer neighbour (live batch, cached rows joined, or the blank
    prompt appended) they give the prediction they give alone."""
    noisy = torch.randn(2, 16, 4, 4, generator=torch.Generator().manual_seed(1))
    t = torch.tensor([400.0, 800.0])
    together = adapter.encode_prompts(["a", "a long caption with many more words than the first"])
    assert together.attention_mask[0].sum() < together.embeds.shape[1]
    alone = [adapter.encode_prompts([p]) for p in ("a", "a long caption with many more words than the first")]
    assert torch.allclose(together.embeds[0, :alone[0].embeds.shape[1]], alone[0].embeds[0], atol=1e-6)
    batched = adapter.predict(noisy, t, together)
    single = adapter.predict(noisy[:1], t[:1], alone[0])
    assert torch.allclose(batched[:1], single, atol=1e-5)
    unmasked = PromptEmbeds(together.embeds, None, together.lengths)
    assert not torch.allclose(adapter.predict(noisy, t, unmasked)[:1], single, atol=1e-3)  # the mask matters
    joined = concat_embeds(alone[1], adapter.text.blank_prompt_embeds(), 1)
    assert joined.embeds.shape[1] == alone[1].embeds.shape[1] and joined.attention_mask[1].sum() == 5


@pytest.mark.parametrize("dtype", DTYPES)
def test_dynamic_shift_is_the_pipelines_calculate_shift(loaded, dtype):
    """At 1024 px: the shift from the packed sequence length is the pipeline's `calculate_shift` with the
    released scheduler's base/max shift, and shifting u gives the scheduler's own (exponential) sigmas before its
    terminal stretch. The shift and the sigmas are float64/float32 whatever the model's dtype, so bf16 holds them to
    float32 rounding too."""
    adapter = loaded(dtype)
    latents = torch.zeros(1, 16, 128, 128, dtype=dtype)
    seq_len = adapter.noise_schedule.image_seq_len(latents)
    assert seq_len == 64 * 64
    config = adapter.scheduler.config
    assert (config.max_shift, config.max_image_seq_len, config.time_shift_type) == (0.9, 8192, "exponential")
    mu = calculate_shift(seq_len, config.base_image_seq_len, config.max_image_seq_len, config.base_shift,
                         config.max_shift)
    shift = adapter.noise_schedule.shift_schedule.shift_for(seq_len)
    assert shift == pytest.approx(np.exp(mu), rel=1e-12)
    scheduler = FlowMatchEulerDiscreteScheduler.from_config(config, shift_terminal=None)
    u = np.linspace(1.0, 1 / 8, 8)
    scheduler.set_timesteps(sigmas=u, mu=mu)
    assert torch.allclose(shift_u(torch.tensor(u), shift).float(), scheduler.sigmas[:-1], atol=1e-6)


def test_lora_targets_are_the_blocks_attention_and_mlps_that_reach_the_output(adapter):
    """Every target is a Linear and gets a gradient (DDP stops on one that does not): the last block's text-only
    path (its text queries, text output projection and text MLP) is left out, since its text output is unused."""
    from peft import LoraConfig, inject_adapter_in_model

    targets = adapter.lora_target_modules()
    modules = dict(adapter.transformer.named_modules())
    assert all(isinstance(modules[n], torch.nn.Linear) for n in targets)
    assert len(targets) == 2 * 12 - 4
    assert "transformer_blocks.0.txt_mlp.net.2" in targets and "transformer_blocks.1.txt_mlp.net.2" not in targets
    assert "transformer_blocks.1.attn.add_k_proj" in targets  # the image attends to the last block's text keys
    assert not any(n.endswith(("img_mod.1", "txt_mod.1")) for n in targets)
    transformer = copy.deepcopy(adapter.transformer)
    inject_adapter_in_model(LoraConfig(r=2, target_modules=targets + ["transformer_blocks.1.txt_mlp.net.2"]),
                            transformer)
    for name, param in transformer.named_parameters():
        param.requires_grad_("lora_B" in name)
        if "lora_B" in name:
            torch.nn.init.normal_(param)
    embeds = adapter.encode_prompts(PROMPTS[:1])
    adapter.predict(torch.randn(1, 16, 4, 4), torch.tensor([500.0]), embeds, module=transformer).square().mean().backward()
    no_grad = {n.rsplit(".lora_B", 1)[0] for n, p in transformer.named_parameters() if p.requires_grad and p.grad is None}
    assert no_grad == {"transformer_blocks.1.txt_mlp.net.2"}  # the check sees a dead target; the defaults have none


def test_quantized_loading_reads_layer_by_layer_and_keeps_the_edges(tiny_cache, adapter, monkeypatch):
    """`quantize` streams the transformer: each block's tensors are read, then quantized before the next block is
    read; embedders, the text norm and the final layers stay in full precision; `quantize_te` quantizes the
    text encoder as transformers loads it. Predictions stay close to the full-precision model's."""
    from optimum.quanto import QModuleMixin

    from toolkit import quantize

    reads: list[tuple[list[str], int]] = []
    original = quantize.StreamedWeights.read

    def recording(self, names, dtype, device, **options):
        frozen = sum(isinstance(m, QModuleMixin) and m.frozen for m in model_being_loaded[0].modules()) \
            if model_being_loaded else 0
        reads.append((names, frozen))
        return original(self, names, dtype, device, **options)

    model_being_loaded: list[torch.nn.Module] = []
    original_load = quantize.load_quantized

    def capture(empty_model, *args, **kwargs):
        model_being_loaded.append(empty_model)
        return original_load(empty_model, *args, **kwargs)

    monkeypatch.setattr(quantize.StreamedWeights, "read", recording)
    monkeypatch.setattr(qwen, "load_quantized", capture)
    quantized = QwenImageAdapter.load(model_config(arch="qwen_image", name_or_path="tiny", quantize=True,
                                                   qtype="qint8", quantize_te=True, qtype_te="qint8"), CPU,
                                      torch.float32)
    linears = {name for name, m in adapter.transformer.named_modules() if isinstance(m, torch.nn.Linear)}
    layers_read = 0
    for names, frozen in reads:  # one layer at a time, each quantized before the next is read
        layers = {n.rpartition(".")[0] for n in names if n.startswith("transformer_blocks.")} & linears
        assert frozen == layers_read and len(layers) <= 1, (names, frozen)
        layers_read += len(layers)
    blocks = [int(n.split(".")[1]) for names, _ in reads for n in names if n.startswith("transformer_blocks.")]
    assert blocks == sorted(blocks) and layers_read == 2 * 14  # block by block; 14 linears in each
    modules = dict(quantized.transformer.named_modules())
    assert isinstance(modules["transformer_blocks.0.attn.to_q"], QModuleMixin)
    assert isinstance(modules["transformer_blocks.1.img_mod.1"], QModuleMixin)
    for kept in ("img_in", "txt_in", "proj_out", "norm_out.linear", "time_text_embed.timestep_embedder.linear_1"):
        assert not isinstance(modules[kept], QModuleMixin), kept
    assert not any(p.device.type == "meta" for p in quantized.transformer.parameters())
    assert isinstance(quantized.text_encoder.model.language_model.layers[0].mlp.up_proj, QModuleMixin)
    embeds = adapter.encode_prompts(PROMPTS[:1])
    noisy, t = torch.randn(1, 16, 4, 4, generator=torch.Generator().manual_seed(2)), torch.tensor([500.0])
    full, approx = adapter.predict(noisy, t, embeds), quantized.predict(noisy, t, embeds)
    assert torch.allclose(full, approx, atol=0.05 * full.abs().max().item())
    q_embeds = quantized.encode_prompts(PROMPTS[:1])
    assert q_embeds.embeds.shape == embeds.embeds.shape


def test_a_weight_file_that_does_not_fit_the_config_is_named(tmp_path, tiny_cache):
    import shutil

    from safetensors.torch import load_file, save_file

    folder = tmp_path / "model"
    shutil.copytree(qwen.ensure_tiny_qwen_image(), folder)
    weights = folder / "transformer" / "diffusion_pytorch_model.safetensors"
    state = load_file(str(weights))
    del state["transformer_blocks.1.attn.to_q.weight"]
    save_file(state, str(weights))
    with pytest.raises(ValueError, match=r"transformer: the weights do not fit .*missing 1 tensors .*to_q"):
        QwenImageAdapter.load(model_config(arch="qwen_image", name_or_path=str(folder), quantize=True), CPU,
                              torch.float32)


def test_sampling_maps_guidance_to_true_cfg(adapter):
    sampling = adapter.sampling
    text = sampling.conditioning("a blob", "")
    assert text["prompt_embeds_mask"].all() and text["negative_prompt_embeds"].shape[1] == 6  # " " + the tail
    guided = sampling.pipeline_arguments(text, 4.0)
    assert guided["true_cfg_scale"] == 4.0 and "guidance_scale" not in guided and "negative_prompt_embeds" in guided
    # the pipeline cuts even given embeddings at its max_sequence_length (512 unless told): samples use training's
    assert guided["max_sequence_length"] == adapter.max_sequence_length == 1024
    plain = sampling.pipeline_arguments(text, 1.0)
    assert "negative_prompt_embeds" not in plain and plain["true_cfg_scale"] == 1.0
    assert (sampling.negative_prompt(""), sampling.negative_prompt("blurry")) == (" ", "blurry")  # what PNGs record


def test_a_single_transformer_file_loads_with_or_without_comfyuis_prefix(tmp_path, adapter):
    """A single file in ComfyUI's layout (diffusers' names, maybe under `model.diffusion_model.`) loads layer by
    layer, its config from `single_file_config`, quantized or not, to the folder model's weights."""
    from safetensors.torch import save_file

    state = adapter.transformer.state_dict()
    path = tmp_path / "qwen_image_bf16.safetensors"
    save_file({f"model.diffusion_model.{k}": v.contiguous() for k, v in state.items()}, str(path))
    loaded = QwenImageAdapter.load(model_config(arch="qwen_image", name_or_path=str(path),
                                                single_file_config=str(qwen.ensure_tiny_qwen_image())), CPU,
                                   torch.float32)
    assert loaded.transformer.state_dict().keys() == state.keys()
    assert all(torch.equal(loaded.transformer.state_dict()[k], v) for k, v in state.items())
    quantized = QwenImageAdapter.load(model_config(arch="qwen_image", name_or_path=str(path), quantize=True,
                                                   single_file_config=str(qwen.ensure_tiny_qwen_image())), CPU,
                                      torch.float32)
    embeds = adapter.encode_prompts(PROMPTS[:1])
    noisy, t = torch.randn(1, 16, 4, 4, generator=torch.Generator().manual_seed(4)), torch.tensor([300.0])
    full = adapter.predict(noisy, t, embeds)
    assert torch.allclose(quantized.predict(noisy, t, embeds), full, atol=0.05 * full.abs().max().item())


@pytest.mark.parametrize("model, train, message", [
    ("arch: qwen_image, name_or_path: tiny, max_sequence_length: 2000", "", "max_sequence_length"),
    ("arch: qwen_image, name_or_path: tiny", ", zero_terminal_snr: true", "train.zero_terminal_snr: the qwen_image"),
    ("arch: qwen_image, name_or_path: tiny", ", guidance_scale: 3.0", "train.guidance_scale: the qwen_image"),
])
def test_config_refuses_what_qwen_image_cannot_do(tmp_path, registry, model, train, message):
    path = inline_job(tmp_path / "job.yaml", model, train)
    with pytest.raises(ConfigError, match=message):
        load_config(str(path), registry)
