"""Inference engines: the protocol and its backends."""
