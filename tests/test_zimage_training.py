"""Z-Image through the real job path: a qint8-quantized training transformer, a separate qfloat8 sampling
transformer that shares the trained LoRA, low-VRAM placement, memory records, and the files it writes."""

from __future__ import annotations

import logging
import math

import pytest
import torch
from diffusers import ZImagePipeline, ZImageTransformer2DModel
from helpers import QUICKSTART_DATA, held_out_loss, trainer_process, write_job
from optimum.quanto import qfloat8, qint8
from optimum.quanto.nn import QModuleMixin
from PIL import Image
from safetensors import safe_open
from safetensors.torch import load_file

import toolkit.device
from jobs.job import get_job
from toolkit.config.loader import load_config
from toolkit.config.schema import DatasetConfig
from toolkit.data.dataset import build_dataset, load_pixels
from toolkit.models.zimage.adapter import ZImageAdapter
from toolkit.models.zimage.tiny import TINY_ZIMAGE
from toolkit.quantize import quantize_blockwise, weight_bytes
from toolkit.run.metrics import read_metrics
from toolkit.run.monitor import Monitor

UPDATES = 40
MODEL = {"arch": "zimage", "name_or_path": "tiny", "quantize": True, "qtype": "qint8", "low_vram": True,
         "sampling": {"name_or_path": "tiny-turbo", "quantize": True, "qtype": "qfloat8"}}


class Records(logging.Handler):
    def __init__(self):
        super().__init__()
        self.memory: list[dict] = []

    def emit(self, record: logging.LogRecord) -> None:
        if hasattr(record, "memory"):
            self.memory.append(record.memory)


def zimage_process(tmp, **overrides) -> dict:
    base = {"model": MODEL, "datasets": [{"folder_path": str(QUICKSTART_DATA), "resolution": [64],
                                          "cache_latents": True}]}
    return trainer_process(tmp, **{**base, **overrides})


@pytest.fixture(scope="module")
def trained(tmp_path_factory, registry):
    tmp = tmp_path_factory.mktemp("zimage")
    process = zimage_process(
        tmp,
        network={"linear": 4, "linear_alpha": 8},
        save={"formats": ["diffusers"]},
        train={"steps": UPDATES, "lr": 3e-3, "batch_size": 2, "cache_text_embeddings": True,
               "timestep_type": "shift"},
        sample={"sample_every": 20, "prompts": ["[trigger], a red circle"], "sample_steps": 2,
                "width": 64, "height": 64},
        logging={"debug_memory": True},
    )
    records, logger = Records(), logging.getLogger("difftune")
    level = logger.level
    logger.addHandler(records)
    logger.setLevel(logging.INFO)
    samplings: list[dict] = []
    real_sample = Monitor.sample

    def observed_sample(self, step):
        sampler = self.sampler
        lora_params = [p for p in sampler.trained_modules[0].parameters() if p.requires_grad]
        rng, weights = torch.get_rng_state(), [p.detach().clone() for p in lora_params]
        real_sample(self, step)
        samplings.append({
            "step": step, "rng_kept": torch.equal(torch.get_rng_state(), rng),
            "training_after": sampler.trained_modules[0].training,
            "no_grads": all(p.grad is None for p in lora_params),
            "weights_kept": all(torch.equal(p, w) for p, w in zip(lora_params, weights)),
            "sampling_transformer_training": sampler.adapter.sampling_transformer.training,
        })

    try:
        with pytest.MonkeyPatch.context() as patch:
            patch.setattr(Monitor, "sample", observed_sample)
            config, path = load_config(str(write_job(tmp / "job.yaml", "zimage", process)), registry)
            job = get_job(config, path, registry)
            job.run()
    finally:
        logger.removeHandler(records)
        logger.setLevel(level)
    return job.processes[0], tmp / "output" / "zimage", records.memory, samplings


def held_out_batch(adapter):
    dataset = build_dataset([DatasetConfig(folder_path=str(QUICKSTART_DATA), resolution=[64])], "shp",
                            adapter.divisor)
    square = [item for item in dataset.items if item.bucket == (64, 64)]
    return torch.stack([load_pixels(item) for item in square]), [item.record.caption for item in square]


def quantized_types(module: torch.nn.Module) -> set:
    return {m.weight_qtype for m in module.modules() if isinstance(m, QModuleMixin)}


@pytest.mark.slow
def test_run_is_finite_and_writes_samples(trained):
    _, run_dir, _, _ = trained
    records = read_metrics(run_dir / "metrics.jsonl")
    assert [r["step"] for r in records] == list(range(1, UPDATES + 1))
    assert all(math.isfinite(r["loss"]) for r in records)
    assert sorted(p.name for p in (run_dir / "samples").iterdir()) == ["step_000000020_0.png",
                                                                        "step_000000040_0.png"]


@pytest.mark.slow
def test_transformers_are_quantized_as_asked(trained):
    process, _, _, _ = trained
    adapter = process.adapter
    assert quantized_types(adapter.transformer) == {qint8}
    assert quantized_types(adapter.sampling_transformer) == {qfloat8}
    # embedders and the final layer stay in full precision
    assert not isinstance(adapter.transformer.t_embedder.mlp[0], QModuleMixin)
    assert not any(isinstance(m, QModuleMixin) for m in adapter.transformer.all_final_layer.modules())


@pytest.mark.slow
def test_sampling_transformer_shares_the_trained_lora(trained):
    """After 40 updates the sampling transformer's LoRA tensors are the trained ones: same storage."""
    process, _, _, _ = trained
    (mirror,) = process.mirrors
    assert mirror.mirror is process.adapter.sampling_transformer
    pairs = mirror.shared_parameters()
    assert pairs and len(pairs) == len(process.lora_params)
    assert all(mine is theirs and mine.data_ptr() == theirs.data_ptr() for mine, theirs in pairs)
    trained_ids = {id(p) for p in process.lora_params}
    assert all(id(mine) in trained_ids for mine, _ in pairs)
    assert any(p.abs().sum() > 0 for p in process.lora_params if p.shape[0] > p.shape[-1])  # lora_B moved from 0


@pytest.mark.slow
def test_lora_lowers_the_held_out_loss_and_loads_in_diffusers(trained):
    process, run_dir, _, _ = trained
    adapter = process.adapter
    pixels, captions = held_out_batch(adapter)
    module = adapter.transformer
    module.eval()
    after = held_out_loss(adapter, module, pixels, captions)
    module.disable_adapters()
    try:
        before = held_out_loss(adapter, module, pixels, captions)
    finally:
        module.enable_adapters()
    assert after < before * 0.95, (before, after)

    # the unquantized base in diffusers, with the primary file (ComfyUI form) and the diffusers form: the same
    # output, and the LoRA acts
    pipe = ZImagePipeline.from_pretrained(ZImageAdapter.resolve_source("tiny"))
    pipe.set_progress_bar_config(disable=True)
    base = held_out_loss(adapter, pipe.transformer, pixels, captions)
    losses, images = [], []
    for name, adapter_name in (("zimage.safetensors", "primary"), ("zimage.diffusers.safetensors", "diffusers")):
        pipe.load_lora_weights(str(run_dir), weight_name=name, adapter_name=adapter_name)
        pipe.set_adapters([adapter_name])
        losses.append(held_out_loss(adapter, pipe.transformer, pixels, captions))
        images.append(pipe("a red circle", num_inference_steps=2, guidance_scale=0.0, width=64, height=64,
                           output_type="np", generator=torch.Generator().manual_seed(0)).images)
    assert abs(images[0] - images[1]).max() <= 1e-5
    assert losses[0] == pytest.approx(losses[1], rel=1e-5)
    assert losses[0] < base * 0.95, (base, losses[0])


@pytest.mark.slow
def test_the_primary_file_uses_the_diffusion_model_prefix(trained):
    _, run_dir, _, _ = trained
    with safe_open(str(run_dir / "zimage.safetensors"), "pt") as handle:
        keys = list(handle.keys())
    assert keys and all(k.startswith("diffusion_model.") for k in keys)
    assert "diffusion_model.layers.0.attention.to_q.lora_down.weight" in keys
    assert "diffusion_model.layers.0.attention.to_q.alpha" in keys


@pytest.mark.slow
def test_memory_records_cover_the_stages(trained):
    _, _, memory, _ = trained
    labels = [record["label"] for record in memory]
    for label in ("sampling transformer load", "sampling transformer quantization", "model load",
                  "transformer quantization", "image encoder unload", "text encoder unload", "sampling"):
        assert label in labels
    assert labels.index("sampling transformer load") < labels.index("model load")  # loaded first
    assert all("rss_before" in record and record["seconds"] >= 0 for record in memory)


@pytest.mark.slow
def test_sampling_leaves_training_state_untouched(trained):
    """Each sample() during the run: the global RNG, train mode, gradients and LoRA weights as before."""
    _, _, _, samplings = trained
    assert [s["step"] for s in samplings] == [20, 40]
    for s in samplings:
        assert s["rng_kept"] and s["training_after"] and s["no_grads"] and s["weights_kept"]
        assert not s["sampling_transformer_training"]


@pytest.mark.slow
def test_low_vram_moves_go_through_the_device_helper(tmp_path, registry, monkeypatch):
    """With low_vram, the encoders visit the accelerator only to build the caches and then leave; the sampling
    transformer arrives for sampling and leaves after it, without taking the trained LoRA along."""
    moves = []
    real = toolkit.device.safe_module_to_device

    def recording(module, device):
        moves.append((type(module).__name__, torch.device(device).type))
        return real(module, device)

    monkeypatch.setattr(toolkit.device, "safe_module_to_device", recording)
    process = zimage_process(tmp_path, train={"steps": 2, "cache_text_embeddings": True},
                             sample={"prompts": ["a red circle"], "sample_steps": 1, "width": 64, "height": 64})
    config, path = load_config(str(write_job(tmp_path / "job.yaml", "lv", process)), registry)
    job = get_job(config, path, registry)
    job.run()
    trainer = job.processes[0]
    encoders = [("Qwen3Model", "cpu"), ("AutoencoderKL", "cpu")]
    assert all(move in moves for move in encoders)
    # the last sampling round: the text encoder visits alone to encode the prompts and leaves; then the VAE and
    # the sampling transformer arrive for rendering and leave in reverse order
    assert [name for name, _ in moves[-6:]] == ["Qwen3Model", "Qwen3Model", "AutoencoderKL",
                                                 "ZImageTransformer2DModel", "ZImageTransformer2DModel",
                                                 "AutoencoderKL"]
    assert {p.device.type for p in trainer.lora_params} == {"cpu"}  # where training keeps them here
    assert all(mine is theirs for mine, theirs in trainer.mirrors[0].shared_parameters())


def test_quantized_sampling_transformer_is_about_half_of_bf16():
    """A Z-Image transformer whose blocks dominate (as in the real model): qfloat8 weights, embedders and the
    final layer kept in bf16, take at most 55 % of the bf16 bytes."""
    config = {**TINY_ZIMAGE["transformer"], "dim": 512, "n_heads": 4, "n_kv_heads": 4, "axes_dims": [32, 48, 48]}
    torch.manual_seed(0)
    transformer = ZImageTransformer2DModel(**config).to(torch.bfloat16)
    bf16 = weight_bytes(transformer)
    quantize_blockwise(transformer, "qfloat8", ZImageAdapter.quantization_blocks(transformer),
                       list(ZImageAdapter.QUANTIZATION_EXCLUDE), None)
    assert weight_bytes(transformer) <= 0.55 * bf16, weight_bytes(transformer) / bf16


@pytest.mark.slow
def test_resume_with_a_shared_sampling_lora_is_exact(tmp_path, registry):
    """2 updates, then a rerun with 4: the same LoRA as 4 updates in one go (quantized base, sampling mirror)."""
    def run(name: str, steps: int):
        process = zimage_process(tmp_path, train={"steps": steps, "batch_size": 2, "lr": 3e-3},
                                 save={"save_every": 2, "dtype": "float32"},
                                 sample={"prompts": ["a red circle"], "sample_steps": 1, "width": 64, "height": 64,
                                         "sample_every": 2})
        config, path = load_config(str(write_job(tmp_path / f"{name}.yaml", name, process)), registry)
        get_job(config, path, registry).run()
        return tmp_path / "output" / name / f"{name}.safetensors"

    run("split", 2)
    first_sample = tmp_path / "output" / "split" / "samples" / "step_000000002_0.png"
    stamp = first_sample.stat().st_mtime_ns
    split = load_file(run("split", 4))
    assert first_sample.stat().st_mtime_ns == stamp  # resumed at step 2: step 2 was not trained or sampled again
    whole = load_file(run("whole", 4))
    assert split.keys() == whole.keys()
    assert all(torch.equal(split[k], whole[k]) for k in whole)


@pytest.mark.parametrize("kind", ["lora", "lokr"])
def test_moving_the_sampling_transformer_leaves_the_trained_lora_in_place(tiny_cache, kind):
    """The mirror shares the trained LoRA's modules; while it moves (here to `meta`, where a moved tensor would
    lose its data) they are detached, so the trained LoRA stays put. Without detaching it would move along."""
    from toolkit.config.schema import NetworkConfig
    from toolkit.device import safe_module_to_device
    from toolkit.models.registry import model_config
    from toolkit.network.lora import add_lora, mirror_lora

    adapter = ZImageAdapter.load(model_config(arch="zimage", name_or_path="tiny",
                                             sampling={"name_or_path": "tiny-turbo"}), torch.device("cpu"),
                                 torch.float32)
    network = NetworkConfig(type=kind, linear=4, linear_alpha=4)
    adapted = (".lora_", ".lokr_")
    trained = add_lora(adapter.transformer, network, adapter.lora_target_modules())
    mirror = mirror_lora(adapter.transformer, adapter.sampling_transformer)

    def trained_lora_devices() -> set[str]:
        return {p.device.type for name, p in adapter.transformer.named_parameters() if any(a in name for a in adapted)}

    with mirror.detached():
        safe_module_to_device(adapter.sampling_transformer, "meta")
    assert trained_lora_devices() == {"cpu"}
    assert [id(p) for p in trained] == [id(p) for n, p in adapter.transformer.named_parameters()
                                        if any(a in n for a in adapted)]
    assert all(mine is theirs for mine, theirs in mirror.shared_parameters())  # attached again
    assert next(adapter.sampling_transformer.parameters()).device.type == "meta"
    if kind == "lora":  # the same move without detaching takes the shared LoRA modules along
        adapter.sampling_transformer.to("meta")
        assert trained_lora_devices() == {"meta"}


def test_precomputed_sampling_conditioning_renders_the_same_image(tiny_cache):
    """Sampling encodes the prompts first (so the text encoder can leave before the sampling model arrives):
    the images equal the pipeline's own encoding, with guidance and a negative prompt too."""
    from toolkit.config.schema import SampleConfig
    from toolkit.models.registry import model_config
    from toolkit.run.sampling import SampleRenderer

    adapter = ZImageAdapter.load(model_config(arch="zimage", name_or_path="tiny"), torch.device("cpu"), torch.float32)
    cfg = SampleConfig(prompts=["a red circle"], neg="blurry", guidance_scale=3.0, sample_steps=2, width=64, height=64)
    images = {}
    for name, conditioning in (("pipeline", None), ("precomputed", None)):
        renderer = SampleRenderer(cfg, None, tiny_cache / f"samples_{name}", "tiny")
        if name == "precomputed":
            conditioning = renderer.conditioning(adapter)
            assert conditioning[0] is not None
        (path,) = renderer.render(adapter, 1, conditioning=conditioning)
        images[name] = torch.tensor(list(Image.open(path).getdata()))
    assert torch.equal(images["pipeline"], images["precomputed"])


def test_quantized_text_encoder_still_encodes(tiny_cache):
    from toolkit.models.registry import model_config

    plain = ZImageAdapter.load(model_config(arch="zimage", name_or_path="tiny"), torch.device("cpu"), torch.float32)
    quantized = ZImageAdapter.load(model_config(arch="zimage", name_or_path="tiny", quantize_te=True, qtype_te="qint8"),
                                   torch.device("cpu"), torch.float32)
    assert quantized_types(quantized.text_encoder) == {qint8}
    assert not isinstance(quantized.text_encoder.embed_tokens, QModuleMixin)
    ours, theirs = quantized.encode_prompts(["a red circle"]), plain.encode_prompts(["a red circle"])
    error = (ours.embeds - theirs.embeds).norm() / theirs.embeds.norm()
    assert 0 < error < 0.05


def test_qfloat8_weights_stay_off_quantos_marlin_kernel():
    """quanto's Marlin fp8 kernel (CUDA, compute capability 8+) drops the layer bias; quantizing through
    toolkit.quantize keeps qfloat8 on the generic path."""
    from optimum.quanto.tensor.weights import qbytes

    quantize_blockwise(torch.nn.Sequential(torch.nn.Linear(64, 64)), "qfloat8")
    assert qbytes.is_extension_available("quanto_cuda") is False
    assert qbytes.is_extension_available("quanto_cpp") == qbytes.is_extension_available.__wrapped_original__("quanto_cpp")
