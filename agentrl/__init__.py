"""agentrl: agentic reinforcement learning on terminal tasks."""

__version__ = "0.1.0"
