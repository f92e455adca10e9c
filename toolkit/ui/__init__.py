"""The local web dashboard (`python run.py --ui`): runs, their curves and samples, control, and a job queue; it
reads the run folders' files as its only truth (docs/ui.md)."""
