"""Sandboxes: the protocol and its backends (podman, daytona, fake)."""
