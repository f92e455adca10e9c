"""Example extension: `type: dataset_report` checks datasets before training.

It scans the dataset folders exactly as training would (skipping unreadable images, applying the
trigger word, assigning buckets) and writes `<training_folder>/<name>/dataset_report.json`. An
extension is a package in extensions/ with a `register(registry)` function. It imports the training libraries
(accelerate, torch through toolkit.data) where it runs, not at the top: extensions are imported whenever a job file
is checked, and checking stays fast.
"""

from __future__ import annotations

import json
import logging
from collections import Counter
from pathlib import Path
from typing import Literal

from pydantic import Field

from jobs.process.base_process import BaseProcess
from toolkit.config.schema import DatasetConfig, Section
from toolkit.files import write_text_atomic

log = logging.getLogger("difftune")


class DatasetReportConfig(Section):
    """Process `dataset_report`: what training would see in these datasets."""

    type: Literal["dataset_report"] = Field("dataset_report", description="Process type.")
    training_folder: str = Field("output", description="The report goes to <training_folder>/<name>/.")
    trigger_word: str | None = Field(None, description="As in sd_trainer.")
    divisor: int = Field(64, ge=1, description="Bucket sides are multiples of this (SD 1.x: 64).")
    datasets: list[DatasetConfig] = Field(..., min_length=1, description="Datasets to report on.")


class DatasetReport(BaseProcess):
    config: DatasetReportConfig

    def run(self) -> None:
        from accelerate import PartialState

        report = [self.describe(cfg) for cfg in self.config.datasets]
        if not PartialState().is_main_process:  # under accelerate launch, one process writes
            return
        out = Path(self.config.training_folder) / self.job.name / "dataset_report.json"
        write_text_atomic(out, json.dumps(report, indent=2))
        log.info("dataset report written to %s", out)

    def describe(self, cfg: DatasetConfig) -> dict:
        from toolkit.data.dataset import items_for_dataset, scan_folder

        records = scan_folder(cfg, self.config.trigger_word)
        items = items_for_dataset(records, cfg, self.config.divisor)
        buckets = Counter(f"{w}x{h}" for w, h in (item.bucket for item in items))
        return {
            "folder": cfg.folder_path,
            "images": len(records),
            "items_per_epoch": len(items),
            "empty_captions": sum(1 for r in records if not r.caption),
            "buckets": dict(sorted(buckets.items())),
        }


def register(registry) -> None:
    registry.register("dataset_report", DatasetReport, DatasetReportConfig, source="extensions/example")
