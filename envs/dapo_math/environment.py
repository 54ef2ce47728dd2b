"""`MathEnvironment`: DAPO-format rows -> single-turn episodes scored by answer equivalence.

One episode is one generation: the row's `prompt` rendered once with the tokenizer's chat template,
`engine.generate` on those ids, the answer extracted from the decoded text (`answer.py`) and checked
against `reward_model.ground_truth` with math-verify in a killable worker (`verify.py`). The trained
segment is exactly the prompt ids plus the generated ids (loss mask 1 and the engine's log-probs on
the generated ones); the text is decoded only to score it, never re-tokenized.

Rewards are the reference recipe's (verl `reward_score/math_dapo.py`): +1 for a correct answer, -1
otherwise (wrong, missing, unparseable, or a check that ran out of time). DAPO's overlong reward
shaping (`overlong_buffer_len`, `overlong_penalty_factor`) is applied to training episodes when
enabled; evaluations score correctness only, so pass@k counts correct answers.
"""

from __future__ import annotations

import asyncio
import json
import logging
import time
from pathlib import Path
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field

from agentrl.agent.tokens import Segment
from agentrl.engine.base import Engine, SamplingParams, generate_to_end
from agentrl.episode.run import segment_samples
from agentrl.episode.sample import Episode, Status
from agentrl.rollout.environment import EnvContext, EnvironmentPluginError, Split
from envs.dapo_math.answer import ANSWER_WINDOW_CHARS, extract_answer
from envs.dapo_math.rows import ground_truth, read_rows
from envs.dapo_math.verify import MathVerifier, Verdict

log = logging.getLogger("agentrl.envs.dapo_math")

DEFAULT_DATA = Path("data/dapo_math")


class MathConfig(BaseModel):
    """Settings of the DAPO-math environment (every one printed by `--dry-run`)."""

    model_config = ConfigDict(extra="forbid")

    name: Literal["dapo_math"] = "dapo_math"
    train_file: str = Field(
        str(DEFAULT_DATA / "dapo-math-17k.jsonl"),
        description="DAPO-format rows for training (.jsonl or .parquet); `download` writes this file.",
    )
    eval_file: str | None = Field(
        str(DEFAULT_DATA / "aime-2024.jsonl"),
        description="DAPO-format rows for evaluation (AIME-style); None evaluates on the train rows.",
    )
    max_train_rows: int | None = Field(None, ge=1, description="Use only the first N training rows.")
    max_eval_rows: int | None = Field(None, ge=1, description="Use only the first N eval rows.")
    max_new_tokens: int = Field(20480, ge=1, description="Response budget (the DAPO recipe: 20k).")
    eval_max_new_tokens: int | None = Field(None, ge=1, description="Eval budget (None: max_new_tokens).")
    correct_reward: float = Field(1.0, description="Reward of a correct answer (reference: 1).")
    wrong_reward: float = Field(
        -1.0, description="Reward of a wrong, missing or unverifiable answer (reference: -1)."
    )
    overlong_buffer_len: int | None = Field(
        None,
        ge=1,
        description="DAPO's soft overlong punishment: the last N tokens of the budget cost up to "
        "overlong_penalty_factor, linearly (the DAPO recipe: 4096 of 20480). None: off.",
    )
    overlong_penalty_factor: float = Field(1.0, ge=0)
    answer_window_chars: int | None = Field(
        ANSWER_WINDOW_CHARS, ge=1, description="Read the answer from the response's last N characters."
    )
    verify_timeout_s: float = Field(
        10.0, gt=0, description="Hard limit on one equivalence check; over it the worker is killed."
    )
    verify_workers: int = Field(2, ge=1, description="math-verify worker processes.")
    engine_timeout_s: float = Field(1800.0, gt=0, description="Limit on one generation call.")


class MathRunner:
    """One row -> one single-turn `Episode` (the `EpisodeRunner` protocol)."""

    def __init__(self, env: MathEnvironment, engine: Engine, *, run_id: str) -> None:
        self.env = env
        self.engine = engine
        self.run_id = run_id
        self.config = env.config

    def _sampling(self, *, eval: bool, seed: int | None) -> SamplingParams:
        c, ctx = self.config, self.env.context
        budget = (c.eval_max_new_tokens or c.max_new_tokens) if eval else c.max_new_tokens
        return SamplingParams(
            temperature=ctx.temperature, top_p=ctx.top_p, top_k=ctx.top_k, max_new_tokens=budget, seed=seed
        )

    def _reward(self, verdict: Verdict, response_len: int, *, eval: bool) -> tuple[float, float]:
        """(reward, overlong penalty) as the DAPO recipe computes them."""
        c = self.config
        reward = c.correct_reward if verdict.correct else c.wrong_reward
        penalty = 0.0
        if c.overlong_buffer_len and not eval:
            expected = c.max_new_tokens - c.overlong_buffer_len
            penalty = min(-(response_len - expected) / c.overlong_buffer_len * c.overlong_penalty_factor, 0.0)
        return reward + penalty, penalty

    async def _score(self, text: str, gold: str) -> tuple[str | None, Verdict]:
        answer = extract_answer(text, window=self.config.answer_window_chars)
        if answer is None:
            return None, self.env.verifier.record_no_answer()
        return answer, await self.env.verifier.check(answer, gold)

    async def run(
        self,
        row: dict[str, Any],
        *,
        group_id: str,
        sample_index: int,
        attempt: int = 0,
        eval: bool = False,
        seed: int | None = None,
    ) -> Episode:
        t0 = time.monotonic()
        gold = ground_truth(row)
        sampling = self._sampling(eval=eval, seed=seed)
        session_id = f"{self.run_id}:{group_id}:{sample_index}:{attempt}"
        tok = self.env.context.tokenizer
        mismatches = 0
        if tok is None:  # a text-only API engine: evaluation only, nothing to train
            text, finish = await asyncio.wait_for(
                self.engine.chat(row["prompt"], sampling),  # type: ignore[attr-defined]
                self.config.engine_timeout_s,
            )
            ids: list[int] = []
            logps: list[float] = []
            versions: list[int] = []
            prompt_ids: list[int] = []
        else:
            prompt_ids = self.env.prompt_ids(row)
            out = await generate_to_end(
                self.engine,
                prompt_ids,
                sampling,
                session_id=session_id,
                timeout_s=self.config.engine_timeout_s,
            )
            ids, logps, versions, finish = out.output_ids, out.logprobs, out.versions, out.finish_reason
            mismatches = out.version_mismatches
            text = tok.decode(ids, skip_special_tokens=True)
        t_gen = time.monotonic()
        answer, verdict = await self._score(text, gold)
        reward, penalty = self._reward(verdict, len(ids), eval=eval)
        status = Status.TRUNCATED if finish == "length" else Status.COMPLETED
        end_reason = "length" if finish == "length" else verdict.outcome
        timings = {"generate_s": t_gen - t0, "verify_s": time.monotonic() - t_gen}
        segments = segment_samples(
            [Segment(prompt_ids, list(ids), [1] * len(ids), list(logps), list(versions))],
            reward=reward,
            status=status,
            end_reason=end_reason,
            prompt_id=group_id,
            sample_index=sample_index,
            task_id=group_id,
            timings=timings,
        )
        if not segments and tok is not None:
            status = Status.FAILED_POLICY  # nothing generated: an outcome, nothing to train on
        return Episode(
            segments=segments,
            reward=reward,
            status=status,
            turn_versions=list(versions),
            end_reason=end_reason,
            task_id=group_id,
            prompt_id=group_id,
            sample_index=sample_index,
            attempt=attempt,
            timings=timings,
            metadata={
                "answer": answer,
                "ground_truth": gold,
                "verdict": verdict.outcome,
                "acc": float(verdict.correct),
                "overlong_penalty": penalty,
                "response_tokens": len(ids),
                "version_mismatches": mismatches,
            },
        )


class MathEnvironment:
    """DAPO-format rows from files; a runner per engine; one math-verify worker pool."""

    def __init__(self, config: MathConfig, context: EnvContext) -> None:
        try:
            import math_verify  # noqa: F401
        except ImportError:
            raise EnvironmentPluginError(
                "the dapo_math environment checks answers with math-verify: pip install 'agentrl[math]'"
            ) from None
        self.config = config
        self.context = context
        self._rows: dict[str, list[dict[str, Any]]] = {}
        self._prompt_ids: dict[str, list[int]] = {}
        self.verifier = MathVerifier(timeout_s=config.verify_timeout_s, workers=config.verify_workers)

    def rows(self, split: Split) -> list[dict[str, Any]]:
        if split not in self._rows:
            c = self.config
            if split == "train" or c.eval_file is None:
                rows = read_rows(c.train_file)[: c.max_train_rows]
            else:
                rows = read_rows(c.eval_file)
            if split == "eval":
                rows = rows[: c.max_eval_rows]
            self._rows[split] = rows
        return self._rows[split]

    def prompt_ids(self, row: dict[str, Any]) -> list[int]:
        """The row's prompt rendered once with the chat template and tokenized (cached)."""
        key = json.dumps(row["prompt"], sort_keys=True)
        ids = self._prompt_ids.get(key)
        if ids is None:
            tok = self.context.tokenizer
            text = tok.apply_chat_template(row["prompt"], tokenize=False, add_generation_prompt=True)
            ids = self._prompt_ids[key] = list(tok(text, add_special_tokens=False)["input_ids"])
        return ids

    def runner(self, engine: Engine, *, run_id: str, record_dir: Path | None = None) -> MathRunner:
        return MathRunner(self, engine, run_id=run_id)

    async def aclose(self) -> None:
        await self.verifier.aclose()


class _Plugin:
    name = "dapo_math"
    Config = MathConfig

    def build(self, config: MathConfig, context: EnvContext) -> MathEnvironment:
        return MathEnvironment(config, context)


plugin = _Plugin()
