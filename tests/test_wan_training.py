"""Wan end to end on the tiny presets, through the real job path: a folder of clips and an image (Wan 2.1, quantized
base and text encoder, both caches), the sample video, the LoRA in WanPipeline in both file forms; Wan 2.2 A14B's two
experts, each trained on its own noise range with a file of its own; exact resume with the video latent cache (two
processes: tests/test_family_launches.py)."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from diffusers import WanPipeline
from helpers import (
    assert_same_training,
    held_out_without_and_with_lora,
    make_image,
    merge_sections,
    pipelines_with_lora,
    run_job,
    straight_and_resumed,
)
from helpers import trainer_process as base_process
from instrumented_run import control_after
from safetensors import safe_open
from safetensors.torch import load_file

from toolkit.data.clips import clip_info
from toolkit.network.lora import lora_state_dict
from toolkit.run.metrics import read_metrics
from toolkit.run.video import video_metadata, write_video


def moving_square(frames: int, start: int, colour: tuple[int, int, int], size: int = 32) -> np.ndarray:
    """A square of `colour` moving right one pixel per frame over a dark floor: motion to learn."""
    video = np.full((frames, size, size, 3), 20, np.uint8)
    for k in range(frames):
        left = (start + 2 * k) % (size - 8)
        video[k, 12:20, left:left + 8] = colour
    return video


def clip_folder(folder):
    """Three 9-frame clips (8 fps) and one image, with captions."""
    if not folder.exists():
        for i, colour in enumerate([(230, 40, 40), (40, 230, 40), (40, 40, 230)]):
            write_video(folder / f"clip_{i}", moving_square(9, 3 * i, colour), 8.0, {})
            (folder / f"clip_{i}.txt").write_text(f"a square moving right, colour {i}")
        make_image(folder / "still.png", (32, 32), color=(200, 200, 40), caption="a yellow floor")
    return folder


def wan_process(tmp_path, name_or_path: str = "tiny", **overrides) -> dict:
    process = base_process(tmp_path, model={"arch": "wan", "name_or_path": name_or_path},
                           datasets=[{"folder_path": str(clip_folder(tmp_path / "data")), "resolution": [32],
                                      "num_frames": 5}],
                           train={"batch_size": 2, "steps": 4, "lr": 1e-3, "dtype": "fp32", "seed": 42})
    return merge_sections(process, overrides)


def clip_batch(adapter, folder) -> tuple[torch.Tensor, list[str]]:
    """The clips' 5-frame pixels and captions, as the dataset loads them."""
    from toolkit.config.schema import DatasetConfig
    from toolkit.data.dataset import build_dataset, load_pixels

    dataset = build_dataset([DatasetConfig(folder_path=str(folder), resolution=[32], num_frames=5)], "shp",
                            adapter.divisor, frame_step=4)
    clips = [item for item in dataset.items if item.frames == 5]
    return torch.stack([load_pixels(item) for item in clips]), [item.record.caption for item in clips]


def render(pipe, steps: int = 2) -> np.ndarray:
    """A 5-frame video; A14B needs enough steps to reach the low-noise expert (its flow shift 12 keeps the first
    ones above the boundary)."""
    return pipe("shp, a square moving right", num_frames=5, height=32, width=32, num_inference_steps=steps,
                guidance_scale=1.0, output_type="np", generator=torch.Generator().manual_seed(0)).frames


@pytest.mark.slow
def test_clips_and_an_image_with_a_quantized_base_both_caches_and_its_lora_in_the_pipeline(tmp_path, registry,
                                                                                          tiny_cache):
    """Finite losses, the held-out loss on the clips falls, a 5-frame sample video at 8 fps with its prompt, and the
    LoRA (ComfyUI names, and the diffusers form) loads in WanPipeline alike, changing its output."""
    process = wan_process(tmp_path, model={"quantize": True, "qtype": "qint8", "quantize_te": True,
                                           "qtype_te": "qint8", "low_vram": True},
                          network={"linear": 4, "linear_alpha": 8},
                          train={"steps": 30, "lr": 3e-3, "cache_text_embeddings": True,
                                 "gradient_checkpointing": True},
                          save={"formats": ["diffusers"]},
                          sample={"prompts": ["shp, a square moving right"], "neg": "blurry", "width": 32,
                                  "height": 32, "sample_steps": 2, "num_frames": 5, "fps": 8})
    process["datasets"][0].update(cache_latents_to_disk=True, cache_dir=str(tmp_path / "cache"))
    trainer, run_dir = run_job(tmp_path, registry, "w", process)
    records = read_metrics(run_dir / "metrics.jsonl")
    assert len(records) == 30 and all(np.isfinite(r["loss"]) for r in records)
    assert len(list((tmp_path / "cache" / "latents").glob("*.safetensors"))) == 4  # three clips and the image
    adapter = trainer.adapter
    pixels, captions = clip_batch(adapter, tmp_path / "data")
    assert pixels.shape == (3, 3, 5, 32, 32)
    before, after = held_out_without_and_with_lora(adapter, adapter.transformer, pixels, captions)
    assert after < before * 0.97, (before, after)

    sample = run_dir / "samples" / "step_000000030_0.mp4"
    info = clip_info(sample)
    assert (info.frames, info.fps, info.width, info.height) == (5, 8.0, 32, 32)
    record = video_metadata(sample)
    assert (record["prompt"], record["pipeline"], record["negative_prompt"], record["num_frames"]) == (
        "shp, a square moving right", "WanPipeline", "blurry", "5")
    assert "<video" in (run_dir / "report.html").read_text()

    with safe_open(str(run_dir / "w.safetensors"), "pt") as handle:
        keys, header = list(handle.keys()), handle.metadata()
    assert "diffusion_model.blocks.0.self_attn.q.lora_down.weight" in keys
    assert "diffusion_model.blocks.1.cross_attn.o.alpha" in keys and "diffusion_model.blocks.1.ffn.2.lora_up.weight" in keys
    assert all(k.startswith("diffusion_model.") for k in keys)
    assert header["modelspec.architecture"] == "wan/lora" and header["ss_base_model_version"] == "wan"
    pipes = pipelines_with_lora(WanPipeline, adapter.source, run_dir, (None, "w.safetensors", "w.diffusers.safetensors"))
    base, primary, diffusers_form = (render(pipe) for pipe in pipes.values())
    assert abs(primary - base).max() > 1e-3 and abs(primary - diffusers_form).max() < 1e-5
    # `run.py --convert-lora` between the two forms (the original Wan names resolved against the model's module
    # names) gives files with the run's keys that render what the run's own files render
    import run

    for source, to, expected in (("w.safetensors", "diffusers", "w.diffusers.safetensors"),
                                 ("w.diffusers.safetensors", "comfy", "w.safetensors")):
        target = tmp_path / "converted" / f"{to}.safetensors"
        target.parent.mkdir(exist_ok=True)
        assert run.main(["--convert-lora", str(run_dir / source), str(target), "--to", to, "--arch", "wan",
                         "--model", adapter.source]) == 0
        assert load_file(str(target)).keys() == load_file(str(run_dir / expected)).keys(), to
        converted = pipelines_with_lora(WanPipeline, adapter.source, target.parent, (target.name,))
        assert abs(render(converted[target.name]) - primary).max() < 1e-5, to

@pytest.mark.slow
def test_two_experts_train_on_their_own_noise_ranges_and_write_a_file_each(tmp_path, registry, tiny_cache,
                                                                          monkeypatch):
    """Wan 2.2 A14B with low_vram (one expert on the accelerator at a time): updates alternate between the experts
    every `expert_switch_every`, each seeing only timesteps of its range (high noise from 875 up), and each LoRA is
    written to a file of its own that loads into its transformer in WanPipeline; the sample uses both."""
    from toolkit.models.wan.adapter import WanExperts

    calls: list[tuple[str, float, float]] = []
    forward = WanExperts.forward

    def recording(self, expert, **kwargs):
        t = kwargs["timestep"]
        calls.append((expert, float(t.min()), float(t.max())))
        return forward(self, expert, **kwargs)

    monkeypatch.setattr(WanExperts, "forward", recording)
    process = wan_process(tmp_path, "tiny-wan2.2-a14b", model={"expert_switch_every": 2, "low_vram": True},
                          train={"steps": 8, "batch_size": 4, "lr": 3e-3}, save={"formats": ["diffusers"]},
                          sample={"prompts": ["shp, a square"], "width": 32, "height": 32, "sample_steps": 4,
                                  "num_frames": 5})
    trainer, run_dir = run_job(tmp_path, registry, "a14b", process)
    # batch 4 over buckets of three clips and one image: one micro-batch per update
    assert [expert for expert, _, _ in calls] == ["high_noise"] * 2 + ["low_noise"] * 2 + ["high_noise"] * 2 + [
        "low_noise"] * 2
    for expert, low, high in calls:
        assert (low >= 875.0) if expert == "high_noise" else (high < 875.0), calls
    assert sorted(p.name for p in run_dir.glob("a14b*.safetensors")) == [
        "a14b_high_noise.diffusers.safetensors", "a14b_high_noise.safetensors", "a14b_low_noise.diffusers.safetensors",
        "a14b_low_noise.safetensors"]
    assert clip_info(run_dir / "samples" / "step_000000008_0.mp4").frames == 5
    pipe = WanPipeline.from_pretrained(trainer.adapter.source)
    pipe.set_progress_bar_config(disable=True)
    base = render(pipe, 8)
    pipe.load_lora_weights(str(run_dir), weight_name="a14b_high_noise.safetensors")
    assert pipe.transformer.peft_config and not getattr(pipe.transformer_2, "peft_config", None)
    high_only = render(pipe, 8)
    pipe.load_lora_weights(str(run_dir), weight_name="a14b_low_noise.safetensors", load_into_transformer_2=True,
                           adapter_name="low")
    both = render(pipe, 8)
    assert abs(high_only - base).max() > 1e-4 and abs(both - high_only).max() > 1e-4

    # a later run continues from the pair: `pretrained_lora_path` naming either file (in either form) loads each
    # expert's own
    again = wan_process(tmp_path, "tiny-wan2.2-a14b",
                        network={"pretrained_lora_path": str(run_dir / "a14b_low_noise.diffusers.safetensors")},
                        train={"steps": 1, "batch_size": 4, "lr": 1e-9})
    continued, _ = run_job(tmp_path, registry, "again", again)
    for component in continued.components:
        saved = load_file(str(run_dir / f"a14b_{component.file_part}.diffusers.safetensors"))
        now = lora_state_dict(component.module, "transformer", torch.float32)
        assert now.keys() == {k.replace(".lora_A.", ".lora.down.").replace(".lora_B.", ".lora.up.") for k in saved}
        for key, value in saved.items():
            mine = now[key.replace(".lora_A.", ".lora.down.").replace(".lora_B.", ".lora.up.")]
            torch.testing.assert_close(mine, value, rtol=0, atol=1e-6)


@pytest.mark.slow
def test_one_expert_alone(tmp_path, registry, tiny_cache, monkeypatch):
    """`model.experts: [low_noise]`: only the low-noise expert trains (timesteps below the boundary only) and only
    its file is written; the high-noise transformer has no LoRA. A control request renders a sample video mid-run,
    and the report shows it."""
    from toolkit.models.wan.adapter import WanExperts

    seen: list[tuple[str, float]] = []
    forward = WanExperts.forward

    def recording(self, expert, **kwargs):
        seen.append((expert, float(kwargs["timestep"].max())))
        return forward(self, expert, **kwargs)

    monkeypatch.setattr(WanExperts, "forward", recording)
    process = wan_process(tmp_path, "tiny-wan2.2-a14b", model={"experts": ["low_noise"]}, train={"steps": 3},
                          sample={"prompts": ["shp, a square"], "width": 32, "height": 32, "sample_steps": 2,
                                  "num_frames": 5})
    with control_after({2: ["sample"]}):  # a user's `run.py --control RUN sample` mid-run
        trainer, run_dir = run_job(tmp_path, registry, "low", process)
    assert seen and all(expert == "low_noise" and t < 875.0 for expert, t in seen)
    assert clip_info(run_dir / "samples" / "step_000000002_0.mp4").frames == 5
    assert "samples/step_000000002_0.mp4" in (run_dir / "report.html").read_text()
    assert [p.name for p in run_dir.glob("low*.safetensors")] == ["low_low_noise.safetensors"]
    adapter = trainer.adapter
    assert not getattr(adapter.transformer, "peft_config", None)
    # the untrained expert serves samples only: it waits on the CPU and visits the accelerator while they render
    assert adapter.sample_only == [adapter.transformer] and adapter.sampling.only_modules() == [adapter.transformer]


@pytest.mark.slow
def test_ctrl_c_and_rerun_continue_exactly_with_the_video_latent_cache(tmp_path, tiny_cache):
    """Two experts in turn (gradient checkpointing through both), clips through the disk latent cache, captions
    dropped at random: the same losses, LRs and both expert files, bit for bit, after a stop and a rerun."""
    process = wan_process(tmp_path, "tiny-wan2.2-a14b", network={"linear": 4, "linear_alpha": 4, "dropout": 0.1},
                          train={"steps": 6, "gradient_accumulation": 2, "lr_scheduler": "linear",
                                 "gradient_checkpointing": True},
                          save={"save_every": 2, "max_step_saves_to_keep": 3})
    process["datasets"][0].update(cache_latents_to_disk=True, cache_dir=str(tmp_path / "cache"),
                                  caption_dropout_rate=0.2)
    assert_same_training(*straight_and_resumed(tmp_path, process))


@pytest.mark.slow
def test_a_too_short_clip_is_named_before_the_model_loads(tmp_path, registry, monkeypatch):
    """The data is read before the model: a clip shorter than num_frames stops the run in seconds, naming the clip,
    instead of after minutes of loading."""
    from toolkit.data.dataset import DatasetError
    from toolkit.models.wan.adapter import WanAdapter

    loads = []
    monkeypatch.setattr(WanAdapter, "load", classmethod(lambda cls, *args, **kwargs: loads.append(args)))
    folder = tmp_path / "short"
    write_video(folder / "tiny_clip", moving_square(3, 0, (255, 0, 0)), 8.0, {})
    (folder / "tiny_clip.txt").write_text("a square")
    process = wan_process(tmp_path)
    process["datasets"] = [{"folder_path": str(folder), "resolution": [32], "num_frames": 5}]
    with pytest.raises(DatasetError, match=r"tiny_clip\.mp4: 3 frames"):
        run_job(tmp_path, registry, "short", process)
    assert loads == []
