"""Local sandboxes on podman, written against the docker-compatible CLI (`docker` works the same:
`--cli docker` or `AGENTRL_CONTAINER_CLI=docker`).

- Images (`provider.py`): built from the task's `environment/` context, tagged by a content hash of
  that context, so an unchanged task reuses its image; one build per tag at a time; a `FROM` whose
  base is neither local nor pullable is rewritten to the offline stand-in that serves its repository
  (in a temporary Dockerfile, never by re-tagging a real name; `images.py`), the rewrite part of the
  tag, and every build then runs with `--pull=never`; the build timeout from task.toml; the host CA
  bundle handed to pip in build steps (a pip.conf in a read-only mount at /etc/xdg/pip, which leaves
  nothing in the image) so `pip install` works behind TLS-intercepting proxies. Mounting the bundle
  over /etc/ssl/certs/ca-certificates.crt instead breaks every build that runs update-ca-certificates.
- Isolation (`provider.py`): `--network=none` unless the task allows internet (or the user
  overrides), no host mounts but a read-only static init, no host environment (podman's proxy
  passthrough is off); tests/ and solution/ are never inside during the agent phase. Limits: the
  task's cpus, memory and storage, else 1 CPU, 2 GiB and 10 GiB; 1024 pids; storage by the storage
  driver where it can, else measured from the host (docs/failures.md). PID 1 is catatonit in pause
  mode: it reaps orphans and cannot be killed from inside. Labels (run id, task id, created-at) let
  `agentrl sandbox reap` find what a dead process left behind; containers are removed on close, on
  cancellation and at exit.
- Fast exec (`shell.py`, `sandbox.py`): commands go through one persistent `bash` per container over
  a pipe (~1-2 ms a command instead of ~150 ms for `podman exec`), with output captured to files,
  bounded head+tail inside the container, and sent back in one length-prefixed frame per command
  under a fresh random nonce (`_BOOTSTRAP` explains why the agent cannot forge it). Clean commands
  (cwd, env or user given: the verifier's, agentrl's own) each run in a subshell under a timeout.
  The agent's commands run in its session shell: one long-lived bash that runs them at its own top
  level, so the shell state persists as in a terminal, snapshotted for when a timeout has to kill it
  (`shellstate.py`, `_SESSION_SHELL`). A shell that dies between commands is replaced (with a new
  session); one that fails during a command is a typed error, never a second run of the command:
  infrastructure when the container is gone or the host's client died, a `SandboxPolicyError` when
  the command could have done it. If no shell starts at all, the sandbox falls back to one `podman
  exec` per command (output streamed and bounded on the host, no session) and says so once.
- Processes (`procs.py`): read from the host's /proc, killed by PID namespace before verification.
- Terminal: `open_terminal` starts tmux in the container (`terminal.py`), every tmux command a clean
  command of the persistent shell. Images get tmux from a layer built once per image where it is
  missing (`terminal_image`).
"""

from agentrl.sandbox.podman.cli import LABEL_RUN, context_hash, run_cli
from agentrl.sandbox.podman.provider import PodmanProvider, reap
from agentrl.sandbox.podman.sandbox import PodmanSandbox

__all__ = ["LABEL_RUN", "PodmanProvider", "PodmanSandbox", "context_hash", "reap", "run_cli"]
