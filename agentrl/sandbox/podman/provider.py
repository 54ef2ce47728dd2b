"""`PodmanProvider`: images (build, stand-in bases, tmux layer), container creation with the task's
limits and network, and `reap` of what a dead run left behind."""

from __future__ import annotations

import asyncio
import copy
import hashlib
import logging
import os
import re
import shutil
import tempfile
import time
import uuid
from pathlib import Path
from typing import TYPE_CHECKING, Any

from agentrl.errors import InputError
from agentrl.sandbox import images
from agentrl.sandbox.base import (
    DEFAULT_CPUS,
    DEFAULT_MEMORY_MB,
    DEFAULT_OUTPUT_LIMIT,
    DEFAULT_PIDS_LIMIT,
    DEFAULT_STORAGE_MB,
    ImageBuildError,
    Sandbox,
    SandboxCreateError,
    SandboxError,
    SandboxProvider,
    tail,
)
from agentrl.sandbox.podman import compose, netns
from agentrl.sandbox.podman.cli import (
    _LIVE,
    _UNRESOLVED_FROM,
    BUILD_PIP_DIR,
    INIT_PATH,
    LABEL_BUILD,
    LABEL_CREATED,
    LABEL_RUN,
    LABEL_TASK,
    build_ca_dir,
    context_hash,
    find_init,
    init_and_layer,
    is_podman,
    rm_args,
    run_cli,
)
from agentrl.sandbox.podman.sandbox import PodmanSandbox
from agentrl.sandbox.terminal import INSTALL_TMUX, NO_TMUX
from agentrl.tasks.compose import MAIN
from agentrl.tasks.config import resolve_env_templates

if TYPE_CHECKING:
    from agentrl.tasks.task import Task
log = logging.getLogger(__name__)


class PodmanProvider(SandboxProvider):
    """Creates `PodmanSandbox`es for tasks; optionally keeps a warm pool per task."""

    def __init__(
        self,
        *,
        cli: str | None = None,
        allow_network: bool | None = None,
        pids_limit: int = DEFAULT_PIDS_LIMIT,
        inject_ca: bool = True,
        output_limit: int = DEFAULT_OUTPUT_LIMIT,
        warm_pool: int = 0,
        default_cpus: float | None = DEFAULT_CPUS,
        default_memory_mb: int | None = DEFAULT_MEMORY_MB,
        default_storage_mb: int | None = DEFAULT_STORAGE_MB,
        storage_check_s: float = 2.0,
        shell_grace_s: float = 30.0,
        init: str | None = None,
        terminal_tools: bool = True,
        private_verification: bool = True,
    ) -> None:
        """Limits: a task's own `cpus` / `memory_mb` / `storage_mb` win; when it is silent the
        defaults apply (None: no limit). `init` is a static init run as PID 1 in pause mode
        (default: catatonit, found like podman finds it): it reaps zombies and cannot be killed from
        inside, so `kill -9 -1` ends the agent's processes but never the container.
        `terminal_tools`: sandboxes run the task's image plus one layer that installs tmux where it
        is missing (built once per image, with the build network), so `open_terminal` works.
        `private_verification`: the tests run in a verification container of their own with
        provenance (`verifier.py`) where the host allows it (rootful podman); False verifies inside
        the sandbox after the `podman diff` tamper scan."""
        self.cli = cli or os.environ.get("AGENTRL_CONTAINER_CLI", "podman")
        self.allow_network = allow_network  # None: the task decides; True/False: user override
        self.pids_limit = pids_limit
        # docker build has no build-time mounts; podman's `-v` on build is what makes this work.
        self._podman = is_podman(self.cli)
        self._ca_dir = build_ca_dir() if inject_ca and self._podman else None
        self.output_limit = output_limit
        self.warm_pool = warm_pool
        self.default_cpus = default_cpus
        self.default_memory_mb = default_memory_mb
        self.default_storage_mb = default_storage_mb
        self.storage_check_s = storage_check_s
        self.shell_grace_s = shell_grace_s
        self.init = init if init is not None else find_init()
        self.terminal_tools = terminal_tools
        self.private_verification = private_verification and self._podman
        self._terminal_images: dict[str, str] = {}
        self._terminal_notes: dict[str, str] = {}  # image -> why its tmux layer is missing
        self._storage_opt: bool | None = None  # whether the storage driver caps a container's size
        self._build_locks: dict[str, asyncio.Lock] = {}
        self._unpullable: set[str] = set()
        self._resolved: dict[str, str] = {}  # task directory -> its image
        # task directory -> the build that failed (its Dockerfile fails the same way again: an
        # episode of the task is told at once instead of building it a second time)
        self._failed_builds: dict[str, ImageBuildError] = {}
        self._standins_said: set[tuple[str, str]] = set()  # warned once per provider
        self._live: set[str] = set()
        self._compose: dict[str, compose.ComposeNet] = {}  # a compose task's sandbox -> its network
        self._pool: dict[str, list[PodmanSandbox]] = {}
        self._pool_tasks: set[asyncio.Task[None]] = set()
        self._background: set[asyncio.Task[Any]] = set()

    # -- images ---------------------------------------------------------------------------------
    async def image_for(self, task: Task) -> str:
        """The image to run `task` in: `docker_image` when it is local or can be pulled (Harbor's
        default), else the image built from environment/Dockerfile. Resolved once per task and
        provider: every later episode of the task starts without asking the image store again
        (four or five CLI calls, about 0.2 s of CPU each episode on a 2-core machine)."""
        if task.compose is not None:  # a multi-container task: the agent's is service `main`
            task = task.service_task(task.compose.services[MAIN])
        key = _environment_key(task)
        if (failed := self._failed_builds.get(key)) is not None:
            raise copy.copy(failed)  # the same error, a fresh traceback
        if (known := self._resolved.get(key)) is None:
            try:
                known = self._resolved[key] = await self._image_for(task)
            except ImageBuildError as exc:
                if not exc.timed_out:  # a slow build may be faster next time; a failing one is not
                    self._failed_builds[key] = exc
                raise
        return known

    async def _image_for(self, task: Task) -> str:
        env = task.config.environment
        if env.docker_image:
            if await self._have_or_pull(env.docker_image):
                return env.docker_image
            if task.dockerfile is None:
                raise SandboxCreateError(
                    f"{task.task_id}: docker_image {env.docker_image!r} is neither local nor pullable"
                    " and there is no environment/Dockerfile to build instead"
                )
            log.info("%s: %s unavailable; building environment/Dockerfile", task.task_id, env.docker_image)
        if task.dockerfile is None:
            raise SandboxCreateError(f"{task.task_id}: no environment/Dockerfile and no docker_image")
        dockerfile = await self._dockerfile_offline(task)
        key = context_hash(task.environment_dir)
        if dockerfile is not None:
            # the rewrite names the stand-in with its recipe hash: a new recipe is a new image
            key = hashlib.sha256(f"{key}\n{dockerfile}".encode()).hexdigest()[:16]
        tag = f"localhost/agentrl-task/{task.task_id.lower()}:{key}"
        lock = self._build_locks.setdefault(tag, asyncio.Lock())
        async with lock:
            rc, _, _ = await run_cli(self.cli, "image", "inspect", tag, timeout=60)
            if rc == 0:
                return tag
            await self._build(task, tag, dockerfile)
        return tag

    async def _dockerfile_offline(self, task: Task) -> str | None:
        """environment/Dockerfile with every `FROM` whose base is neither local nor pullable
        rewritten to the stand-in serving its repository; None when no line needs it. A stand-in
        an older agentrl tagged under the real name counts as local only while the stand-in under
        its own name is missing."""
        assert task.dockerfile is not None
        text = task.dockerfile.read_text(encoding="utf-8", errors="replace")
        recipe = images.load_recipe()
        replace: dict[int, str] = {}
        for line in images.from_lines(text):
            standin = images.standin_for(line.image, recipe)
            if await self._have_or_pull(line.image) and (
                standin is None
                or await self._recipe_label(line.image) is None
                or not await self._have(standin)
            ):
                continue
            if standin is None:
                raise ImageBuildError(
                    f"{task.task_id}: environment/Dockerfile line {line.line + 1}: FROM {line.written} "
                    "is not present locally, cannot be pulled, and no offline stand-in serves it "
                    f"(sandbox_images/bases.toml lists {', '.join(recipe.repositories)}): load the "
                    f"image on this machine (`{self.cli} load` / `{self.cli} pull` where a registry "
                    "answers), or start FROM a base the stand-ins serve"
                )
            if not await self._have(standin):
                raise ImageBuildError(
                    f"{task.task_id}: FROM {line.written} is not present locally and cannot be "
                    f"pulled; its offline stand-in {standin} is not built: run `agentrl sandbox "
                    "build-bases`"
                )
            if (task.task_id, line.written) not in self._standins_said:
                # what the stand-ins hold is said once per provider; each task's line stays short
                first = not self._standins_said
                self._standins_said.add((task.task_id, line.written))
                log.warning(
                    "%s: FROM %s is not present locally and cannot be pulled: the stand-in %s answers "
                    "instead%s",
                    task.task_id,
                    line.written,
                    standin,
                    f"; {recipe.content}" if first else "",
                )
            replace[line.line] = standin
        return images.rewrite_froms(text, replace) if replace else None

    async def _have(self, image: str) -> bool:
        return (await run_cli(self.cli, "image", "inspect", image, timeout=60))[0] == 0

    async def _recipe_label(self, image: str) -> str | None:
        rc, out, _ = await run_cli(
            self.cli,
            "image",
            "inspect",
            "--format",
            f'{{{{ index .Config.Labels "{images.RECIPE_LABEL}" }}}}',
            image,
            timeout=60,
        )
        value = out.strip()
        return value if rc == 0 and value and value != "<no value>" else None

    async def terminal_image(self, image: str, timeout: float = 600.0) -> str:
        """`image` plus a layer that installs tmux where it is missing (`INSTALL_TMUX`), built
        once and tagged by the image's id. An image whose layer cannot be built (no shell in it,
        say) is used as it is: the command path does not need tmux, and `open_terminal` says why
        there is none."""
        if not self.terminal_tools:
            return image
        if image in self._terminal_images:
            return self._terminal_images[image]
        lock = self._build_locks.setdefault(f"terminal:{image}", asyncio.Lock())
        async with lock:
            if image in self._terminal_images:
                return self._terminal_images[image]
            rc, out, err = await run_cli(
                self.cli, "image", "inspect", "--format", "{{.Id}}\t{{.Config.User}}", image, timeout=60
            )
            image_id, _, user = out.strip().partition("\t")
            if rc != 0 or not image_id:
                raise SandboxCreateError(f"inspecting image {image} failed", log_tail=tail(err, 500))
            recipe = hashlib.sha256(f"{image_id}\n{INSTALL_TMUX}".encode()).hexdigest()[:16]
            tag = f"localhost/agentrl-terminal/image:{recipe}"
            if (await run_cli(self.cli, "image", "inspect", tag, timeout=60))[0] != 0:
                dockerfile = f"FROM {image_id}\nUSER root\nRUN {INSTALL_TMUX}\n"
                if user and user not in ("root", "0", "0:0"):
                    dockerfile += f"USER {user}\n"
                with tempfile.TemporaryDirectory(prefix="agentrl-terminal-") as ctx:
                    (Path(ctx) / "Dockerfile").write_text(dockerfile)
                    args = ["build", "--network=host", "--pull=never" if self._podman else "--pull=false"]
                    try:
                        rc, out, err = await run_cli(self.cli, *args, "-t", tag, ctx, timeout=timeout)
                    except TimeoutError:
                        rc, out, err = 1, "", f"took longer than {timeout:.0f}s"
                if rc != 0:
                    note = tail((out + err).strip(), 300)
                    log.warning(
                        "could not add tmux to %s (the terminal will be unavailable): %s", image, note
                    )
                    self._terminal_notes[image] = note
                    tag = image
                elif any(line.startswith(NO_TMUX) for line in (out + err).splitlines()):
                    # (the build log also echoes the RUN line, which holds the same words)
                    self._terminal_notes[tag] = "no package manager of the image could install it"
                    log.warning("%s has no tmux and none could be installed: no terminal in it", image)
            self._terminal_images[image] = tag
            return tag

    async def _have_or_pull(self, image: str) -> bool:
        if image in self._unpullable:
            return await self._have(image)
        lock = self._build_locks.setdefault(image, asyncio.Lock())
        async with lock:
            if await self._have(image):
                return True
            try:
                pulled = (await run_cli(self.cli, "pull", "--quiet", image, timeout=600))[0] == 0
            except TimeoutError:
                pulled = False
            if not pulled:
                self._unpullable.add(image)  # one try per provider: offline, every try fails
            return pulled

    async def _build(self, task: Task, tag: str, dockerfile: str | None = None) -> None:
        """Build `tag` from environment/ with the Dockerfile as written, or `dockerfile` (the
        rewritten text) from a temporary file next to the unchanged context. Every base is local
        by now (present, pulled or a stand-in), so nothing is pulled during the build, unless a
        `FROM` names its image through a build argument no one could resolve beforehand."""
        assert task.dockerfile is not None
        with tempfile.TemporaryDirectory(prefix="agentrl-dockerfile-") as tmp:
            path = Path(task.dockerfile).resolve()
            if dockerfile is not None:
                path = Path(tmp) / "Dockerfile"
                path.write_text(dockerfile, encoding="utf-8")
                ignore = Path(task.environment_dir) / "Dockerfile.dockerignore"
                if ignore.is_file():
                    shutil.copyfile(ignore, Path(tmp) / "Dockerfile.dockerignore")
            # --force-rm: a failed build's intermediate containers go too, not only a good one's;
            # the label marks its layers, pruned below when it fails.
            build_id = uuid.uuid4().hex[:16]
            args = ["build", "--network=host", "--force-rm", "--label", f"{LABEL_BUILD}={build_id}"]
            args += ["-t", tag, "-f", str(path)]
            if not _UNRESOLVED_FROM.search(dockerfile or path.read_text(errors="replace")):
                # docker never pulls a base it has unless told to; its --pull takes no value.
                args.append("--pull=never" if self._podman else "--pull=false")
            if self._ca_dir is not None:
                args += ["-v", f"{Path(self._ca_dir).resolve()}:{BUILD_PIP_DIR}:ro"]
            args.append(str(Path(task.environment_dir).resolve()))  # the CLI runs in cli_cwd()
            timeout = task.config.environment.build_timeout_sec
            try:
                rc, out, err = await run_cli(self.cli, *args, timeout=timeout)
            except TimeoutError:
                await self._prune_build(build_id)
                error = ImageBuildError(
                    f"building {task.task_id} took longer than {timeout:.0f}s (build_timeout_sec)"
                )
                error.timed_out = True
                raise error from None
        if rc != 0:
            await self._prune_build(build_id)
            raise ImageBuildError(
                f"building the image of {task.task_id} failed (exit {rc})", log_tail=tail((out + err), 4000)
            )

    async def _prune_build(self, build_id: str) -> None:
        """The layers a failed build left (its cached intermediate images), unless a later image
        was built on them: `image prune` removes only those with no child and no tag. The failed
        step's working container can outlive the build by a moment (seen on a loaded machine: it
        holds the last layer, and that layer the ones under it), so the prune is tried again a
        few times while layers of the build are left."""
        label = f"label={LABEL_BUILD}={build_id}"
        for attempt in range(3):  # (layers a later image was built on stay: at most 1.5 s lost)
            rc, _, err = await run_cli(self.cli, "image", "prune", "-f", "--filter", label, timeout=120)
            if rc != 0:
                log.info("pruning the layers of a failed build: %s", tail(err.strip(), 200))
            rc, out, _ = await run_cli(self.cli, "images", "-a", "-q", "--filter", label, timeout=60)
            if rc != 0 or not out.split() or attempt == 2:
                return
            await asyncio.sleep(0.5 * (attempt + 1))

    # -- containers -----------------------------------------------------------------------------
    def _network(self, task: Task) -> str:
        """ "bridge" where a phase of the sandbox may reach the network or part of it (the agent's,
        or a shared verifier's: `set_network` closes or narrows each phase), else "none"."""
        if self.allow_network is not None:
            return "bridge" if self.allow_network else "none"
        phases = set()
        for phase in task.steps or [task]:  # a multi-step task's steps each have their own
            phases.add(phase.config.phase_network("agent"))
            if phase.verifier_mode == "shared":
                phases.add(phase.config.phase_network("verifier"))
        return "bridge" if phases & {"public", "allowlist"} else "none"

    def _limit_args(self, task: Task) -> list[str]:
        """The task's cpus and memory (else the defaults), the pids cap, no host proxy variables:
        the agent's container and the verifier's get the same."""
        env = task.config.environment
        args = ["--pids-limit", str(self.pids_limit)]
        if self._podman:
            args.append("--http-proxy=false")  # podman copies the host's proxy variables by default
        if cpus := env.cpus or self.default_cpus:
            args += ["--cpus", str(cpus)]
        if memory := env.memory_mb or self.default_memory_mb:
            args += ["--memory", f"{memory}m", "--memory-swap", f"{memory}m"]
        return args

    def _labels(self, task: Task, run_id: str) -> list[str]:
        return [
            "--label", f"{LABEL_RUN}={run_id}", "--label", f"{LABEL_TASK}={task.task_id}",
            "--label", f"{LABEL_CREATED}={int(time.time())}",
        ]  # fmt: skip

    def _run_args(
        self, task: Task, run_id: str, name: str, network: list[str] | None = None
    ) -> tuple[list[str], int | None]:
        """`run` arguments without the storage cap, and the storage limit in MiB; `network`
        replaces the network options (a compose task's network)."""
        env = task.config.environment
        args = [
            "run",
            "-d",
            "--name",
            name,
            *(network if network is not None else ["--network", self._network(task)]),
            "--label",
            f"{LABEL_RUN}={run_id}",
            "--label",
            f"{LABEL_TASK}={task.task_id}",
            "--label",
            f"{LABEL_CREATED}={int(time.time())}",
            *self._limit_args(task),
        ]
        if self.init:
            args += ["-v", f"{self.init}:{INIT_PATH}:ro", "--entrypoint", INIT_PATH]
        else:
            args += ["--init", "--entrypoint", "sleep"]
        if env.workdir:
            args += ["-w", env.workdir]
        # `${VAR}` / `${VAR:-default}` values come from the host, as in Harbor (an unset one is a
        # task error that names the variable).
        for k, v in resolve_env_templates(env.env, str(task.path / "task.toml")).items():
            args += ["-e", f"{k}={v}"]
        return args, env.storage_mb or self.default_storage_mb

    async def _start(self, task: Task, run_id: str, image: str) -> PodmanSandbox:
        env = task.config.environment
        # Container names allow [a-zA-Z0-9][a-zA-Z0-9_.-]*; run ids and task ids may hold anything.
        safe = re.sub(r"[^a-z0-9_.-]+", "-", f"{run_id[:24]}-{task.task_id[:24]}".lower())
        name = f"agentrl-{safe}-{uuid.uuid4().hex[:8]}"
        spec = task.compose
        net: compose.ComposeNet | None = None
        network: list[str] | None = None
        _LIVE[name] = self.cli
        self._live.add(name)
        command = [image, "-P"] if self.init else [image, "infinity"]
        try:
            if spec is not None:
                _LIVE[f"net:{name}-net"] = self.cli
                net = await compose.create_network(self, spec, name, self._labels(task, run_id))
                self._compose[name] = net
                network = compose.main_args(spec, net, dict(zip(spec.volumes, net.volumes, strict=True)))
            args, storage = self._run_args(task, run_id, name, network)
            rc, err = 1, ""
            if storage and self._storage_opt is not False:
                rc, _, err = await run_cli(
                    self.cli, *args, "--storage-opt", f"size={storage}m", *command, timeout=120
                )
                if rc == 0:
                    self._storage_opt = True
                elif "only supported for" in err or "storage-opt" in err.lower() or "quota" in err.lower():
                    log.info(
                        "the storage driver cannot cap container size (%s): measuring from the host",
                        tail(err.strip(), 200),
                    )
                    self._storage_opt = False
                    await run_cli(self.cli, *rm_args(self.cli), name, timeout=120)
            if rc != 0 and not (storage and self._storage_opt):
                rc, _, err = await run_cli(self.cli, *args, *command, timeout=120)
            if rc != 0:
                raise SandboxCreateError(
                    f"starting a container for {task.task_id} failed", log_tail=tail(err, 2000)
                )
            # The writable layer (storage measured from the host) and the init's host pid (the
            # verifier kills the agent's processes by its PID namespace).
            pid, upper, err = await init_and_layer(self.cli, name)
            if storage and not self._storage_opt and upper is None:
                raise SandboxCreateError(
                    f"{task.task_id} asks for storage_mb={storage}, which this host can enforce neither "
                    "with the storage driver (overlay on xfs with pquota) nor by measuring the "
                    "container's writable layer from the host; pass default_storage_mb=None and set no "
                    "storage_mb to run without a storage limit",
                    log_tail=tail(err, 500),
                )
            measured = bool(storage and not self._storage_opt and upper)
            sandbox = PodmanSandbox(
                self,
                name,
                env.workdir,
                storage_mb=storage if measured else None,
                upper_dir=upper,
                image=image,
                limit_args=tuple(self._limit_args(task)),
                storage_limit_mb=storage,
            )
            sandbox._init_pid = pid
            sandbox.network = "bridge" if net else self._network(task)
            sandbox.compose = net
            first = (task.steps or [task])[0].config  # the first agent phase's policy
            policy, hosts = first.phase_network("agent"), first.phase_hosts("agent")
            if self.allow_network is not None:
                policy = "public" if self.allow_network else "no-network"
            if sandbox.network == "bridge" and sandbox._init_pid:
                sandbox._resolvers = netns.resolvers(sandbox._init_pid)  # before the agent can edit them
            if sandbox.network == "bridge" and policy != "public":
                # before the agent's first command, and before any other service starts
                await sandbox.set_network(policy, hosts)
            if spec is not None and net is not None:

                async def started(service: str, container: str) -> None:
                    _LIVE[container] = self.cli
                    await sandbox.add_service(service, container)

                await compose.start_services(self, task, spec, name, net, self._labels(task, run_id), started)
            res = await sandbox._exec_clean(
                "mkdir -p /logs/verifier /logs/agent /logs/artifacts && chmod 777 /logs /logs/*", timeout=60
            )
            if res.exit_code != 0:
                raise SandboxCreateError(f"preparing /logs in {name} failed", log_tail=res.stderr)
            return sandbox
        except BaseException:
            await asyncio.shield(self._remove(name))
            raise

    async def create(self, task: Task, *, run_id: str) -> Sandbox:
        for part in task.steps or [task]:  # refused before anything starts, not mid-episode
            for phase in ("agent", "verifier"):
                if self.allow_network is None and (
                    wild := [h for h in part.config.phase_hosts(phase) if h.startswith("*.")]
                ):
                    raise InputError(
                        f"{task.task_id}: the {phase} phase allows {wild[0]!r}: podman enforces an "
                        "allowlist by address, and a wildcard names no address; list the hostnames, "
                        "or run on Daytona"
                    )
        pooled = self._pool.get(task.task_id)
        while pooled:
            sandbox = pooled.pop()
            if await sandbox.alive():
                self._refill(task, run_id)
                return sandbox
            await sandbox.close()
        image = await self.terminal_image(
            await self.image_for(task), task.config.environment.build_timeout_sec
        )
        try:
            sandbox = await self._start(task, run_id, image)
        except SandboxCreateError:
            self._resolved.pop(_environment_key(task), None)  # an image removed meanwhile: ask again
            raise
        self._refill(task, run_id)
        return sandbox

    def _refill(self, task: Task, run_id: str) -> None:
        if self.warm_pool > 0:
            self.prefetch(task, run_id=run_id)

    def prefetch(self, task: Task, *, run_id: str, count: int | None = None) -> None:
        """Start containers for an upcoming task in the background (the warm pool)."""
        want = (
            (count or self.warm_pool)
            - len(self._pool.get(task.task_id, []))
            - sum(1 for t in self._pool_tasks if t.get_name() == task.task_id)
        )
        for _ in range(max(0, want)):
            t = asyncio.create_task(self._warm_one(task, run_id), name=task.task_id)
            self._pool_tasks.add(t)
            t.add_done_callback(self._pool_tasks.discard)

    async def wait_warm(self, task: Task) -> int:
        """Wait for the pre-starts of `task` in flight; return how many sandboxes are pooled."""
        pending = [t for t in self._pool_tasks if t.get_name() == task.task_id]
        if pending:
            await asyncio.gather(*pending, return_exceptions=True)
        return len(self._pool.get(task.task_id, []))

    async def _warm_one(self, task: Task, run_id: str) -> None:
        try:
            image = await self.image_for(task)
            image = await self.terminal_image(image, task.config.environment.build_timeout_sec)
            sandbox = await self._start(task, run_id, image)
        except SandboxError as exc:
            log.warning("warm pool: could not pre-start %s: %s", task.task_id, exc)
            return
        self._pool.setdefault(task.task_id, []).append(sandbox)

    async def _remove(self, name: str) -> None:
        try:
            await run_cli(self.cli, *rm_args(self.cli), name, timeout=120)
            if (net := self._compose.pop(name, None)) is not None:
                await compose.remove_network(self.cli, net)
                for container in net.containers.values():
                    _LIVE.pop(container, None)
            _LIVE.pop(f"net:{name}-net", None)
        finally:
            self._live.discard(name)
            _LIVE.pop(name, None)

    def live_sandboxes(self) -> int:
        return len(self._live)

    async def aclose(self) -> None:
        if self._background:
            await asyncio.gather(*self._background, return_exceptions=True)
        for t in list(self._pool_tasks):
            t.cancel()
        if self._pool_tasks:
            await asyncio.gather(*self._pool_tasks, return_exceptions=True)
        for sandboxes in self._pool.values():
            for s in sandboxes:
                await s.close()
        self._pool.clear()
        for name in list(self._live):
            await self._remove(name)


async def reap(
    *, cli: str = "podman", run_id: str | None = None, older_than_s: float | None = None
) -> list[str]:
    """Remove agentrl containers by label: of one run, or older than a cutoff, or all."""
    args = [
        "ps",
        "-a",
        "--filter",
        f"label={LABEL_RUN}",
        "--format",
        f'{{{{.Names}}}}\t{{{{index .Labels "{LABEL_RUN}"}}}}\t{{{{index .Labels "{LABEL_CREATED}"}}}}',
    ]
    if run_id is not None:
        args[3] = f"label={LABEL_RUN}={run_id}"
    rc, out, err = await run_cli(cli, *args, timeout=120)
    if rc != 0:
        raise SandboxError(f"listing containers failed: {tail(err.strip(), 500)}")
    now = time.time()
    doomed = []
    for line in out.splitlines():
        parts = line.split("\t")
        if len(parts) < 3:
            continue
        name, _, created = parts[:3]
        if older_than_s is not None and created.isdigit() and now - int(created) < older_than_s:
            continue
        doomed.append(name)
    for name in doomed:
        await run_cli(cli, *rm_args(cli), name, timeout=120)
    # A compose task's network and named volumes go with its sandbox (its services, labelled like
    # it, were removed above).
    rc, out, _ = await run_cli(cli, "network", "ls", "--format", "{{.Name}}", timeout=60)
    networks = set(out.split()) if rc == 0 else set()
    for name in doomed:
        if f"{name}-net" in networks:
            await run_cli(cli, "network", "rm", "-f", f"{name}-net", timeout=120)
            rc, out, _ = await run_cli(cli, "volume", "ls", "-q", "--filter", f"name={name}-", timeout=60)
            if rc == 0 and out.split():
                await run_cli(cli, "volume", "rm", "-f", *out.split(), timeout=120)
    return doomed


def _environment_key(task: Task) -> str:
    """What a task's image depends on, cheaply: its directory, `docker_image`, and the path, size and
    modification time of every file of environment/ (an edited Dockerfile is a new key)."""
    parts = [str(task.path.resolve()), str(task.config.environment.docker_image)]
    env_dir = Path(task.environment_dir)
    if env_dir.is_dir():
        for path in sorted(env_dir.rglob("*")):
            st = path.lstat()
            parts.append(f"{path.relative_to(env_dir)}:{st.st_size}:{st.st_mtime_ns}")
    return "\n".join(parts)
