"""Wuerstchen prior (stage C) LoRA: the tiny preset through the real job path, the image encoder's weights,
the family's config keys (a 2-process run: tests/test_family_launches.py)."""

from __future__ import annotations

import math

import pytest
import torch
from diffusers import DDPMWuerstchenScheduler
from diffusers.pipelines.deprecated.wuerstchen import WuerstchenPrior, WuerstchenPriorPipeline
from helpers import QUICKSTART_DATA, held_out_loss, run_job, trainer_process, write_job
from safetensors.torch import save_file
from torchvision.transforms import Normalize
from transformers import CLIPTextModel, CLIPTokenizer

from toolkit.config.loader import ConfigError, load_config
from toolkit.config.schema import DatasetConfig
from toolkit.data.dataset import build_dataset, load_pixels
from toolkit.models.wuerstchen.image_encoder import EfficientNetImageEncoder, read_image_encoder_state
from toolkit.models.wuerstchen.tiny import TINY_WUERSTCHEN, ensure_tiny_wuerstchen
from toolkit.run.metrics import read_metrics

TINY = {"arch": "wuerstchen", "name_or_path": "tiny", "image_encoder_path": "tiny", "decoder_name_or_path": "tiny"}
UPDATES = 40

#: the dtypes the prior's math is pinned in: float32 and bf16 (what GPU runs train in)
DTYPES = [pytest.param(torch.float32, id="float32"), pytest.param(torch.bfloat16, id="bf16")]
#: the image embeddings against the encoder's own output, scaled: torch's float32 default (0.0 measured); in bf16 both
#: sides run the encoder on the same bf16 input and scale its output in float32, so they are equal bit for bit
EMBEDDING_TOLERANCE = {torch.float32: {}, torch.bfloat16: {"rtol": 0, "atol": 0}}


def wuerstchen_process(tmp, **overrides) -> dict:
    base = {"model": TINY, "datasets": [{"folder_path": str(QUICKSTART_DATA), "resolution": [96]}]}
    return trainer_process(tmp, **{**base, **overrides})


@pytest.fixture(scope="module", params=["live", "cached"])
def trained(request, tmp_path_factory, registry, tiny_wuerstchen):
    """A 40-update run with the encoders live, and one with image-embedding and text-embedding caches."""
    tmp = tmp_path_factory.mktemp(f"wuerstchen_{request.param}")
    cached = request.param == "cached"
    process = wuerstchen_process(
        tmp,
        network={"linear": 4, "linear_alpha": 8},
        datasets=[{"folder_path": str(QUICKSTART_DATA), "resolution": [96], "cache_latents": cached}],
        train={"steps": UPDATES, "lr": 5e-3, "batch_size": 2, "cache_text_embeddings": cached},
        sample={"prompts": ["[trigger], a red circle"], "sample_steps": 2, "width": 128, "height": 128},
    )
    return run_job(tmp, registry, "wuerstchen", process)


def prior_pipeline(folder) -> WuerstchenPriorPipeline:
    """The tiny prior as users load it, part by part (the deprecated pipeline class does not reload whole)."""
    source = folder / "prior"
    pipe = WuerstchenPriorPipeline(
        prior=WuerstchenPrior.from_pretrained(source, subfolder="prior"),
        text_encoder=CLIPTextModel.from_pretrained(source, subfolder="text_encoder"),
        tokenizer=CLIPTokenizer.from_pretrained(source, subfolder="tokenizer"),
        scheduler=DDPMWuerstchenScheduler.from_pretrained(source, subfolder="scheduler"),
    )
    pipe.set_progress_bar_config(disable=True)
    return pipe


def held_out_batch(adapter):
    dataset = build_dataset([DatasetConfig(folder_path=str(QUICKSTART_DATA), resolution=[96])], "shp",
                            adapter.divisor)
    square = [item for item in dataset.items if item.bucket == (96, 96)]
    return torch.stack([load_pixels(item) for item in square]), [item.record.caption for item in square]


@pytest.mark.slow
def test_tiny_run_is_finite_and_writes_a_sample(trained):
    _, run_dir = trained
    records = read_metrics(run_dir / "metrics.jsonl")
    assert [r["step"] for r in records] == list(range(1, UPDATES + 1))
    assert all(math.isfinite(r["loss"]) for r in records)
    assert sorted(p.name for p in (run_dir / "samples").iterdir()) == [f"step_{UPDATES:09d}_0.png"]


@pytest.mark.slow
def test_default_clipping_keeps_a_random_init_prior_finite(tmp_path, registry, tiny_cache):
    """The prior predicts (x - a) / |1 - b|: at plain random init its gradient norms reach 10^4 and more. The
    default max_grad_norm (1.0) clips them (the run differs from an unclipped one) and every loss stays finite."""
    raw = ensure_tiny_wuerstchen({**TINY_WUERSTCHEN, "prior_out_scale": 1.0})
    model = {"arch": "wuerstchen", "name_or_path": str(raw / "prior"),
             "image_encoder_path": str(raw / "image_encoder.safetensors")}
    runs = {}
    for name, train in (("clipped", {}), ("unclipped", {"max_grad_norm": 0})):
        process, run_dir = run_job(tmp_path, registry, name, wuerstchen_process(
            tmp_path, model=model, train={"steps": 20, "lr": 1e-3, "batch_size": 2, **train}))
        runs[name] = (process, read_metrics(run_dir / "metrics.jsonl"))
    process, records = runs["clipped"]
    assert process.config.train.max_grad_norm == 1.0
    assert len(records) == 20 and all(math.isfinite(r["loss"]) for r in records)
    assert max(r["grad_norm"] for r in records) > 1e4  # what the clipping had to tame
    clipped = [p.detach() for p in process.lora_params]
    unclipped = [p.detach() for p in runs["unclipped"][0].lora_params]
    assert any(not torch.equal(a, b) for a, b in zip(clipped, unclipped))


@pytest.mark.slow
def test_caches_are_used_when_asked(trained):
    process, _ = trained
    cached = process.config.train.cache_text_embeddings
    assert (type(process.data.conditioning).__name__ == "CachedCaptions") == cached
    assert (process.data.dataset.latents is not None) == cached
    if cached:  # the encoders left the accelerator list for the rest of training
        assert process.adapter.image_encoder in process.placement.offloaded
        assert process.adapter.text_encoder in process.placement.offloaded


@pytest.mark.slow
def test_prior_learns_and_lora_loads_in_the_prior_pipeline(trained, tiny_wuerstchen):
    process, run_dir = trained
    adapter = process.adapter
    pipe = prior_pipeline(tiny_wuerstchen)
    pixels, captions = held_out_batch(adapter)

    def embeddings():
        return pipe("shp, a red circle", num_inference_steps=2, height=128, width=128, output_type="pt",
                    generator=torch.Generator().manual_seed(0)).image_embeddings

    before_loss = held_out_loss(adapter, pipe.prior, pixels, captions)
    before = embeddings()
    pipe.load_lora_weights(str(run_dir), weight_name="wuerstchen.safetensors")
    after_loss = held_out_loss(adapter, pipe.prior, pixels, captions)
    after = embeddings()

    assert after_loss < before_loss * 0.95, (before_loss, after_loss)
    assert (after - before).abs().max() > 1e-3
    # the file reproduces the trained prior (alpha / rank scaling included)
    adapter.prior.eval()
    assert held_out_loss(adapter, adapter.prior, pixels, captions) == pytest.approx(after_loss, rel=1e-4)


@pytest.mark.slow
def test_lora_targets_the_prior_attention(trained):
    process, _ = trained
    from safetensors import safe_open

    with safe_open(str(process.folder.final_lora), "pt") as handle:
        keys = list(handle.keys())
    assert keys and all(k.startswith("prior.") for k in keys)
    targets = {k.split(".lora.")[0].split(".attention.")[-1] for k in keys}
    assert targets == {"to_q", "to_k", "to_v", "to_out.0"}  # the tiny prior has no added k/v projections


@pytest.mark.parametrize("dtype", DTYPES)
def test_embeddings_are_the_scaled_imagenet_normalised_encoder_output(tiny_wuerstchen, dtype):
    """The encoder runs in the model's dtype on the ImageNet-normalised pixels; the embeddings the prior trains on
    are its output scaled, float32 in both dtypes (the pipeline decodes them as x 42 - 1)."""
    from toolkit.models.registry import model_config
    from toolkit.models.wuerstchen.adapter import WuerstchenAdapter

    adapter = WuerstchenAdapter.load(model_config(**TINY), torch.device("cpu"), dtype)
    pixels = torch.rand(2, 3, 64, 96) * 2 - 1
    normalise = Normalize(mean=(0.485, 0.456, 0.406), std=(0.229, 0.224, 0.225))
    with torch.no_grad():
        expected = adapter.image_encoder(normalise((pixels + 1) / 2).to(dtype)).float().add(1).div(42)
    embeddings = adapter.encode_images(pixels)
    assert embeddings.shape == (2, 16, 2, 3) and embeddings.dtype == torch.float32  # 32x smaller
    torch.testing.assert_close(embeddings, expected, **EMBEDDING_TOLERANCE[dtype])
    # the cache key follows the encoder's weights
    identity = adapter.encoder_identity("image")
    with torch.no_grad():
        adapter.image_encoder.mapper[0].weight.mul_(1.01)
    assert adapter.encoder_identity("image") != identity


@pytest.mark.parametrize("dtype", DTYPES)
def test_predict_is_the_prior_as_its_pipelines_steps_call_it(tiny_wuerstchen, dtype):
    """Each step of WuerstchenPriorPipeline (no guidance) is its scheduler's step on adapter.predict(x, t, prompt):
    the timestep is the pipeline's ratio in [0, 1] (rounded once to the model's dtype, as the pipeline rounds it) and
    the prompt the CLIP encoder's last hidden state, bit for bit in float32 and in bf16, where the prior predicts in
    bf16 on both sides; fails with the ratio flipped."""
    from toolkit.models.registry import model_config
    from toolkit.models.wuerstchen.adapter import WuerstchenAdapter

    adapter = WuerstchenAdapter.load(model_config(**{**TINY, "decoder_name_or_path": None}), torch.device("cpu"),
                                     dtype)
    pipe = WuerstchenPriorPipeline(prior=adapter.prior, text_encoder=adapter.text_encoder,
                                   tokenizer=adapter.tokenizer,
                                   scheduler=DDPMWuerstchenScheduler.from_config(adapter.scheduler.config))
    pipe.set_progress_bar_config(disable=True)
    start = torch.randn(1, 16, 3, 3, generator=torch.Generator().manual_seed(0)).to(dtype)
    seen: list[tuple[torch.Tensor, torch.Tensor]] = []

    def record(pipeline, step, t, kwargs):
        seen.append((t.clone(), kwargs["latents"].clone()))
        return {}

    pipe("a red circle", num_inference_steps=3, height=96, width=96, guidance_scale=1.0, latents=start.clone(),
         generator=torch.Generator().manual_seed(1), output_type="pt", callback_on_step_end=record)
    embeds = adapter.encode_prompts(["a red circle"])
    generator = torch.Generator().manual_seed(1)  # the step's noise, drawn as the pipeline drew it
    before = start
    for i, (t, after) in enumerate(seen):
        prediction = adapter.predict(before, t.reshape(1), embeds)
        assert prediction.dtype == dtype
        step = pipe.scheduler.step(prediction, t.reshape(1).to(dtype), before, generator=generator).prev_sample
        assert torch.equal(after, step), i
        flipped = adapter.predict(before, (1 - t).reshape(1), embeds)
        assert not torch.allclose(prediction.float(), flipped.float(), atol=1e-2)  # the check can tell t apart
        before = after
    assert len(seen) == 3


@pytest.fixture(scope="module")
def encoder_state():
    torch.manual_seed(0)
    encoder = EfficientNetImageEncoder(width=0.125).eval()
    return encoder, {k: v.clone() for k, v in encoder.state_dict().items()}


def test_image_encoder_loads_a_stage_b_checkpoint_and_safetensors(tmp_path, encoder_state):
    encoder, state = encoder_state
    checkpoint = tmp_path / "model_v2_stage_b.pt"
    torch.save({"effnet_state_dict": state, "state_dict": {"other.weight": torch.zeros(1)}}, checkpoint)
    safetensors = tmp_path / "effnet.safetensors"
    save_file({k: v.contiguous() for k, v in state.items()}, safetensors)
    pixels = torch.randn(1, 3, 64, 64)
    for path in (checkpoint, safetensors):
        loaded = EfficientNetImageEncoder.from_state_dict(read_image_encoder_state(str(path)), str(path)).eval()
        assert loaded.stage_channels == encoder.stage_channels == [8, 8, 8, 8, 16, 16, 32]
        with torch.no_grad():
            torch.testing.assert_close(loaded(pixels), encoder(pixels))


def test_tiny_encoder_has_the_real_key_layout(encoder_state):
    """Same stages and layers as torchvision's EfficientNetV2-S, so a real stage-B state dict fits its keys."""
    _, state = encoder_state
    real = EfficientNetImageEncoder(width=1.0)
    assert set(real.state_dict()) == set(state)
    assert real.state_dict()["mapper.0.weight"].shape == (16, 1280, 1, 1)


def test_image_encoder_rejects_wrong_weights_clearly(tmp_path, encoder_state):
    _, state = encoder_state
    vae_like = tmp_path / "vae.safetensors"
    save_file({"encoder.conv_in.weight": torch.zeros(8, 3, 3, 3)}, vae_like)
    with pytest.raises(ValueError, match=r"vae.safetensors: not a Wuerstchen EfficientNet image encoder"):
        EfficientNetImageEncoder.from_state_dict(read_image_encoder_state(str(vae_like)), str(vae_like))

    missing = {k: v for k, v in state.items() if not k.startswith("backbone.7.")}
    with pytest.raises(ValueError, match=r"cut.pt: not a Wuerstchen EfficientNet image encoder \(no 'backbone.7.0"):
        EfficientNetImageEncoder.from_state_dict(missing, "cut.pt")
    mixed = {**state, "mapper.0.weight": torch.zeros(16, 1280, 1, 1)}  # a full-width mapper on a tiny backbone
    with pytest.raises(ValueError, match=r"mixed.pt: weights do not fit .*: wrong shape mapper.0.weight \(1\)"):
        EfficientNetImageEncoder.from_state_dict(mixed, "mixed.pt")

    no_effnet = tmp_path / "stage_b.pt"
    torch.save({"state_dict": {"x": torch.zeros(1)}}, no_effnet)
    with pytest.raises(ValueError, match=r"stage_b.pt: no `effnet_state_dict`"):
        read_image_encoder_state(str(no_effnet))
    with pytest.raises(FileNotFoundError, match="model.image_encoder_path"):
        read_image_encoder_state(str(tmp_path / "absent.pt"))


def test_family_keys_are_checked_in_the_config(tmp_path, registry):
    no_encoder = wuerstchen_process(tmp_path, model={"arch": "wuerstchen", "name_or_path": "tiny"})
    with pytest.raises(ConfigError, match=r"model.image_encoder_path: required key is missing"):
        load_config(str(write_job(tmp_path / "a.yaml", "a", no_encoder)), registry)
    misplaced = trainer_process(tmp_path, model={"arch": "sd15", "name_or_path": "tiny", "decoder_name_or_path": "x"})
    with pytest.raises(ConfigError, match=r"model.decoder_name_or_path: not a key of arch sd15 \(only of: wuerstchen\)"):
        load_config(str(write_job(tmp_path / "b.yaml", "b", misplaced)), registry)


def test_sample_prompts_without_a_decoder_are_a_config_error(tmp_path, registry):
    """Known from the family's facts: refused when the job file is read, before any model loads."""
    process = wuerstchen_process(tmp_path, model={**TINY, "decoder_name_or_path": None},
                                 sample={"prompts": ["a red circle"], "width": 128, "height": 128})
    with pytest.raises(ConfigError, match=r"sample.prompts: wuerstchen renders sample images through another model: "
                       r"set model.decoder_name_or_path"):
        load_config(str(write_job(tmp_path / "c.yaml", "c", process)), registry)


def test_a_full_width_torchvision_encoder_loads_with_its_widths_and_outputs():
    """A reference built the way Wuerstchen's code builds it (torchvision's efficientnet_v2_s features plus the
    mapper), with non-trivial BatchNorm statistics: widths read back, same outputs, also without the
    `num_batches_tracked` counters."""
    from torch import nn
    from torchvision.models import efficientnet_v2_s

    torch.manual_seed(0)
    reference = nn.Module()
    reference.backbone = efficientnet_v2_s(weights=None).features
    reference.mapper = nn.Sequential(nn.Conv2d(1280, 16, kernel_size=1, bias=False), nn.BatchNorm2d(16))
    for module in reference.modules():
        if isinstance(module, nn.BatchNorm2d):
            module.running_mean.uniform_(-0.5, 0.5)
            module.running_var.uniform_(0.5, 2.0)
    reference.eval()
    state = {k: v for k, v in reference.state_dict().items() if not k.endswith("num_batches_tracked")}
    loaded = EfficientNetImageEncoder.from_state_dict(state, "reference").eval()
    assert loaded.stage_channels == [24, 24, 48, 64, 128, 160, 256]
    pixels = torch.randn(1, 3, 64, 64)
    with torch.no_grad():
        assert torch.equal(loaded(pixels), reference.mapper(reference.backbone(pixels)))


def test_other_efficientnets_are_refused_by_name(encoder_state):
    _, state = encoder_state
    v2_l = {**state, "backbone.8.0.weight": torch.zeros(1)}
    with pytest.raises(ValueError, match="l.pt: an EfficientNetV2-L encoder"):
        EfficientNetImageEncoder.from_state_dict(v2_l, "l.pt")
    no_stage = {k: v for k, v in state.items() if not k.startswith("backbone.3.")}
    with pytest.raises(ValueError, match=r"gap.pt: not a Wuerstchen EfficientNet image encoder \(no 'backbone.3.0"):
        EfficientNetImageEncoder.from_state_dict(no_stage, "gap.pt")
