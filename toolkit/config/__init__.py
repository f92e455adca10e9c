"""Job configuration: typed schema and the loader that validates job files against it."""

from .loader import ConfigError, load_config
from .schema import JobConfig, SDTrainerConfig

__all__ = ["ConfigError", "JobConfig", "SDTrainerConfig", "load_config"]
