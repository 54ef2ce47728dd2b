"""Text that sandbox errors carry: a tail starts where a line or a word starts, never mid-word."""

from __future__ import annotations

import pytest
from hypothesis import given
from hypothesis import strategies as st

from agentrl.sandbox.base import tail


def test_a_short_text_is_kept_whole_and_a_long_one_starts_at_a_line_or_a_word() -> None:
    assert tail("short", 10) == "short"
    log = "".join(f"Step {i}: RUN apt-get install package-{i}\n" for i in range(40))
    cut = tail(log, 200)
    assert cut.startswith("...Step ") and log.endswith(cut[3:]) and len(cut) <= 200
    words = "storage quota exceeded for container overlay " * 20
    cut = tail(words, 100)
    assert cut.startswith("...") and cut[3:].split(" ")[0] in words.split(" ")


@given(st.text(), st.integers(min_value=4, max_value=300))
def test_a_tail_is_a_bounded_suffix(text: str, limit: int) -> None:
    cut = tail(text, limit)
    assert len(cut) <= max(limit, len(text) if len(text) <= limit else limit)
    assert text.endswith(cut[3:] if cut != text else cut)


async def test_the_oracles_and_the_image_builders_errors_start_at_a_word() -> None:
    """The oracle's failed-solution detail and a failed image build's log tail (they print the
    end of long tool output) are cut where a word starts, as every sandbox error is."""
    from unittest import mock

    from agentrl.episode.oracle import _solve
    from agentrl.sandbox import images
    from agentrl.sandbox.base import ExecResult, ImageBuildError
    from agentrl.tasks.task import load_task
    from tests.conftest import BUNDLED_TASKS

    noise = " ".join(f"compiler-diagnostic-{i}" for i in range(400))
    words = set(noise.split(" "))

    class Box:
        async def exec(self, cmd: str, **kwargs: object) -> ExecResult:
            return ExecResult(stdout="", stderr=noise, exit_code=1 if "solve.sh" in cmd else 0)

        async def upload(self, src: object, dst: str) -> None:
            return None

    detail = await _solve(Box(), load_task(BUNDLED_TASKS / "hello-file"))
    assert detail.startswith("solve.sh exited 1: ...") and detail.split("...", 1)[1].split(" ")[0] in words

    failed = mock.Mock(returncode=1, stdout="", stderr=noise)
    with (
        mock.patch.object(images.subprocess, "run", return_value=failed),
        pytest.raises(ImageBuildError) as err,
    ):
        images._run("podman", "build", "-t", "x")
    assert err.value.log_tail.startswith("...") and err.value.log_tail[3:].split(" ")[0] in words
