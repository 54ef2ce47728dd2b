"""Offline stand-in base images (`agentrl sandbox build-bases`).

No registry for base images is reachable on machines like ours. One Debian bookworm root file
system, bootstrapped with debootstrap, imported and extended with what task images commonly expect
(bash, python3 with pip and venv, ca-certificates; tmux for `open_terminal`, vim-tiny and nano for
agents that edit interactively), is tagged under every base name listed in
`sandbox_images/bases.toml`; task builds then run with `--pull=never`. A label carries the hash of
the recipe so re-running is a no-op until the recipe changes.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import subprocess
import tempfile
import tomllib
from dataclasses import dataclass
from pathlib import Path

from agentrl.sandbox.base import ImageBuildError

BASES_TOML = Path(__file__).resolve().parents[2] / "sandbox_images" / "bases.toml"
STANDIN_REPO = "localhost/agentrl-base"
RECIPE_LABEL = "agentrl.base-recipe"

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


@dataclass(frozen=True)
class BaseRecipe:
    suite: str
    variant: str
    mirror: str
    packages: tuple[str, ...]
    names: tuple[str, ...]

    @property
    def digest(self) -> str:
        blob = json.dumps([self.suite, self.variant, self.mirror, self.packages, _DOCKERFILE], sort_keys=True)
        return hashlib.sha256(blob.encode()).hexdigest()[:16]


def load_recipe(path: Path = BASES_TOML) -> BaseRecipe:
    data = tomllib.loads(path.read_text(encoding="utf-8"))
    return BaseRecipe(
        suite=data["suite"],
        variant=data["variant"],
        mirror=data["mirror"],
        packages=tuple(data["packages"]),
        names=tuple(data["names"]),
    )


def qualified(name: str) -> str:
    """The fully qualified form podman resolves a short name to (docker.io/library/...)."""
    first = name.split("/", 1)[0]
    if "/" in name and ("." in first or ":" in first or first == "localhost"):
        return name
    return f"docker.io/{name}" if "/" in name else f"docker.io/library/{name}"


def _run(cli: str, *args: str, timeout: float = 900, check: bool = True) -> subprocess.CompletedProcess[str]:
    proc = subprocess.run([cli, *args], capture_output=True, text=True, timeout=timeout)
    if check and proc.returncode != 0:
        raise ImageBuildError(
            f"{cli} {' '.join(args[:3])} failed", log_tail=(proc.stdout + proc.stderr)[-3000:]
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


def _rootfs_tarball(recipe: BaseRecipe, cache: Path, log) -> Path:  # type: ignore[no-untyped-def]
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
            raise ImageBuildError("debootstrap failed", log_tail=(proc.stdout + proc.stderr)[-3000:])
        partial = tarball.with_suffix(".partial")
        subprocess.run(["tar", "-C", str(root), "-cf", str(partial), "."], check=True, timeout=600)
        partial.replace(tarball)
    return tarball


def _pullable(cli: str, name: str) -> bool:
    return _run(cli, "pull", "--quiet", name, check=False, timeout=120).returncode == 0


def build_bases(
    *,
    cli: str = "podman",
    force_standins: bool = False,
    try_pull: bool = True,
    cache: Path | None = None,
    log=print,  # type: ignore[no-untyped-def]
) -> dict[str, str]:
    """Make every base name in the recipe resolvable locally. Returns {name: "present" | "pulled" |
    "stand-in"}. Idempotent: names already carrying this recipe's label are left alone."""
    recipe = load_recipe()
    cache = cache or Path(os.environ.get("AGENTRL_CACHE", Path.home() / ".cache" / "agentrl"))
    status: dict[str, str] = {}
    todo: list[str] = []
    for name in recipe.names:
        label = image_label(cli, name, RECIPE_LABEL)
        if label == recipe.digest:
            status[name] = "stand-in"
        elif label is None and image_exists(cli, name) and not force_standins:
            status[name] = "present"
        elif not force_standins and try_pull and _pullable(cli, name):
            status[name] = "pulled"
        else:
            todo.append(name)
    if not todo:
        return status
    standin = f"{STANDIN_REPO}:{recipe.suite}-{recipe.digest}"
    if image_label(cli, standin, RECIPE_LABEL) != recipe.digest:
        tarball = _rootfs_tarball(recipe, cache, log)
        rootfs = f"{STANDIN_REPO}-rootfs:{recipe.digest}"
        log(f"importing {tarball.name}")
        _run(cli, "import", str(tarball), rootfs)
        with tempfile.TemporaryDirectory(prefix="agentrl-base-") as ctx:
            (Path(ctx) / "Dockerfile").write_text(
                _DOCKERFILE.format(rootfs=rootfs, label=RECIPE_LABEL, recipe=recipe.digest)
            )
            _run(cli, "build", "--pull=never", "--network=host", "-t", standin, ctx, timeout=1800)
    for name in todo:
        _run(cli, "tag", standin, name)
        if qualified(name) != name:
            _run(cli, "tag", standin, qualified(name))
        status[name] = "stand-in"
    log(
        "NOTE: these base images are offline stand-ins with Debian bookworm's content "
        "(Python 3.11 even where the name says 3.12 or 3.13, Debian's userland under ubuntu:*). "
        "Where a registry is reachable, real images are pulled instead (--pull)."
    )
    return status
