"""Stable Diffusion 1.x family."""
