"""The monitor part of a run: everything that watches it or steers it from outside, and nothing that trains.

status.json (running / stopped / finished / failed, from the first moment of the run), control requests (stop,
save, sample) agreed across processes, metrics.jsonl lines and TensorBoard scalars for logged updates, the
progress bar, sample images and report.html. Its lifecycle: `started` (before setup, so that a setup failure is
reported) -> `planned` (the plan, the resumed step and the samples part are known) -> per update `after_update`
and `decide` -> `ended`."""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass

import torch
from tqdm.auto import tqdm

from toolkit.config.sections import LoggingConfig
from toolkit.device import memory_fields
from toolkit.files import write_json_atomic
from toolkit.run.control import RunMonitor
from toolkit.run.folder import RunFolder
from toolkit.run.metrics import (
    MetricsWriter,
    Throughput,
    TimestepStats,
    progress_bars_wanted,
    truncate_after,
    truncate_event_files_after,
)
from toolkit.run.report import PLAN_FILE, write_report
from toolkit.run.sampling import Sampler
from toolkit.train.plan import TrainingPlan

log = logging.getLogger("difftune")
#: how old the memory figures of a metrics line may be
MEMORY_READ_S = 1.0


@dataclass
class UpdateValues:
    """One update's loss parts and gradient norm, still on the device (averaged over processes): they come to
    the host, in one transfer, only when the update is logged or the progress bar is due."""

    step: int
    epoch: int
    scheduled_lr: float
    names: list[str]
    values: torch.Tensor  # one float32 value per name

    @property
    def loss(self) -> torch.Tensor:
        return self.values[self.names.index("loss")]


@dataclass(frozen=True)
class Decision:
    """What every process does after this update, agreed over the host group."""

    stop: bool = False
    save: bool = False
    sample: bool = False


class Monitor:
    def __init__(self, folder: RunFolder, accelerator, host_group, logging_cfg: LoggingConfig, name: str):
        self.folder = folder
        self.accelerator = accelerator
        self.host_group = host_group
        self.cfg = logging_cfg
        self.name = name
        self.is_main = accelerator.is_main_process
        self.status = RunMonitor(folder.root, self.is_main, total=0)
        self.metrics = MetricsWriter(folder.metrics, enabled=False)
        self.throughput = Throughput(accelerator.num_processes)
        self.timestep_stats = TimestepStats() if logging_cfg.debug_timesteps else None
        self.sampler: Sampler | None = None
        self.plan: TrainingPlan | None = None
        #: the progress bar's smoothed loss (a host value), and the losses it has not followed yet (still on the
        #: device: each update's values and where its loss is among them)
        self.smoothed_loss: float | None = None
        self.unread_losses: list[tuple[torch.Tensor, int]] = []
        self.postfix_shown_at = 0.0
        self.memory: dict[str, float] | None = None
        #: the `extra` values of the last logged update, on the host
        self.extra_values: list[float] | None = None
        self.memory_read_at = 0.0
        self.progress: tqdm | None = None

    @property
    def progress_enabled(self) -> bool:
        return self.is_main and progress_bars_wanted()

    # ---- lifecycle -----------------------------------------------------------------------------------

    def started(self) -> None:
        """status.json says `running` from the start (main process)."""
        self.status.started()

    def planned(self, plan: TrainingPlan, step: int, resumed: bool, sampler: Sampler) -> None:
        """The plan and the resumed step are known: status with them, the plan file for the report, stale control
        requests dropped, metrics.jsonl cut back to the resumed step (a fresh start begins it empty), TensorBoard."""
        self.plan, self.sampler = plan, sampler
        self.status.status.total = plan.total_updates
        self.status.planned = True
        self.status.started(step)
        if self.is_main:
            write_json_atomic(self.folder.root / PLAN_FILE, plan.as_dict(), sort_keys=False)
            dropped = self.status.drop_stale_requests()
            if dropped:
                log.warning("ignoring %d control request(s) left from before this run started", dropped)
            # a fresh start (or one from a step-0 checkpoint, which evaluates step 0 again) begins them empty
            kept = step if resumed and step > 0 else -1
            truncate_after(self.folder.metrics, kept)
            if self.cfg.tensorboard:  # the same for TensorBoard's event files: no update is shown twice
                truncate_event_files_after(self.folder.root / "tensorboard", kept)
        self.metrics = MetricsWriter(self.folder.metrics, enabled=self.is_main)
        if self.cfg.tensorboard and self.is_main:
            self.accelerator.init_trackers(self.name)

    def open_progress(self, step: int) -> None:
        self.progress = tqdm(total=self.plan.total_updates, initial=step, desc="train", unit="step",
                             disable=not self.progress_enabled)
        self.throughput.restart()

    def close_progress(self) -> None:
        if self.progress is not None:
            self.progress.close()
            self.progress = None

    def ended(self, state: str, step: int | None, error: str | None = None) -> None:
        """How the run ended; `step` None keeps the folder's last known step (a failure before the plan)."""
        self.status.ended(state, step, error)

    def failed(self, error: BaseException, step: int) -> None:
        """status.json says `failed` at once: a launcher ends the other processes soon after one fails, so nothing
        waits before it (the metrics lines follow when the monitor closes, at most half a second behind). A status
        that cannot be written (the disk the failure is about) is logged, never raised over the error itself."""
        try:
            self.ended("failed", step if self.status.planned else None, f"{type(error).__name__}: {error}")
        except OSError as write_error:
            log.warning("could not write %s/status.json: %s", self.folder.root, write_error)

    def close(self) -> None:
        self.close_progress()
        self.metrics.close()
        # not accelerator.end_training(): it also destroys the process group a next job of the launch needs
        for tracker in getattr(self.accelerator, "trackers", []):
            tracker.finish()

    # ---- per update ----------------------------------------------------------------------------------

    def after_update(self, update: UpdateValues, readings, evaluated: dict[str, float] | None = None,
                     extra: torch.Tensor | None = None) -> list[float] | None:
        """The metrics line of a logged update (and the progress bar at most once a second): the only reads of
        device values. `readings()` gives the optimizer's own figures (LR it used, update RMS) for that line;
        `evaluated` (the validation figures of this update's weights) makes the update a logged one. `extra` (device
        values another part wants on the host, e.g. the non-finite watch's flags) comes in the same transfer when
        the update is logged: returned then, else None."""
        shown = self.progress is not None and not self.progress.disable  # the bar `open_progress` made
        # kept as they are until the next host read: no device operation per update for the smoothed loss (the
        # bar's, and every metrics line's `smoothed_loss`, with or without a bar)
        self.unread_losses.append((update.values, update.names.index("loss")))
        logged = self.logs(update.step, evaluated)
        postfix_due = shown and time.monotonic() - self.postfix_shown_at >= 1.0
        self.extra_values = None
        if logged or postfix_due:
            record = self.host_record(update, readings(), extra if logged else None) | (evaluated or {})
            if logged:
                self.log_record(record)
            if postfix_due:
                self.progress.set_postfix(loss=f"{record['smoothed_loss']:.4f}", lr=f"{record['lr']:.2e}",
                                          s_it=f"{record['time']:.2f}", refresh=False)
                self.postfix_shown_at = time.monotonic()
        if self.progress is not None:
            self.progress.update(1)
        self.status.heartbeat(update.step)
        return self.extra_values

    def logs(self, step: int, evaluated: dict[str, float] | None = None) -> bool:
        """Whether the update at `step` gets a metrics line (and so reads its values from the device)."""
        return step % self.cfg.log_every == 0 or step == self.plan.total_updates or evaluated is not None

    def log_skipped(self, step: int, epoch: int, skipped: int) -> None:
        """The metrics line of an update dropped for non-finite values (`train.on_nan: skip`): `step` is the update
        it would have been, so a resumed run that meets it again writes it once."""
        record = {"step": step, "epoch": epoch, "skipped_update": 1, "skipped_updates": skipped}
        self.metrics.write(record)
        if self.cfg.tensorboard:
            self.accelerator.log({"skipped_updates": skipped}, step=step)

    def host_record(self, update: UpdateValues, readings: dict, extra: torch.Tensor | None = None) -> dict:
        """The update's values on the host (one transfer, which waits for the device), with the LR it used and
        the throughput since the last logged update. The losses the progress bar has not followed yet come in the
        same transfer and move its smoothed loss (`smoothed_loss`: the bar and the metrics line)."""
        # the update's own loss is among the unread ones: read with its values, not joined to them again
        unread = [values[index].reshape(1) for values, index in self.unread_losses if values is not update.values]
        tail = [] if extra is None else [extra.float().reshape(-1)]
        values = (torch.cat([update.values, *unread, *tail]).float().tolist() if unread or tail
                  else update.values.tolist())
        if tail:
            values, self.extra_values = values[:-len(extra)], values[-len(extra):]
        losses = values[len(update.names):]
        losses += [values[index] for unread_values, index in self.unread_losses if unread_values is update.values]
        self.unread_losses = []
        for loss in losses:
            self.smoothed_loss = loss if self.smoothed_loss is None else self.smoothed_loss + 0.1 * (loss - self.smoothed_loss)
        record = {"step": update.step, "epoch": update.epoch, **dict(zip(update.names, values))}
        record["smoothed_loss"] = self.smoothed_loss
        record.update(readings)
        return record | self.throughput.read()

    def memory_reading(self) -> dict[str, float]:
        """The memory fields of a metrics line, read at most once a second (the process's memory changes slowly;
        reading it is a file read per line, which with `log_every: 1` is one per update)."""
        now = time.monotonic()
        if self.memory is None or now - self.memory_read_at >= MEMORY_READ_S:
            self.memory, self.memory_read_at = memory_fields(), now
        return self.memory

    def log_evaluation(self, step: int, epoch: int, evaluated: dict[str, float]) -> None:
        """A metrics line of validation figures alone: those of the weights before the first update (step 0)."""
        record = {"step": step, "epoch": epoch, **evaluated}
        self.metrics.write(record)
        if self.cfg.tensorboard:
            self.accelerator.log(evaluated, step=step)

    def log_record(self, record: dict) -> None:
        """A metrics.jsonl line (and TensorBoard scalars); the throughput window restarts here."""
        record = {k: v for k, v in record.items() if k != "smoothed_loss"}
        if self.timestep_stats is not None:
            record.update(self.timestep_stats.flush())
        record.update(self.memory_reading())
        self.metrics.write(record)
        if self.cfg.tensorboard:
            self.accelerator.log({k: v for k, v in record.items() if isinstance(v, (int, float))}, step=record["step"])
        self.throughput.restart()

    def decide(self, stop_signal: bool) -> Decision:
        """Once per update on every process (collective): a stop signal on any process and the control requests
        the main process found become one decision everywhere."""
        wanted = self.status.take_requests()
        flags = [stop_signal or wanted["stop"], wanted["save"], wanted["sample"]]
        if self.accelerator.num_processes > 1:
            # host flags over the host (gloo) group: nothing here waits for the accelerator's queued work
            tensor = torch.tensor(flags, dtype=torch.int32)
            torch.distributed.all_reduce(tensor, group=self.host_group)
            flags = [value > 0 for value in tensor.tolist()]
        return Decision(*flags)

    def acknowledge(self) -> None:
        """The requests of the last decision were acted on: their files go."""
        self.status.acknowledge()

    # ---- outputs -------------------------------------------------------------------------------------

    def sample(self, step: int) -> None:
        """Sample images (main process), then the report; every process waits. Not training time."""
        if self.sampler is not None and self.sampler.enabled:
            if self.sampler.render(step, self.progress_enabled):
                self.write_report()
            self.accelerator.wait_for_everyone()
        self.throughput.restart()

    def write_report(self) -> None:
        """The report is a convenience: failing to write it (a full disk, a concurrent --report) is logged, never
        the end of the training run."""
        if not self.is_main:
            return
        self.metrics.drain()  # the report reads metrics.jsonl: every line handed over first
        try:
            write_report(self.folder.root)
        except OSError as error:
            log.warning("could not write %s/report.html: %s", self.folder.root, error)
