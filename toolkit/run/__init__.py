"""Run services: checkpoints, status and control, metrics, the report, sample images, signals."""
