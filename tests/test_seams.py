"""The seams hold: the rollout manager, the trainer and the runtime import no environment."""

from __future__ import annotations

import subprocess
import sys
import textwrap

TERMINAL = (
    "agentrl.sandbox",
    "agentrl.tasks.",  # the package face and its generic prompt rows (`tasks.rows`) excepted below
    "agentrl.agent",
    "agentrl.episode.run",
    "agentrl.episode.verify",
    "envs",
)


def test_manager_trainer_and_runtime_import_nothing_terminal_specific() -> None:
    code = textwrap.dedent(f"""
        import sys
        import agentrl.rollout.manager, agentrl.rollout.buffer, agentrl.train.torch_backend
        import agentrl.train.batch, agentrl.runtime.loop, agentrl.runtime.config, agentrl.eval.passk
        print([m for m in sys.modules if m.startswith({TERMINAL!r}) and m != "agentrl.tasks.rows"])
    """)
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert out.strip() == "[]"


def test_environments_are_found_by_name_and_validate_their_own_settings() -> None:
    from agentrl.rollout.environment import available, resolve_config

    assert "tbench2" in available()
    cfg = resolve_config({"name": "tbench2", "agent": {"max_turns": 2}})
    assert cfg.model_dump()["agent"]["max_turns"] == 2
