"""Wan 2.1 / 2.2 video models (`arch: wan`)."""
