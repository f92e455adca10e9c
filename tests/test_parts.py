"""The trainer's parts, each built with what it needs and tested without running a job: the run folder, the
checkpoints (save and resume), the monitor, the objective, the data, the samples."""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest
import torch
from accelerate import Accelerator
from accelerate.state import AcceleratorState, GradientState
from diffusers import ConfigMixin, ModelMixin
from diffusers.loaders.peft import PeftAdapterMixin
from helpers import make_images

from toolkit.config.sections import LoggingConfig, NetworkConfig, ObjectiveSection, SampleConfig, TrainConfig
from toolkit.diffusion.schedules import FlowMatchNoiseSchedule
from toolkit.models.base import LatentDist, LoraComponent, PromptEmbeds
from toolkit.network.lora import add_lora
from toolkit.run import checkpoint, control
from toolkit.run.checkpoint import CheckpointError, Checkpoints, TrainedParts
from toolkit.run.folder import RunFolder, RunFolderError
from toolkit.run.metrics import read_metrics
from toolkit.run.monitor import Decision, Monitor, UpdateValues
from toolkit.train.objective import DiffusionObjective, StepDraw
from toolkit.train.plan import Position, TrainingPlan


@pytest.fixture
def accelerator():
    acc = Accelerator(cpu=True)
    yield acc
    AcceleratorState._reset_state(reset_partial_state=False)
    GradientState._reset_state()


class TinyDenoiser(ModelMixin, ConfigMixin, PeftAdapterMixin):
    """Two projections with a dropout between them: enough for LoRA files, optimizer state and dropout."""

    def __init__(self, width: int = 8, dropout: float = 0.0):
        super().__init__()
        self.to_q = torch.nn.Linear(width, width)
        self.drop = torch.nn.Dropout(dropout)
        self.to_out = torch.nn.Linear(width, width)

    def forward(self, x):
        return self.to_out(self.drop(self.to_q(x)))


def lora_module(seed: int = 0, dropout: float = 0.0) -> tuple[TinyDenoiser, list[torch.nn.Parameter]]:
    torch.manual_seed(seed)
    module = TinyDenoiser(dropout=dropout)
    module.requires_grad_(False)
    params = add_lora(module, NetworkConfig(linear=2, linear_alpha=2), ["to_q", "to_out"])
    return module, params


def trained_parts(seed: int = 0) -> TrainedParts:
    module, params = lora_module(seed)
    optimizer = torch.optim.AdamW(params, lr=1e-2)
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda step: 1.0 / (1 + step))
    return TrainedParts([LoraComponent(module, "unet", "lora_unet")], optimizer, scheduler)


def one_update(parts: TrainedParts) -> None:
    loss = parts.components[0].module(torch.ones(2, 8)).pow(2).mean()
    loss.backward()
    parts.optimizer.step()
    parts.optimizer.zero_grad()
    parts.lr_scheduler.step()


# ---- run folder ------------------------------------------------------------------------------------------


def test_run_folder_resumes_the_newest_complete_checkpoint_and_guards_saved_work(tmp_path):
    folder = RunFolder(tmp_path / "run", "run")
    assert folder.resume_point("auto", overwrite=False) is None  # nothing there: a fresh start
    for step in (2, 4):
        done = folder.checkpoints / checkpoint.step_dir_name(step)
        done.mkdir(parents=True)
        (done / checkpoint.COMPLETE_MARKER).write_text("{}")
    (folder.checkpoints / checkpoint.step_dir_name(6)).mkdir()  # a save that never finished
    assert folder.resume_point("auto", overwrite=False) == folder.checkpoints / "step_000000004"
    with pytest.raises(RunFolderError, match="already holds saved work"):
        folder.resume_point(False, overwrite=False)
    assert folder.resume_point(False, overwrite=True) is None
    with pytest.raises(CheckpointError, match="not a complete checkpoint"):
        folder.resume_point(str(folder.checkpoints / "step_000000006"), overwrite=False)


def test_run_folder_overwrite_removes_only_what_a_run_writes(tmp_path):
    folder = RunFolder(tmp_path / "run", "run")
    for path in (folder.metrics, folder.final_lora, folder.root / "notes.txt"):
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text("x")
    folder.open(overwrite=True, resolved_config={"a": 1})
    assert not folder.metrics.exists() and not folder.final_lora.exists()
    assert (folder.root / "notes.txt").exists() and (folder.root / "config.yaml").read_text() == "a: 1\n"


def test_run_folder_knows_the_files_of_its_familys_parts_and_nothing_else(tmp_path):
    """Wan 2.2 A14B writes a file per expert: overwrite and set-aside take those (every form, peft folders too), not
    another file that merely starts with the run's name."""
    folder = RunFolder(tmp_path / "run", "run", ("high_noise", "low_noise"))
    theirs = [folder.final_lora_form("comfy", "comfy", "high_noise"),
              folder.final_lora_form("diffusers", "comfy", "low_noise")]
    mine = [folder.root / "run_backup.safetensors", folder.root / "run_old_peft" / "adapter_config.json"]
    for path in theirs + mine:
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text("x")
    folder.final_lora_form("peft", "comfy", "high_noise").mkdir()
    assert [p.name for p in folder.final_loras()] == ["run_high_noise.safetensors", "run_high_noise_peft",
                                                      "run_low_noise.diffusers.safetensors"]
    folder.open(overwrite=True, resolved_config={"a": 1})
    assert not any(p.exists() for p in theirs) and all(p.exists() for p in mine)


# ---- checkpoints -----------------------------------------------------------------------------------------


def test_checkpoints_save_and_resume_restore_every_trained_part(tmp_path, accelerator):
    parts = trained_parts()
    one_update(parts)
    saver = Checkpoints(accelerator, tmp_path / "ck", 2, parts, {"lr": 1e-2}, lambda step: {"step": str(step)})
    torch.manual_seed(123)
    folder = saver.save(Position(global_step=1, epoch=0, micro_batch_in_epoch=3))
    assert folder.name == "step_000000001" and saver.last_saved_step == 1
    assert json.loads((folder / "train_state.json").read_text())["micro_batch_in_epoch"] == 3
    draw_after_save = torch.rand(3)
    one_update(parts)
    after_two = {k: v.clone() for k, v in parts.components[0].module.state_dict().items() if "lora" in k}

    fresh = trained_parts()
    with torch.no_grad():  # other adapter weights: everything trained must come from the checkpoint
        for param in fresh.optimizer.param_groups[0]["params"]:
            param.normal_()
    loader = Checkpoints(accelerator, tmp_path / "ck", 2, fresh, {"lr": 1e-2}, lambda step: {})
    torch.manual_seed(999)
    position = loader.resume(folder, micro_batches_per_epoch=3, gradient_accumulation=1)
    assert torch.equal(torch.rand(3), draw_after_save)  # the global RNG as it was saved
    assert position == Position(1, 1, 0)  # the saved epoch was complete: the next one starts
    assert fresh.lr_scheduler.last_epoch == 1 and loader.last_saved_step == 1
    one_update(fresh)
    resumed = {k: v for k, v in fresh.components[0].module.state_dict().items() if "lora" in k}
    assert all(torch.equal(resumed[k], after_two[k]) for k in after_two)  # same weights, moments and LR


def test_checkpoint_resume_refuses_another_rank_before_changing_anything(tmp_path, accelerator):
    parts = trained_parts()
    folder = Checkpoints(accelerator, tmp_path / "ck", 2, parts, {}, lambda step: {}).save(Position(1, 0, 1))
    wider = TinyDenoiser()
    wider.requires_grad_(False)
    wider_params = add_lora(wider, NetworkConfig(linear=4, linear_alpha=4), ["to_q", "to_out"])
    optimizer = torch.optim.AdamW(wider_params)
    other = TrainedParts([LoraComponent(wider, "unet", "lora_unet")], optimizer, torch.optim.lr_scheduler.LambdaLR(optimizer, lambda s: 1.0))
    before = {k: v.clone() for k, v in wider.state_dict().items()}
    with pytest.raises(CheckpointError, match="does not match the current config"):
        Checkpoints(accelerator, tmp_path / "ck", 2, other, {}, lambda step: {}).resume(folder, 4, 1)
    assert all(torch.equal(v, before[k]) for k, v in wider.state_dict().items())


def test_checkpoints_keep_the_newest_and_replace_a_resaved_step(tmp_path, accelerator):
    parts = trained_parts()
    saver = Checkpoints(accelerator, tmp_path / "ck", 2, parts, {}, lambda step: {})
    for step in (1, 2, 3, 3):
        saver.save(Position(step, 0, step))
    complete, incomplete = checkpoint.scan_checkpoints(tmp_path / "ck")
    assert [p.name for p in complete] == ["step_000000002", "step_000000003"] and incomplete == []


# ---- monitor ---------------------------------------------------------------------------------------------


def plan(total: int = 4) -> TrainingPlan:
    return TrainingPlan.create(samples=4, batches=4, processes=1, gradient_accumulation=1, steps=total, epochs=None,
                               warmup_steps=0, warmup_ratio=None)


def update(step: int, loss: float) -> UpdateValues:
    return UpdateValues(step, 0, 1e-3, ["loss", "grad_norm"], torch.tensor([loss, 0.5]))


class NoSamples:
    enabled = False


def test_monitor_logs_every_nth_update_and_always_the_last(tmp_path, accelerator, monkeypatch):
    monkeypatch.setenv("TQDM_DISABLE", "1")
    folder = RunFolder(tmp_path / "run", "run")
    monitor = Monitor(folder, accelerator, None, LoggingConfig(log_every=3), "run")
    monitor.started()
    assert json.loads((folder.root / "status.json").read_text())["state"] == "running"
    monitor.planned(plan(4), step=0, resumed=False, sampler=NoSamples())
    monitor.open_progress(0)
    for step in range(1, 5):
        monitor.after_update(update(step, loss=float(step)), lambda: {"lr": 1e-3})
    monitor.ended("finished", 4)
    monitor.close()
    records = read_metrics(folder.metrics)
    assert [(r["step"], r["loss"], r["lr"]) for r in records] == [(3, 3.0, 1e-3), (4, 4.0, 1e-3)]
    assert json.loads((folder.root / "plan.json").read_text())["total updates"] == 4
    assert json.loads((folder.root / "status.json").read_text())["state"] == "finished"


def test_monitor_decides_from_control_requests_and_a_stop_signal(tmp_path, accelerator, monkeypatch):
    monkeypatch.setattr(control, "POLL_S", 0.0)  # control/ looked at by every decision
    folder = RunFolder(tmp_path / "run", "run")
    monitor = Monitor(folder, accelerator, None, LoggingConfig(), "run")
    monitor.started()
    monitor.planned(plan(), step=0, resumed=False, sampler=NoSamples())
    assert monitor.decide(stop_signal=False) == Decision()
    control.request(folder.root, "save")
    control.request(folder.root, "sample")
    assert monitor.decide(stop_signal=False) == Decision(save=True, sample=True)
    monitor.acknowledge()
    assert monitor.decide(stop_signal=True) == Decision(stop=True)
    assert not list((folder.root / "control").iterdir())
    monitor.close()


def test_a_resumed_monitor_keeps_the_metrics_up_to_the_resumed_step(tmp_path, accelerator):
    folder = RunFolder(tmp_path / "run", "run")
    folder.root.mkdir(parents=True)
    folder.metrics.write_text("".join(json.dumps({"step": s}) + "\n" for s in range(1, 7)))
    monitor = Monitor(folder, accelerator, None, LoggingConfig(), "run")
    monitor.planned(plan(8), step=4, resumed=True, sampler=NoSamples())
    monitor.close()
    assert [r["step"] for r in read_metrics(folder.metrics)] == [1, 2, 3, 4]


def test_a_failure_before_the_plan_keeps_the_folders_last_known_step(tmp_path, accelerator):
    folder = RunFolder(tmp_path / "run", "run")
    control.Status(state="stopped", pid=os.getpid(), step=7, total=9).write(folder.root)
    monitor = Monitor(folder, accelerator, None, LoggingConfig(), "run")
    monitor.started()
    monitor.failed(ValueError("bad"), step=0)
    status = json.loads((folder.root / "status.json").read_text())
    assert (status["state"], status["step"], status["last_error"]) == ("failed", 7, "ValueError: bad")


# ---- objective -------------------------------------------------------------------------------------------


class FakeAdapter:
    """A flow-matching 'family' whose denoiser is TinyDenoiser over flattened latents: enough for the objective."""

    def __init__(self, dropout: float = 0.0):
        self.module, _ = lora_module(dropout=dropout)
        self.noise_schedule = FlowMatchNoiseSchedule()
        self.predicted_in_training_mode: list[bool] = []
        self.experts_seen: list[tuple[str | None, list[float]]] = []

    def trainable_module(self):
        return self.module

    def latents_from_dist(self, dist: LatentDist, generator=None):
        return dist.mean.float()

    def expert_at(self, update_index: int):
        return None

    def predict(self, noisy, timesteps, embeds, module=None, image_sizes=None, expert=None, references=None):
        module = module or self.module
        self.predicted_in_training_mode.append(module.training)
        self.experts_seen.append((None if expert is None else expert.name, timesteps.tolist()))
        flat = noisy.reshape(noisy.shape[0], -1)[:, :8] + embeds.embeds.reshape(embeds.embeds.shape[0], -1)[:, :8]
        return module(flat).reshape(noisy.shape[0], 8, 1, 1)


class TwoExpertAdapter(FakeAdapter):
    """Experts in turn per update: high noise [0.875, 1) on even updates, low noise [0, 0.875) on odd ones."""

    def expert_at(self, update_index: int):
        from toolkit.models.base import Expert

        return Expert("high", (0.875, 1.0)) if update_index % 2 == 0 else Expert("low", (0.0, 0.875))


def test_an_update_draws_timesteps_in_its_experts_range_and_predicts_with_it():
    """The expert an update trains bounds its timesteps (the sampler's draw rescaled into the range, with
    train.timestep_range inside it) and reaches predict, the blank-prompt base pass included."""
    adapter = TwoExpertAdapter()
    section = ObjectiveSection(timestep_type="shift", timestep_range=[0.0, 0.5], blank_prompt_preservation=True,
                               blank_prompt_probability=1.0)
    objective = DiffusionObjective(section, 3, adapter, blank_embeds=embeds(0.0))
    for update in range(6):
        adapter.experts_seen.clear()
        objective.loss(batch(), embeds(), StepDraw(0, update, update, 0.0))
        low, high = (0.875, 0.875 + 0.125 * 0.5) if update % 2 == 0 else (0.0, 0.875 * 0.5)
        names = {name for name, _ in adapter.experts_seen}
        assert names == {"high" if update % 2 == 0 else "low"}
        assert all(low * 1000 <= t <= high * 1000 for _, ts in adapter.experts_seen for t in ts), adapter.experts_seen


def batch() -> dict:
    return {"latent_mean": torch.linspace(-1, 1, 16).reshape(2, 8, 1, 1), "indices": [0, 1]}


def embeds(value: float = 0.5) -> PromptEmbeds:
    return PromptEmbeds(torch.full((2, 8), value))


def test_objective_draws_are_a_pure_function_of_seed_and_position():
    at = StepDraw(epoch=1, batch=2, update_index=3, progress=0.5)
    first = DiffusionObjective(ObjectiveSection(), 42, FakeAdapter()).loss(batch(), embeds(), at)
    torch.rand(100)  # the global RNG does not matter
    again = DiffusionObjective(ObjectiveSection(), 42, FakeAdapter()).loss(batch(), embeds(), at)
    other = DiffusionObjective(ObjectiveSection(), 42, FakeAdapter()).loss(
        batch(), embeds(), StepDraw(1, 3, 3, 0.5))
    assert torch.equal(first.loss, again.loss) and torch.equal(first.u, again.u)
    assert not torch.equal(first.u, other.u)
    assert set(first.parts) == {"loss_main"} and first.per_sample.shape == (2,)


def test_the_loss_of_an_unweighted_batch_is_its_samples_mean_and_their_losses_are_still_given():
    """Without masks, sampler or min-SNR weights the loss is made over all elements at once; each sample's loss (for
    the timestep statistics) is the same as the weighted path gives, and outside the graph."""
    at = StepDraw(epoch=0, batch=1, update_index=2, progress=0.0)
    plain = DiffusionObjective(ObjectiveSection(), 42, FakeAdapter()).loss(batch(), embeds(), at)
    weighted = DiffusionObjective(ObjectiveSection(min_snr_gamma=1e9), 42, FakeAdapter()).loss(batch(), embeds(), at)
    assert type(plain.loss.grad_fn).__name__ == "MseLossBackward0" != type(weighted.loss.grad_fn).__name__
    torch.testing.assert_close(plain.per_sample, weighted.per_sample.detach())
    torch.testing.assert_close(plain.loss, plain.per_sample.mean())
    assert not plain.per_sample.requires_grad and plain.per_sample is plain.per_sample  # made once, when asked


def test_blank_prompt_base_pass_has_no_dropout_and_leaves_the_rng_alone():
    """The base model's own blank-prompt prediction is the target of the preservation term: computed with the
    adapters off and without dropout (eval mode), and without drawing from training's RNG streams."""
    adapter = FakeAdapter(dropout=0.5)
    adapter.module.train()
    objective = DiffusionObjective(ObjectiveSection(blank_prompt_preservation=True), 42, adapter,
                                   blank_embeds=PromptEmbeds(torch.zeros(1, 8)))
    noisy, timesteps = torch.ones(2, 8, 1, 1), torch.tensor([500.0, 500.0])
    torch.manual_seed(0)
    state = torch.get_rng_state()
    loss = objective.blank_prompt_loss(noisy, timesteps, torch.zeros(2, 8, 1, 1), None)
    assert torch.equal(torch.get_rng_state(), state)
    assert adapter.predicted_in_training_mode == [False] and adapter.module.training
    adapter.module.disable_adapters()
    adapter.module.eval()
    with torch.no_grad():
        base = adapter.predict(noisy, timesteps, PromptEmbeds(torch.zeros(2, 8)))
    adapter.module.enable_adapters()
    assert torch.allclose(loss, base.float().pow(2).mean())  # the exact, dropout-free base prediction


def test_min_snr_and_differential_guidance_change_the_loss_not_the_draws():
    at = StepDraw(0, 0, 0, 0.0)
    plain = DiffusionObjective(ObjectiveSection(), 1, FakeAdapter()).loss(batch(), embeds(), at)
    snr = DiffusionObjective(ObjectiveSection(min_snr_gamma=1.0), 1, FakeAdapter()).loss(batch(), embeds(), at)
    guided = DiffusionObjective(ObjectiveSection(differential_guidance_scale=2.0), 1, FakeAdapter()).loss(
        batch(), embeds(), at)
    assert torch.equal(plain.u, snr.u) and torch.equal(plain.u, guided.u)
    assert not torch.equal(plain.loss, snr.loss) and "loss_diff_guidance" in guided.parts


# ---- data ------------------------------------------------------------------------------------------------


def test_training_data_resumes_mid_epoch_without_loading_the_skipped_batches(tmp_path, accelerator, tiny_sd15):
    from toolkit.data.training_data import TrainingData
    from toolkit.device import ModulePlacement
    from toolkit.models.registry import get_adapter_class, model_config

    adapter = get_adapter_class("sd15").load(model_config(arch="sd15", name_or_path="tiny"), torch.device("cpu"),
                                             torch.float32)
    from toolkit.config.sections import DatasetConfig

    folder = make_images(tmp_path / "data", 6, size=(32, 32))
    train = TrainConfig(steps=4, batch_size=2, seed=3)
    data = TrainingData([DatasetConfig(folder_path=str(folder), resolution=[32])], None, train, adapter,
                        ModulePlacement(torch.device("cpu"), low_vram=False))
    data.build_caches(accelerator)
    data.dataloader = data.make_dataloader(pin_memory=False)
    full = [b["indices"] for _, b in data.one_epoch(accelerator.device, Position(0, 1, 0))]
    resumed = [(i, b["indices"]) for i, b in data.one_epoch(accelerator.device, Position(0, 1, 2))]
    assert len(full) == 3 and sorted(sum(full, [])) == list(range(6))
    assert resumed == [(2, full[2])]
    assert data.embeds_for({"indices": [0, 1]}, 1).embeds.shape[0] == 2


def same_batch(mine, theirs) -> bool:
    """Two batches (dicts of tensors, lists and nested dicts) hold equal values."""
    if isinstance(mine, dict):
        return mine.keys() == theirs.keys() and all(same_batch(mine[key], theirs[key]) for key in mine)
    if isinstance(mine, torch.Tensor):
        return torch.equal(mine, theirs)
    return mine == theirs


def test_a_loader_without_workers_is_read_in_process_with_the_batches_torchs_iterator_gives(
        tmp_path, accelerator, tiny_sd15, monkeypatch):
    """Without workers the trainer reads its loader's batches itself (`loaded_batches`: torch's single-process
    iterator costs host time per batch); they are the batches torch's iterator gives, from a resumed micro-batch on,
    across epochs: decoded pictures with flips, latents kept in memory (made once), and cached flipped variants not
    yet encoded (their pixels pending)."""
    from toolkit.config.sections import DatasetConfig
    from toolkit.data.training_data import TrainingData, loaded_batches
    from toolkit.device import ModulePlacement
    from toolkit.models.registry import get_adapter_class, model_config

    adapter = get_adapter_class("sd15").load(model_config(arch="sd15", name_or_path="tiny"), torch.device("cpu"),
                                             torch.float32)
    folders = [make_images(tmp_path / name, 3, size=(32, 32)) for name in ("pixels", "kept", "pending")]
    cfgs = [DatasetConfig(folder_path=str(folders[0]), resolution=[32], flip_x=True),
            DatasetConfig(folder_path=str(folders[1]), resolution=[32], cache_latents=True),
            DatasetConfig(folder_path=str(folders[2]), resolution=[32], cache_latents=True, flip_x=True)]
    data = TrainingData(cfgs, None, TrainConfig(steps=4, batch_size=2, seed=3), adapter,
                        ModulePlacement(torch.device("cpu"), low_vram=False))
    data.build_caches(accelerator)
    loader = data.make_dataloader(pin_memory=False, workers=0)
    loader.batch_sampler.start_at(0, 1, 3)  # micro-batch 1 of epoch 0 to the end of epoch 2
    by_torch = list(loader)
    loader.batch_sampler.start_at(0, 1, 3)
    monkeypatch.setattr(torch.utils.data.DataLoader, "__iter__", lambda self: pytest.fail("torch's iterator was used"))
    ours = list(loaded_batches(loader))
    assert len(ours) == len(by_torch) == 3 * loader.batch_sampler.per_epoch - 1
    kinds = {("pixels" in b, "latent_mean" in b, "pending" in b) for b in ours}
    assert {(True, False, False), (False, True, False)} <= kinds and any(pending for *_, pending in kinds)
    assert all(same_batch(mine, theirs) for mine, theirs in zip(ours, by_torch, strict=True))


# ---- samples ---------------------------------------------------------------------------------------------


def test_sampler_brings_offloaded_text_encoders_only_when_prompts_are_not_encoded():
    from toolkit.device import ModulePlacement
    from toolkit.run.sampling import Sampler, SampleRenderer

    text, vae, extra = torch.nn.Linear(1, 1), torch.nn.Linear(1, 1), torch.nn.Linear(1, 1)

    class Parts:
        @staticmethod
        def only_modules():
            return [extra]

    class Adapter:
        sampling = Parts()

        @staticmethod
        def text_encoder_modules():
            return [text]

    placement = ModulePlacement(torch.device("cpu"), low_vram=False)
    placement.offloaded = [vae, text]
    renderer = SampleRenderer(SampleConfig(prompts=["a"]), None, Path("unused"), "tiny")
    sampler = Sampler(renderer, Adapter(), placement, [torch.nn.Linear(1, 1)], [], is_main=True)
    assert sampler.modules_for([{"prompt_embeds": 1}]) == [vae, extra]
    assert sampler.modules_for([None]) == [vae, text, extra]
