"""Multi-step tasks (Harbor's `[[steps]]`) through the real agent loop and real podman sandboxes:
one sandbox, each step's instruction in a fresh conversation, its workdir and setup.sh, its own
tests (hidden from the next step's agent), the `min_reward` gate and the reward strategy; the
record marks the steps and replays."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from agentrl.agent.actions import get_format
from agentrl.agent.loop import AgentConfig
from agentrl.agent.tokens import ChatRenderer
from agentrl.engine.base import SamplingParams
from agentrl.engine.scripted import ScriptedEngine
from agentrl.episode.record import read_record
from agentrl.episode.run import EpisodeConfig, replay_episode, run_episode
from agentrl.sandbox.podman import PodmanProvider
from agentrl.tasks.task import load_task
from tests.chat_tokenizer import byte_tokenizer

pytestmark = [pytest.mark.container, pytest.mark.slow]

TASK = Path(__file__).resolve().parents[1] / "envs" / "tbench2" / "tasks" / "two-step-notes"
FMT = get_format("terminus-json")


def commands(*cmds: str) -> list[str]:
    return [
        FMT.render([c + "\n" for c in cmds], task_complete=False, analysis="a", plan="p"),
        FMT.render([], task_complete=True, analysis="done", plan="finish"),
    ]


async def _episode(script: list[str], tmp_path: Path, task: Path = TASK):  # type: ignore[no-untyped-def]
    tok = byte_tokenizer()
    provider = PodmanProvider()
    engine = ScriptedEngine(script, tok)
    try:
        result = await run_episode(
            load_task(task),
            provider=provider,
            engine=engine,
            renderer=ChatRenderer(tok),
            config=EpisodeConfig(
                agent=AgentConfig(
                    max_turns=3, max_new_tokens=4096, max_total_tokens=32768, terminal="commands"
                ),
                sampling=SamplingParams(max_new_tokens=4096),
            ),
            run_id="steps",
            record_dir=tmp_path,
        )
    finally:
        await provider.aclose()
    assert provider.live_sandboxes() == 0
    prompts = [tok.decode(ids) for _, ids in engine.calls]
    return result, prompts


async def test_both_steps_solved_score_one_and_the_second_agent_sees_no_tests(tmp_path: Path) -> None:
    result, prompts = await _episode(
        commands("echo first > /app/notes.txt")
        + commands("ls /tests /app", "cat /app/inbox/extra.txt >> /app/notes.txt"),
        tmp_path,
    )
    assert result.verify.reward == 1.0 and result.verify.rewards == {"reward": 1.0}
    # each step is a fresh conversation opened by its own instruction
    assert "Create the file `/app/notes.txt`" in prompts[0] and "inbox" not in prompts[0]
    assert (
        "A new note arrived in `/app/inbox/extra.txt`" in prompts[2]
        and "/app/notes.txt` holding" not in prompts[2]
    )
    second = result.run.turns[2].outputs[0]
    assert "/tests" in second.stderr and "No such file" in second.stderr  # step 1's tests are gone
    assert "setup.sh" not in second.stdout  # the workdir's setup ran (and removed itself)
    # one episode: every step's segments are its samples, under one reward
    assert len(result.samples) == 2 and {s.reward for s in result.samples} == {1.0}
    record = read_record(result.record_path)
    assert [t["step"] for t in record.turns] == [0, 0, 1, 1]
    report = await replay_episode(result.record_path, provider=PodmanProvider(), run_id="steps-replay")
    assert report.replayed_reward == 1.0 and report.reward_matches


async def test_the_reward_is_the_mean_over_the_steps(tmp_path: Path) -> None:
    result, _ = await _episode(commands("echo first > /app/notes.txt") + commands("true"), tmp_path)
    assert result.verify.reward == 0.5 and result.verify.outcome == "fail"


async def test_a_step_under_its_min_reward_stops_the_task(tmp_path: Path) -> None:
    result, prompts = await _episode(commands("echo wrong > /app/notes.txt") + commands("true"), tmp_path)
    assert result.verify.reward == 0.0
    assert len(prompts) == 2 and all("inbox" not in p for p in prompts)  # step 2 never started
    lines = [json.loads(line) for line in result.record_path.read_text().splitlines()]
    assert [x["name"] for x in lines if x["type"] == "step"] == ["write"]


def _variant(tmp_path: Path, old: str, new: str) -> Path:
    """two-step-notes with one line of its task.toml changed."""
    import shutil

    d = tmp_path / "variant" / TASK.name
    shutil.copytree(TASK, d)
    toml = (d / "task.toml").read_text()
    assert old in toml
    (d / "task.toml").write_text(toml.replace(old, new))
    return d


async def test_the_final_strategy_takes_the_last_steps_reward(tmp_path: Path) -> None:
    """`multi_step_reward_strategy = "final"`: the first step failed (no gate here), the second
    passed, so the task scores 1 where "mean" would give 0.5."""
    task = _variant(tmp_path, 'multi_step_reward_strategy = "mean"', 'multi_step_reward_strategy = "final"')
    toml = (task / "task.toml").read_text()
    (task / "task.toml").write_text(toml.replace("min_reward = 1.0\n", ""))
    result, prompts = await _episode(
        commands("echo wrong > /app/notes.txt")
        + commands("echo first > /app/notes.txt", "cat /app/inbox/extra.txt >> /app/notes.txt"),
        tmp_path,
        task,
    )
    assert len(prompts) == 4  # both steps ran
    assert result.verify.reward == 1.0 and result.verify.outcome == "pass"


async def test_a_min_reward_table_gates_on_the_keys_it_names(tmp_path: Path) -> None:
    """`min_reward = { reward = 1.0 }` (Harbor's per-key form) gates like the float."""
    task = _variant(tmp_path, "min_reward = 1.0", "min_reward = { reward = 1.0 }")
    result, prompts = await _episode(
        commands("echo wrong > /app/notes.txt") + commands("true"), tmp_path, task
    )
    assert result.verify.reward == 0.0 and len(prompts) == 2  # step 2 never started


async def test_a_multi_step_episode_is_one_training_episode_in_the_rollout_manager() -> None:
    """Through the rollout manager (the training path): a group of two on the two-step task, one
    sample solving both steps, one giving up at once (the first step's gate stops it). The solver's
    episode holds a segment per step, and all its samples get one advantage (one per episode, as
    for split episodes)."""
    from collections import Counter

    from agentrl.episode.run import SandboxEpisodeRunner
    from agentrl.rollout import RolloutConfig, RolloutManager
    from agentrl.train.batch import training_samples

    tok = byte_tokenizer()
    calls: Counter[tuple[str, bool]] = Counter()

    def reply(session_id: str | None, turn: int, ids: list[int]) -> str:
        step2 = "A new note arrived" in tok.decode(ids)
        key = (str(session_id), step2)
        calls[key] += 1
        if int(str(session_id).split(":")[-2]) != 0 or calls[key] > 1:
            return FMT.render([], task_complete=True, analysis="done", plan="finish")
        cmd = "cat /app/inbox/extra.txt >> /app/notes.txt" if step2 else "echo first > /app/notes.txt"
        return FMT.render([cmd + "\n"], task_complete=False, analysis="a", plan="p")

    provider = PodmanProvider()
    engine = ScriptedEngine(reply, tok)
    runner = SandboxEpisodeRunner(
        provider=provider,
        engine=engine,
        renderer=ChatRenderer(tok),
        config=EpisodeConfig(
            agent=AgentConfig(max_turns=3, max_new_tokens=4096, max_total_tokens=32768, terminal="commands"),
            sampling=SamplingParams(max_new_tokens=4096),
        ),
        run_id="steps-rollout",
    )
    rows = [{"prompt": "p", "metadata": {"task_id": TASK.name, "task_path": str(TASK)}}]
    config = RolloutConfig(batch_size=2, n_samples_per_prompt=2, max_in_flight=2, max_staleness=None)
    try:
        async with RolloutManager(runner, engine, rows, config) as mgr:
            (group,) = await mgr.get_batch(timeout=600)
    finally:
        await provider.aclose()
    assert provider.live_sandboxes() == 0
    episodes = sorted((e for e in group.episodes if e is not None), key=lambda e: e.sample_index)
    assert [e.reward for e in episodes] == [1.0, 0.0]
    assert len(episodes[0].segments) == 2  # one per step: each step is a fresh conversation
    advantages: dict[str | None, set[float]] = {}
    for s in training_samples([group.episodes]):
        advantages.setdefault(s.episode_id, set()).add(round(float(s.advantage or 0.0), 6))
    assert sorted(len(v) for v in advantages.values()) == [1, 1]  # one advantage per episode
    low, high = sorted(next(iter(v)) for v in advantages.values())
    assert high > 0 and low == -high  # the solver's above the group's mean, the other below
