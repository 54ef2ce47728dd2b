"""A multi-container task's `environment/docker-compose.yaml`, read as Harbor's Docker provider
runs it (`reference/harbor.md` 3.2): the agent in service `main` (its image the task's own
environment unless the file says otherwise, kept alive by agentrl), the other services beside
it. Backend-neutral: what runs where is the sandbox backend's (`agentrl.sandbox.podman.compose`).

Supported per service: `image`, `build` (a context, or `context` / `dockerfile`), `command`,
`entrypoint`, `environment`, `working_dir`, `user`, `healthcheck`, `depends_on` (with
`service_started`, `service_healthy`, `service_completed_successfully`), `volumes` (named
volumes, and bind mounts of paths inside `environment/`) and the limits `mem_limit`, `cpus`,
`pids_limit` or `deploy.resources.limits`. Ignored (the sandbox's own network stands in for
`networks`): `ports`, `expose`, `restart`, `container_name`, `networks`, `hostname`, `labels`,
`stdin_open`, `tty`, `init`, `deploy`'s other keys and `pull_policy`. Refused, because they would hand the
agent's side more than a container: `privileged`, `cap_add`, `devices`, `security_opt`,
`network_mode`, `pid`, `ipc`, host bind mounts outside `environment/` and `volumes_from`.

Interpolation (`${VAR}`, `${VAR:-default}`, `$VAR`, `$$`) takes the task's `[environment].env`
and Harbor's `CONTEXT_DIR`, `MAIN_IMAGE_NAME`, `CPUS` and `MEMORY`, never the host's environment
(credentials never reach a sandbox); an unset name without a default is a task error.
"""

from __future__ import annotations

import math
import re
import shlex
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import yaml

from agentrl.errors import TaskFormatError

COMPOSE_FILE = "docker-compose.yaml"
MAIN = "main"
_IGNORED = {
    "ports", "expose", "restart", "container_name", "networks", "hostname", "labels", "stdin_open",
    "tty", "init", "pull_policy", "platform", "logging", "stop_grace_period",
}  # fmt: skip
_REFUSED = {
    "privileged", "cap_add", "devices", "security_opt", "network_mode", "pid", "ipc", "volumes_from",
    "userns_mode", "cgroup_parent", "extra_hosts",
}  # fmt: skip
_VAR = re.compile(
    r"\$(?:\$|\{(?P<braced>[A-Za-z_][A-Za-z0-9_]*)(?::?-(?P<default>[^}]*))?\}|(?P<bare>[A-Za-z_][A-Za-z0-9_]*))"
)
_DURATION = re.compile(r"(\d+(?:\.\d+)?)(ms|s|m|h)")


@dataclass(frozen=True)
class Healthcheck:
    command: list[str]  # what `exec` runs: ["sh", "-c", ...] for a shell form
    interval_s: float = 30.0
    timeout_s: float = 30.0
    retries: int = 3
    start_period_s: float = 0.0


@dataclass(frozen=True)
class Service:
    name: str
    image: str | None = None
    build_context: Path | None = None
    dockerfile: str = "Dockerfile"
    command: list[str] | None = None
    entrypoint: list[str] | None = None
    environment: dict[str, str] = field(default_factory=dict)
    working_dir: str | None = None
    user: str | None = None
    healthcheck: Healthcheck | None = None
    depends_on: dict[str, str] = field(default_factory=dict)  # service -> condition
    volumes: tuple[tuple[str, str, bool], ...] = ()  # (named volume or host path, target, read-only)
    # Its limits (`mem_limit` / `cpus` / `pids_limit`, or `deploy.resources.limits`); None: the
    # provider's defaults.
    memory_mb: int | None = None
    cpus: float | None = None
    pids: int | None = None


@dataclass(frozen=True)
class ComposeSpec:
    services: dict[str, Service]  # `main` first, then in an order that honours depends_on
    volumes: tuple[str, ...] = ()  # named volumes

    @property
    def sidecars(self) -> list[Service]:
        return [s for s in self.services.values() if s.name != MAIN]


def interpolate(value: Any, env: dict[str, str], where: str) -> Any:
    """Compose's variable substitution over strings, lists and mappings."""
    if isinstance(value, str):

        def sub(m: re.Match[str]) -> str:
            if m.group(0) == "$$":
                return "$"
            name = m.group("braced") or m.group("bare")
            if name in env and (env[name] or m.group("default") is None):
                return env[name]
            if m.group("default") is not None:
                return m.group("default")
            raise TaskFormatError(
                where, None, f"${{{name}}} is not set", "set it in [environment].env or give a default"
            )

        return _VAR.sub(sub, value)
    if isinstance(value, list):
        return [interpolate(v, env, where) for v in value]
    if isinstance(value, dict):
        return {k: interpolate(v, env, where) for k, v in value.items()}
    return value


def _seconds(value: Any, where: str, key: str) -> float:
    if isinstance(value, int | float):
        return float(value)
    parts = _DURATION.findall(str(value))
    if not parts or "".join(a + b for a, b in parts) != str(value).replace(" ", ""):
        raise TaskFormatError(where, key, f"{value!r} is not a duration like '5s' or '1m30s'")
    scale = {"ms": 0.001, "s": 1.0, "m": 60.0, "h": 3600.0}
    return sum(float(n) * scale[u] for n, u in parts)


def _words(value: Any, where: str, key: str) -> list[str] | None:
    if value is None:
        return None
    if isinstance(value, str):
        return shlex.split(value)
    if isinstance(value, list) and all(isinstance(v, str | int | float) for v in value):
        return [str(v) for v in value]
    raise TaskFormatError(where, key, f"expected a string or a list of strings, got {value!r}")


def _healthcheck(value: Any, where: str, key: str) -> Healthcheck | None:
    if value is None or (isinstance(value, dict) and value.get("disable")):
        return None
    if not isinstance(value, dict) or "test" not in value:
        raise TaskFormatError(where, key, "a healthcheck needs a `test`")
    test = value["test"]
    if isinstance(test, str):
        command = ["sh", "-c", test]
    elif isinstance(test, list) and test and test[0] in ("CMD", "CMD-SHELL"):
        command = (
            ["sh", "-c", " ".join(map(str, test[1:]))]
            if test[0] == "CMD-SHELL"
            else [str(t) for t in test[1:]]
        )
    elif isinstance(test, list) and test and test[0] == "NONE":
        return None
    else:
        raise TaskFormatError(where, f"{key}.test", f"{test!r}: use a string, [CMD, ...] or [CMD-SHELL, ...]")
    return Healthcheck(
        command,
        interval_s=_seconds(value.get("interval", 30), where, f"{key}.interval"),
        timeout_s=_seconds(value.get("timeout", 30), where, f"{key}.timeout"),
        retries=int(value.get("retries", 3)),
        start_period_s=_seconds(value.get("start_period", 0), where, f"{key}.start_period"),
    )


def _environment(value: Any, where: str, key: str) -> dict[str, str]:
    if value is None:
        return {}
    if isinstance(value, dict):
        return {str(k): "" if v is None else str(v) for k, v in value.items()}
    if isinstance(value, list):
        out = {}
        for item in value:
            name, sep, val = str(item).partition("=")
            if sep:
                out[name] = val
        return out
    raise TaskFormatError(where, key, f"expected a mapping or a list of NAME=value, got {value!r}")


def _env_files(environment_dir: Path, value: Any, where: str, key: str) -> dict[str, str]:
    """`env_file`: files of NAME=value lines inside environment/ (comments and blanks skipped)."""
    out: dict[str, str] = {}
    for name in [value] if isinstance(value, str) else value or []:
        path = (environment_dir / str(name)).resolve()
        if not path.is_relative_to(environment_dir.resolve()) or not path.is_file():
            raise TaskFormatError(where, key, f"{name!r} is not a file inside environment/")
        for line in path.read_text(encoding="utf-8", errors="replace").splitlines():
            k, sep, v = line.strip().partition("=")
            if sep and not k.startswith("#"):
                out[k.strip()] = v.strip()
    return out


def load_compose(
    environment_dir: Path, *, env: dict[str, str], main_image: str | None, main_has_dockerfile: bool
) -> ComposeSpec:
    """Read and check `environment_dir/docker-compose.yaml` over Harbor's base for `main` (built
    from `environment/` or the task's `docker_image`)."""
    path = environment_dir / COMPOSE_FILE
    where = str(path)
    try:
        data = yaml.safe_load(path.read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, yaml.YAMLError) as exc:
        raise TaskFormatError(where, None, f"cannot read the compose file: {exc}") from None
    if not isinstance(data, dict) or not isinstance(data.get("services"), dict) or not data["services"]:
        raise TaskFormatError(where, "services", "a compose file needs a `services` mapping")
    data = interpolate(data, env, where)
    named = data.get("volumes") or {}
    if not isinstance(named, dict):
        raise TaskFormatError(where, "volumes", "top-level `volumes` must be a mapping")
    raw: dict[str, Any] = dict(data["services"])
    raw.setdefault(MAIN, {})
    services: dict[str, Service] = {}
    for name, spec in raw.items():
        key = f"services.{name}"
        if not re.fullmatch(r"[A-Za-z0-9][A-Za-z0-9_.-]*", str(name)):
            raise TaskFormatError(where, key, f"{name!r} is not a valid service name")
        spec = spec or {}
        if not isinstance(spec, dict):
            raise TaskFormatError(where, key, "a service must be a mapping")
        bad = sorted(set(spec) & _REFUSED)
        if bad:
            raise TaskFormatError(
                where, f"{key}.{bad[0]}", f"{bad[0]} would give the task's containers more than a container",
                "agentrl runs services unprivileged, on the task's own network",
            )  # fmt: skip
        unknown = sorted(set(spec) - _IGNORED - _REFUSED - {
            "image", "build", "command", "entrypoint", "environment", "working_dir", "user", "healthcheck",
            "depends_on", "volumes", "env_file", "mem_limit", "cpus", "pids_limit", "deploy",
        })  # fmt: skip
        if unknown:
            raise TaskFormatError(where, f"{key}.{unknown[0]}", "not supported by agentrl's compose")
        build = spec.get("build")
        context: Path | None = None
        dockerfile = "Dockerfile"
        if isinstance(build, str):
            context = environment_dir / build
        elif isinstance(build, dict):
            context = environment_dir / str(build.get("context", "."))
            dockerfile = str(build.get("dockerfile", "Dockerfile"))
        elif build is not None:
            raise TaskFormatError(where, f"{key}.build", "expected a path or a mapping")
        image = spec.get("image")
        if name == MAIN and context is None and image is None:
            # Harbor's base: main is built from environment/, or is the task's docker_image.
            if main_image is not None and not main_has_dockerfile:
                image = main_image
            else:
                context = environment_dir
        if context is not None:
            context = context.resolve()
            if not context.is_relative_to(environment_dir.resolve()) or not (context / dockerfile).is_file():
                raise TaskFormatError(
                    where, f"{key}.build", f"no {dockerfile} in {context} inside environment/"
                )
        if context is None and not image:
            raise TaskFormatError(where, key, "a service needs an `image` or a `build`")
        volumes = []
        for i, vol in enumerate(spec.get("volumes") or []):
            text = vol if isinstance(vol, str) else f"{vol.get('source', '')}:{vol.get('target', '')}"
            parts = str(text).split(":")
            if len(parts) < 2:
                raise TaskFormatError(where, f"{key}.volumes[{i}]", f"{vol!r}: use source:target[:ro]")
            source, target, ro = parts[0], parts[1], parts[2:] == ["ro"]
            if source.startswith((".", "/")):
                host = (environment_dir / source).resolve()
                if not host.is_relative_to(environment_dir.resolve()):
                    raise TaskFormatError(
                        where, f"{key}.volumes[{i}]", f"{source!r} is outside environment/",
                        "bind only files of the task's environment/",
                    )  # fmt: skip
                source = str(host)
            elif source not in named:
                raise TaskFormatError(where, f"{key}.volumes[{i}]", f"volume {source!r} is not declared")
            volumes.append((source, target, ro))
        deps = spec.get("depends_on") or {}
        if isinstance(deps, list):
            deps = {d: "service_started" for d in deps}
        depends = {
            str(d): (c or {}).get("condition", "service_started")
            if isinstance(c, dict)
            else "service_started"
            for d, c in deps.items()
        }
        for dep, cond in depends.items():
            if dep not in raw:
                raise TaskFormatError(where, f"{key}.depends_on", f"{dep!r} is not a service")
            if cond not in ("service_started", "service_healthy", "service_completed_successfully"):
                raise TaskFormatError(where, f"{key}.depends_on", f"unknown condition {cond!r}")
        services[name] = Service(
            name=name,
            image=image,
            build_context=context,
            dockerfile=dockerfile,
            command=_words(spec.get("command"), where, f"{key}.command"),
            entrypoint=_words(spec.get("entrypoint"), where, f"{key}.entrypoint"),
            environment={
                **_env_files(environment_dir, spec.get("env_file"), where, f"{key}.env_file"),
                **_environment(spec.get("environment"), where, f"{key}.environment"),
            },
            working_dir=spec.get("working_dir"),
            user=None if spec.get("user") is None else str(spec["user"]),
            healthcheck=_healthcheck(spec.get("healthcheck"), where, f"{key}.healthcheck"),
            depends_on=depends,
            volumes=tuple(volumes),
            **_limits(spec, where, key),
        )
    return ComposeSpec(_ordered(services, where), tuple(named))


_SIZE = re.compile(r"(\d+(?:\.\d+)?)\s*([bkmg]?)b?", re.IGNORECASE)


def _limits(spec: dict[str, Any], where: str, key: str) -> dict[str, Any]:
    """A service's memory (MiB), cpus and pids limits, from its own keys or `deploy.resources.limits`
    (compose's byte values: a number of bytes, or with a b/k/m/g unit)."""
    deploy = spec.get("deploy") or {}
    limits = ((deploy.get("resources") or {}).get("limits") or {}) if isinstance(deploy, dict) else {}
    if not isinstance(limits, dict):
        raise TaskFormatError(where, f"{key}.deploy.resources.limits", "expected a mapping")
    out: dict[str, Any] = {}
    memory = spec.get("mem_limit", limits.get("memory"))
    if memory is not None:
        m = _SIZE.fullmatch(str(memory).strip())
        if not m:
            raise TaskFormatError(
                where, f"{key}.mem_limit", f"{memory!r} is not a size", "write it as 512m or 1g"
            )
        scale = {"": 1, "b": 1, "k": 2**10, "m": 2**20, "g": 2**30}[m.group(2).lower()]
        out["memory_mb"] = max(1, math.ceil(float(m.group(1)) * scale / 2**20))
    cpus = spec.get("cpus", limits.get("cpus"))
    if cpus is not None:
        try:
            out["cpus"] = float(cpus)
        except (TypeError, ValueError):
            raise TaskFormatError(where, f"{key}.cpus", f"{cpus!r} is not a number of cpus") from None
    pids = spec.get("pids_limit", limits.get("pids"))
    if pids is not None:
        if not isinstance(pids, int) or isinstance(pids, bool):
            raise TaskFormatError(where, f"{key}.pids_limit", f"{pids!r} is not a number of processes")
        out["pids"] = pids
    return out


def _ordered(services: dict[str, Service], where: str) -> dict[str, Service]:
    """`main` first (it holds the network the others join), then each service after those it
    depends on (main's own dependencies are started after it, before the agent runs)."""
    out: dict[str, Service] = {MAIN: services[MAIN]}
    visiting: set[str] = set()

    def visit(name: str) -> None:
        if name in out and name != MAIN:
            return
        if name in visiting:
            raise TaskFormatError(where, f"services.{name}.depends_on", "depends_on has a cycle")
        visiting.add(name)
        for dep in services[name].depends_on:
            if dep != MAIN:
                visit(dep)
        visiting.discard(name)
        out[name] = services[name]

    for name in services:
        if name != MAIN:
            visit(name)
    for dep in services[MAIN].depends_on:
        visit(dep)
    return out
