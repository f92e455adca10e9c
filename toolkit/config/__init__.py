"""Job configuration: typed schema (toolkit.config.schema) and the loader that validates job files (toolkit.config.loader)."""
