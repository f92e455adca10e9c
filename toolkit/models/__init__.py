"""Model families behind one contract (toolkit.models.base), looked up by `model.arch` (toolkit.models.registry)."""
