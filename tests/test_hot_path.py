"""The training loop's hot path: values are read back from the device only for logged updates, attention
runs through PyTorch's SDPA, and `train.compile` trains through a compiled model without changing what is
trained."""

from __future__ import annotations

import time

import pytest
import torch
from helpers import make_images, trainer_process, write_job
from safetensors.torch import load_file

from jobs.job import get_job
from toolkit.config.loader import load_config
from toolkit.models.registry import get_adapter_class, model_config
from toolkit.run.metrics import Throughput, read_metrics
from toolkit.train.objective import DiffusionObjective


class DeviceValue(torch.Tensor):
    """Stands in for a tensor on an accelerator: operations on it keep the type (so everything computed from
    the model's output does), and each read back to the host is recorded."""

    reads: list[str] = []

    def item(self):
        DeviceValue.reads.append("item")
        return super().item()

    def tolist(self):
        DeviceValue.reads.append("tolist")
        return super().tolist()

    def cpu(self, *args, **kwargs):
        DeviceValue.reads.append("cpu")
        return super().cpu(*args, **kwargs)

    def numpy(self, *args, **kwargs):
        DeviceValue.reads.append("numpy")
        return super().numpy(*args, **kwargs)

    def __float__(self):
        DeviceValue.reads.append("float")
        return super().__float__()

    def __bool__(self):
        DeviceValue.reads.append("bool")
        return super().__bool__()

    def __format__(self, spec):
        DeviceValue.reads.append("format")
        return super().__format__(spec)


@pytest.fixture
def device_values(monkeypatch):
    """The model's predictions and the gradient norm become DeviceValues for the duration of a test."""
    predict, clip = DiffusionObjective.predict, torch.nn.utils.clip_grad_norm_

    def marked_predict(self, *args, **kwargs):
        prediction, blank = predict(self, *args, **kwargs)
        return prediction.as_subclass(DeviceValue), blank

    def marked_clip(*args, **kwargs):
        return clip(*args, **kwargs).as_subclass(DeviceValue)

    monkeypatch.setattr(DiffusionObjective, "predict", marked_predict)
    monkeypatch.setattr(torch.nn.utils, "clip_grad_norm_", marked_clip)
    monkeypatch.setenv("TQDM_DISABLE", "1")  # the progress bar reads the smoothed loss once a second
    DeviceValue.reads = []
    return DeviceValue


def train(tmp_path, registry, name: str, **overrides):
    data = make_images(tmp_path / "data", 4)
    process = trainer_process(tmp_path, datasets=[{"folder_path": str(data), "resolution": [32]}], **overrides)
    config, path = load_config(str(write_job(tmp_path / f"{name}.yaml", name, process)), registry)
    job = get_job(config, path, registry)
    job.run()
    return job.processes[0], read_metrics(tmp_path / "output" / name / "metrics.jsonl")


@pytest.mark.slow
def test_values_come_to_the_host_once_per_logged_update_only(tmp_path, registry, device_values):
    # 12 updates of 2 micro-batches each, logged every 6th: two reads in all, not one per update or micro-batch
    _, records = train(tmp_path, registry, "sparse", train={"steps": 12, "gradient_accumulation": 2},
                       logging={"log_every": 6})
    assert [r["step"] for r in records] == [6, 12]
    assert device_values.reads == ["tolist", "tolist"]
    assert all(r["loss"] > 0 and r["grad_norm"] > 0 and r["time"] > 0 for r in records)

    device_values.reads = []
    _, records = train(tmp_path / "every", registry, "every", train={"steps": 4}, logging={"log_every": 1})
    assert len(records) == 4 and device_values.reads == ["tolist"] * 4


@pytest.mark.slow
def test_the_progress_bar_reads_the_loss_at_most_once_a_second(tmp_path, registry, device_values, monkeypatch):
    monkeypatch.delenv("TQDM_DISABLE")
    monkeypatch.setattr("toolkit.run.monitor.time.monotonic", lambda: 1000.0)  # time stands still
    _, records = train(tmp_path, registry, "bar", train={"steps": 12}, logging={"log_every": 6})
    # update 1 for the bar (its first showing), then only the logged updates 6 and 12
    assert len(records) == 2 and device_values.reads == ["tolist"] * 3


def test_logged_time_is_the_mean_since_the_last_logged_update():
    throughput = Throughput(processes=2)
    for _ in range(4):
        throughput.count(samples=3)
    time.sleep(0.05)
    figures = throughput.read()
    assert figures["time"] == pytest.approx(figures["samples_per_s"] ** -1 * 3 * 2, rel=1e-6)
    assert figures["time"] >= 0.05 / 4
    throughput.restart()  # e.g. after saving a checkpoint: that time is not training time
    throughput.count(samples=3)
    assert throughput.read()["time"] < 0.05


@pytest.mark.parametrize("arch, extra", [
    ("sd15", {}),
    ("wuerstchen", {"image_encoder_path": "tiny", "decoder_name_or_path": "tiny"}),
    ("zimage", {}),
])
def test_attention_runs_through_sdpa(arch, extra, monkeypatch):
    adapter = get_adapter_class(arch).load(model_config(arch=arch, name_or_path="tiny", **extra),
                                           torch.device("cpu"), torch.float32)
    calls = []
    sdpa = torch.nn.functional.scaled_dot_product_attention

    def counted(*args, **kwargs):
        calls.append(1)
        return sdpa(*args, **kwargs)

    monkeypatch.setattr(torch.nn.functional, "scaled_dot_product_attention", counted)
    latents = adapter.latents_from_dist(adapter.encode_latent_dist(torch.zeros(1, 3, 64, 64)), None)
    embeds = adapter.encode_prompts(["a red circle"])
    with torch.no_grad():
        adapter.predict(latents, adapter.noise_schedule.timesteps(torch.tensor([0.5])), embeds)
    assert calls, f"{arch}: no attention layer called torch's scaled_dot_product_attention"


@pytest.mark.slow
def test_compile_trains_the_same_lora_through_a_compiled_model(tmp_path, registry):
    # aot_eager traces and runs the same graph as inductor would compile, without the C++ code generation
    settings = {"steps": 3, "batch_size": 2, "lr": 1e-3}
    eager, eager_records = train(tmp_path / "eager", registry, "eager", train=settings)
    torch._dynamo.reset()
    torch._dynamo.utils.counters.clear()
    compiled, records = train(tmp_path / "compiled", registry, "compiled",
                              train={**settings, "compile": True, "compile_backend": "aot_eager"})
    assert isinstance(compiled.trained_module, torch._dynamo.eval_frame.OptimizedModule)
    assert torch._dynamo.utils.counters["stats"]["unique_graphs"] > 0  # really compiled, not silently eager
    assert not isinstance(eager.trained_module, torch._dynamo.eval_frame.OptimizedModule)
    assert [r["loss"] for r in records] == pytest.approx([r["loss"] for r in eager_records], rel=1e-4)
    ours = load_file(tmp_path / "compiled" / "output" / "compiled" / "compiled.safetensors")
    theirs = load_file(tmp_path / "eager" / "output" / "eager" / "eager.safetensors")
    assert ours.keys() == theirs.keys()  # compiling does not rename the saved LoRA
    for key in ours:
        torch.testing.assert_close(ours[key], theirs[key], rtol=1e-3, atol=1e-6)


@pytest.mark.slow
@pytest.mark.parametrize("persistent", [True, False])
def test_dataloader_workers_are_configurable_and_end_with_the_run(tmp_path, registry, persistent, monkeypatch):
    """`train.num_workers` and `train.persistent_workers` reach the DataLoader; its worker processes are gone once
    the run has ended, persistent ones too (the trainer object, kept by its job, no longer holds them)."""
    import multiprocessing

    from toolkit.data.training_data import TrainingData

    made, make_dataloader = [], TrainingData.make_dataloader
    monkeypatch.setattr(TrainingData, "make_dataloader", lambda *a, **k: made.append(make_dataloader(*a, **k)) or made[-1])
    trainer, records = train(tmp_path, registry, "workers", train={"steps": 2, "num_workers": 1,
                                                                 "persistent_workers": persistent})
    loader = made.pop()
    assert made == [] and loader.num_workers == 1 and loader.persistent_workers is persistent
    assert len(records) == 2
    del loader
    assert multiprocessing.active_children() == [] and trainer.data.dataloader is None
