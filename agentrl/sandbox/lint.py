"""Lint many task directories quickly, turning every defect into a row, never a traceback.

Beyond `Task.validate` (the format), lint reports what would fail later, at build or run time:
`COPY` / `ADD` sources missing from the build context, scripts Harbor would fix silently
(non-executable `test.sh`, CRLF line ends), a network the agent's commands could reach, a `FROM`
that would fail to build offline (neither local nor served by a stand-in base).
"""

from __future__ import annotations

import functools
import glob
import json
import os
import re
import shlex
import shutil
import subprocess
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path

from agentrl.errors import TaskFormatError
from agentrl.sandbox import images
from agentrl.tasks.task import Task


@dataclass
class LintResult:
    task: Task
    errors: list[str] = field(default_factory=list)
    warnings: list[str] = field(default_factory=list)

    @property
    def ok(self) -> bool:
        return not self.errors


_INSTRUCTION = re.compile(r"^\s*(COPY|ADD)\s+(.*)$", re.IGNORECASE)


def _joined_lines(text: str) -> list[str]:
    """Dockerfile instructions with backslash continuations joined and comments dropped."""
    lines: list[str] = []
    current = ""
    for raw in text.splitlines():
        if not current and raw.lstrip().startswith("#"):
            continue
        if raw.rstrip().endswith("\\"):
            current += raw.rstrip()[:-1] + " "
            continue
        lines.append(current + raw)
        current = ""
    if current:
        lines.append(current)
    return lines


def missing_copy_sources(task: Task) -> list[str]:
    """`COPY` / `ADD` sources that are not in the build context (a build would fail on them)."""
    if task.dockerfile is None:
        return []
    context = task.environment_dir.resolve()
    missing = []
    for line in _joined_lines(task.dockerfile.read_text(encoding="utf-8", errors="replace")):
        m = _INSTRUCTION.match(line)
        if m is None:
            continue
        body = m.group(2).strip()
        if body.startswith("["):
            continue  # the JSON form: rare in tasks, not checked
        try:
            words = shlex.split(body)
        except ValueError:
            continue
        if any(w.startswith("--from") for w in words):
            continue  # from another build stage or image
        sources = [w for w in words if not w.startswith("--")][:-1]
        for src in sources:
            if "://" in src or src.startswith("$"):
                continue
            pattern = str(context / src.lstrip("/"))
            if not glob.glob(pattern):
                missing.append(f"Dockerfile: {m.group(1).upper()} source {src!r} is not in environment/")
    return missing


@functools.cache
def _present_locally(image: str) -> bool:
    cli = os.environ.get("AGENTRL_CONTAINER_CLI", "podman")
    if shutil.which(cli) is None:
        return False
    try:
        proc = subprocess.run([cli, "image", "inspect", image], capture_output=True, timeout=30)
    except (OSError, subprocess.TimeoutExpired):
        return False
    return proc.returncode == 0


def unservable_bases(task: Task) -> list[str]:
    """`FROM`s that would fail to build offline: the image is not on this machine and no stand-in
    base serves its repository (whatever tag, digest or registry mirror names it)."""
    if task.dockerfile is None:
        return []
    recipe = images.load_recipe()
    text = task.dockerfile.read_text(encoding="utf-8", errors="replace")
    return [
        f"unservable base: FROM {line.written} (line {line.line + 1}) would fail to build offline: it "
        "is not present locally and no stand-in base serves its repository; load the image on the "
        "build machine or start FROM a base sandbox_images/bases.toml lists"
        for line in images.from_lines(text)
        if images.standin_for(line.image, recipe) is None and not _present_locally(line.image)
    ]


# What the stand-ins really hold (Debian bookworm's packages, sandbox_images/bases.toml's `has`):
# Python 3.11 (every family), Node.js 18, Go 1.19; cargo 1.63, which reads Cargo.lock versions up
# to 3 (version 4 needs 1.78).
STANDIN_PYTHON = (3, 11)
STANDIN_NODE = 18
STANDIN_GO = (1, 19)
STANDIN_CARGO_LOCK = 3
_GO_DIRECTIVE = re.compile(r"^go\s+(\d+)\.(\d+)", re.MULTILINE)
_LOCK_VERSION = re.compile(r"^version\s*=\s*(\d+)", re.MULTILINE)
_REQUIRES_PYTHON = re.compile(
    r"^\s*requires-python\s*=\s*[\"']\s*(?:>=|~=|==|\^)\s*(\d+)\.(\d+)", re.MULTILINE
)
_VERSION_FILE = re.compile(r"^\s*v?(\d+)(?:\.(\d+))?")
_NODE_ENGINE = re.compile(r"(?:>=|\^|~|=)?\s*v?(\d+)")


def build_plan(task: Task) -> tuple[bool, list[str]]:
    """Whether this machine can build `task`'s image(s) offline, and how, per FROM: the image as it
    is here, or the stand-in base that answers for its repository and what that really holds, or
    why not (no stand-in, or a toolchain the stand-in is too old for)."""
    recipe = images.load_recipe()
    lines: list[str] = []
    ok = True
    for name, env in task.environments():
        where = "" if env is task else f" ({name})"
        if env.dockerfile is None:
            lines.append(f"image{where}: {env.config.environment.docker_image or 'none'} (prebuilt)")
            continue
        text = env.dockerfile.read_text(encoding="utf-8", errors="replace")
        for line in images.from_lines(text):
            if _present_locally(line.image):
                lines.append(f"FROM {line.written}{where}: present here")
                continue
            family = recipe.family_for(line.image)
            if family is None:
                ok = False
                lines.append(f"FROM {line.written}{where}: cannot build offline (no stand-in serves it)")
                continue
            holds = family.has or f"Debian {family.suite}, Python {STANDIN_PYTHON[0]}.{STANDIN_PYTHON[1]}"
            lines.append(f"FROM {line.written}{where}: stand-in {family.standin} ({holds})")
        gaps = toolchain_gaps(env)
        ok = ok and not gaps
        lines += gaps
    return ok, lines


def toolchain_gaps(task: Task) -> list[str]:
    """Where an offline build would get a language stand-in older than the task's own files ask
    for: a go.mod's `go` directive above the stand-in's Go, a Cargo.lock version its cargo cannot
    read. Only FROMs that a stand-in would answer (not present locally) are judged."""
    if task.dockerfile is None:
        return []
    recipe = images.load_recipe()
    text = task.dockerfile.read_text(encoding="utf-8", errors="replace")
    families = set()
    for line in images.from_lines(text):
        family = recipe.family_for(line.image)
        if family is not None and not _present_locally(line.image):
            families.add(family.family)
    out: list[str] = []
    env = task.environment_dir
    if families:  # every stand-in is Debian bookworm's Python 3.11
        for path in sorted([*env.rglob("pyproject.toml"), *env.rglob(".python-version")]):
            text = path.read_text(errors="replace")
            m = _REQUIRES_PYTHON.search(text) if path.name == "pyproject.toml" else _VERSION_FILE.match(text)
            if m and m.group(2) is not None and (int(m.group(1)), int(m.group(2))) > STANDIN_PYTHON:
                out.append(
                    f"toolchain: {path.relative_to(task.path)} asks for Python {m.group(1)}.{m.group(2)}, but "
                    f"the offline stand-in has Python {STANDIN_PYTHON[0]}.{STANDIN_PYTHON[1]}: this machine "
                    "cannot build the task offline (load the real image, or build with a registry)"
                )
    if any(f.endswith("node") for f in families):
        for path in sorted([*env.rglob("package.json"), *env.rglob(".nvmrc")]):
            wanted = _node_major(path)
            if wanted is not None and wanted > STANDIN_NODE:
                out.append(
                    f"toolchain: {path.relative_to(task.path)} asks for Node.js {wanted}, but the offline "
                    f"node stand-in has Node.js {STANDIN_NODE}: this machine cannot build the task offline "
                    "(load the real image, or build with a registry)"
                )
    if any(f.endswith("golang") for f in families):
        for mod in sorted(env.rglob("go.mod")):
            m = _GO_DIRECTIVE.search(mod.read_text(errors="replace"))
            if m and (int(m.group(1)), int(m.group(2))) > STANDIN_GO:
                out.append(
                    f"toolchain: {mod.relative_to(task.path)} asks for Go {m.group(1)}.{m.group(2)}, but the "
                    f"offline golang stand-in has Go {STANDIN_GO[0]}.{STANDIN_GO[1]}: this machine cannot "
                    "build the task offline (load the real image, or build with a registry)"
                )
    if any(f.endswith("rust") for f in families):
        for lock in sorted(env.rglob("Cargo.lock")):
            m = _LOCK_VERSION.search(lock.read_text(errors="replace"))
            if m and int(m.group(1)) > STANDIN_CARGO_LOCK:
                out.append(
                    f"toolchain: {lock.relative_to(task.path)} is lock-file version {m.group(1)}, which the "
                    "offline rust stand-in's cargo 1.63 cannot read: this machine cannot build the task "
                    "offline (load the real image, or build with a registry)"
                )
    return out


def _node_major(path: Path) -> int | None:
    """The lowest Node.js major a package.json's `engines.node` (or an .nvmrc) admits, or None."""
    text = path.read_text(errors="replace")
    if path.name == ".nvmrc":
        m = _VERSION_FILE.match(text)
        return int(m.group(1)) if m else None
    try:
        engines = json.loads(text).get("engines") or {}
    except (ValueError, AttributeError):
        return None
    spec = engines.get("node") if isinstance(engines, dict) else None
    if not isinstance(spec, str):
        return None
    m = _NODE_ENGINE.match(spec.strip().split("||")[0].strip())
    return int(m.group(1)) if m else None


def lint_task(task: Task) -> LintResult:
    result = LintResult(task)
    try:
        result.warnings = task.validate()
        for name, env in task.environments():
            # the task's own environment keeps its plain messages; the others say which they are
            def said(m: str, env: Task = env, name: str = name) -> str:
                kind, _, rest = m.partition(":")
                return m if env is task else f"{kind} ({name}):{rest}"

            result.errors += [said(m) for m in missing_copy_sources(env)]
            result.warnings += [said(m) for m in unservable_bases(env)]
            result.warnings += [said(m) for m in toolchain_gaps(env)]
    except TaskFormatError as exc:
        result.errors.append(str(exc))
    except OSError as exc:
        result.errors.append(f"{task.path}: cannot read: {exc}")
    return result


def lint_tasks(tasks: list[Task]) -> list[LintResult]:
    return [lint_task(t) for t in tasks]


def warning_kinds(results: list[LintResult]) -> Counter[str]:
    """Warnings counted by kind (their text up to the first colon), for a corpus summary."""
    return Counter(w.split(":", 1)[0] for r in results for w in r.warnings)
