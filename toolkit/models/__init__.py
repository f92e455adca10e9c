"""Model families behind one contract (base.ModelAdapter), looked up by `model.arch`."""

from .base import ModelAdapter, NoiseSchedule, PromptEmbeds
from .registry import available_archs, get_adapter_class

__all__ = ["ModelAdapter", "NoiseSchedule", "PromptEmbeds", "available_archs", "get_adapter_class"]
