"""A Harbor / terminal-bench-2 task directory, loaded lazily.

task.toml            configuration (see `agentrl.tasks.config`)
instruction.md       what the agent is asked to do (leading canary lines stripped)
environment/         Dockerfile and its build context (optional when docker_image is set)
tests/test.sh        the verifier; writes /logs/verifier/reward.txt or reward.json
solution/solve.sh    optional reference solution (the oracle agent runs it)
steps/<name>/        a multi-step task's steps (`[[steps]]`): instruction.md, and optionally
                     tests/, solution/ and workdir/ (uploaded to the working directory before the
                     step, its setup.sh run); `Task.steps` gives each as a task of its own
"""

from __future__ import annotations

import contextlib
import functools
import hashlib
import os
import re
import shutil
import tempfile
from collections.abc import Iterator
from dataclasses import dataclass, field, replace
from pathlib import Path

from agentrl.errors import TaskFormatError
from agentrl.tasks.compose import COMPOSE_FILE, ComposeSpec, Service, load_compose
from agentrl.tasks.config import (
    ArtifactConfig,
    EnvironmentConfig,
    StepConfig,
    TaskConfig,
    parse_task_config,
    resolve_env_templates,
)

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

    @property
    def instruction_path(self) -> Path:
        return self.path / "instruction.md"

    @functools.cached_property
    def instruction(self) -> str:
        """The instruction, canary lines stripped ("" for a multi-step task: its steps have theirs).
        Raises `TaskFormatError` when it is missing, not UTF-8, or over `MAX_INSTRUCTION_BYTES`
        (checked before anything is read)."""
        path = self.instruction_path
        self.check_runnable()
        if self.steps:
            return ""
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
            return self.instruction_path.stat().st_size
        except FileNotFoundError:
            return None

    @property
    def environment_dir(self) -> Path:
        return self.path / "environment"

    @property
    def dockerfile(self) -> Path | None:
        path = self.environment_dir / "Dockerfile"
        return path if path.is_file() else None

    @functools.cached_property
    def compose(self) -> ComposeSpec | None:
        """A multi-container task's services (`environment/docker-compose.yaml`), None for one
        container. Raises `TaskFormatError` for a compose file agentrl cannot run as written."""
        if not (self.environment_dir / COMPOSE_FILE).is_file():
            return None
        env = self.config.environment
        infra = {"CONTEXT_DIR": str(self.environment_dir.resolve()), "MAIN_IMAGE_NAME": f"hb__{self.task_id}"}
        if env.cpus:
            infra["CPUS"] = f"{env.cpus:g}"
        if env.memory_mb:
            infra["MEMORY"] = f"{env.memory_mb}M"
        values = {**resolve_env_templates(env.env, str(self.path / "task.toml")), **infra}
        return load_compose(
            self.environment_dir,
            env=values,
            main_image=env.docker_image,
            main_has_dockerfile=self.dockerfile is not None,
        )

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

    @functools.cached_property
    def steps(self) -> list[TaskStep]:
        """A multi-step task's steps in order, each a task of its own (its instruction, tests,
        solution and timeouts as Harbor resolves them); empty for a single-step task."""
        return [TaskStep(self.path, parent=self, index=i) for i in range(len(self.config.steps))]

    @property
    def root(self) -> Task:
        """The task directory's own task (a step's parent)."""
        return self

    def service_task(self, service: Service) -> EnvironmentView:
        """A compose service's image as a task a provider builds: its build context, or its
        `image` (with a one-line Dockerfile beside it under `$AGENTRL_CACHE`, so an image neither
        local nor pullable is served by an offline stand-in like any `FROM`)."""
        context = service.build_context
        if context is None:
            assert service.image is not None
            cache = Path(os.environ.get("AGENTRL_CACHE", Path.home() / ".cache" / "agentrl"))
            context = cache / "compose-images" / hashlib.sha256(service.image.encode()).hexdigest()[:16]
            context.mkdir(parents=True, exist_ok=True)
            (context / "Dockerfile").write_text(f"FROM {service.image}\n")
        env = self.config.environment
        return EnvironmentView(
            self.path,
            of=self,
            context=context,
            environment=replace(env, docker_image=service.image if service.build_context is None else None),
            suffix=service.name,
            dockerfile_name=service.dockerfile,
        )

    def environments(self) -> list[tuple[str, Task]]:
        """Every image the task builds, named: its own, its compose services', its separate
        verifiers' (the task's and each step's)."""
        out: list[tuple[str, Task]] = [("environment", self)]
        if self.compose is not None:
            out += [(f"service {s.name}", self.service_task(s)) for s in self.compose.sidecars]
        seen: set[Path | None] = set()
        for phase in [self, *self.steps]:
            view = phase.verifier_task
            if view is not None and view.context not in seen:
                seen.add(view.context)
                out.append(("verifier", view))
        return out

    @property
    def verifier_mode(self) -> str:
        """ "shared" (the tests run over the agent's sandbox) or "separate" (in an environment of
        their own that gets only the artifacts), as Harbor resolves it."""
        ver = self.config.verifier
        return ver.environment_mode or ("separate" if ver.environment is not None else "shared")

    @property
    def artifacts(self) -> tuple[ArtifactConfig, ...]:
        """What is collected after the agent phase: `/logs/artifacts` (always, unless named), then
        the task's `artifacts` (and a step's)."""
        own = self.config.artifacts
        implicit = () if any(a.source.rstrip("/") == "/logs/artifacts" for a in own) else (
            ArtifactConfig("/logs/artifacts"),
        )  # fmt: skip
        return implicit + own

    @functools.cached_property
    def verifier_task(self) -> EnvironmentView | None:
        """The separate verifier's environment as a task a provider can start (None when shared).
        Its image, as Harbor 0.25 picks it: the step's `[verifier.environment].docker_image`, a
        `Dockerfile` in the step's tests/, the task's `[verifier.environment].docker_image`, a
        `Dockerfile` in tests/ (each of these "bundles" its tests: /tests comes from the image),
        else the task's own environment with the tests uploaded. Its resources and network: the
        step's verifier environment, the task's, else a copy of `[environment]` (without its
        healthcheck); the verifier phase's `network_mode` and `allowed_hosts` over that."""
        if self.verifier_mode != "separate":
            return None
        root = self.root
        step_env = self.step.verifier_environment if isinstance(self, TaskStep) else None
        task_env = root.config.verifier.environment
        env = step_env or task_env or root.config.environment
        step_tests = self.step_dir / "tests" if isinstance(self, TaskStep) else None
        context: Path | None
        if step_env is not None and step_env.docker_image:
            context, image = None, step_env.docker_image
        elif step_tests is not None and (step_tests / "Dockerfile").is_file():
            context, image = step_tests, None
        elif task_env is not None and task_env.docker_image:
            context, image = None, task_env.docker_image
        elif (root.tests_dir / "Dockerfile").is_file():
            context, image = root.tests_dir, None
        else:
            context, image = root.environment_dir, root.config.environment.docker_image
        bundled = context != root.environment_dir
        verifier = self.config.verifier
        network = verifier.network_mode or env.network_mode
        hosts = verifier.allowed_hosts if verifier.network_mode else env.allowed_hosts
        # A healthcheck only where the verifier's environment is declared: `[environment]`'s is
        # written for the agent's image.
        healthcheck = env.healthcheck if (step_env or task_env) is not None else None
        return EnvironmentView(
            root.path, of=self, context=context, bundled=bundled,
            environment=replace(
                env, docker_image=image, network_mode=network, allowed_hosts=hosts, healthcheck=healthcheck
            ),
        )  # fmt: skip

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
        elif not config.steps and not self.instruction.strip():
            raise TaskFormatError(str(self.instruction_path), None, "instruction.md is empty")
        for step in self.steps:
            step.validate_step()
        if config.environment.docker_image is None:
            if not self.environment_dir.is_dir():
                raise TaskFormatError(
                    str(self.path / "task.toml"),
                    "environment.docker_image",
                    "no environment/ directory and no docker_image",
                    "add environment/Dockerfile or set [environment].docker_image",
                )
            if self.dockerfile is None and self.compose is None:
                raise TaskFormatError(
                    str(self.environment_dir / "Dockerfile"),
                    None,
                    "environment/Dockerfile is missing",
                    "add a Dockerfile (or a docker-compose.yaml) or set [environment].docker_image",
                )
        if config.environment.os != "linux":
            raise TaskFormatError(
                str(self.path / "task.toml"),
                "environment.os",
                f"os {config.environment.os!r} is not supported",
                "agentrl runs linux tasks",
            )
        if not config.steps and not self.test_script.is_file():
            raise TaskFormatError(
                str(self.test_script),
                None,
                "tests/test.sh is missing",
                "every task needs a verifier script that writes /logs/verifier/reward.txt",
            )
        for sub in (self.tests_dir, self.solution_dir, self.path / "steps"):
            if sub.is_dir():
                _check_containment(self.path, sub)
        if any(step.solve_script is None for step in self.steps or [self]):
            warnings.append("solution/solve.sh is missing: the oracle sweep cannot validate this task")
        warnings += self._script_warnings()
        if config.phase_network("agent") != "no-network":
            warnings.append(
                f"network: the agent phase is {config.phase_network('agent')!r}: the policy's commands "
                "reach the network (an RL run executes whatever the model writes)"
            )
        return warnings

    def check_runnable(self) -> None:
        """Refuse what agentrl would otherwise run wrongly: collect hooks and artifacts of a
        service the task does not have; a compose file agentrl cannot run as written."""
        config = self.config
        where = str(self.path / "task.toml")
        services = set(self.root.compose.services) if self.root.compose is not None else {"main"}
        named = [("verifier.collect.service", h.service) for h in config.verifier.collect]
        named += [("artifacts.service", a.service or "main") for a in self.artifacts]
        for field_name, service in named:
            if service not in services:
                raise TaskFormatError(
                    where,
                    field_name,
                    f"service {service!r} is not a service of the task ({', '.join(sorted(services))})",
                    "name a service of environment/docker-compose.yaml, or main",
                )

    def _script_warnings(self) -> list[str]:
        found = []
        if self.test_script.is_file() and not os.access(self.test_script, os.X_OK):
            found.append("tests/test.sh is not executable: it is made executable inside, as Harbor does")
        for sub in (self.tests_dir, self.solution_dir):
            for script in crlf_scripts(sub):
                found.append(f"{script.relative_to(self.path)} has CRLF line ends: converted to LF on upload")
        return found


@dataclass
class TaskStep(Task):
    """Step `index` of a multi-step task, as a task: the step's instruction, its tests (the shared
    tests/ when it has none), its solution (the task's when it has none), its workdir, and the
    task's config with the step's agent and verifier settings (Harbor 0.25 `StepConfig`: the agent
    timeout and users inherit; the verifier timeout does not; verifier env is merged)."""

    parent: Task | None = field(default=None, repr=False)
    index: int = 0

    @property
    def step(self) -> StepConfig:
        assert self.parent is not None
        return self.parent.config.steps[self.index]

    @property
    def step_name(self) -> str:
        return self.step.name

    @property
    def step_dir(self) -> Path:
        return self.path / "steps" / self.step.name

    @functools.cached_property
    def config(self) -> TaskConfig:
        assert self.parent is not None
        base, step = self.parent.config, self.step
        agent_net, verifier_net = step.agent_network, step.verifier_network
        return replace(
            base,
            agent=replace(
                base.agent,
                timeout_sec=step.agent_timeout_sec or base.agent.timeout_sec,
                user=step.agent_user if step.agent_user is not None else base.agent.user,
                network_mode=agent_net[0] or base.agent.network_mode,
                allowed_hosts=agent_net[1] if agent_net[0] else base.agent.allowed_hosts,
            ),
            verifier=replace(
                base.verifier,
                timeout_sec=step.verifier_timeout_sec,
                env={**base.verifier.env, **step.verifier_env},
                user=step.verifier_user if step.verifier_user is not None else base.verifier.user,
                network_mode=verifier_net[0] or base.verifier.network_mode,
                allowed_hosts=verifier_net[1] if verifier_net[0] else base.verifier.allowed_hosts,
            ),
        )

    @property
    def instruction_path(self) -> Path:
        return self.step_dir / "instruction.md"

    @property
    def tests_dir(self) -> Path:
        own = self.step_dir / "tests"
        return own if (own / "test.sh").is_file() else self.path / "tests"

    @property
    def solution_dir(self) -> Path:
        own = self.step_dir / "solution"
        return own if own.is_dir() else self.path / "solution"

    @property
    def workdir(self) -> Path:
        return self.step_dir / "workdir"

    @property
    def steps(self) -> list[TaskStep]:  # type: ignore[override]
        return []

    @property
    def root(self) -> Task:
        assert self.parent is not None
        return self.parent

    @property
    def verifier_mode(self) -> str:
        """The step's `environment_mode`, else "separate" when the step has a verifier
        environment, else the task's mode."""
        step = self.step
        if step.verifier_environment_mode is not None:
            return step.verifier_environment_mode
        return "separate" if step.verifier_environment is not None else self.root.verifier_mode

    @property
    def artifacts(self) -> tuple[ArtifactConfig, ...]:
        return self.root.artifacts + self.step.artifacts

    def validate_step(self) -> None:
        if not self.instruction.strip():
            raise TaskFormatError(str(self.instruction_path), None, "the step's instruction.md is empty")
        if not self.test_script.is_file():
            raise TaskFormatError(
                str(self.step_dir / "tests" / "test.sh"),
                None,
                f"step {self.step_name!r} has no tests/test.sh and the task has no shared tests/test.sh",
                "give the step its own tests/ or the task a shared one",
            )


@dataclass
class EnvironmentView(Task):
    """Another environment of a task, as a task a sandbox provider can build and start: a
    separate verifier's (`Task.verifier_task`, with `bundled` when its image holds /tests) or a
    compose service's. Its image is `environment.docker_image` when that is local or pullable,
    else `dockerfile` in `context`."""

    of: Task | None = field(default=None, repr=False)
    context: Path | None = None
    environment: EnvironmentConfig | None = None
    bundled: bool = False
    suffix: str = "verifier"
    dockerfile_name: str = "Dockerfile"

    @property
    def task_id(self) -> str:
        assert self.of is not None
        return f"{self.of.task_id}-{self.suffix}"

    @functools.cached_property
    def config(self) -> TaskConfig:
        assert self.of is not None and self.environment is not None
        base, network, hosts = self.of.config, self.environment.network_mode, self.environment.allowed_hosts
        return replace(
            base,
            environment=self.environment,
            agent=replace(base.agent, network_mode=network, allowed_hosts=hosts),
            verifier=replace(
                base.verifier,
                network_mode=network,
                allowed_hosts=hosts,
                environment=None,
                environment_mode="shared",
            ),
            steps=(),
            artifacts=(),
        )

    @property
    def environment_dir(self) -> Path:
        return self.context if self.context is not None else self.path / ".no-build-context"

    @property
    def dockerfile(self) -> Path | None:
        path = self.environment_dir / self.dockerfile_name
        return path if path.is_file() else None

    @functools.cached_property
    def compose(self) -> ComposeSpec | None:
        return None

    @property
    def tests_dir(self) -> Path:
        assert self.of is not None
        return self.of.tests_dir


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
