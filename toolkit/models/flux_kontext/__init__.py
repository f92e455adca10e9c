"""FLUX.1 Kontext: image editing on the FLUX.1 transformer (`arch: flux_kontext`)."""
