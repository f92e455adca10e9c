"""Wuerstchen v2 prior family."""
