"""Daytona sandboxes on the `daytona` SDK's `AsyncDaytona`: the production backend.

- Images: the task's `environment/Dockerfile` with its build context (`Image.from_dockerfile`, so
  Daytona builds and caches it as a snapshot), or `docker_image`; either way one layer is added that
  prepares `/logs/{verifier,agent,artifacts}` as root, so a create needs no extra round trip.
- Isolation and size: `network_block_all` unless the task allows internet (a task's
  `allowed_hosts` become Daytona's `domain_allow_list`, which Daytona enforces); cpu, memory and
  disk from task.toml rounded up to whole units, with floors.
- Lifetime: labels (run id, task id, launcher, owner) let `reap_daytona` find what a dead process
  left behind; auto-stop, auto-delete and a TTL are backstops; a keepalive refreshes activity while
  the model thinks (model latency is not sandbox activity, so auto-stop would otherwise fire
  mid-episode). Sandboxes are deleted on close, on cancellation (shielded) and at interpreter exit.
- Create under load: a concurrency limit, jittered exponential backoff on throttling and transient
  errors, `SandboxQuotaError` (never retried) for quota and limit errors with the provider's
  message. Each attempt has a unique name, so a create that is cancelled or times out midway is
  found by name and deleted.
- exec: one POSIX `sh` wrapper per command runs it with bash under `timeout` (its own process group,
  so a timeout or a cancellation kills everything it started), as the requested user, in `cwd`,
  with `env`; stdout and stderr are captured to files inside the sandbox, bounded there (head +
  tail) and sent back framed by a random nonce, so one `process.exec` round trip returns both
  streams and the exit code. Commands that may outlive `exec_limit_s` (the HTTP request of
  `process.exec`) run the same wrapper through a session command with `run_async` and polling.
  The agent's commands (no cwd, env or user) share a shell session (`shellstate.py`) kept in a
  directory of the sandbox that only they read; other commands start clean.
- Terminal: `open_terminal` runs tmux in the sandbox through the same exec (`terminal.py`).
"""

from agentrl.sandbox.daytona.provider import DaytonaProvider, reap_daytona
from agentrl.sandbox.daytona.sandbox import DaytonaSandbox

__all__ = ["DaytonaProvider", "DaytonaSandbox", "reap_daytona"]
