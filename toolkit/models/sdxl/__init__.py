"""Stable Diffusion XL family."""
