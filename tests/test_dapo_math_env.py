"""The dapo_math environment on the seams: rows as published, one-segment episodes with exact
tokens, the reference rewards, partial rollouts, infra versus policy, pass@k through the shared
evaluator, and the hub download against a loopback stand-in of the hub."""

from __future__ import annotations

import hashlib
import http.server
import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

pytest.importorskip("math_verify")
pytest.importorskip("transformers")

from agentrl.engine.base import Engine, EngineError, Generation, SamplingParams
from agentrl.engine.scripted import ScriptedEngine
from agentrl.episode.sample import Status
from agentrl.errors import InfraError
from agentrl.eval.passk import evaluate
from agentrl.rollout.environment import EnvContext, get_plugin
from agentrl.runtime import RunConfig, resolve
from envs.dapo_math import MathConfig, MathEnvironment
from envs.dapo_math.rows import MathRowError, dapo_row, read_rows
from envs.dapo_math.synthetic import arithmetic_rows, solution_text, statement
from tests.chat_tokenizer import byte_tokenizer
from tests.http_standin import serve

FIXTURES = Path(__file__).resolve().parent / "fixtures" / "dapo_math"
TRAIN = FIXTURES / "train.jsonl"
AIME = FIXTURES / "aime.jsonl"


def make_env(tmp_path: Path, **options: Any) -> MathEnvironment:
    options = {"max_new_tokens": 64, **options}
    config = MathConfig(train_file=str(TRAIN), eval_file=str(AIME), **options)
    ctx = EnvContext(tokenizer=byte_tokenizer(), seed=0, out_dir=tmp_path, temperature=1.0)
    return MathEnvironment(config, ctx)


@pytest.fixture
async def env(tmp_path: Path) -> Any:
    e = make_env(tmp_path)
    yield e
    await e.aclose()


def test_the_plugin_is_found_by_name_and_its_settings_show_in_the_run_config() -> None:
    assert get_plugin("dapo_math").Config is MathConfig
    cfg = resolve(RunConfig, overrides=["env.name=dapo_math", f"env.train_file={TRAIN}"])
    assert cfg.env["name"] == "dapo_math" and cfg.env["wrong_reward"] == -1.0
    assert cfg.env["correct_reward"] == 1.0 and cfg.env["verify_timeout_s"] == 10.0


def test_an_unknown_setting_is_an_error() -> None:
    from agentrl.runtime.config import ConfigError

    with pytest.raises(ConfigError, match="bogus"):
        resolve(RunConfig, overrides=["env.name=dapo_math", "env.bogus=1"])


def test_rows_are_kept_exactly_as_published(env: MathEnvironment) -> None:
    published = [json.loads(line) for line in TRAIN.read_text().splitlines()]
    assert env.rows("train") == published
    row = env.rows("train")[0]
    assert set(row) == {"data_source", "prompt", "ability", "reward_model", "extra_info"}
    assert row["reward_model"] == {"ground_truth": "12", "style": "rule-lighteval/MATH_v2"}
    assert [r["reward_model"]["ground_truth"] for r in env.rows("eval")] == ["19", "30", "45"]


def test_a_row_without_a_ground_truth_is_rejected_with_its_line(tmp_path: Path) -> None:
    bad = tmp_path / "bad.jsonl"
    row = dapo_row("What is 1 + 1?", "2", index="a")
    del row["reward_model"]
    bad.write_text(json.dumps(row) + "\n")
    with pytest.raises(MathRowError, match=r"bad.jsonl:1: `reward_model.ground_truth`"):
        read_rows(bad)
    with pytest.raises(MathRowError, match="download"):
        read_rows(tmp_path / "missing.jsonl")


def scripted(replies: dict[int, str]) -> ScriptedEngine:
    """Replies by sample index (the session id ends with `:<sample_index>:<attempt>`)."""
    return ScriptedEngine(lambda sid, turn, ids: replies[int(sid.split(":")[-2])], byte_tokenizer())


async def test_an_episode_is_one_segment_of_prompt_ids_plus_generated_ids(env: MathEnvironment) -> None:
    engine = scripted({0: "x = 12\nAnswer: 12"})
    row = env.rows("train")[0]
    episode = await env.runner(engine, run_id="t").run(row, group_id="g", sample_index=0)
    [seg] = episode.segments
    prompt = env.prompt_ids(row)
    assert engine.calls[0][1] == prompt  # the prompt rendered once by the chat template
    generated = byte_tokenizer().encode("x = 12\nAnswer: 12", add_special_tokens=False)
    assert seg.tokens == prompt + generated + [engine.eos_id] and seg.prompt_length == len(prompt)
    assert seg.loss_mask == [1] * (len(generated) + 1) and seg.rollout_logprobs == [-0.5] * (
        len(generated) + 1
    )
    assert seg.weight_versions == [0] and episode.turn_versions == [0]
    assert episode.reward == 1.0 and episode.status is Status.COMPLETED and episode.trainable
    assert episode.metadata["verdict"] == "correct" and episode.metadata["answer"] == "12"
    seg.check()


@pytest.mark.parametrize(
    ("reply", "verdict"),
    [
        ("Answer: 13", "wrong"),
        ("I do not know", "no_answer"),
        ("Answer: }{", "unparsed"),
        ("\\boxed{12.0}", "correct"),
    ],
)
async def test_rewards_are_the_reference_recipes(env: MathEnvironment, reply: str, verdict: str) -> None:
    episode = await env.runner(scripted({0: reply}), run_id="t").run(
        env.rows("train")[0], group_id="g", sample_index=0
    )
    assert episode.metadata["verdict"] == verdict
    assert episode.reward == (1.0 if verdict == "correct" else -1.0)
    assert episode.status is Status.COMPLETED and episode.trainable  # a policy outcome, trained on


async def test_a_response_cut_at_the_budget_is_truncated_and_still_scored(tmp_path: Path) -> None:
    env = make_env(tmp_path, max_new_tokens=5)
    try:
        episode = await env.runner(scripted({0: "Answer: 12 and more"}), run_id="t").run(
            env.rows("train")[0], group_id="g", sample_index=0
        )
    finally:
        await env.aclose()
    assert episode.status is Status.TRUNCATED and episode.end_reason == "length"
    assert episode.reward == -1.0 and len(episode.segments[0].loss_mask) == 5


async def test_overlong_shaping_applies_to_training_not_to_evals(tmp_path: Path) -> None:
    env = make_env(tmp_path, max_new_tokens=20, overlong_buffer_len=10, overlong_penalty_factor=1.0)
    reply = "Answer: 12" + " " * 5  # 15 tokens + eos = 16: 6 past the 10 expected
    try:
        runner = env.runner(scripted({0: reply, 1: reply}), run_id="t")
        train = await runner.run(env.rows("train")[0], group_id="g", sample_index=0)
        evaluated = await runner.run(env.rows("train")[0], group_id="g", sample_index=1, eval=True)
    finally:
        await env.aclose()
    assert train.reward == pytest.approx(1.0 - 0.6) and train.metadata["overlong_penalty"] == pytest.approx(
        -0.6
    )
    assert evaluated.reward == 1.0


class AbortOnceEngine(Engine):
    """Answers in two pieces: the first ends with finish "abort" (a weight update) on version 0,
    the rest comes on version 1, continuing from the ids already generated."""

    def __init__(self, text: str) -> None:
        self.ids = byte_tokenizer().encode(text, add_special_tokens=False) + [byte_tokenizer().eos_token_id]
        self.inputs: list[list[int]] = []

    async def generate(
        self, input_ids: list[int], sampling: SamplingParams, *, session_id: str | None = None
    ) -> Generation:
        self.inputs.append(list(input_ids))
        if len(self.inputs) == 1:
            return Generation(self.ids[:4], [-0.1] * 4, "abort", 0)
        rest = self.ids[4:]
        return Generation(rest, [-0.2] * len(rest), "stop", 1)


async def test_an_aborted_generation_continues_from_its_tokens_on_the_new_weights(
    env: MathEnvironment,
) -> None:
    engine = AbortOnceEngine("Answer: 12")
    row = env.rows("train")[0]
    episode = await env.runner(engine, run_id="t").run(row, group_id="g", sample_index=0)
    prompt = env.prompt_ids(row)
    assert engine.inputs[1] == prompt + engine.ids[:4]
    [seg] = episode.segments
    assert seg.tokens == prompt + engine.ids and seg.weight_versions == [0, 1]
    assert seg.rollout_logprobs == [-0.1] * 4 + [-0.2] * (len(engine.ids) - 4)
    assert episode.reward == 1.0 and episode.oldest_version() == 0


class DownEngine(Engine):
    async def generate(
        self, input_ids: list[int], sampling: SamplingParams, *, session_id: str | None = None
    ):  # type: ignore[no-untyped-def]
        raise EngineError("connection refused")


async def test_an_engine_failure_is_infra_never_a_reward(env: MathEnvironment) -> None:
    with pytest.raises(InfraError) as info:
        await env.runner(DownEngine(), run_id="t").run(env.rows("train")[0], group_id="g", sample_index=0)
    assert info.value.cause == "engine"


async def test_a_hanging_answer_scores_as_wrong_with_a_counted_timeout(tmp_path: Path) -> None:
    env = make_env(tmp_path, verify_timeout_s=2.0, verify_workers=1)
    try:
        reply = "Answer: 7^{7^{7^{7}}} - 7^{7^{7^{7}}} + 7"
        episode = await env.runner(scripted({0: reply}), run_id="t").run(
            env.rows("train")[0], group_id="g", sample_index=0
        )
    finally:
        await env.aclose()
    assert episode.metadata["verdict"] == "timeout" and episode.reward == -1.0
    assert episode.status is Status.COMPLETED and env.verifier.counts["timeout"] == 1


async def test_pass_at_k_through_the_shared_evaluator(env: MathEnvironment) -> None:
    problems = {"a+b=20": "19", "$15$": "30", "$506$": "45"}  # a phrase of each eval problem -> gold

    def reply(sid: str, turn: int, ids: list[int]) -> str:
        """Right on even samples, wrong on odd ones."""
        text = byte_tokenizer().decode(ids)
        gold = next(g for phrase, g in problems.items() if phrase in text)
        return f"Answer: {gold}" if int(sid.split(":")[-2]) % 2 == 0 else "Answer: 0"

    engine = ScriptedEngine(reply, byte_tokenizer())
    summary = await evaluate(env.runner(engine, run_id="e"), env.rows("eval"), samples_per_row=4, ks=[1, 2])
    assert summary.pass_at(1) == pytest.approx(0.5)
    assert summary.pass_at(2) == pytest.approx(1 - (2 / 4) * (1 / 3))
    assert summary.unscored == 0 and summary.episodes == 12


def test_the_synthetic_family_is_in_the_dapo_format_and_its_eval_set_is_held_out() -> None:
    train = arithmetic_rows(50, seed=0)
    held = arithmetic_rows(20, seed=1, exclude={statement(r) for r in train})
    assert not {statement(r) for r in train} & {statement(r) for r in held}
    row = train[0]
    assert row["prompt"][0]["content"].startswith("Solve the following math problem step by step.")
    a, b = row["extra_info"]["operands"]
    assert int(row["reward_model"]["ground_truth"]) == (a + b if row["extra_info"]["op"] == "+" else a * b)
    assert solution_text(row).endswith(f"Answer: \\boxed{{{row['reward_model']['ground_truth']}}}")


# --- the hub download, against a loopback stand-in of the hub -----------------------------------


class HubStandIn(http.server.BaseHTTPRequestHandler):
    """Serves `/datasets/<repo>/resolve/<revision>/<path>` from `files` with the headers
    huggingface_hub reads (commit, etag, size); anything else is a 404."""

    files: dict[str, bytes] = {}
    requests: list[str] = []

    def _file(self) -> bytes | None:
        self.requests.append(self.path)
        parts = self.path.split("?")[0].split("/")
        # ['', 'datasets', owner, name, 'resolve', revision, *path]
        if len(parts) < 7 or parts[1] != "datasets" or parts[4] != "resolve":
            return None
        return self.files.get(f"{parts[2]}/{parts[3]}:{'/'.join(parts[6:])}")

    def _headers(self, body: bytes) -> None:
        self.send_response(200)
        self.send_header("Content-Length", str(len(body)))
        self.send_header("ETag", '"' + hashlib.sha256(body).hexdigest() + '"')
        self.send_header("X-Repo-Commit", "0" * 40)
        self.end_headers()

    def do_HEAD(self) -> None:
        body = self._file()
        if body is None:
            self.send_error(404)
        else:
            self._headers(body)

    def do_GET(self) -> None:
        body = self._file()
        if body is None:
            self.send_error(404)
        else:
            self._headers(body)
            self.wfile.write(body)

    def log_message(self, *args: Any) -> None:
        pass


@pytest.fixture
def hub() -> Iterator[str]:
    with serve(HubStandIn) as url:
        yield url


def parquet_bytes(rows: list[dict[str, Any]], tmp_path: Path) -> bytes:
    pa = pytest.importorskip("pyarrow")
    import pyarrow.parquet as pq

    path = tmp_path / "rows.parquet"
    pq.write_table(pa.Table.from_pylist(rows), path)
    return path.read_bytes()


def test_download_writes_the_published_rows_deduplicated(tmp_path: Path, hub: str) -> None:
    from envs.dapo_math.hub import DATASETS, download_datasets

    train = [json.loads(line) for line in TRAIN.read_text().splitlines()]
    aime = [json.loads(line) for line in AIME.read_text().splitlines()]
    (train_repo, train_file), (aime_repo, aime_file) = DATASETS["dapo-math-17k"], DATASETS["aime-2024"]
    HubStandIn.files = {
        f"{train_repo}:{train_file}": parquet_bytes(train * 3, tmp_path),  # published repeated
        f"{aime_repo}:{aime_file}": parquet_bytes(aime, tmp_path),
    }
    written = download_datasets(tmp_path / "data", endpoint=hub, report=lambda s: None)
    assert written == {tmp_path / "data" / "dapo-math-17k.jsonl": 4, tmp_path / "data" / "aime-2024.jsonl": 3}
    assert read_rows(tmp_path / "data" / "dapo-math-17k.jsonl") == train
    assert read_rows(tmp_path / "data" / "aime-2024.jsonl") == aime


def test_a_missing_file_on_the_hub_is_a_clear_error(tmp_path: Path, hub: str) -> None:
    from envs.dapo_math.hub import HubError, download_datasets

    HubStandIn.files = {}
    with pytest.raises(HubError, match=r"cannot download data/dapo-math-17k.parquet of BytedTsinghua-SIA"):
        download_datasets(tmp_path / "data", endpoint=hub, report=lambda s: None)
