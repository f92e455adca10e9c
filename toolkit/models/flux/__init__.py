"""FLUX.1 family ([dev] and [schnell])."""
