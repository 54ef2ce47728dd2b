"""An SGLang-compatible HTTP server around the in-process engine (`app.EngineServer`), as strict as
SGLang 0.5.16 (`app.py` says which behaviours and why): the data plane, the OpenAI-compatible
endpoints (`chat.py`) and the control plane (`control.py`)."""

from agentrl.engine.server.app import EngineServer, serve

__all__ = ["EngineServer", "serve"]
