"""Episodes end to end on fake sandboxes: samples, caps, failure classification, record/replay."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from agentrl.agent.loop import AgentConfig, EndReason
from agentrl.agent.tokens import ChatRenderer
from agentrl.engine.base import Engine, EngineError, Generation, SamplingParams
from agentrl.engine.scripted import ScriptedEngine
from agentrl.episode.record import read_record
from agentrl.episode.run import EpisodeConfig, SandboxEpisodeRunner, replay_episode, run_episode
from agentrl.episode.sample import Status
from agentrl.errors import InfraError
from agentrl.tasks.task import load_task
from agentrl.testing.sandbox import FakeSandboxProvider, Faults
from tests.chat_tokenizer import byte_tokenizer

TASK = Path(__file__).parent / "fixtures" / "sandbox_tasks" / "write-hello"


def fenced(cmd: str) -> str:
    return f"```bash\n{cmd}\n```"


def provider(**kw) -> FakeSandboxProvider:  # type: ignore[no-untyped-def]
    p = FakeSandboxProvider(**kw)
    # Reward 1 iff the agent wrote the file the task asks for.
    p.grader = lambda sb: 1.0 if any("hello" in c and ">" in c for c in sb.commands) else 0.0
    return p


def config(**agent) -> EpisodeConfig:  # type: ignore[no-untyped-def]
    return EpisodeConfig(
        action_format="fenced-bash", agent=AgentConfig(**agent), sampling=SamplingParams(max_new_tokens=128)
    )


async def run(engine: Engine, prov: FakeSandboxProvider, cfg: EpisodeConfig | None = None, **kw):  # type: ignore[no-untyped-def]
    tok = byte_tokenizer()
    return await run_episode(
        load_task(TASK),
        provider=prov,
        engine=engine,
        renderer=ChatRenderer(tok),
        config=cfg or config(),
        run_id="t",
        **kw,
    )


async def test_a_solved_episode_yields_one_aligned_sample() -> None:
    tok = byte_tokenizer()
    prov = provider()
    engine = ScriptedEngine([fenced("echo hello > /app/hello.txt"), "TASK_COMPLETE"], tok)
    result = await run(engine, prov)
    (sample,) = result.samples
    sample.check()
    assert sample.reward == 1.0 and sample.status is Status.COMPLETED
    assert sample.end_reason == EndReason.TASK_COMPLETE.value
    generated = [t for t, m in zip(sample.tokens[sample.prompt_length :], sample.loss_mask, strict=True) if m]
    expected = (
        tok.encode(fenced("echo hello > /app/hello.txt"), add_special_tokens=False)
        + [tok.eos_token_id]
        + tok.encode("TASK_COMPLETE", add_special_tokens=False)
        + [tok.eos_token_id]
    )
    assert generated == expected
    assert all(lp != 0.0 for lp, m in zip(sample.rollout_logprobs, sample.loss_mask, strict=True) if m)
    assert all(lp == 0.0 for lp, m in zip(sample.rollout_logprobs, sample.loss_mask, strict=True) if not m)
    assert set(sample.timings) >= {"engine_s", "sandbox_s", "verifier_s"}
    assert prov.live_sandboxes() == 0
    # tests/ reached the sandbox only for verification, after every agent command.
    sb = prov.sandboxes[0]
    first_test_cmd = next(i for i, c in enumerate(sb.commands) if "/tests" in c)
    assert sb.commands[first_test_cmd].startswith("rm -rf /tests")  # the verifier's own reset
    assert all("/tests" not in c for c in sb.commands[:first_test_cmd])


async def test_malformed_replies_become_observations_and_end_as_no_action() -> None:
    tok = byte_tokenizer()
    result = await run(
        ScriptedEngine(["hmm", "still thinking", "no idea"], tok),
        provider(),
        config(max_consecutive_malformed=3),
    )
    (sample,) = result.samples
    assert result.run.malformed_turns == 3
    assert sample.status is Status.FAILED_POLICY and sample.end_reason == "no_action"
    assert sample.reward == 0.0  # a policy failure keeps its verified reward
    assert "no ```bash code block" in result.run.turns[0].observation


async def test_max_turns_truncates() -> None:
    tok = byte_tokenizer()
    result = await run(ScriptedEngine([fenced("ls")] * 5, tok), provider(), config(max_turns=2))
    assert result.samples[0].status is Status.TRUNCATED and result.samples[0].end_reason == "max_turns"


async def test_token_budget_stops_before_exceeding() -> None:
    tok = byte_tokenizer()
    result = await run(
        ScriptedEngine([fenced("ls -la /app")] * 50, tok),
        provider(),
        config(max_turns=50, max_total_tokens=400, max_new_tokens=64),
    )
    (sample,) = result.samples
    assert sample.end_reason == "token_budget" and sample.status is Status.TRUNCATED
    assert len(sample.tokens) <= 400


class _DownEngine(Engine):
    async def generate(self, input_ids, sampling, *, session_id=None) -> Generation:  # type: ignore[no-untyped-def]
        raise EngineError("503 from every worker")


async def test_engine_failure_is_infra_and_recorded(tmp_path: Path) -> None:
    prov = provider()
    with pytest.raises(InfraError) as info:
        await run(_DownEngine(), prov, record_dir=tmp_path)
    assert info.value.cause == "engine"
    (record,) = tmp_path.glob("*.jsonl")
    result = read_record(record).result
    assert (
        result["status"] == "failed-infra"
        and result["reward"] is None
        and result["failure_cause"] == "engine"
    )
    assert prov.live_sandboxes() == 0


async def test_sandbox_transport_error_is_infra() -> None:
    tok = byte_tokenizer()
    prov = provider(faults=Faults(transport_error=1.0))
    with pytest.raises(InfraError) as info:
        await run(ScriptedEngine([fenced("ls")], tok), prov)
    assert info.value.cause == "sandbox_transport"
    assert prov.live_sandboxes() == 0


async def test_a_verifier_that_writes_no_reward_after_an_agent_phase_is_a_policy_failure() -> None:
    """The agent's work could have broken the tests (docs/failures.md): reward 0 with its cause,
    never an infra failure that would hand the policy a re-roll. The oracle sweep, where no agent
    ran, still reports such a verifier as the task's error."""
    tok = byte_tokenizer()
    prov = FakeSandboxProvider(grader=lambda sb: None)
    result = await run(ScriptedEngine([fenced("echo hello > /app/hello.txt"), "TASK_COMPLETE"], tok), prov)
    assert result.episode.reward == 0.0 and result.episode.status is Status.FAILED_POLICY
    assert result.episode.failure_cause == "verifier_error"


async def test_a_reward_out_of_range_after_an_agent_phase_is_a_policy_failure_with_the_value_shown() -> None:
    """The tests run the agent's programs with the verifier's rights, so the agent could have
    written it: reward 0 with its cause, never a re-roll (the oracle sweep calls it the task's)."""
    tok = byte_tokenizer()
    prov = FakeSandboxProvider(grader=lambda sb: 7.0)
    result = await run(ScriptedEngine([fenced("echo hello > /app/hello.txt"), "TASK_COMPLETE"], tok), prov)
    assert result.episode.status is Status.FAILED_POLICY and result.episode.reward == 0.0
    assert result.episode.failure_cause == "reward_out_of_range" and result.verify is not None
    assert "7.0" in (result.verify.error or "")


async def test_record_then_replay_matches(tmp_path: Path) -> None:
    tok = byte_tokenizer()
    prov = provider()
    prov.on(r"^ls /app$", "hello.txt\n")
    script = [fenced("ls /app"), fenced("echo hello > /app/hello.txt"), "TASK_COMPLETE"]
    result = await run(ScriptedEngine(script, tok), prov, record_dir=tmp_path)
    rec = read_record(result.record_path)
    header, turns, final = rec.header, rec.turns, rec.result
    assert header["task_id"] == "write-hello" and len(turns) == 3 and final["reward"] == 1.0
    assert turns[0]["outputs"][0]["stdout"] == "hello.txt\n"
    assert json.loads(json.dumps(final["samples"]))[0]["loss_mask"]
    report = await replay_episode(result.record_path, provider=prov, run_id="replay")
    assert report.reward_matches and report.outputs_match
    # A sandbox that answers differently is reported, turn by turn.
    other = provider()
    other.on(r"^ls /app$", "nothing here\n")
    report2 = await replay_episode(result.record_path, provider=other, run_id="replay2")
    assert not report2.outputs_match and report2.turns[0].matched is False


async def test_episode_runner_serves_the_rollout_seam() -> None:
    tok = byte_tokenizer()
    prov = provider()
    runner = SandboxEpisodeRunner(
        provider=prov,
        engine=ScriptedEngine([fenced("echo hello > x"), "TASK_COMPLETE"], tok),
        renderer=ChatRenderer(tok),
        config=config(),
        run_id="r",
    )
    row = {"metadata": {"task_path": str(TASK), "task_id": "write-hello"}}
    sample = await runner.run(row, group_id="g0", sample_index=3, attempt=0)
    assert sample.prompt_id == "g0" and sample.sample_index == 3 and sample.reward == 1.0


async def test_an_oversized_instruction_is_refused_before_any_sandbox_starts(tmp_path: Path) -> None:
    import shutil

    from agentrl.errors import TaskFormatError
    from agentrl.tasks.task import MAX_INSTRUCTION_BYTES

    task_dir = tmp_path / "huge"
    shutil.copytree(TASK, task_dir)
    (task_dir / "instruction.md").write_text("x" * (MAX_INSTRUCTION_BYTES + 1))
    prov = FakeSandboxProvider()
    tok = byte_tokenizer()
    with pytest.raises(TaskFormatError, match="byte cap"):
        await run_episode(
            load_task(task_dir),
            provider=prov,
            engine=ScriptedEngine(["TASK_COMPLETE"], tok),
            renderer=ChatRenderer(tok),
            config=EpisodeConfig(action_format="fenced-bash"),
            run_id="huge",
            record_dir=tmp_path / "records",
        )
    assert prov.created == 0 and not (tmp_path / "records").exists()
