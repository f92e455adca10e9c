"""Qwen-Image (`arch: qwen_image`)."""
