"""A Harbor / terminal-bench-2 task directory, loaded lazily.

task.toml            configuration (see `agentrl.tasks.config`)
instruction.md       what the agent is asked to do (leading canary lines stripped)
environment/         Dockerfile and its build context (optional when docker_image is set)
tests/test.sh        the verifier; writes /logs/verifier/reward.txt or reward.json
solution/solve.sh    optional reference solution (the oracle agent runs it)
"""

from __future__ import annotations

import contextlib
import functools
import os
import re
import shutil
import tempfile
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path

from agentrl.errors import TaskFormatError
from agentrl.tasks.config import TaskConfig, parse_task_config

# An instruction is a prompt: 256 KiB is far above any real task's (terminal-bench's are a few KiB)
# and far below what would stall tokenization or fill a context (a 48 MB one took 9.5 GB).
MAX_INSTRUCTION_BYTES = 256 * 1024

_CANARY = re.compile(r"^\s*(<!--.*canary.*-->|#.*canary.*)\s*$", re.IGNORECASE)


def strip_canary(text: str) -> str:
    """Harbor drops leading canary comment lines and the blank lines right after them."""
    lines = text.splitlines(keepends=True)
    i = 0
    while i < len(lines) and _CANARY.match(lines[i]):
        i += 1
    if i:
        while i < len(lines) and not lines[i].strip():
            i += 1
    return "".join(lines[i:])


@dataclass
class Task:
    """One task directory. Nothing is read from disk until a property needs it."""

    path: Path
    _config: TaskConfig | None = field(default=None, repr=False)

    @property
    def task_id(self) -> str:
        """The directory name: stable, unique within a task set, used for hashing and labels."""
        return self.path.name

    @property
    def name(self) -> str:
        return self.config.name or self.task_id

    @functools.cached_property
    def config(self) -> TaskConfig:
        if self._config is not None:
            return self._config
        toml_path = self.path / "task.toml"
        try:
            text = toml_path.read_text(encoding="utf-8")
        except FileNotFoundError:
            raise TaskFormatError(
                str(toml_path), None, "task.toml is missing", "every task directory needs a task.toml"
            ) from None
        except UnicodeDecodeError:
            raise TaskFormatError(str(toml_path), None, "task.toml is not UTF-8 text") from None
        return parse_task_config(text, str(toml_path))

    @functools.cached_property
    def instruction(self) -> str:
        """The instruction, canary lines stripped. Raises `TaskFormatError` when it is missing,
        not UTF-8, or over `MAX_INSTRUCTION_BYTES` (checked before anything is read)."""
        path = self.path / "instruction.md"
        self.check_runnable()
        size = self.instruction_bytes
        if size is not None and size > MAX_INSTRUCTION_BYTES:
            raise TaskFormatError(
                str(path),
                None,
                f"instruction.md is {size} bytes, over the {MAX_INSTRUCTION_BYTES} byte cap",
                "shorten it; put large inputs in environment/ for the agent to read",
            )
        try:
            text = path.read_text(encoding="utf-8")
        except FileNotFoundError:
            raise TaskFormatError(
                str(path), None, "instruction.md is missing", "write the agent's instruction there"
            ) from None
        except UnicodeDecodeError:
            raise TaskFormatError(str(path), None, "instruction.md is not UTF-8 text") from None
        return strip_canary(text)

    @property
    def instruction_bytes(self) -> int | None:
        """The size of instruction.md, None when it does not exist."""
        try:
            return (self.path / "instruction.md").stat().st_size
        except FileNotFoundError:
            return None

    @property
    def environment_dir(self) -> Path:
        return self.path / "environment"

    @property
    def dockerfile(self) -> Path | None:
        path = self.environment_dir / "Dockerfile"
        return path if path.is_file() else None

    @property
    def tests_dir(self) -> Path:
        return self.path / "tests"

    @property
    def test_script(self) -> Path:
        return self.tests_dir / "test.sh"

    @property
    def solution_dir(self) -> Path:
        return self.path / "solution"

    @property
    def solve_script(self) -> Path | None:
        path = self.solution_dir / "solve.sh"
        return path if path.is_file() else None

    def validate(self) -> list[str]:
        """Check the whole directory; raise the first real defect, return warnings.

        Warnings cover unknown keys (the format evolves), deprecated keys and a missing solution.
        """
        config = self.config
        self.check_runnable()
        warnings = [f"task.toml: unknown key '{k}' (kept, ignored)" for k in config.unknown_keys]
        warnings += [f"task.toml: {d}" for d in config.deprecations]
        size = self.instruction_bytes
        if size is not None and size > MAX_INSTRUCTION_BYTES:
            warnings.append(
                f"instruction.md is {size} bytes, over the {MAX_INSTRUCTION_BYTES} byte cap: episodes "
                "refuse this task"
            )
        elif not self.instruction.strip():
            raise TaskFormatError(str(self.path / "instruction.md"), None, "instruction.md is empty")
        if config.environment.docker_image is None:
            if not self.environment_dir.is_dir():
                raise TaskFormatError(
                    str(self.path / "task.toml"),
                    "environment.docker_image",
                    "no environment/ directory and no docker_image",
                    "add environment/Dockerfile or set [environment].docker_image",
                )
            if self.dockerfile is None:
                raise TaskFormatError(
                    str(self.environment_dir / "Dockerfile"),
                    None,
                    "environment/Dockerfile is missing",
                    "add a Dockerfile or set [environment].docker_image",
                )
        if config.environment.os != "linux":
            raise TaskFormatError(
                str(self.path / "task.toml"),
                "environment.os",
                f"os {config.environment.os!r} is not supported",
                "agentrl runs linux tasks",
            )
        if not self.test_script.is_file():
            raise TaskFormatError(
                str(self.test_script),
                None,
                "tests/test.sh is missing",
                "every task needs a verifier script that writes /logs/verifier/reward.txt",
            )
        for sub in (self.tests_dir, self.solution_dir):
            if sub.is_dir():
                _check_containment(self.path, sub)
        if self.solve_script is None:
            warnings.append("solution/solve.sh is missing: the oracle sweep cannot validate this task")
        warnings += self._script_warnings()
        if config.phase_network("agent") != "no-network":
            warnings.append(
                f"network: the agent phase is {config.phase_network('agent')!r}: the policy's commands "
                "reach the network (an RL run executes whatever the model writes)"
            )
        return warnings

    def check_runnable(self) -> None:
        """Refuse what agentrl would otherwise run wrongly: multi-step tasks (never as one step)
        and phase network policies that differ (a sandbox keeps one policy for its lifetime)."""
        config = self.config
        where = str(self.path / "task.toml")
        if config.steps:
            raise TaskFormatError(
                where,
                "steps",
                f"a multi-step task ({len(config.steps)} [[steps]]: {', '.join(config.steps)}) is not supported",
                "run each step as a task of its own, or run this task with Harbor",
            )
        agent, verifier = config.phase_network("agent"), config.phase_network("verifier")
        if agent != verifier:
            raise TaskFormatError(
                where,
                "agent.network_mode" if config.agent.network_mode else "verifier.network_mode",
                f"the agent phase's network ({agent!r}) differs from the verifier's ({verifier!r}): "
                "agentrl keeps one network policy per sandbox",
                "set [environment].network_mode and drop the phase overrides",
            )

    def _script_warnings(self) -> list[str]:
        found = []
        if self.test_script.is_file() and not os.access(self.test_script, os.X_OK):
            found.append("tests/test.sh is not executable: it is made executable inside, as Harbor does")
        for sub in (self.tests_dir, self.solution_dir):
            for script in crlf_scripts(sub):
                found.append(f"{script.relative_to(self.path)} has CRLF line ends: converted to LF on upload")
        return found


@contextlib.contextmanager
def scripts_with_lf(directory: Path) -> Iterator[Path]:
    """`directory` as it should be uploaded: itself, or, when a `.sh` script in it has Windows
    line ends (a `#!/bin/bash` line ending in CR names an unknown interpreter), a temporary copy with those
    scripts converted to LF."""
    crlf = crlf_scripts(directory)
    if not crlf:
        yield directory
        return
    with tempfile.TemporaryDirectory(prefix="agentrl-lf-") as tmp:
        copy = Path(tmp) / directory.name
        shutil.copytree(directory, copy, symlinks=True)
        for script in crlf:
            target = copy / script.relative_to(directory)
            target.write_bytes(script.read_bytes().replace(b"\r\n", b"\n"))
        yield copy


def crlf_scripts(directory: Path) -> list[Path]:
    """The `.sh` scripts under `directory` with Windows line ends."""
    if not directory.is_dir():
        return []
    return sorted(
        p for p in directory.rglob("*.sh") if p.is_file() and not p.is_symlink() and b"\r\n" in p.read_bytes()
    )


def _check_containment(root: Path, sub: Path) -> None:
    """Every file under tests/ and solution/ must resolve inside the task (Harbor's path safety)."""
    real_root = root.resolve()
    for dirpath, dirnames, filenames in os.walk(sub, followlinks=False):
        for name in dirnames + filenames:
            p = Path(dirpath) / name
            if p.is_symlink() and not p.resolve().is_relative_to(real_root):
                raise TaskFormatError(
                    str(p), None, "symlink points outside the task directory", "copy the file in instead"
                )


def load_task(path: str | os.PathLike[str]) -> Task:
    """A lazy handle on one task directory; call `.validate()` to check it fully."""
    p = Path(path)
    if not p.is_dir():
        raise TaskFormatError(str(p), None, "not a directory", "pass a task directory holding task.toml")
    return Task(p)


def discover_tasks(*roots: str | os.PathLike[str]) -> list[Task]:
    """Task directories under the given paths: a path holding task.toml is a task, otherwise its
    immediate subdirectories holding task.toml (or anything that looks like a task) are."""
    found: list[Task] = []
    for root in roots:
        r = Path(root)
        if not r.exists():
            raise TaskFormatError(str(r), None, "path does not exist")
        if (r / "task.toml").exists():
            found.append(Task(r))
            continue
        with os.scandir(r) as entries:
            children = sorted(e.path for e in entries if e.is_dir() and not e.name.startswith("."))
        for child in children:
            c = Path(child)
            if any((c / n).exists() for n in ("task.toml", "instruction.md", "tests", "environment")):
                found.append(Task(c))
    return found
