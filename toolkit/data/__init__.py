"""Data: image folders, captions, aspect-ratio buckets."""
