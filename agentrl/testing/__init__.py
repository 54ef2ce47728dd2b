"""Test doubles: in-memory sandboxes and terminals, a fault-injecting engine, the rollout simulator
and synthetic dashboard data. Tests and benchmarks import them; product code never does (an
import-linter contract in pyproject.toml).
"""
