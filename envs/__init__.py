"""The bundled environment plugins (see `agentrl.rollout.environment`)."""
