"""When a run goes wrong it says what happened and loses nothing. Faults are injected inside the real trainer
(`DIFFTUNE_TEST_FAULTS`, toolkit/run/faults.py: a test hook in the code path, not a mock of it): non-finite losses
with `train.on_nan: stop` and `skip`."""

from __future__ import annotations

import json
import logging

import pytest
import torch
from helpers import QUICKSTART_DATA, assert_same_training, straight_and_resumed, trainer_process, write_job

import run
from toolkit.run.checkpoint import OPTIMIZER_FILE
from toolkit.run.faults import ENV, Faults
from toolkit.run.metrics import read_metrics
from toolkit.train.nonfinite import NonFiniteWatch, RunFacts, likely_causes

FACTS = RunFacts(lr=1e-4, optimizer="adamw", max_grad_norm=1.0, train_dtype="no", model_dtype="fp32", arch="sd15",
                 resumed_at=0)


def run_with_faults(monkeypatch, tmp_path, spec: str, name: str, **overrides) -> int:
    monkeypatch.setenv(ENV, spec)
    return run.main([str(write_job(tmp_path / f"{name}.yaml", name, trainer_process(tmp_path, **overrides)))])


def checkpoint_steps(run_dir) -> list[int]:
    return sorted(int(p.name.split("_")[1]) for p in (run_dir / "checkpoints").glob("step_*"))


def test_faults_parse_and_act_only_where_listed():
    faults = Faults.parse("nan_loss@3, oom@sampling, memory@training:2")
    loss = torch.tensor(0.5)
    assert faults.loss(loss, 2) is loss and torch.isnan(faults.loss(loss, 3))
    faults.phase("training")
    with pytest.raises(MemoryError):
        faults.phase("training")  # its second entry
    faults.phase("training")
    with pytest.raises(torch.OutOfMemoryError, match="sampling"):
        faults.phase("sampling")
    assert Faults.parse("") == Faults()
    with pytest.raises(ValueError, match="nan_loss@N"):
        Faults.parse("nan@3")


def test_a_nan_loss_stops_the_run_at_the_next_read_and_keeps_the_last_checkpoint(monkeypatch, tmp_path, caplog):
    """on_nan stop (the default): micro-batch 3 makes update 3 NaN; the flags wait on the device until the next
    save (update 4, no metrics line before it), which is refused: the checkpoint of update 2 stays the newest, bit
    for bit the clean run's, and the message names the update, its two files, the values and the likely causes."""
    caplog.set_level(logging.INFO, logger="difftune")
    clean = run_with_faults(monkeypatch, tmp_path, "", "clean", train={"steps": 2},
                            save={"save_every": 2}, logging={"log_every": 10})
    assert clean == 0
    code = run_with_faults(monkeypatch, tmp_path, "nan_loss@3", "nan", train={"steps": 6},
                           save={"save_every": 2}, logging={"log_every": 10})
    assert code == 1
    folder = tmp_path / "output" / "nan"
    assert checkpoint_steps(folder) == [2] and not (folder / "nan.safetensors").exists()
    assert not list((folder / "checkpoints").glob(".tmp*"))
    from safetensors.torch import load_file

    ours = load_file(str(folder / "checkpoints" / "step_000000002" / "lora.safetensors"))
    theirs = load_file(str(tmp_path / "output" / "clean" / "checkpoints" / "step_000000002" / "lora.safetensors"))
    assert all(torch.equal(ours[k], theirs[k]) for k in theirs)
    message = next(r.message for r in caplog.records if "non-finite" in r.message)
    assert message.startswith("update 3: non-finite loss, grad_norm (train.on_nan: stop)")
    named = [part for part in message.split("the batch's files: ")[1].split("\n")[0].split(", ")]
    assert len(named) == 2 and all((QUICKSTART_DATA / p.split("/")[-1]).is_file() for p in named)
    assert "found at update 4" in message and "the weights diverged" in message
    status = json.loads((folder / "status.json").read_text())
    assert status["state"] == "failed" and "update 3" in status["last_error"]


def test_on_nan_skip_drops_the_update_and_counts_it(monkeypatch, tmp_path, caplog):
    """on_nan skip: the NaN update takes no optimizer step and no LR step and does not count toward train.steps;
    metrics.jsonl says so; the LR of every update is the schedule's for that update; Adam stepped 5 times."""
    caplog.set_level(logging.WARNING, logger="difftune")
    code = run_with_faults(monkeypatch, tmp_path, "nan_loss@3", "skip",
                           train={"steps": 5, "on_nan": "skip", "lr_scheduler": "linear", "lr": 1e-3})
    assert code == 0
    folder = tmp_path / "output" / "skip"
    records = read_metrics(folder / "metrics.jsonl")
    assert [r["step"] for r in records if "loss" in r] == [1, 2, 3, 4, 5]
    assert [(r["step"], r["skipped_updates"]) for r in records if "skipped_update" in r] == [(3, 1)]
    lrs = [r["lr"] for r in records if "loss" in r]
    assert lrs == pytest.approx([1e-3 * (1 - k / 5) for k in range(5)])  # linear decay by real updates
    assert all(torch.isfinite(torch.tensor(r["loss"])) for r in records if "loss" in r)
    state = torch.load(folder / "checkpoints" / "step_000000005" / OPTIMIZER_FILE, weights_only=False)["state"]
    assert {int(s["step"]) for s in state.values()} == {5}
    assert any("update 3: non-finite loss" in r.message and "skipped" in r.message for r in caplog.records)
    train_state = json.loads((folder / "checkpoints" / "step_000000005" / "train_state.json").read_text())
    assert train_state["skipped_updates"] == 1


@pytest.mark.slow
def test_a_skipped_update_resumes_exactly(monkeypatch, tmp_path):
    """A run that skips update 5's NaN batch, straight through and stopped by Ctrl-C after update 3 then resumed:
    the same updates, losses, LRs, skip line and final LoRA, bit for bit."""
    monkeypatch.setenv(ENV, "nan_loss@5")
    process = trainer_process(tmp_path, train={"steps": 6, "on_nan": "skip", "lr_scheduler": "cosine"})
    straight, resumed = straight_and_resumed(tmp_path, process)
    assert_same_training(straight, resumed)
    assert [r["step"] for r in read_metrics(resumed / "metrics.jsonl") if "skipped_update" in r] == [5]


def test_the_run_stops_past_max_skipped_updates(monkeypatch, tmp_path, caplog):
    caplog.set_level(logging.ERROR, logger="difftune")
    code = run_with_faults(monkeypatch, tmp_path, "nan_loss@2,nan_loss@3", "many",
                           train={"steps": 5, "on_nan": "skip", "max_skipped_updates": 1})
    assert code == 1
    assert any("more than train.max_skipped_updates (1)" in r.message for r in caplog.records)
    assert not (tmp_path / "output" / "many" / "many.safetensors").exists()


def test_fp16_scaler_skips_are_not_on_nan_events_but_a_nan_loss_is(monkeypatch, tmp_path, caplog):
    """fp16 on the CPU uses a GradScaler, whose overflow skips are no on_nan events (the run trains to the end); a
    NaN loss under fp16 stops the run at once (the scaler's skip read the device already), saying fp16 is a likely
    cause."""
    caplog.set_level(logging.ERROR, logger="difftune")
    assert run_with_faults(monkeypatch, tmp_path, "", "fp16", train={"steps": 3, "dtype": "fp16"}) == 0
    code = run_with_faults(monkeypatch, tmp_path, "nan_loss@2", "fp16nan", train={"steps": 3, "dtype": "fp16"})
    assert code == 1
    message = next(r.message for r in caplog.records if "non-finite" in r.message)
    assert "non-finite loss" in message and "grad_norm" not in message.split("\n")[0] and "bf16" in message


def test_likely_causes_follow_the_configuration():
    assert "fp16 overflows" in likely_causes(RunFacts(**{**FACTS.__dict__, "train_dtype": "fp16"}), 5, ["loss"])[0]
    assert "the gradients overflowed" in likely_causes(FACTS, 5, ["grad_norm"])[0]
    assert "the first update of this run" in likely_causes(FACTS, 1, ["loss", "grad_norm"])[0]
    high = likely_causes(RunFacts(**{**FACTS.__dict__, "lr": 5e-3, "max_grad_norm": 0.0}), 9, ["loss"])
    assert any("is high for adamw" in c for c in high) and any("not clipped" in c for c in high)
    resumed = RunFacts(**{**FACTS.__dict__, "resumed_at": 100})
    assert "the first update of this run" in likely_causes(resumed, 101, ["loss"])[0]


def test_the_stop_watch_reads_the_device_only_when_checked():
    """watch() keeps device flags and never reads them; check() reads all of them at once."""
    watch = NonFiniteWatch("stop", 10, FACTS)
    values = torch.tensor([0.1, float("nan")])
    watch.watch(1, ["loss", "grad_norm"], torch.tensor([0.1, 0.2]), ["a.png"])
    watch.watch(2, ["loss", "grad_norm"], values, ["b.png"])
    assert len(watch.pending) == 2 and all(isinstance(w.finite, torch.Tensor) for w in watch.pending)
    with pytest.raises(Exception, match=r"update 2: non-finite grad_norm[\s\S]*b\.png"):
        watch.check(2)
    assert watch.pending == []
    watch.check(3)  # nothing pending: nothing read
    for step in range(1, NonFiniteWatch.MAX_PENDING + 1):  # a run that logs rarely: read once per MAX_PENDING
        watch.watch(step, ["loss"], torch.tensor([0.1]), [])
    assert watch.pending == []


# ---- out of memory ----------------------------------------------------------------------------------------


@pytest.mark.parametrize("spec, phase_words, suggestion, checkpoint", [
    ("oom@loading", "accelerator memory while loading the model", None, None),
    ("oom@caching", "while caching latents and text embeddings", "cache_latents_to_disk", None),
    ("oom@training:3", "while training (update 3, bucket 64x64, 2 per micro-batch)",
     "train.gradient_checkpointing: true", 2),
    ("memory@training:3", "out of host memory while training", "train.batch_size: 1", 2),
    ("oom@saving:2", "while saving a checkpoint", "free host memory", 2),
    ("oom@final", "while writing the final LoRA files", "fewer save.formats", 4),
])
def test_out_of_memory_in_each_phase_is_one_message_and_keeps_the_checkpoint(
        monkeypatch, tmp_path, caplog, spec, phase_words, suggestion, checkpoint):
    """An out-of-memory error raised where the run enters a phase: one message naming the phase (in training the
    update, bucket and batch), the memory figures and what would lower it; the run stops with its last checkpoint
    complete (and said so), nothing partial under a final name."""
    caplog.set_level(logging.ERROR, logger="difftune")
    code = run_with_faults(monkeypatch, tmp_path, spec, "oom", train={"steps": 4}, save={"save_every": 2})
    assert code == 1
    message = next(r.message for r in caplog.records if "memory while" in r.message)
    assert phase_words in message and "memory now: process:" in message and "MemoryError" not in message
    if suggestion:
        assert suggestion in message
    folder = tmp_path / "output" / "oom"
    if checkpoint:
        assert checkpoint_steps(folder)[-1] == checkpoint and f"checkpoint of update {checkpoint} is complete" in message
    assert not list((folder / "checkpoints").glob(".tmp*")) if (folder / "checkpoints").exists() else True
    assert not (folder / "oom.safetensors").exists()
    assert json.loads((folder / "status.json").read_text())["state"] == "failed"


def test_running_out_of_memory_while_sampling_skips_the_samples_and_trains_on(monkeypatch, tmp_path, caplog):
    caplog.set_level(logging.WARNING, logger="difftune")
    code = run_with_faults(monkeypatch, tmp_path, "oom@sampling", "samples", train={"steps": 2},
                           sample={"prompts": ["shp"], "sample_every": 2, "sample_at_start": True, "width": 64,
                                   "height": 64, "sample_steps": 2})
    assert code == 0
    assert any("samples of step 0 skipped; training goes on" in r.message and "sample.width" in r.message
               for r in caplog.records)
    folder = tmp_path / "output" / "samples"
    assert (folder / "samples.safetensors").exists()
    assert [p.name for p in (folder / "samples").glob("*.png")] and not list((folder / "samples").glob("*000000000*"))


def test_memory_suggestions_are_ranked_by_what_they_would_save():
    from toolkit.run.out_of_memory import JobMemory, out_of_memory_message, suggestions

    job = JobMemory(denoiser_bytes=8 * 2**30, text_encoder_bytes=4 * 2**30, image_encoder_bytes=2**28,
                    has_quantize=True, quantized=False, has_low_vram=True, low_vram=False,
                    gradient_checkpointing=False, batch_size=4, resolution=1024, cache_latents=False,
                    cache_text=False, sample_size=(1024, 1024), on_accelerator=True)
    ranked = suggestions("training", job, used=30 * 2**30)  # 30 GiB in use: about 17.75 GiB of activations
    savings = [s for s, _ in ranked]
    assert savings == sorted(savings, reverse=True)
    assert ranked[0][1].startswith("train.batch_size: 1") and ranked[1][1].startswith("train.gradient_checkpointing")
    assert any(text.startswith("model.quantize: true") for _, text in ranked)
    done = JobMemory(**{**job.__dict__, "gradient_checkpointing": True, "batch_size": 1, "quantized": True,
                        "low_vram": True})
    assert [text.split(":")[0] for _, text in suggestions("training", done, used=30 * 2**30)] == [
        "datasets[].resolution"]
    figures = {"allocated": 30 * 2**30, "reserved": 31 * 2**30, "peak": 31 * 2**30, "free": 2**29,
               "total": 32 * 2**30, "rss": 6 * 2**30}
    text = out_of_memory_message("training", "bucket 1024x1024", job, torch.OutOfMemoryError("x"), figures)
    assert text.startswith("out of accelerator memory while training (bucket 1024x1024).")
    assert "30.0 GiB allocated, 31.0 GiB reserved, peak 31.0 GiB, 0.5 GiB free of 32.0 GiB" in text


# ---- files that go bad while the run is on ----------------------------------------------------------------


def copied_data(tmp_path):
    import shutil

    folder = tmp_path / "data"
    shutil.copytree(QUICKSTART_DATA, folder, ignore=shutil.ignore_patterns("_difftune_cache"))
    return folder


def test_an_image_deleted_and_one_damaged_mid_run_are_replaced_named_and_counted(tmp_path, caplog):
    """After update 2 one image is deleted and another overwritten with garbage (images decoded every draw): the run
    trains to the end; each file is named once in a warning, its samples stand in from the next readable image of
    the bucket, and metrics.jsonl counts them."""
    from instrumented_run import wrapped

    from toolkit.run.monitor import Monitor

    caplog.set_level(logging.WARNING, logger="difftune")
    data = copied_data(tmp_path)
    process = trainer_process(tmp_path, datasets=[{"folder_path": str(data), "resolution": [64]}],
                              train={"steps": 8, "decoded_images_gib": 0})

    def spoil_after_two(original):
        def after_update(self, update, readings, evaluated=None, extra=None):
            read = original(self, update, readings, evaluated, extra)
            if update.step == 2:
                (data / "00_red_circle.png").unlink()
                (data / "01_yellow_square.png").write_bytes(b"not an image")
            return read
        return after_update

    with wrapped(Monitor, "after_update", spoil_after_two):
        assert run.main([str(write_job(tmp_path / "bad.yaml", "bad", process))]) == 0
    named = [r.message for r in caplog.records if "replaced by the next readable one" in r.message]
    assert len(named) == 2 and any("00_red_circle.png" in m for m in named) and any("01_yellow" in m for m in named)
    records = [r for r in read_metrics(tmp_path / "output" / "bad" / "metrics.jsonl") if "loss" in r]
    assert [r["step"] for r in records] == list(range(1, 9)) and records[-1]["replaced_samples"] == 2
    assert "replaced_samples" not in records[0]


def test_a_cache_entry_damaged_between_runs_is_encoded_again(tmp_path, caplog):
    """A latent cache on disk, one entry overwritten with garbage after the run that built it: the next run encodes
    it again from its image (warning once, counting it), writes it anew, and trains to the end."""
    from safetensors.torch import load_file

    caplog.set_level(logging.WARNING, logger="difftune")
    data = copied_data(tmp_path)
    process = trainer_process(tmp_path, datasets=[{"folder_path": str(data), "resolution": [64],
                                                   "cache_latents_to_disk": True}], train={"steps": 2})
    assert run.main([str(write_job(tmp_path / "first.yaml", "first", process))]) == 0
    entries = sorted(p for p in data.rglob("*.safetensors"))
    assert len(entries) == 8
    entries[3].write_bytes(b"damaged")
    process["train"]["steps"] = 4
    assert run.main([str(write_job(tmp_path / "second.yaml", "second", process))]) == 0
    assert any(f"cached latent {entries[3]} was missing or damaged" in r.message for r in caplog.records)
    assert "mean" in load_file(str(entries[3]))  # written anew
    records = [r for r in read_metrics(tmp_path / "output" / "second" / "metrics.jsonl") if "loss" in r]
    assert records[-1]["reencoded_latents"] == 1


def test_a_clip_that_decodes_short_mid_run_is_replaced_by_another_of_its_bucket(tmp_path):
    from helpers import write_mp4
    from test_dataset_clips import LEVEL, by_name, clip_folder, video_dataset

    dataset = video_dataset(clip_folder(tmp_path, copies=2))
    index, _ = by_name(dataset)["clip.mp4"]
    other, _ = by_name(dataset)["clip1.mp4"]
    write_mp4(tmp_path / "clip.mp4", frames=3, level=LEVEL)  # replaced after the scan by a shorter clip
    sample = dataset[index]
    assert sample["index"] == other and sample["replaced"][0][0] == str(tmp_path / "clip.mp4")
    assert "has no frame 3" in sample["replaced"][0][1]
    from toolkit.data.dataset import collate

    assert collate([sample])["replaced"] == sample["replaced"]
