"""Z-Image family."""
