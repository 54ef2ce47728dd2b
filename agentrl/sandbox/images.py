"""Offline stand-in base images (`agentrl sandbox build-bases`, `bases list/remove`, `prune`).

No registry for base images is reachable on machines like ours. One Debian bookworm root file
system, bootstrapped with debootstrap, imported and extended with what task images commonly expect
(bash, python3 with pip and venv, ca-certificates; tmux for `open_terminal`, vim-tiny and nano for
agents that edit interactively), is built as `localhost/agentrl-base/<suite>:<recipe hash>`. It
never takes a real image's name: a task build whose `FROM` names a base that is neither local nor
pullable has that `FROM` rewritten to the stand-in (`plan_froms`), when the base's repository is one
`sandbox_images/bases.toml` lists, under any tag, digest pin or registry-mirror spelling
(`standin_key`). A label carries the hash of the recipe so re-building is a no-op until the recipe
changes; older agentrl versions tagged real names with it, which `remove_standins` undoes.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import re
import shutil
import subprocess
import tempfile
import threading
import time
import tomllib
from dataclasses import dataclass, field
from pathlib import Path

from agentrl.progress import progress_bar
from agentrl.sandbox.base import ImageBuildError, tail


class StandinError(ImageBuildError):
    """A stand-in family that does not exist, or could not be built."""


BASES_TOML = Path(__file__).resolve().parents[2] / "sandbox_images" / "bases.toml"
STANDIN_REPO = "localhost/agentrl-base"
RECIPE_LABEL = "agentrl.base-recipe"
TASK_IMAGE_REPOS = ("localhost/agentrl-task/", "localhost/agentrl-terminal/")
# What agentrl before the stand-in namespace left behind (besides the real names it tagged).
_LEGACY_STANDIN_PREFIXES = ("localhost/agentrl-base:", "localhost/agentrl-base-rootfs:")
_DOCKER_HUB = {"docker.io", "index.docker.io", "registry-1.docker.io"}
STANDIN_CONTENT = (
    "its content is Debian {suite}'s whatever the name says (Python 3.11 under python:3.12 or "
    "python:3.13, Debian's userland under ubuntu:*)"
)

# Debian's python is "externally managed" (PEP 668); python:*-slim images are not, and task
# Dockerfiles `pip install` freely. `python` and `pip` exist in those images too.
_DOCKERFILE = """\
FROM {rootfs}
ENV DEBIAN_FRONTEND=noninteractive LANG=C.UTF-8 PIP_ROOT_USER_ACTION=ignore PIP_DISABLE_PIP_VERSION_CHECK=1
RUN rm -f /usr/lib/python3*/EXTERNALLY-MANAGED \\
 && ln -sf /usr/bin/python3 /usr/local/bin/python \\
 && ln -sf /usr/bin/pip3 /usr/local/bin/pip \\
 && apt-get clean && rm -rf /var/lib/apt/lists/*
LABEL {label}={recipe}
CMD ["bash"]
"""
# A language family: the root stand-in plus Debian's packages of that language.
_FAMILY_DOCKERFILE = """\
FROM {parent}
RUN apt-get update && apt-get install -y --no-install-recommends {packages} \\
 && apt-get clean && rm -rf /var/lib/apt/lists/*
LABEL {label}={recipe}
CMD ["bash"]
"""


@dataclass(frozen=True)
class BaseRecipe:
    """One family of stand-ins. The root family is a bootstrapped Debian root file system; every
    other family is the root plus Debian packages (`parent`), built only when a task needs it."""

    suite: str
    variant: str
    mirror: str
    packages: tuple[str, ...]
    names: tuple[str, ...]
    family: str = "bookworm"
    parent: BaseRecipe | None = None
    has: str = ""  # what the language really is, in words: "Node.js 18 (Debian's nodejs, npm)"

    @property
    def dockerfile(self) -> str:
        if self.parent is None:
            return _DOCKERFILE
        return _FAMILY_DOCKERFILE.format(
            parent=self.parent.standin,
            packages=" ".join(self.packages),
            label=RECIPE_LABEL,
            recipe="{recipe}",
        )

    @property
    def digest(self) -> str:
        if self.parent is None:  # unchanged since the first recipe: a built root stays valid
            blob = json.dumps(
                [self.suite, self.variant, self.mirror, self.packages, _DOCKERFILE], sort_keys=True
            )
        else:
            blob = json.dumps([self.parent.digest, self.family, self.packages, self.dockerfile])
        return hashlib.sha256(blob.encode()).hexdigest()[:16]

    @property
    def standin(self) -> str:
        """The stand-in's own name; never a real image's."""
        return f"{STANDIN_REPO}/{self.family}:{self.digest}"

    @property
    def repositories(self) -> tuple[str, ...]:
        """The repositories the stand-in answers for, under any tag: those of `names`."""
        return tuple(dict.fromkeys(standin_key(n) for n in self.names))

    @property
    def content(self) -> str:
        if self.parent is None:
            return STANDIN_CONTENT.format(suite=self.suite)
        return f"its content is Debian {self.suite}'s: {self.has}"


@dataclass(frozen=True)
class BaseCatalog:
    """Every stand-in family of `sandbox_images/bases.toml`. Reads like the root family (its
    `standin`, `digest`, `names`) for callers that know one stand-in; `repositories` are those of
    every family, and `standin_for` picks the family of a reference."""

    root: BaseRecipe
    families: tuple[BaseRecipe, ...]  # the root first

    @property
    def standin(self) -> str:
        return self.root.standin

    @property
    def digest(self) -> str:
        return self.root.digest

    @property
    def names(self) -> tuple[str, ...]:
        return self.root.names

    @property
    def repositories(self) -> tuple[str, ...]:
        return tuple(r for family in self.families for r in family.repositories)

    @property
    def content(self) -> str:
        """The root's content, and where each language stand-in's versions are said (a warning
        names the stand-in that answered: `bookworm-node` is the node family)."""
        if len(self.families) == 1:
            return self.root.content
        names = ", ".join(f.family for f in self.families[1:])
        return (
            f"{self.root.content}; the language stand-ins ({names}) hold Debian {self.root.suite}'s "
            "version of their language, whatever the tag says (`agentrl sandbox bases list` shows it)"
        )

    def family_for(self, ref: str) -> BaseRecipe | None:
        key = standin_key(ref, self.repositories)
        return next((f for f in self.families if key in f.repositories), None)

    def family(self, name: str) -> BaseRecipe:
        for f in self.families:
            if f.family == name:
                return f
        known = ", ".join(f.family for f in self.families)
        raise StandinError(f"no stand-in family {name!r}: sandbox_images/bases.toml has {known}")


def load_recipe(path: Path | None = None) -> BaseCatalog:
    """The stand-in families: `sandbox_images/bases.toml`, or the file `AGENTRL_BASES_TOML` names
    (families of your own: the same root, more `[families.*]`)."""
    path = path or Path(os.environ.get("AGENTRL_BASES_TOML") or BASES_TOML)
    data = tomllib.loads(path.read_text(encoding="utf-8"))
    root = BaseRecipe(
        suite=data["suite"],
        variant=data["variant"],
        mirror=data["mirror"],
        packages=tuple(data["packages"]),
        names=tuple(data["names"]),
        family=data["suite"],
    )
    families = [root]
    for name, spec in (data.get("families") or {}).items():
        families.append(
            BaseRecipe(
                suite=root.suite,
                variant=root.variant,
                mirror=root.mirror,
                packages=tuple(spec["packages"]),
                names=tuple(spec["names"]),
                family=f"{root.suite}-{name}",
                parent=root,
                has=spec["has"],
            )
        )
    return BaseCatalog(root, tuple(families))


def qualified(name: str) -> str:
    """The fully qualified form podman resolves a short name to (docker.io/library/...)."""
    first = name.split("/", 1)[0]
    if "/" in name and ("." in first or ":" in first or first == "localhost"):
        return name
    return f"docker.io/{name}" if "/" in name else f"docker.io/library/{name}"


def repository(ref: str) -> str:
    """`ref` without its tag and digest, fully qualified: `python:3.12@sha256:...` ->
    `docker.io/library/python`; Docker Hub's other host names count as docker.io."""
    name = ref.split("@", 1)[0]
    slash = name.rfind("/")
    if name.rfind(":") > slash:
        name = name[: name.rfind(":")]
    name = qualified(name)
    host, _, rest = name.partition("/")
    if host not in _DOCKER_HUB:
        return name
    return f"docker.io/{rest}" if "/" in rest else f"docker.io/library/{rest}"


def standin_key(ref: str, known: tuple[str, ...] = ()) -> str:
    """The known repository `ref` names, through a registry mirror too, else its own repository.

    Mirrors keep the upstream path under a prefix of their own: `<mirror>/docker/library/debian`,
    `mirror.gcr.io/library/ubuntu`, `<mirror>/ghcr.io/laude-institute/t-bench/ubuntu-24-04`: a
    reference whose path ends with a known repository's path (after its host) names that one."""
    repo = repository(ref)
    if repo in known:
        return repo
    path = repo.split("/", 1)[1] if "/" in repo else repo
    for candidate in known:
        tail = candidate.split("/", 1)[1]
        if path == tail or path.endswith("/" + tail) or path.endswith("/" + candidate):
            return candidate
    return repo


def standin_for(ref: str, recipe: BaseCatalog | BaseRecipe) -> str | None:
    """The stand-in that serves `ref` (any tag, digest pin or mirror spelling of a known
    repository), or None."""
    if isinstance(recipe, BaseCatalog):
        family = recipe.family_for(ref)
        return family.standin if family is not None else None
    return recipe.standin if standin_key(ref, recipe.repositories) in recipe.repositories else None


# -- Dockerfile FROM lines ------------------------------------------------------------------------
_FROM = re.compile(
    r"^(?P<indent>\s*)FROM\s+(?P<flags>(?:--\S+\s+)*)(?P<image>\S+)(?P<rest>(?:\s+AS\s+(?P<alias>\S+))?\s*)$",
    re.IGNORECASE,
)
_GLOBAL_ARG = re.compile(r"^\s*ARG\s+(?P<name>\w+)(?:=(?P<value>\S*))?\s*$", re.IGNORECASE)


@dataclass(frozen=True)
class FromLine:
    """One `FROM` naming an image (not an earlier stage, not `scratch`)."""

    line: int
    written: str  # as in the Dockerfile
    image: str  # with the global ARG defaults substituted


def from_lines(text: str) -> list[FromLine]:
    """The `FROM` lines of a Dockerfile that name an image: `FROM <stage>` and `scratch` are
    skipped; `${ARG}` takes the default of a global `ARG` (one that is still unresolved is
    skipped, since no one can say which image it names)."""
    args: dict[str, str] = {}
    stages: set[str] = set()
    seen_from = False
    out: list[FromLine] = []
    for number, raw in enumerate(text.splitlines()):
        if not seen_from and (arg := _GLOBAL_ARG.match(raw)) and arg.group("value") is not None:
            args[arg.group("name")] = arg.group("value").strip("\"'")
            continue
        m = _FROM.match(raw)
        if m is None:
            continue
        seen_from = True
        written = m.group("image")
        image = re.sub(
            r"\$\{(\w+)\}|\$(\w+)", lambda v: args.get(v.group(1) or v.group(2), v.group(0)), written
        )
        is_stage = image.lower() in stages
        if m.group("alias"):
            stages.add(m.group("alias").lower())
        if is_stage:
            continue
        if image.lower() == "scratch" or "$" in image:
            continue
        out.append(FromLine(number, written, image))
    return out


def rewrite_froms(text: str, replace: dict[int, str]) -> str:
    """`text` with the image of each `FROM` on a line in `replace` swapped for the given one.
    The stage name stays; `--platform` goes, since a stand-in exists for the host's platform only."""
    lines = text.splitlines(keepends=True)
    for number, image in replace.items():
        m = _FROM.match(lines[number].rstrip("\r\n"))
        assert m is not None, lines[number]
        ending = lines[number][len(lines[number].rstrip("\r\n")) :]
        flags = " ".join(f for f in m.group("flags").split() if not f.lower().startswith("--platform"))
        lines[number] = (
            f"{m.group('indent')}FROM {flags + ' ' if flags else ''}{image}{m.group('rest')}{ending}"
        )
    return "".join(lines)


def serve_offline(text: str, cli: str = "podman") -> str:
    """`text` (a Dockerfile) with each `FROM` of a known base that is not local rewritten to the
    stand-in; for callers that never pull (test fakes of remote builders). The provider's own
    build also tries a pull first and fails clearly on an unknown base (`PodmanProvider`)."""
    recipe = load_recipe()
    replace = {
        line.line: standin
        for line in from_lines(text)
        if (standin := standin_for(line.image, recipe)) is not None and not image_exists(cli, line.image)
    }
    return rewrite_froms(text, replace) if replace else text


# -- podman -------------------------------------------------------------------------------------
def _run(cli: str, *args: str, timeout: float = 900, check: bool = True) -> subprocess.CompletedProcess[str]:
    proc = subprocess.run([cli, *args], capture_output=True, text=True, timeout=timeout)
    if check and proc.returncode != 0:
        raise ImageBuildError(
            f"{cli} {' '.join(args[:3])} failed", log_tail=tail(proc.stdout + proc.stderr, 3000)
        )
    return proc


def image_label(cli: str, image: str, label: str) -> str | None:
    proc = _run(
        cli, "image", "inspect", "--format", f'{{{{ index .Config.Labels "{label}" }}}}', image, check=False
    )
    value = proc.stdout.strip()
    return value if proc.returncode == 0 and value and value != "<no value>" else None


def image_exists(cli: str, image: str) -> bool:
    return _run(cli, "image", "inspect", image, check=False, timeout=60).returncode == 0


def _rootfs_tarball(recipe: BaseRecipe, cache: Path, log) -> Path:
    tarball = cache / f"rootfs-{recipe.suite}-{recipe.variant}-{recipe.digest}.tar"
    if tarball.exists():
        return tarball
    if shutil.which("debootstrap") is None:
        raise ImageBuildError("debootstrap is not installed: run `bash sandbox_images/setup_host.sh`")
    cache.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(prefix="agentrl-rootfs-", dir=cache) as tmp:
        root = Path(tmp) / "root"
        log(f"debootstrap --variant={recipe.variant} {recipe.suite} (about a minute)")
        proc = subprocess.run(
            [
                "debootstrap",
                f"--variant={recipe.variant}",
                f"--include={','.join(recipe.packages)}",
                recipe.suite,
                str(root),
                recipe.mirror,
            ],
            capture_output=True,
            text=True,
            timeout=1800,
        )
        if proc.returncode != 0:
            raise ImageBuildError("debootstrap failed", log_tail=tail(proc.stdout + proc.stderr, 3000))
        partial = tarball.with_suffix(".partial")
        subprocess.run(["tar", "-C", str(root), "-cf", str(partial), "."], check=True, timeout=600)
        partial.replace(tarball)
    return tarball


def _pullable(cli: str, name: str) -> bool:
    return _run(cli, "pull", "--quiet", name, check=False, timeout=120).returncode == 0


def build_standin(
    *, cli: str = "podman", recipe: BaseRecipe | None = None, cache: Path | None = None, log=print
) -> str:
    """Build the stand-in of `recipe` (default: the root family; a language family builds the
    root first) only under its own name, unless it exists with this recipe's label."""

    recipe = recipe or load_recipe().root
    cache = cache or Path(os.environ.get("AGENTRL_CACHE", Path.home() / ".cache" / "agentrl"))
    standin = recipe.standin
    if image_label(cli, standin, RECIPE_LABEL) == recipe.digest:
        return standin
    if recipe.parent is not None:
        build_standin(cli=cli, recipe=recipe.parent, cache=cache, log=log)
        log(f"building {standin}: {recipe.parent.standin} + Debian's {', '.join(recipe.packages)}")
        with progress_bar(f"build {recipe.family}", total=None):
            _build_context(cli, standin, recipe.dockerfile.format(recipe=recipe.digest))
        return standin
    with progress_bar(f"build {recipe.family}", total=3) as bar:
        bar.note("debootstrap")
        tarball = _rootfs_tarball(recipe, cache, log)
        bar.advance(note="import")
        rootfs = f"{STANDIN_REPO}/rootfs:{recipe.digest}"
        log(f"importing {tarball.name}")
        _run(cli, "import", str(tarball), rootfs)
        bar.advance(note="podman build")
        _build_context(
            cli, standin, _DOCKERFILE.format(rootfs=rootfs, label=RECIPE_LABEL, recipe=recipe.digest)
        )
        bar.advance()
    return standin


def _build_context(cli: str, tag: str, dockerfile: str) -> None:
    with tempfile.TemporaryDirectory(prefix="agentrl-base-") as ctx:
        (Path(ctx) / "Dockerfile").write_text(dockerfile)
        _run(cli, "build", "--pull=never", "--network=host", "-t", tag, ctx, timeout=1800)


_build_lock = threading.Lock()  # one stand-in build at a time, in this process
_unpullable: set[tuple[str, str]] = set()


def ensure_standins(
    dockerfile: str,
    *,
    cli: str = "podman",
    log=None,
) -> list[str]:
    """Build the stand-in families a Dockerfile needs, and only those: a family whose stand-in is
    missing is built when a `FROM` it serves names an image that is neither local nor pullable.
    Returns the stand-ins built. Blocking (run it in a thread from async code)."""
    catalog = load_recipe()
    built = []
    for line in from_lines(dockerfile):
        family = catalog.family_for(line.image)
        if family is None or image_exists(cli, family.standin) or image_exists(cli, line.image):
            continue
        if (cli, line.image) not in _unpullable:
            if _pullable(cli, line.image):
                continue
            _unpullable.add((cli, line.image))
        with _build_lock:
            if image_exists(cli, family.standin):
                continue
            say = log or logging.getLogger(__name__).warning
            say(
                f"FROM {line.written} is neither local nor pullable: building the stand-in "
                f"{family.standin} ({family.content})"
            )
            built.append(build_standin(cli=cli, recipe=family, log=log or (lambda _: None)))
    return built


def build_bases(
    *,
    cli: str = "podman",
    force_standins: bool = False,
    try_pull: bool = True,
    families: tuple[str, ...] = (),
    cache: Path | None = None,
    log=print,
) -> dict[str, str]:
    """Build the root stand-in (and the language `families` asked for; task builds build any
    other one when a task needs it) and say how each base name in their recipes will be served.
    Returns {name: "present" | "pulled" | "stand-in"}. Only the stand-ins' own names are tagged:
    a task build rewrites a `FROM` of an unavailable known base to one. `force_standins`: do not
    look for the real images (`--pull=never` builds then use a stand-in for every name not
    already present)."""
    catalog = load_recipe()
    chosen = [
        catalog.root,
        *(
            catalog.family(f if f.startswith(catalog.root.suite + "-") else f"{catalog.root.suite}-{f}")
            for f in families
        ),
    ]
    status: dict[str, str] = {}
    for recipe in dict.fromkeys(chosen):
        standin = build_standin(cli=cli, recipe=recipe, cache=cache, log=log)
        served = []
        for name in recipe.names:
            if image_exists(cli, name) and image_label(cli, name, RECIPE_LABEL) is None:
                status[name] = "present"
            elif not force_standins and try_pull and _pullable(cli, name):
                status[name] = "pulled"
            else:
                status[name] = "stand-in"
                served.append(name)
        if served:
            log(
                f"NOTE: {standin} serves the bases marked stand-in (any tag, digest pin or "
                f"registry-mirror spelling of their repositories): {recipe.content}. Where a "
                "registry is reachable, task builds use the real images."
            )
    return status


# -- listing and removal --------------------------------------------------------------------------
@dataclass
class LocalImage:
    id: str
    names: list[str]
    labels: dict[str, str]
    created: float
    containers: int

    @property
    def recipe(self) -> str | None:
        return self.labels.get(RECIPE_LABEL)


def local_images(cli: str = "podman") -> list[LocalImage]:
    proc = _run(cli, "images", "--format", "json", timeout=120)
    out: list[LocalImage] = []
    seen: set[str] = set()
    for item in json.loads(proc.stdout or "[]"):
        if item["Id"] in seen:  # podman lists an image once per name
            continue
        seen.add(item["Id"])
        out.append(
            LocalImage(
                id=item["Id"],
                names=list(item.get("Names") or []),
                labels=dict(item.get("Labels") or {}),
                created=float(item.get("Created") or 0),
                containers=int(item.get("Containers") or 0),
            )
        )
    return out


@dataclass
class StandinImage:
    name: str
    id: str
    recipe: str | None
    current: bool  # built from today's recipe
    legacy: bool  # a real name (or old-style name) an older agentrl tagged
    serves: tuple[str, ...] = field(default_factory=tuple)


def _is_ours(name: str) -> bool:
    return name.startswith(STANDIN_REPO + "/")


def _recipe_tail(cli: str, image: LocalImage) -> bool:
    """Whether `image` is a stand-in itself, not one merely built FROM it (which inherits the
    label): its two newest layers are every stand-in recipe's last lines, `LABEL
    agentrl.base-recipe=<its label>` then `CMD ["bash"]`."""
    proc = _run(cli, "history", "--no-trunc", "--format", "{{.CreatedBy}}", image.id, check=False, timeout=60)
    steps = [line.strip() for line in proc.stdout.splitlines() if line.strip()][:2]
    return (
        proc.returncode == 0
        and len(steps) == 2
        and steps[0].endswith('CMD ["bash"]')
        and steps[1].endswith(f"LABEL {RECIPE_LABEL}={image.recipe}")
    )


def list_standins(cli: str = "podman", recipe: BaseCatalog | None = None) -> list[StandinImage]:
    """Stand-ins under the namespace, and the names older agentrl versions tagged (legacy): a
    real name on a stand-in's image, or on an image that is provably a stand-in (the recipe label
    and the recipe's own last layers, `_recipe_tail`) whose repository is a known base. An image
    merely built FROM a stand-in, or a real image anyone pulled, is never listed."""
    catalog = recipe or load_recipe()
    by_digest = {f.digest: f for f in catalog.families}
    images = local_images(cli)
    standin_ids = {
        i.id for i in images if any(_is_ours(n) or n.startswith(_LEGACY_STANDIN_PREFIXES) for n in i.names)
    }
    out = []
    for image in images:
        for name in image.names:
            family = by_digest.get(image.recipe or "")
            rootfs = name == f"{STANDIN_REPO}/rootfs:{catalog.root.digest}"
            current = family is not None or rootfs
            if _is_ours(name):
                serves = family.repositories if family is not None and not rootfs else ()
                out.append(StandinImage(name, image.id, image.recipe, current, False, serves))
            elif name.startswith(_LEGACY_STANDIN_PREFIXES) or (
                image.recipe is not None
                and (
                    image.id in standin_ids
                    or (
                        standin_key(name, catalog.repositories) in catalog.repositories
                        and _recipe_tail(cli, image)
                    )
                )
            ):
                out.append(StandinImage(name, image.id, image.recipe, current, True))
    return out


def remove_standins(
    cli: str = "podman", *, legacy_only: bool = False, dry_run: bool = False
) -> tuple[list[str], list[str]]:
    """Untag every name `list_standins` finds (`legacy_only`: only the names older agentrl
    versions left). Returns (removed, failed with the reason); an image a container still uses
    is left and reported."""
    removed, failed = [], []
    for item in list_standins(cli):
        if legacy_only and not item.legacy:
            continue
        if dry_run:
            removed.append(item.name)
            continue
        proc = _run(cli, "rmi", item.name, check=False, timeout=120)
        if proc.returncode == 0:
            removed.append(item.name)
        else:
            failed.append(f"{item.name}: {tail((proc.stderr or proc.stdout).strip(), 200)}")
    return removed, failed


@dataclass
class TaskImage:
    name: str
    id: str
    created: float
    in_use: bool


def task_images(cli: str = "podman") -> list[TaskImage]:
    """Images agentrl built for tasks (and their terminal layers)."""
    return [
        TaskImage(name, image.id, image.created, image.containers > 0)
        for image in local_images(cli)
        for name in image.names
        if name.startswith(TASK_IMAGE_REPOS)
    ]


def prune_task_images(
    cli: str = "podman", *, older_than_s: float | None = None, dry_run: bool = False, now: float | None = None
) -> tuple[list[TaskImage], list[str]]:
    """Remove task images (older than `older_than_s` when given). An image a container uses, even a
    stopped one, is never touched. Returns (removed or, with `dry_run`, to be removed; failures)."""
    now = time.time() if now is None else now
    chosen = [
        image
        for image in task_images(cli)
        if not image.in_use and (older_than_s is None or now - image.created >= older_than_s)
    ]
    if dry_run:
        return chosen, []
    removed, failed = [], []
    for image in chosen:
        proc = _run(cli, "rmi", image.name, check=False, timeout=120)
        if proc.returncode == 0:
            removed.append(image)
        else:
            failed.append(f"{image.name}: {tail((proc.stderr or proc.stdout).strip(), 200)}")
    return removed, failed
