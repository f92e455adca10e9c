"""Watching and steering a training run: status.json, control requests, sample images, the report and the
TensorBoard tracker. Mixed into BaseSDTrainProcess, whose components (accelerator, adapter, renderer,
mirrors, position, plan) it uses."""

from __future__ import annotations

import logging
from contextlib import ExitStack, contextmanager

import torch

from toolkit.control import RunMonitor, write_json_atomic
from toolkit.device import flush, memory_debug, modules_on
from toolkit.metrics import progress_bars_wanted
from toolkit.report import PLAN_FILE, write_report

log = logging.getLogger("difftune")


class WatchedRun:
    # ---- status and report ---------------------------------------------------------------------

    def open_monitor(self) -> None:
        """status.json says `running` from the start (main process), so a failure during setup is reported
        there too, not the previous run's state."""
        self.monitor = RunMonitor(self.run_dir, self.is_main, total=0)
        self.monitor.started()

    def announce_plan(self) -> None:
        """Once the plan and the resumed step are known: status with them, the plan file for the report, stale
        control requests dropped, the TensorBoard tracker started."""
        self.monitor.status.total = self.plan.total_updates
        self.monitor.planned = True
        self.monitor.started(self.position.global_step)
        if self.is_main:
            write_json_atomic(self.run_dir / PLAN_FILE, self.plan.as_dict(), sort_keys=False)
            dropped = self.monitor.drop_stale_requests()
            if dropped:
                log.warning("ignoring %d control request(s) left from before this run started", dropped)
        if self.config.logging.tensorboard and self.is_main:
            self.accelerator.init_trackers(self.job.name)

    def end_tracking(self) -> None:
        # not accelerator.end_training(): it also destroys the process group a next job of the launch needs
        for tracker in getattr(self.accelerator, "trackers", []):
            tracker.finish()

    def write_report(self) -> None:
        """The report is a convenience: failing to write it (a full disk, a concurrent --report) is logged,
        never the end of the training run."""
        try:
            write_report(self.run_dir)
        except OSError as error:
            log.warning("could not write %s/report.html: %s", self.run_dir, error)

    # ---- control ---------------------------------------------------------------------------------

    def steer(self) -> bool:
        """Once per update on every process (collective): a stop signal on any process and the control
        requests the main process found become one decision everywhere. `save` and `sample` act now (and the
        run goes on); returns whether to stop, which every process then does after this same update."""
        wanted = self.monitor.take_requests()
        stop, save, sample = self.stop.requested or wanted["stop"], wanted["save"], wanted["sample"]
        if self.accelerator.num_processes > 1:
            # host flags over the host (gloo) group: nothing here waits for the accelerator's queued work
            flags = torch.tensor([stop, save, sample], dtype=torch.int32)
            torch.distributed.all_reduce(flags, group=self.host_group)
            stop, save, sample = (value > 0 for value in flags.tolist())
        if save and self.last_saved_step != self.position.global_step:
            log.info("control: saving a checkpoint at step %d", self.position.global_step)
            self.save_checkpoint()
        if sample:
            if self.renderer.enabled:
                log.info("control: rendering samples at step %d", self.position.global_step)
            else:
                log.warning("control: sample asked for, but the config has no sample.prompts")
            self.sample(self.position.global_step)
        self.monitor.acknowledge()
        self.stopping = stop
        return stop

    # ---- samples ---------------------------------------------------------------------------------

    def sample(self, step: int) -> None:
        if not self.renderer.enabled:
            return
        if self.is_main:
            self.trained_module.eval()
            # fork_rng: whatever a pipeline draws from the global RNG is not taken from training's stream
            with memory_debug("sampling", self.config.logging.debug_memory), \
                    torch.random.fork_rng(devices=self.cuda_devices()):
                conditioning = self.sampling_conditioning()
                with modules_on(self.sampling_modules(conditioning), self.accelerator.device,
                                while_moving=self.mirrors_detached):
                    self.renderer.render(self.adapter, step, self.progress_enabled, conditioning)
            self.trained_module.train()
            flush()
            self.write_report()
        self.accelerator.wait_for_everyone()
        self.throughput.restart()  # sampling is not training time

    def sampling_conditioning(self) -> list[dict | None]:
        """The prompts' conditioning, computed first where the family can, with an offloaded text encoder
        visiting alone: it has left again before the sampling model arrives."""
        text_encoders = [m for m in self.offloaded if any(m is t for t in self.adapter.text_encoder_modules())]
        with modules_on(text_encoders, self.accelerator.device):
            return self.renderer.conditioning(self.adapter)

    def sampling_modules(self, conditioning: list[dict | None]) -> list[torch.nn.Module]:
        """What rendering needs on the accelerator: the offloaded modules (minus the text encoders when the
        prompts are already encoded) and the sample-only models."""
        encoded = all(c is not None for c in conditioning)
        text_encoders = self.adapter.text_encoder_modules()
        needed = [m for m in self.offloaded if not (encoded and any(m is t for t in text_encoders))]
        return needed + self.adapter.sampling_only_modules()

    @property
    def progress_enabled(self) -> bool:
        return self.is_main and progress_bars_wanted()

    def cuda_devices(self) -> list[int]:
        device = self.accelerator.device
        return [device.index or 0] if device.type == "cuda" else []

    @contextmanager
    def mirrors_detached(self):
        """While models that share the trained LoRA move, the LoRA stays where training keeps it."""
        with ExitStack() as stack:
            for mirror in self.mirrors:
                stack.enter_context(mirror.detached())
            yield
