"""Helpers for tests: image folders and job files."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import torch
import yaml
from PIL import Image

REPO = Path(__file__).resolve().parents[1]
QUICKSTART_DATA = REPO / "config" / "examples" / "quickstart_data"


def make_image(path: Path, size: tuple[int, int], color=(120, 60, 200), caption: str | None = None) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    Image.new("RGB", size, color).save(path)
    if caption is not None:
        path.with_suffix(".txt").write_text(caption, encoding="utf-8")
    return path


def trainer_process(tmp_path: Path, **overrides) -> dict:
    """An sd_trainer process config on the tiny model and the shipped quickstart images."""
    process = {
        "type": "sd_trainer",
        "training_folder": str(tmp_path / "output"),
        "device": "cpu",
        "trigger_word": "shp",
        "network": {"type": "lora", "linear": 4, "linear_alpha": 4},
        "save": {"dtype": "float32", "save_every": 0, "max_step_saves_to_keep": 2},
        "datasets": [{"folder_path": str(QUICKSTART_DATA), "resolution": [64]}],
        "train": {"batch_size": 2, "steps": 4, "lr": 1e-3, "dtype": "fp32", "seed": 42},
        "model": {"arch": "sd15", "name_or_path": "tiny"},
    }
    return merge_sections(process, overrides)


def merge_sections(process: dict, overrides: dict) -> dict:
    """`process` with `overrides`: a dict merged into the section it names (one level), anything else replacing."""
    for key, value in overrides.items():
        if isinstance(value, dict) and isinstance(process.get(key), dict):
            process[key] = {**process[key], **value}
        else:
            process[key] = value
    return process


def run_job(tmp: Path, registry, name: str, process: dict):
    """Run a one-process job file in this process: the trainer (its adapter still loaded) and the run folder."""
    from jobs.job import get_job
    from toolkit.config.loader import load_config

    config, path = load_config(str(write_job(tmp / f"{name}.yaml", name, process)), registry)
    job = get_job(config, path, registry)
    job.run()
    return job.processes[0], Path(process["training_folder"]) / name


def two_bucket_data(folder: Path, square_caption) -> Path:
    """Three square and three wide images (buckets 64x64 and 96x48 at resolution 64, divisor 16); square image i
    is captioned `square_caption(i)`."""
    if not folder.exists():
        for i in range(3):
            make_image(folder / f"square_{i}.png", (64, 64), color=(40 + 60 * i, 200 - 50 * i, 90),
                       caption=square_caption(i))
            make_image(folder / f"wide_{i}.png", (96, 48), color=(200, 30 + 60 * i, 50 * i), caption=f"stripe {i}")
    return folder


def square_batch(folder: Path, divisor: int) -> tuple[torch.Tensor, list[str]]:
    """The pixels and captions of a dataset folder's 64x64 bucket (at resolution 64)."""
    from toolkit.config.schema import DatasetConfig
    from toolkit.data.dataset import build_dataset, load_pixels

    dataset = build_dataset([DatasetConfig(folder_path=str(folder), resolution=[64])], "shp", divisor)
    square = [item for item in dataset.items if item.bucket == (64, 64)]
    return torch.stack([load_pixels(item) for item in square]), [item.record.caption for item in square]


def write_job(path: Path, name: str, *processes: dict) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(yaml.safe_dump({"job": "extension", "config": {"name": name, "process": list(processes)}}))
    return path



def inline_job(path: Path, model: str, train: str = "", sample: str = "") -> Path:
    """A one-process job file written inline (`model`, `train` and `sample` are the insides of YAML flow mappings;
    `train` is appended after `steps: 1`): config checks without a dataset on disk."""
    path.write_text(f"""
config:
  name: t
  process:
    - type: sd_trainer
      model: {{{model}}}
      datasets: [{{folder_path: data}}]
      train: {{steps: 1{train}}}
      sample: {{{sample}}}
""")
    return path


def make_images(folder: Path, count: int, size: tuple[int, int] = (32, 32)) -> Path:
    """`count` small images with distinct colours and captions."""
    for i in range(count):
        make_image(folder / f"img_{i:04d}.png", size, color=(i * 37 % 256, i * 91 % 256, i * 53 % 256),
                   caption=f"image number {i}")
    return folder


def write_mp4(path: Path, frames: int = 12, fps: int = 10, size: tuple[int, int] = (32, 32), level: int = 20) -> Path:
    """An MPEG-4 clip of solid gray frames: frame k has gray level `level` x k (width, height: even)."""
    import av
    import numpy as np

    path.parent.mkdir(parents=True, exist_ok=True)
    with av.open(str(path), "w") as container:
        stream = container.add_stream("mpeg4", rate=fps)
        stream.width, stream.height = size
        stream.pix_fmt = "yuv420p"
        for k in range(frames):
            picture = av.VideoFrame.from_ndarray(np.full((size[1], size[0], 3), level * k, np.uint8), format="rgb24")
            for packet in stream.encode(picture):
                container.mux(packet)
        for packet in stream.encode():
            container.mux(packet)
    return path


def write_gif(path: Path, frames: int = 6, duration_ms: int = 50, size: tuple[int, int] = (32, 32),
              level: int = 20) -> Path:
    """An animated GIF (or WebP, by the suffix) of solid gray frames: frame k has gray level `level` x k."""
    path.parent.mkdir(parents=True, exist_ok=True)
    images = [Image.new("RGB", size, (level * k,) * 3) for k in range(frames)]
    images[0].save(path, save_all=True, append_images=images[1:], duration=duration_ms, loop=0)
    return path


def shown(frames, level: int = 20) -> list[int]:
    """Which generated frame each decoded one is (`write_mp4`/`write_gif`'s frame k has gray level `level` x k;
    lossy codecs keep it within a few steps): frames as uint8 [F, H, W, 3]."""
    return [round(float(frame.mean()) / level) for frame in frames]


def launch(job: Path, processes: int, cwd: Path, script: Path = REPO / "run.py",
           env: dict | None = None, timeout: int = 600, extra_jobs: list[str] = (),
           cpu_by_env: bool = True) -> subprocess.CompletedProcess:
    """`accelerate launch --multi_gpu --num_processes N run.py job [more jobs]` on the CPU (gloo), as a user
    would; several job files in one launch run one after the other in the same processes. `cpu_by_env` False
    leaves ACCELERATE_USE_CPU unset: the jobs' `device: cpu` alone must give CPU processes."""
    env = {**os.environ, "PYTHONPATH": str(REPO), "ACCELERATE_USE_CPU": "1", **(env or {})}
    if not cpu_by_env:
        env.pop("ACCELERATE_USE_CPU")
    command = [sys.executable, "-m", "accelerate.commands.launch", "--multi_gpu", "--num_processes", str(processes),
               "--num_machines", "1", "--mixed_precision", "no", "--dynamo_backend", "no",
               str(script), str(job), *extra_jobs]
    return subprocess.run(command, capture_output=True, text=True, env=env, timeout=timeout, cwd=cwd)


def held_out_loss(adapter, denoiser, pixels: torch.Tensor, captions: list[str]) -> float:
    """Loss of `denoiser` (the family's UNet, prior or transformer) on a fixed (noise, timestep) batch that
    training never draws."""
    from toolkit.train.losses import mse_loss
    from toolkit.train.seeding import seeded_generator

    latents = adapter.encode_images(pixels, seeded_generator(7, "held_out_latent")).float()
    noise = torch.randn(latents.shape, generator=seeded_generator(7, "held_out_noise"))
    t = adapter.noise_schedule.timesteps(torch.linspace(0.05, 0.95, latents.shape[0]))
    noisy = adapter.noise_schedule.add_noise(latents, noise, t)
    embeds = adapter.encode_prompts(captions)
    with torch.no_grad():
        prediction = adapter.predict(noisy, t, embeds, module=denoiser)
    return mse_loss(prediction, adapter.noise_schedule.target(latents, noise, t)).item()


def held_out_without_and_with_lora(adapter, denoiser, pixels: torch.Tensor, captions: list[str]) -> tuple[float, float]:
    """`held_out_loss` of a trained denoiser (eval mode) with its adapters disabled, then enabled."""
    denoiser.eval()
    denoiser.disable_adapters()
    before = held_out_loss(adapter, denoiser, pixels, captions)
    denoiser.enable_adapters()
    return before, held_out_loss(adapter, denoiser, pixels, captions)


def pipelines_with_lora(pipeline_class, source, run_dir: Path, names: tuple[str | None, ...]) -> dict:
    """{file name: the pipeline from `source` with that LoRA file of `run_dir` loaded} (None: without a LoRA)."""
    pipes = {}
    for name in names:
        pipe = pipeline_class.from_pretrained(source)
        pipe.set_progress_bar_config(disable=True)
        if name:
            pipe.load_lora_weights(str(run_dir), weight_name=name)
        pipes[name] = pipe
    return pipes


def straight_and_resumed(tmp_path: Path, process: dict) -> tuple[Path, Path]:
    """The job run straight through (`straight`), and the same job stopped by Ctrl-C after 3 updates (no final LoRA
    yet) and run again (`resumed`): their run folders."""
    from instrumented_run import interrupt_after

    import run

    output = Path(process["training_folder"])
    assert run.main([str(write_job(tmp_path / "a.yaml", "straight", process))]) == 0
    stopped = write_job(tmp_path / "b.yaml", "resumed", process)
    with interrupt_after(3):
        assert run.main([str(stopped)]) == 0
    assert not (output / "resumed" / "resumed.safetensors").exists()
    assert run.main([str(stopped)]) == 0
    return output / "straight", output / "resumed"


def assert_same_training(straight: Path, resumed: Path) -> None:
    """Per update the same step, loss, LR, epoch and validation loss, and the same final LoRA files (the EMA's
    included), bit for bit."""
    from safetensors.torch import load_file

    from toolkit.run.metrics import read_metrics

    def per_update(run_dir: Path) -> list[tuple]:
        return [(r["step"], r.get("loss"), r.get("lr"), r["epoch"], r.get("val_loss"))
                for r in read_metrics(run_dir / "metrics.jsonl")]

    assert per_update(resumed) == per_update(straight)
    # every final file: <name>.safetensors, and one per expert where a family writes them (<name>_high_noise...)
    files = sorted(p.name[len(straight.name):] for p in straight.glob(f"{straight.name}*.safetensors"))
    assert files and files == sorted(p.name[len(resumed.name):] for p in resumed.glob(f"{resumed.name}*.safetensors"))
    for suffix in files:
        ours = load_file(str(resumed / f"{resumed.name}{suffix}"))
        theirs = load_file(str(straight / f"{straight.name}{suffix}"))
        assert ours.keys() == theirs.keys() and all(torch.equal(ours[k], theirs[k]) for k in theirs), suffix


def pipeline_timestep(t: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """The timestep (1000 sigma) the FLUX.1 and Qwen-Image pipelines give their transformer at the scheduler's step t.
    They round t to the model's dtype before dividing by 1000 (`t.to(latents.dtype) / 1000`): in bf16 that can land
    one bf16 step away from predict's single rounding of t / 1000 (FLUX.1 at 759.6: 0.76171875 against 0.7578125;
    Qwen-Image at 582.3: 0.5859375 against 0.58203125), so predict is given the sigma the pipeline's transformer saw;
    in float32 the two are the same."""
    return t if dtype == torch.float32 else (t.to(dtype) / 1000).float() * 1000


def euler_step(latents: torch.Tensor, dt: torch.Tensor, velocity: torch.Tensor) -> torch.Tensor:
    """FlowMatchEulerDiscreteScheduler.step on the pipeline's latents (in the model's dtype) with the model output in
    the model's dtype: predict returns float32 by contract, so its output is cast back to compare like with like; the
    0-dim dt times it stays in that dtype (a 0-dim tensor does not promote), the sum is float32, cast back."""
    dtype = latents.dtype
    return (latents.float() + dt * velocity.to(dtype)).to(dtype)


def shifted_outputs(module, rows: slice):
    """A forward hook on `module` (a transformer's final projection) adding 1 to its output at token `rows`: changes
    that a prediction cut to the target's tokens must not see at the reference's tokens."""
    def hook(_module, _args, output):
        output = output.clone()
        output[:, rows] += 1.0
        return output

    return module.register_forward_hook(hook)
