"""The bundled environment plugins (see `agentrl.environments`)."""
