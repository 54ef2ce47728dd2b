"""Trainer backends (torch), the batch format they share, packing, checkpoints and weight sync."""
