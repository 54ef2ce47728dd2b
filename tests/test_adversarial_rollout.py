"""A 12-step rollout through the real rollout manager, episode runner, agent loop, verifier and
podman sandboxes, with a scripted model that answers one sample of every group honestly and the
other with an attack: every hostile episode is a policy failure (reward 0, with its cause), every
honest one scores 1, the run never stops, and no container is left behind."""

from __future__ import annotations

import os
import shutil
import uuid

import pytest

from agentrl.agent.tokens import ChatRenderer
from agentrl.engine.scripted import ScriptedEngine
from agentrl.episode.run import SandboxEpisodeRunner
from agentrl.episode.sample import Status
from agentrl.rollout import RolloutConfig, RolloutManager
from agentrl.sandbox.podman import LABEL_RUN, PodmanProvider, run_cli
from tests.chat_tokenizer import byte_tokenizer
from tests.test_adversarial_podman import GUARDED, episode_config, fenced

CLI = os.environ.get("AGENTRL_CONTAINER_CLI", "podman")

pytestmark = [
    pytest.mark.container,
    pytest.mark.slow,
    pytest.mark.skipif(shutil.which(CLI) is None, reason=f"{CLI} is not installed"),
]

HONEST = "echo hello > /app/out.txt"
# Attacks that end as policy failures, with the cause each must be counted under.
# `$$` is the agent's own session shell (killing it only restarts the session); `$PPID` is the
# framing shell that talks to the host.
HOSTILE = [
    ("kill -9 $PPID", "shell_killed"),
    ("kill -9 -1", "shell_killed"),
    ("printf 'garbage\\n' > /proc/$PPID/fd/1", "shell_protocol"),
    ("head -c 40000000 /dev/zero | tr '\\0' a > /proc/$PPID/fd/1", "shell_protocol"),
    (
        "printf '#!/bin/sh\\nexit 0\\n' > /usr/local/bin/python3; chmod +x /usr/local/bin/python3",
        "agent_code",
    ),
    (
        "d=/usr/local/lib/python3.11/dist-packages; mkdir -p $d; echo 'import os; os._exit(0)' > $d/zz.pth",
        "agent_code",
    ),
]
STEPS = 12  # 24 hostile episodes: every attack's cause is seen (asserted below)


def plan(session_id: str | None, turn: int, input_ids: list[int]) -> str:
    """Sample 0 of every group is honest, sample 1 attacks (which attack: by the group)."""
    parts = (session_id or "").split(":")
    sample_index, group = int(parts[-2]), ":".join(parts[1:-2])
    if turn > 0:
        return "TASK_COMPLETE"
    if sample_index == 0:
        return fenced(HONEST)
    return fenced(HOSTILE[sum(group.encode()) % len(HOSTILE)][0])


async def test_twelve_steps_mixing_hostile_and_honest_episodes() -> None:
    run_id = f"adv-roll-{uuid.uuid4().hex[:8]}"
    tok = byte_tokenizer()
    engine = ScriptedEngine(plan, tok)
    provider = PodmanProvider(cli=CLI, shell_grace_s=3)
    runner = SandboxEpisodeRunner(
        provider=provider, engine=engine, renderer=ChatRenderer(tok), config=episode_config(), run_id=run_id
    )
    rows = [
        {"prompt": f"p{i}", "metadata": {"task_id": GUARDED.name, "task_path": str(GUARDED)}}
        for i in range(STEPS * 2)
    ]
    config = RolloutConfig(
        batch_size=4, n_samples_per_prompt=2, max_in_flight=4, max_staleness=None, episode_timeout_s=300
    )
    honest, hostile = [], []
    causes = dict(HOSTILE)
    try:
        async with RolloutManager(runner, engine, rows, config) as mgr:
            for _ in range(STEPS):
                for group in await mgr.get_batch(timeout=300):
                    for idx, ep in enumerate(group.episodes):
                        assert ep is not None
                        (honest if idx == 0 else hostile).append(ep)

                async def sync() -> None:
                    engine.weight_version += 1

                await mgr.update_weights(sync)
            counters = mgr.counters
    finally:
        await provider.aclose()
    assert len(honest) == len(hostile) == STEPS * 2
    assert all(ep.status is Status.COMPLETED and ep.reward == 1.0 for ep in honest)
    for ep in hostile:
        assert ep.reward == 0.0 and ep.trainable, ep  # never a reward, never retried as infra
        if ep.status is Status.COMPLETED:
            # Seen once in CI (stop 48, 1 of 24): the short stray line of the `printf` attack did
            # not reach the host, so no frame was garbled; the episode then ends as a plain failed
            # attempt. The invariant that matters holds either way: reward 0, a policy outcome.
            assert ep.failure_cause is None, ep
            continue
        assert ep.status is Status.FAILED_POLICY, ep
        assert ep.failure_cause in set(causes.values())
    assert {ep.failure_cause for ep in hostile if ep.status is Status.FAILED_POLICY} == set(causes.values())
    assert not counters.failures and counters.internal_errors == 0  # no infra, no untyped error
    assert provider.live_sandboxes() == 0
    rc, out, _ = await run_cli(
        CLI, "ps", "-a", "--filter", f"label={LABEL_RUN}={run_id}", "--format", "{{.Names}}"
    )
    assert rc == 0 and out.split() == []
