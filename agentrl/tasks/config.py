"""The `task.toml` schema of Harbor / terminal-bench-2 tasks (Harbor 0.25 `TaskConfig`).

Parsing is strict where a wrong value would change what runs (types, sizes, timeouts) and lenient
where the format evolves: unknown keys are kept in `TaskConfig.unknown_keys` and reported as
warnings, never errors. Every defect is a `TaskFormatError` naming the file and the dotted field.
"""

from __future__ import annotations

import ipaddress
import math
import os
import re
import tomllib
import unicodedata
from dataclasses import dataclass, field
from typing import Any, TypeVar

from agentrl.errors import TaskFormatError

_T = TypeVar("_T")

NETWORK_MODES = ("no-network", "public", "allowlist")
_LABEL = re.compile(r"^(?!-)[a-z0-9-]{1,63}(?<!-)$")


def normalize_host(entry: str) -> str:
    """An `allowed_hosts` entry as Harbor normalises it (`models/task/config.py`): stripped,
    lower-cased, trailing dots removed; an exact hostname, a leading `*.` wildcard over a hostname, an IPv4 or
    IPv6 address (IPv6 compressed) or a strict CIDR. Anything else (URLs, ports, paths, zone ids)
    raises `ValueError`."""
    e = entry.strip().lower().rstrip(".")  # every trailing dot, as Harbor's source does
    if "%" in e:
        raise ValueError(f"{entry!r}: zone ids are not allowed")
    if "/" in e:
        try:
            return str(ipaddress.ip_network(e, strict=True))
        except ValueError:
            raise ValueError(f"{entry!r} is not a CIDR range without host bits") from None
    try:
        return str(ipaddress.ip_address(e))
    except ValueError:
        pass
    name = e[2:] if e.startswith("*.") else e
    if "*" in name or not name or not all(_LABEL.match(label) for label in name.split(".")):
        raise ValueError(f"{entry!r} is neither a hostname, a *.wildcard, an IP address nor a CIDR range")
    if e.startswith("*.") and _is_ip(name):
        raise ValueError(f"{entry!r}: a wildcard over an IP address")
    return e


def _is_ip(text: str) -> bool:
    try:
        ipaddress.ip_address(text)
    except ValueError:
        return False
    return True


def host_kind(entry: str) -> str:
    """Harbor's entry type of a normalised `allowed_hosts` entry: `hostname`,
    `wildcard-hostname`, `ipv4-address`, `ipv6-address`, `ipv4-cidr` or `ipv6-cidr`."""
    if entry.startswith("*."):
        return "wildcard-hostname"
    if "/" in entry:
        return f"ipv{ipaddress.ip_network(entry).version}-cidr"
    if _is_ip(entry):
        return f"ipv{ipaddress.ip_address(entry).version}-address"
    return "hostname"


@dataclass(frozen=True)
class Metadata:
    author_name: str | None = None
    author_email: str | None = None
    difficulty: str | None = None
    category: str | None = None
    tags: tuple[str, ...] = ()
    expert_time_estimate_min: float | None = None
    junior_time_estimate_min: float | None = None
    extra: dict[str, Any] = field(default_factory=dict)


@dataclass(frozen=True)
class CollectHook:
    """A `[[verifier.collect]]` hook: run after the agent phase, before artifacts are collected
    (best effort: a failing hook is logged, never fatal)."""

    command: str
    service: str = "main"
    timeout_sec: float = 60.0
    user: str | int | None = None


@dataclass(frozen=True)
class ArtifactConfig:
    """An `[[artifacts]]` entry: a path in the sandbox collected after the agent phase (and, with a
    separate verifier environment, uploaded into it at the same path)."""

    source: str
    destination: str | None = None
    exclude: tuple[str, ...] = ()
    service: str | None = None


@dataclass(frozen=True)
class VerifierConfig:
    timeout_sec: float = 600.0
    env: dict[str, str] = field(default_factory=dict)
    user: str | int | None = None
    # The verification phase's own network policy (Harbor: `[verifier] network_mode`); None: the
    # environment's.
    network_mode: str | None = None
    allowed_hosts: tuple[str, ...] = ()
    # agentrl's extension: the rewards this verifier may write; anything else is a verifier error
    # (`reward_range = [0, 10]` in [verifier]; Harbor has no such key and accepts any number).
    reward_range: tuple[float, float] = (0.0, 1.0)
    # "shared" | "separate" | None (Harbor: separate when `environment` is set, else shared).
    environment_mode: str | None = None
    environment: EnvironmentConfig | None = None  # `[verifier.environment]`: a separate verifier's
    collect: tuple[CollectHook, ...] = ()


@dataclass(frozen=True)
class TaskAgentConfig:
    timeout_sec: float | None = None
    user: str | int | None = None
    network_mode: str | None = None  # the agent phase's own policy; None: the environment's
    allowed_hosts: tuple[str, ...] = ()


@dataclass(frozen=True)
class HealthcheckConfig:
    """Harbor's environment healthcheck: `command` is run until it exits 0 once; failures during
    `start_period_sec` do not count, `retries` consecutive failures after it fail the start."""

    command: str
    interval_sec: float = 5.0
    timeout_sec: float = 30.0
    start_period_sec: float = 0.0
    start_interval_sec: float = 5.0
    retries: int = 3


@dataclass(frozen=True)
class SolutionConfig:
    env: dict[str, str] = field(default_factory=dict)


@dataclass(frozen=True)
class EnvironmentConfig:
    build_timeout_sec: float = 600.0
    docker_image: str | None = None
    os: str = "linux"
    cpus: float | None = None
    memory_mb: int | None = None
    storage_mb: int | None = None
    gpus: int | None = None
    network_mode: str | None = None
    allowed_hosts: tuple[str, ...] = ()
    env: dict[str, str] = field(default_factory=dict)
    workdir: str | None = None
    healthcheck: HealthcheckConfig | None = None

    @property
    def internet_allowed(self) -> bool:
        """Whether the agent sandbox may reach the network.

        Harbor's default is `public`; ours is no network unless the task says `allow_internet =
        true` or `network_mode = "public"`, because an RL run executes untrusted model actions.
        An allowlist cannot be enforced by a local container backend, so it is treated as public
        only when the user overrides (see the sandbox provider), never silently.
        """
        return self.network_mode == "public"


@dataclass(frozen=True)
class StepConfig:
    """One `[[steps]]` entry of a multi-step task (Harbor 0.25 `StepConfig`)."""

    name: str
    agent_timeout_sec: float | None = None  # None: the task's [agent].timeout_sec
    agent_user: str | int | None = None  # None: the task's
    # Harbor's quirk, kept: a step's verifier timeout defaults to 600 and never inherits the task's.
    verifier_timeout_sec: float = 600.0
    verifier_env: dict[str, str] = field(default_factory=dict)  # over the task's [verifier].env
    verifier_user: str | int | None = None
    # Abort the remaining steps unless the step's rewards reach this: a float gates "reward", a
    # table every key it names (a key the verifier did not write counts as -inf).
    min_reward: float | dict[str, float] | None = None
    # Run after the step's setup, before its agent (besides the environment's own healthcheck).
    healthcheck: HealthcheckConfig | None = None
    verifier_environment_mode: str | None = None  # None: as the step's environment says, else the task's
    verifier_environment: EnvironmentConfig | None = None
    artifacts: tuple[ArtifactConfig, ...] = ()  # after the task's
    # `[steps.agent]` / `[steps.verifier]` `network_mode` and `allowed_hosts`: the step's phase
    # policies, over the task's (Harbor: the step's override wins); (None, ()) inherits.
    agent_network: tuple[str | None, tuple[str, ...]] = (None, ())
    verifier_network: tuple[str | None, tuple[str, ...]] = (None, ())


REWARD_STRATEGIES = ("mean", "final")


@dataclass(frozen=True)
class TaskConfig:
    schema_version: str = "1.0"
    source: str | None = None
    name: str | None = None
    metadata: Metadata = field(default_factory=Metadata)
    verifier: VerifierConfig = field(default_factory=VerifierConfig)
    agent: TaskAgentConfig = field(default_factory=TaskAgentConfig)
    environment: EnvironmentConfig = field(default_factory=EnvironmentConfig)
    solution: SolutionConfig = field(default_factory=SolutionConfig)
    unknown_keys: tuple[str, ...] = ()
    deprecations: tuple[str, ...] = ()
    steps: tuple[StepConfig, ...] = ()  # a multi-step task's `[[steps]]`, in order
    # How a multi-step task's step rewards make its reward: "mean" (Harbor's default when unset;
    # the per-key mean over the steps that were verified) or "final" (the last verified step's).
    reward_strategy: str = "mean"
    artifacts: tuple[ArtifactConfig, ...] = ()

    def phase_network(self, phase: str) -> str:
        """The effective network policy of the "agent" or "verifier" phase (Harbor's phase
        overrides over the environment's baseline; agentrl's baseline is no network)."""
        override = self.agent.network_mode if phase == "agent" else self.verifier.network_mode
        return override or self.environment.network_mode or "no-network"

    def phase_hosts(self, phase: str) -> tuple[str, ...]:
        """The hosts an "allowlist" phase may reach: its override's, else the environment's."""
        own = self.agent if phase == "agent" else self.verifier
        if self.phase_network(phase) != "allowlist":
            return ()
        return own.allowed_hosts if own.network_mode else self.environment.allowed_hosts


# Keys the format defines but that agentrl does not act on yet; kept quiet rather than warned.
_KNOWN_PASSIVE = {
    "": {"task"},
    "environment": {"gpu_types", "tpu", "mcp_servers", "skills_dir"},
    "verifier": set(),
    "agent": set(),
}
ENVIRONMENT_MODES = ("shared", "separate")


class _Reader:
    """Pulls typed values out of one TOML table, recording unknown keys."""

    def __init__(self, file: str, table: dict[str, Any], prefix: str, unknown: list[str]) -> None:
        self.file = file
        self.data = table
        self.prefix = prefix
        self.unknown = unknown
        self.used: set[str] = set()

    def _field(self, key: str) -> str:
        return f"{self.prefix}.{key}" if self.prefix else key

    def err(self, key: str, message: str, hint: str = "") -> TaskFormatError:
        return TaskFormatError(self.file, self._field(key), message, hint)

    def get(self, key: str) -> Any:
        self.used.add(key)
        return self.data.get(key)

    def string(self, key: str) -> str | None:
        value = self.get(key)
        if value is None or isinstance(value, str):
            return value
        raise self.err(key, f"expected a string, got {type(value).__name__} {value!r}")

    def number(self, key: str, *, positive: bool = False) -> float | None:
        value = self.get(key)
        if value is None:
            return None
        if isinstance(value, bool) or not isinstance(value, int | float):
            raise self.err(key, f"expected a number, got {type(value).__name__} {value!r}")
        if not math.isfinite(value):
            raise self.err(key, f"must be finite, got {value!r}")
        if positive and value <= 0:
            raise self.err(key, f"must be > 0, got {value!r}")
        if value < 0:
            raise self.err(key, f"must be >= 0, got {value!r}")
        return float(value)

    def integer(self, key: str) -> int | None:
        value = self.get(key)
        if value is None:
            return None
        if isinstance(value, float) and value.is_integer():
            value = int(value)
        if isinstance(value, bool) or not isinstance(value, int):
            raise self.err(key, f"expected an integer, got {type(value).__name__} {value!r}")
        if value < 0:
            raise self.err(key, f"must be >= 0, got {value!r}")
        return value

    def boolean(self, key: str) -> bool | None:
        value = self.get(key)
        if value is None or isinstance(value, bool):
            return value
        raise self.err(key, f"expected true or false, got {type(value).__name__} {value!r}")

    def user(self, key: str) -> str | int | None:
        value = self.get(key)
        if value is None or (isinstance(value, str | int) and not isinstance(value, bool)):
            return value
        raise self.err(key, f"expected a user name or uid, got {value!r}")

    def str_map(self, key: str) -> dict[str, str]:
        value = self.get(key)
        if value is None:
            return {}
        if not isinstance(value, dict):
            raise self.err(key, f"expected a table of strings, got {type(value).__name__}")
        out: dict[str, str] = {}
        for k, v in value.items():
            if not isinstance(v, str):
                raise self.err(f"{key}.{k}", f"expected a string value, got {type(v).__name__} {v!r}")
            out[k] = v
        return out

    def str_list(self, key: str) -> tuple[str, ...]:
        value = self.get(key)
        if value is None:
            return ()
        if not isinstance(value, list) or not all(isinstance(v, str) for v in value):
            raise self.err(key, f"expected a list of strings, got {value!r}")
        return tuple(value)

    def table(self, key: str) -> dict[str, Any]:
        value = self.get(key)
        if value is None:
            return {}
        if not isinstance(value, dict):
            raise self.err(key, f"expected a table [{self._field(key)}], got {type(value).__name__}")
        return value

    def finish(self, passive: set[str] | None = None) -> None:
        for key in self.data:
            if key not in self.used and key not in (passive or set()):
                self.unknown.append(self._field(key))


def parse_size_mb(file: str, fieldname: str, value: Any) -> int:
    """Harbor's size strings: a number then G, M or K ("2G" -> 2048, "512M" -> 512)."""
    if not isinstance(value, str):
        raise TaskFormatError(file, fieldname, f"expected a size string like '2G', got {value!r}")
    text = value.strip().upper()
    factors = {"G": 1024.0, "M": 1.0, "K": 1 / 1024}
    if not text or text[-1] not in factors:
        raise TaskFormatError(
            file, fieldname, f"cannot parse size {value!r}", "use a number followed by G, M or K, e.g. '2G'"
        )
    try:
        number = float(text[:-1])
    except ValueError:
        raise TaskFormatError(
            file, fieldname, f"cannot parse size {value!r}", "use a number followed by G, M or K, e.g. '2G'"
        ) from None
    if not math.isfinite(number) or number < 0:
        raise TaskFormatError(file, fieldname, f"size must be a finite non-negative number, got {value!r}")
    return int(number * factors[text[-1]])


def resolve_env_templates(env: dict[str, str], where: str = "") -> dict[str, str]:
    """Harbor templating: a whole value `${NAME}` or `${NAME:-default}` takes the host's value."""
    out: dict[str, str] = {}
    for key, value in env.items():
        if value.startswith("${") and value.endswith("}"):
            inner = value[2:-1]
            name, sep, default = inner.partition(":-")
            if name in os.environ:
                out[key] = os.environ[name]
            elif sep:
                out[key] = default
            else:
                raise TaskFormatError(where, key, f"environment variable {name} is not set", f"export {name}")
        else:
            out[key] = value
    return out


def _phase_network(reader: _Reader) -> tuple[str | None, tuple[str, ...]]:
    """A phase's (or an environment's) `network_mode` and `allowed_hosts` (Harbor 1.4.5), the
    hosts normalised."""
    mode = reader.string("network_mode")
    if mode is not None and mode not in NETWORK_MODES:
        raise reader.err("network_mode", f"unknown network mode {mode!r}", f"use one of {NETWORK_MODES}")
    raw = reader.str_list("allowed_hosts")
    if raw and mode != "allowlist":
        raise reader.err(
            "allowed_hosts", "only valid with network_mode = 'allowlist'", "set network_mode = 'allowlist'"
        )
    try:
        hosts = tuple(dict.fromkeys(normalize_host(h) for h in raw))
    except ValueError as exc:
        raise reader.err(
            "allowed_hosts", str(exc), "give hostnames, *.wildcards, IP addresses or CIDR ranges"
        ) from None
    return mode, hosts  # an allowlist of none reaches nothing, as in Harbor


def _healthcheck(
    file: str, env: _Reader, unknown: list[str], prefix: str = "environment.healthcheck"
) -> HealthcheckConfig | None:
    table = env.table("healthcheck")
    if not table:
        return None
    hc = _Reader(file, table, prefix, unknown)
    command = hc.string("command")
    if not command:
        raise hc.err("command", "a healthcheck needs a command", 'e.g. command = "curl -fsS localhost:8000"')
    config = HealthcheckConfig(
        command=command,
        interval_sec=_or(hc.number("interval_sec"), 5.0),
        timeout_sec=hc.number("timeout_sec", positive=True) or 30.0,
        start_period_sec=hc.number("start_period_sec") or 0.0,
        start_interval_sec=_or(hc.number("start_interval_sec"), 5.0),
        retries=_or(hc.integer("retries"), 3),
    )
    hc.finish()
    return config


_WINDOWS_DEVICES = {"CON", "PRN", "AUX", "NUL", "CONIN$", "CONOUT$"} | {
    f"{p}{d}" for p in ("COM", "LPT") for d in "123456789\u00b9\u00b2\u00b3"
}


def _step_name_problem(name: Any) -> str | None:
    """Harbor's portable step-name rules (`harbor/models/task/step_name.py`), or None."""
    if not isinstance(name, str) or not name.strip():
        return "every [[steps]] entry needs a non-empty name"
    if name in (".", "..") or name.endswith((".", " ")):
        return f"step name {name!r} may not be '.', '..' or end in '.' or a space"
    if any(c in '<>:"/\\|?*' or ord(c) < 0x20 or ord(c) == 0x7F for c in name):
        return f'step name {name!r} may not hold < > : " / \\ | ? * or control characters'
    if name.split(".")[0].upper() in _WINDOWS_DEVICES:
        return f"step name {name!r} is a reserved device name"
    if len(name.encode()) > 255:
        return f"step name {name[:40]!r}... is longer than 255 bytes"
    return None


def _steps(file: str, top: _Reader, unknown: list[str], deprecations: list[str]) -> tuple[StepConfig, ...]:
    steps = top.get("steps")
    if steps is None:
        return ()
    if not isinstance(steps, list) or not all(isinstance(s, dict) for s in steps):
        raise top.err("steps", "expected an array of tables [[steps]]")
    out: list[StepConfig] = []
    seen: set[str] = set()
    for i, table in enumerate(steps):
        step = _Reader(file, table, f"steps[{i}]", unknown)
        name = step.get("name")
        problem = _step_name_problem(name)
        if problem:
            raise step.err("name", problem, "step names become directory names under steps/")
        folded = unicodedata.normalize("NFC", name).casefold()
        if folded in seen:
            raise step.err("name", f"step name {name!r} is used twice (names compare case-insensitively)")
        seen.add(folded)
        agent = _Reader(file, step.table("agent"), f"steps[{i}].agent", unknown)
        ver = _Reader(file, step.table("verifier"), f"steps[{i}].verifier", unknown)
        min_reward: Any = step.get("min_reward")
        if isinstance(min_reward, bool) or not (
            min_reward is None
            or isinstance(min_reward, int | float)
            or (isinstance(min_reward, dict) and all(
                isinstance(v, int | float) and not isinstance(v, bool) for v in min_reward.values()
            ))
        ):  # fmt: skip
            raise step.err("min_reward", f"expected a number or a table of numbers, got {min_reward!r}")
        if isinstance(min_reward, dict):
            min_reward = {str(k): float(v) for k, v in min_reward.items()}
        elif min_reward is not None:
            min_reward = float(min_reward)
        out.append(
            StepConfig(
                name=name,
                agent_timeout_sec=agent.number("timeout_sec", positive=True),
                agent_user=agent.user("user"),
                verifier_timeout_sec=ver.number("timeout_sec", positive=True) or 600.0,
                verifier_env=ver.str_map("env"),
                verifier_user=ver.user("user"),
                min_reward=min_reward,
                healthcheck=_healthcheck(file, step, unknown, f"steps[{i}].healthcheck"),
                **{f"verifier_{k}": v for k, v in _verifier_environment(file, ver, deprecations).items()},
                artifacts=_artifacts(step),
                agent_network=_phase_network(agent),
                verifier_network=_phase_network(ver),
            )
        )
        agent.finish()
        ver.finish()
        step.finish()
    return tuple(out)


_SERVICE = re.compile(r"[A-Za-z0-9][A-Za-z0-9_.-]*\Z")


def _verifier_environment(file: str, ver: _Reader, deprecations: list[str]) -> dict[str, Any]:
    """`environment_mode` and `[verifier.environment]` (Harbor: `shared` with an environment is an
    error)."""
    mode = ver.string("environment_mode")
    if mode is not None and mode not in ENVIRONMENT_MODES:
        raise ver.err("environment_mode", f"unknown mode {mode!r}", f"use one of {ENVIRONMENT_MODES}")
    table = ver.table("environment")
    environment = None
    if table:
        if mode == "shared":
            raise ver.err(
                "environment_mode",
                "'shared' with a [verifier.environment] table",
                "drop environment_mode (a verifier environment means 'separate') or the table",
            )
        sub = _Reader(file, table, ver._field("environment"), ver.unknown)
        environment = _environment(file, sub, deprecations)
    return {"environment_mode": mode, "environment": environment}


def _collect(file: str, ver: _Reader) -> tuple[CollectHook, ...]:
    hooks = ver.get("collect")
    if hooks is None:
        return ()
    if not isinstance(hooks, list) or not all(isinstance(h, dict) for h in hooks):
        raise ver.err("collect", "expected an array of tables [[verifier.collect]]")
    out = []
    for i, table in enumerate(hooks):
        hook = _Reader(file, table, f"{ver._field('collect')}[{i}]", ver.unknown)
        command = hook.string("command")
        if not command:
            raise hook.err("command", "a collect hook needs a command")
        service = hook.string("service") or "main"
        if not _SERVICE.match(service):
            raise hook.err("service", f"{service!r} is not a compose service name")
        timeout = hook.number("timeout_sec", positive=True)
        out.append(CollectHook(command, service, 60.0 if timeout is None else timeout, hook.user("user")))
        hook.finish()
    return tuple(out)


def _artifacts(reader: _Reader) -> tuple[ArtifactConfig, ...]:
    """`artifacts = [...]` entries: a path, or a table (Harbor `ArtifactConfig`)."""
    entries = reader.get("artifacts")
    if entries is None:
        return ()
    if not isinstance(entries, list):
        raise reader.err("artifacts", "expected a list of paths or tables")
    out = []
    for i, entry in enumerate(entries):
        where = f"artifacts[{i}]"
        table = {"source": entry} if isinstance(entry, str) else entry
        if not isinstance(table, dict):
            raise reader.err(where, f"expected a path or a table, got {entry!r}")
        art = _Reader(reader.file, table, reader._field(where), reader.unknown)
        source = art.string("source")
        if not source or ".." in source.split("/"):
            raise art.err("source", f"{source!r}: a container path without '..' is needed")
        service = art.string("service")
        if service not in (None, "main") and not source.startswith("/"):
            raise art.err("source", "a service's artifact needs an absolute path")
        if service is not None and not _SERVICE.match(service):
            raise art.err("service", f"{service!r} is not a compose service name")
        dest = art.string("destination") or None
        if dest is not None and (
            dest.startswith("/") or "\\" in dest or ".." in dest.split("/") or dest == "manifest.json"
        ):
            raise art.err("destination", f"{dest!r}: a relative path under artifacts/, without '..'")
        out.append(ArtifactConfig(source, dest, art.str_list("exclude"), service))
        art.finish()
    return tuple(out)


def _reward_range(reader: _Reader) -> tuple[float, float]:
    value = reader.get("reward_range")
    if value is None:
        return (0.0, 1.0)
    if (
        not isinstance(value, list)
        or len(value) != 2
        or any(isinstance(v, bool) or not isinstance(v, int | float) or not math.isfinite(v) for v in value)
        or value[0] > value[1]
    ):
        raise reader.err("reward_range", f"expected [low, high], two finite numbers, got {value!r}")
    return (float(value[0]), float(value[1]))


def _size_field(reader: _Reader, mb_key: str, alias: str, deprecations: list[str]) -> int | None:
    """`memory_mb` (int, or a size string) and the deprecated `memory` alias, reconciled."""
    raw = reader.get(mb_key)
    value: int | None
    if isinstance(raw, str):
        value = parse_size_mb(reader.file, reader._field(mb_key), raw)
    else:
        value = reader.integer(mb_key)
    alias_raw = reader.get(alias)
    if alias_raw is not None:
        deprecations.append(f"{reader._field(alias)} is deprecated: use {reader._field(mb_key)}")
        if isinstance(alias_raw, str):
            parsed = parse_size_mb(reader.file, reader._field(alias), alias_raw)
            if value is not None and value != parsed:
                raise reader.err(alias, f"{alias_raw!r} disagrees with {mb_key} = {value}", "keep only one")
            value = parsed
    return value


def _environment(file: str, env: _Reader, deprecations: list[str]) -> EnvironmentConfig:
    """An `[environment]` table (or a verifier's `[verifier.environment]`, of the same schema)."""
    os_name = (env.string("os") or "linux").lower()
    if os_name not in ("linux", "windows"):
        raise env.err("os", f"unknown os {os_name!r}", "use 'linux' or 'windows'")
    network_mode, allowed_hosts = _phase_network(env)
    allow_internet = env.boolean("allow_internet")
    if allow_internet is not None:
        deprecations.append(f"{env._field('allow_internet')} is deprecated: use {env._field('network_mode')}")
        if network_mode is None:
            network_mode = "public" if allow_internet else "no-network"
    gpus = env.integer("gpus")
    config = EnvironmentConfig(
        build_timeout_sec=env.number("build_timeout_sec", positive=True) or 600.0,
        docker_image=env.string("docker_image"),
        os=os_name,
        cpus=env.number("cpus", positive=True),
        memory_mb=_size_field(env, "memory_mb", "memory", deprecations),
        storage_mb=_size_field(env, "storage_mb", "storage", deprecations),
        gpus=gpus,
        network_mode=network_mode,
        allowed_hosts=allowed_hosts,
        env=env.str_map("env"),
        workdir=env.string("workdir"),
        healthcheck=_healthcheck(file, env, env.unknown, f"{env.prefix}.healthcheck"),
    )
    env.finish(_KNOWN_PASSIVE["environment"])
    return config


def parse_task_config(text: str, file: str = "task.toml") -> TaskConfig:
    """Parse `task.toml` text into a `TaskConfig`; raises `TaskFormatError` on any defect."""
    try:
        data = tomllib.loads(text)
    except tomllib.TOMLDecodeError as exc:
        raise TaskFormatError(file, None, f"invalid TOML: {exc}", "fix the syntax") from None
    unknown: list[str] = []
    deprecations: list[str] = []
    top = _Reader(file, data, "", unknown)

    schema_version = top.get("schema_version")
    version = top.get("version")
    if schema_version is None:
        schema_version = version if version is not None else "1.0"
    if not isinstance(schema_version, str | int | float) or isinstance(schema_version, bool):
        raise top.err("version", f"expected a version string like '1.0', got {schema_version!r}")
    source = top.string("source")

    task_table = _Reader(file, top.table("task"), "task", unknown)
    name = task_table.string("name")
    if name is not None and (not name or ".." in name):
        raise task_table.err("name", f"invalid task name {name!r}", "use 'org/name'")
    for key in ("version", "description", "keywords", "authors"):
        task_table.get(key)
    task_table.finish()

    meta = _Reader(file, top.table("metadata"), "metadata", unknown)
    known_meta = {
        "author_name",
        "author_email",
        "difficulty",
        "category",
        "tags",
        "expert_time_estimate_min",
        "junior_time_estimate_min",
    }
    metadata = Metadata(
        author_name=meta.string("author_name"),
        author_email=meta.string("author_email"),
        difficulty=meta.string("difficulty"),
        category=meta.string("category"),
        tags=meta.str_list("tags"),
        expert_time_estimate_min=meta.number("expert_time_estimate_min"),
        junior_time_estimate_min=meta.number("junior_time_estimate_min"),
        # [metadata] is a free dict in Harbor: extra keys are data, not defects.
        extra={k: v for k, v in meta.data.items() if k not in known_meta},
    )

    ver = _Reader(file, top.table("verifier"), "verifier", unknown)
    verifier = VerifierConfig(
        timeout_sec=ver.number("timeout_sec", positive=True) or 600.0,
        env=ver.str_map("env"),
        user=ver.user("user"),
        reward_range=_reward_range(ver),
        **dict(zip(("network_mode", "allowed_hosts"), _phase_network(ver), strict=True)),
        **_verifier_environment(file, ver, deprecations),
        collect=_collect(file, ver),
    )
    ver.finish(_KNOWN_PASSIVE["verifier"])

    ag = _Reader(file, top.table("agent"), "agent", unknown)
    agent = TaskAgentConfig(
        timeout_sec=ag.number("timeout_sec", positive=True),
        user=ag.user("user"),
        **dict(zip(("network_mode", "allowed_hosts"), _phase_network(ag), strict=True)),
    )
    ag.finish(_KNOWN_PASSIVE["agent"])

    environment = _environment(
        file, _Reader(file, top.table("environment"), "environment", unknown), deprecations
    )

    sol = _Reader(file, top.table("solution"), "solution", unknown)
    solution = SolutionConfig(env=sol.str_map("env"))
    sol.finish()

    artifacts = _artifacts(top)
    steps = _steps(file, top, unknown, deprecations)
    strategy = top.string("multi_step_reward_strategy") or "mean"
    if strategy not in REWARD_STRATEGIES:
        raise top.err(
            "multi_step_reward_strategy", f"{strategy!r} is not one of {', '.join(REWARD_STRATEGIES)}"
        )
    top.finish(_KNOWN_PASSIVE[""])
    return TaskConfig(
        schema_version=str(schema_version),
        source=source,
        name=name,
        metadata=metadata,
        verifier=verifier,
        agent=agent,
        environment=environment,
        solution=solution,
        unknown_keys=tuple(unknown),
        deprecations=tuple(deprecations),
        steps=steps,
        reward_strategy=strategy,
        artifacts=artifacts,
    )


def _or(value: _T | None, default: _T) -> _T:
    """A value read from task.toml, or the default where the key is absent."""
    return default if value is None else value
