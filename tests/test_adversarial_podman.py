"""The adversarial suite on real podman sandboxes: every known forgery, breakage and resource attack,
sent by a scripted model through the real agent loop, episode runner and verifier.

Each attack must end as reward 0 (an ordinary failed episode) or a policy failure with its cause,
never an infrastructure failure (which would be a re-roll) and never an exception out of the
episode; the run survives (an honest episode afterwards still scores 1) and nothing is left
running. The tasks are in `tests/fixtures/adversarial/` (see its README).
"""

from __future__ import annotations

import asyncio
import json
import os
import shutil
import subprocess
import uuid
from pathlib import Path

import pytest

from agentrl.agent.loop import AgentConfig
from agentrl.agent.tokens import ChatRenderer
from agentrl.engine.base import SamplingParams
from agentrl.engine.scripted import ScriptedEngine
from agentrl.episode.run import EpisodeConfig, EpisodeResult, run_episode
from agentrl.episode.sample import Status
from agentrl.episode.verify import verify
from agentrl.errors import TaskFormatError
from agentrl.sandbox.podman import LABEL_RUN, PodmanProvider, run_cli
from agentrl.tasks.task import MAX_INSTRUCTION_BYTES, load_task
from tests.chat_tokenizer import byte_tokenizer

FIXTURES = Path(__file__).parent / "fixtures" / "adversarial"
GUARDED = FIXTURES / "guarded-hello"
CLI = os.environ.get("AGENTRL_CONTAINER_CLI", "podman")

pytestmark = [
    pytest.mark.container,
    pytest.mark.skipif(shutil.which(CLI) is None, reason=f"{CLI} is not installed"),
]

HONEST = ["echo hello > /app/out.txt"]
FAIL = ("fail", None)  # verified as usual: the attack gained nothing
CODE = ("tampered", "agent_code")  # the verifier ran code the agent made: provenance caught it


def script(path: str, *lines: str) -> str:
    """A command that writes `lines` to `path` (one printf, no here-document)."""
    quoted = " ".join("'" + line.replace("'", "'\\''") + "'" for line in lines)
    return f"printf '%s\\n' {quoted} > {path}"


def survivor(*loop: str) -> list[str]:
    """Commands that leave a *listening* process behind (one the verifier keeps, as it would a
    service the task asked for) running `loop` every 10 ms."""
    return [
        script(
            "/tmp/s.py",
            "import glob, os, socket, time",
            "s = socket.socket(); s.bind(('127.0.0.1', 8123)); s.listen()",
            "while True:",
            *(f"    {line}" for line in loop),
            "    time.sleep(0.01)",
        ),
        "nohup python3 /tmp/s.py >/dev/null 2>&1 & sleep 0.5",
    ]


def forge(path: str, value: str = "1") -> str:
    return f"    try: os.makedirs(os.path.dirname({path!r}), exist_ok=True); open({path!r}, 'w').write({value!r})"


PYTHON_EXIT_0 = "import os; os._exit(0)"

# (name, the model's commands, (verifier outcome, failure cause)). None scores more than 0; the
# attacks are grouped by kind, several variants each, none of them named by any check.
ATTACKS = [
    # -- a process the agent started lives on into verification ----------------------------------
    (
        "background loop rewrites the reward while the tests run",
        [
            "(while :; do mkdir -p /logs/verifier; echo 1 > /logs/verifier/reward.txt; sleep 0.02; done)"
            " >/dev/null 2>&1 &",
            "setsid bash -c 'while :; do echo 1 > /logs/verifier/reward.txt; sleep 0.02; done'"
            " >/dev/null 2>&1 </dev/null &",
        ],
        FAIL,
    ),
    (
        "a kept service rewrites /logs/verifier/reward.txt",
        survivor(forge("/logs/verifier/reward.txt"), "    except OSError: pass"),
        FAIL,
    ),
    (
        "a kept service writes the reward through /proc/*/root",
        survivor(
            "for p in glob.glob('/proc/[0-9]*/root/logs/verifier'):",
            "    try: open(p + '/reward.txt', 'w').write('1')",
            "    except OSError: pass",
        ),
        FAIL,
    ),
    (
        "a kept service answers the tests' own file with a passing one",
        survivor(
            "for p in ['/tests/test_outputs.py'] + glob.glob('/proc/[0-9]*/root/tests/test_outputs.py'):",
            "    try: open(p, 'w').write('def test_ok():\\n    pass\\n')",
            "    except OSError: pass",
        ),
        FAIL,
    ),
    (
        "a kept service rewrites the test harness while the tests run",
        survivor(
            "try: open('/opt/harness/pytest.py', 'w').write('import os; os._exit(0)')",
            "except OSError: pass",
        ),
        CODE,
    ),
    (
        "a kept service writes an out-of-range reward (an agent-made re-roll)",
        survivor(forge("/logs/verifier/reward.txt", "7"), "    except OSError: pass"),
        FAIL,
    ),
    # -- the verifier's own commands resolve through the container -------------------------------
    (
        "a python3 earlier on PATH",
        ["printf '#!/bin/sh\\nexit 0\\n' > /usr/local/bin/python3; chmod +x /usr/local/bin/python3"],
        CODE,
    ),
    (
        "the interpreter itself replaced (python3.11)",
        ["cp /bin/true /tmp/t && mv /tmp/t /usr/bin/python3.11"],
        CODE,
    ),
    (
        "test.sh's own shell replaced (/usr/bin/bash)",
        [
            script("/tmp/b", "#!/bin/sh", "echo 1 > /logs/verifier/reward.txt")
            + " && chmod +x /tmp/b && mv /tmp/b /usr/bin/bash"
        ],
        CODE,
    ),
    (
        "a library preloaded into every program (/etc/ld.so.preload)",
        [
            'cp "$(ls /usr/lib/x86_64-linux-gnu/libz.so.* /lib/x86_64-linux-gnu/libz.so.* 2>/dev/null | head -1)"'
            " /usr/local/lib/libhook.so && echo /usr/local/lib/libhook.so > /etc/ld.so.preload"
        ],
        CODE,
    ),
    (
        "replaced /usr/bin/cat (a tool the verifier never runs)",
        ["printf '#!/bin/sh\\necho 1\\n' > /usr/bin/cat"],
        FAIL,
    ),
    # -- the Python the tests run in, changed through paths no check lists -----------------------
    (
        "a .pth file on the system Python's path",
        [
            "mkdir -p /usr/local/lib/python3.11/dist-packages && "
            + script("/usr/local/lib/python3.11/dist-packages/zz.pth", PYTHON_EXIT_0)
        ],
        CODE,
    ),
    (
        "usercustomize in the verifying user's own site directory",
        [
            "d=$(python3 -m site --user-site) && mkdir -p $d && "
            + script("$d/usercustomize.py", PYTHON_EXIT_0),
        ],
        CODE,
    ),
    (
        "a zipped standard library ahead of the real one (python311.zip)",
        [
            "cd /tmp && "
            + script("traceback.py", PYTHON_EXIT_0)
            + " && python3 -m zipfile -c /usr/lib/python311.zip traceback.py && cd /app",
        ],
        CODE,
    ),
    (
        "sitecustomize.py on the system Python's path",
        [
            "d=$(python3 -c 'import site; print(site.getsitepackages()[0])'); mkdir -p $d;"
            " printf 'import os\\nos._exit(0)\\n' > $d/sitecustomize.py"
        ],
        {FAIL, CODE},  # Debian's own sitecustomize comes first on this image: harmless, or caught
    ),
    (
        "pytest.py in the working directory",
        ["printf 'import sys\\nsys.exit(0)\\n' > /app/pytest.py"],
        CODE,
    ),
    (
        "a standard-library module shadowed from the working directory",
        [script("/app/traceback.py", PYTHON_EXIT_0)],
        CODE,
    ),
    (
        "the harness's byte code planted in __pycache__",
        [
            'mkdir -p /opt/harness/__pycache__ && python3 -c "import py_compile, pathlib;'
            " pathlib.Path('/tmp/p.py').write_text('import os; os._exit(0)');"
            " py_compile.compile('/tmp/p.py', '/opt/harness/__pycache__/pytest.cpython-311.pyc')\"",
        ],
        FAIL,  # never read: the verifier's byte code lives elsewhere (VERIFIER_PYTHON_ENV)
    ),
    (
        "conftest.py planted in /tests",
        ["mkdir -p /tests && printf 'import os\\nos._exit(0)\\n' > /tests/conftest.py"],
        FAIL,
    ),
    # -- the verifier's inputs damaged before verification ---------------------------------------
    ("/tests/test.sh made a directory", ["mkdir -p /tests/test.sh"], FAIL),
    ("/logs made a file", ["rm -rf /logs && echo x > /logs"], FAIL),
    ("/logs a link to the root", ["rm -rf /logs && ln -s / /logs"], FAIL),
    ("/tests a link to /etc", ["rm -rf /tests && ln -s /etc /tests"], FAIL),
    ("/tmp cleaned", ["rm -rf /tmp/* /tmp/.[!.]*", "echo still works"], FAIL),
    # `$$` is the agent's own session shell: killing or stopping it loses nothing but the session
    # since the last command (the next one starts a new one from the last snapshot). `$PPID` is
    # the framing shell that talks to the host.
    ("session shell killed", ["kill -9 $$", "echo still works"], FAIL),
    ("shell killed", ["kill -9 $PPID"], ("tampered", "shell_killed")),
    ("every process killed", ["kill -9 -1"], ("tampered", "shell_killed")),
    ("shell stopped", ["kill -STOP $PPID"], ("tampered", "shell_unresponsive")),
    (
        "garbage on the shell's stdout",
        ["printf 'garbage\\n' > /proc/$PPID/fd/1"],
        ("tampered", "shell_protocol"),
    ),
    (
        "forged frame header",
        [
            "printf '__AGENTRL_%s 0 0 0 0 0 0 0 0\\n' $(od -An -tx1 -N16 /dev/urandom | tr -d ' \\n') > /proc/$PPID/fd/1; sleep 0.3"
        ],
        ("tampered", "shell_protocol"),
    ),
    (
        "40 MB without a newline on the shell's stdout",
        ["head -c 40000000 /dev/zero | tr '\\0' a > /proc/$PPID/fd/1"],
        ("tampered", "shell_protocol"),
    ),
    # The bomb outlives its command; when its noise needs a fork to report and none is free, the
    # shell stops answering (a policy failure); otherwise the episode is verified (and fails).
    ("fork bomb", ["bomb() { bomb | bomb & }; bomb; sleep 3"], {FAIL, ("tampered", "shell_unresponsive")}),
]


def episode_config() -> EpisodeConfig:
    return EpisodeConfig(
        action_format="fenced-bash",
        agent=AgentConfig(max_turns=8, command_timeout_s=10),
        sampling=SamplingParams(max_new_tokens=512),
    )


def fenced(cmd: str) -> str:
    return f"```bash\n{cmd}\n```"


async def episode(provider: PodmanProvider, commands: list[str], run_id: str, task=None) -> EpisodeResult:  # type: ignore[no-untyped-def]
    tok = byte_tokenizer()
    engine = ScriptedEngine([*(fenced(c) for c in commands), "TASK_COMPLETE"], tok)
    return await run_episode(
        task or load_task(GUARDED),
        provider=provider,
        engine=engine,
        renderer=ChatRenderer(tok),
        config=episode_config(),
        run_id=run_id,
    )


def containers(run_id: str) -> list[str]:
    out = subprocess.run(
        [CLI, "ps", "-a", "--filter", f"label={LABEL_RUN}={run_id}", "--format", "{{.Names}}"],
        capture_output=True,
        text=True,
        check=True,
    )
    return out.stdout.split()


@pytest.fixture
def run_id() -> str:
    return f"adv-{uuid.uuid4().hex[:8]}"


@pytest.fixture
async def provider(run_id: str):  # type: ignore[no-untyped-def]
    p = PodmanProvider(cli=CLI, shell_grace_s=3)
    yield p
    await p.aclose()
    assert p.live_sandboxes() == 0
    assert containers(run_id) == []  # nothing left running


async def test_the_honest_episode_scores_one(provider: PodmanProvider, run_id: str) -> None:
    """The control: the same task and loop score 1 when the work is done, so reward 0 below is the
    attack failing, not the suite."""
    result = await episode(provider, HONEST, run_id)
    assert result.episode.reward == 1.0 and result.episode.status is Status.COMPLETED


@pytest.mark.parametrize(("name", "commands", "expected"), ATTACKS, ids=[a[0] for a in ATTACKS])
async def test_attack_scores_zero_and_the_run_goes_on(
    provider: PodmanProvider, run_id: str, name: str, commands: list[str], expected: object
) -> None:
    result = await episode(provider, commands, run_id)
    assert not Path("/verifier").exists()  # nothing followed the agent's links out to the host
    assert result.verify is not None
    outcome, cause = result.verify.outcome, result.verify.cause
    assert (outcome, cause) in (expected if isinstance(expected, set) else {expected}), result.verify.error
    assert result.episode.reward == 0.0
    if outcome == "tampered":
        assert result.episode.status is Status.FAILED_POLICY and result.episode.failure_cause == cause
    # The run survives: the same provider still scores honest work.
    again = await episode(provider, HONEST, run_id)
    assert again.episode.reward == 1.0


async def test_fork_bomb_orphans_are_reaped_and_defaults_apply(provider: PodmanProvider, run_id: str) -> None:
    task = load_task(FIXTURES / "small-disk")  # silent about cpus and memory
    async with await provider.create(task, run_id=run_id) as sb:
        info = (
            await run_cli(
                CLI,
                "inspect",
                "--format",
                "{{.HostConfig.Memory}} {{.HostConfig.NanoCpus}} {{.HostConfig.PidsLimit}}",
                sb.sandbox_id,
            )
        )[1]
        assert info.split() == [str(2048 * 2**20), str(10**9), "1024"]
        res = await sb.exec("bomb() { bomb | bomb & }; bomb; sleep 3", timeout=2)
        assert res.timed_out
        zombies = "grep -l '^State:[[:space:]]*Z' /proc/[0-9]*/status 2>/dev/null | wc -l"
        for _ in range(40):
            count = await sb.exec(zombies, timeout=30)
            if count.stdout.strip() == "0":
                break
            await asyncio.sleep(0.25)
        assert count.stdout.strip() == "0"  # PID 1 reaps what the bomb left behind
        assert (await sb.exec("echo alive")).stdout == "alive\n"


async def test_storage_limit_is_enforced_as_a_policy_failure(provider: PodmanProvider, run_id: str) -> None:
    task = load_task(FIXTURES / "small-disk")  # storage_mb = 100
    result = await episode(
        provider, ["head -c 300000000 /dev/zero > /app/fill; sleep 5", "echo more"], run_id, task=task
    )
    assert result.episode.reward == 0.0 and result.episode.status is Status.FAILED_POLICY
    assert result.episode.failure_cause == "storage_exceeded"


async def test_host_proxy_variables_never_reach_the_sandbox(
    provider: PodmanProvider, run_id: str, monkeypatch
) -> None:
    monkeypatch.setenv("HTTP_PROXY", "http://user:secret@proxy.invalid:3128")
    monkeypatch.setenv("https_proxy", "http://user:secret@proxy.invalid:3128")
    async with await provider.create(load_task(GUARDED), run_id=run_id) as sb:
        res = await sb.exec("env; cat /proc/1/environ | tr '\\0' '\\n'")
    assert "secret" not in res.stdout and "proxy" not in res.stdout.lower()


async def test_reward_out_of_range_is_a_verifier_error_with_the_value(
    provider: PodmanProvider, run_id: str, tmp_path: Path
) -> None:
    task_dir = tmp_path / "seven"
    shutil.copytree(GUARDED, task_dir)
    (task_dir / "tests" / "test.sh").write_text("#!/bin/bash\necho 7 > /logs/verifier/reward.txt\n")
    task = load_task(task_dir)
    async with await provider.create(task, run_id=run_id) as sb:
        res = await verify(sb, task)
    assert (
        res.outcome == "verifier-error" and res.cause == "reward_out_of_range" and "7.0" in (res.error or "")
    )


async def test_oversized_instruction_is_refused_with_a_task_error(
    provider: PodmanProvider, run_id: str, tmp_path: Path
) -> None:
    task_dir = tmp_path / "huge"
    shutil.copytree(GUARDED, task_dir)
    (task_dir / "instruction.md").write_text("x" * (MAX_INSTRUCTION_BYTES + 1))
    task = load_task(task_dir)
    assert any("over the" in w for w in task.validate())  # lint warns
    with pytest.raises(TaskFormatError, match="cap"):
        await episode(provider, HONEST, run_id, task=task)
    assert provider.live_sandboxes() == 0


async def test_a_listening_service_survives_verification_other_processes_do_not(
    provider: PodmanProvider, run_id: str
) -> None:
    """Tasks may ask for a service the tests talk to; everything else the agent left is killed."""
    async with await provider.create(load_task(GUARDED), run_id=run_id) as sb:
        await sb.exec(
            "python3 -m http.server 8011 --bind 127.0.0.1 >/dev/null 2>&1 & "
            "(while :; do sleep 0.05; done) >/dev/null 2>&1 & "
            "setsid bash -c 'while :; do sleep 0.05; done' >/dev/null 2>&1 </dev/null & sleep 1"
        )
        await sb.stop_processes()
        ps = await sb.exec("ps -eo pid,args")
        assert "http.server 8011" in ps.stdout
        assert "while" not in ps.stdout and "sleep 0.05" not in ps.stdout
        probe = "python3 -c \"import urllib.request; print(urllib.request.urlopen('http://127.0.0.1:8011/').status)\""
        assert (await sb.exec(probe, timeout=30)).stdout == "200\n"


def terminus(keys: str, done: bool = False) -> str:
    return json.dumps(
        {
            "analysis": "",
            "plan": "",
            "commands": [{"keystrokes": keys, "duration": 0.5}],
            "task_complete": done,
        }
    )


@pytest.mark.parametrize(
    ("keys", "status", "cause"),
    [
        ("kill -STOP $(pgrep tmux)\n", Status.FAILED_POLICY, "terminal_broken"),
        ("tmux kill-server\n", Status.COMPLETED, None),  # the session ended: verified as it is
        ("exit\n", Status.COMPLETED, None),
    ],
)
async def test_the_terminal_server_stopped_or_killed_is_the_agents_doing_never_an_exception(
    provider: PodmanProvider, run_id: str, keys: str, status: Status, cause: str | None
) -> None:
    tok = byte_tokenizer()
    engine = ScriptedEngine([terminus(keys), terminus("", True), terminus("", True)], tok)
    config = EpisodeConfig(
        action_format="terminus-json",
        agent=AgentConfig(max_turns=4, command_timeout_s=10),
        sampling=SamplingParams(max_new_tokens=2048),
    )
    result = await run_episode(
        load_task(GUARDED),
        provider=provider,
        engine=engine,
        renderer=ChatRenderer(tok),
        config=config,
        run_id=run_id,
    )
    assert (result.episode.status, result.episode.failure_cause) == (status, cause)
    assert result.episode.reward == 0.0


async def test_the_verification_writing_past_the_storage_limit_is_stopped_and_the_agents_doing(
    provider: PodmanProvider, run_id: str, tmp_path: Path
) -> None:
    """The tests run the agent's programs; one that fills the verifier's own layer is stopped
    when it passes the task's storage limit, never left to fill the host's disk."""
    task_dir = tmp_path / "fills"
    shutil.copytree(GUARDED, task_dir)
    toml = task_dir / "task.toml"
    toml.write_text(toml.read_text().replace("storage_mb = 1024", "storage_mb = 100"))
    (task_dir / "tests" / "test.sh").write_text(
        "#!/bin/bash\nbash /app/fill.sh\necho 1 > /logs/verifier/reward.txt\n"
    )
    fill = script("/app/fill.sh", "dd if=/dev/zero of=/var/tmp/big bs=1M count=2000 2>/dev/null; sleep 30")
    result = await episode(provider, [fill], run_id, task=load_task(task_dir))
    assert result.verify is not None
    assert (result.verify.outcome, result.verify.cause) == ("tampered", "storage_exceeded"), (
        result.verify.error
    )
    assert result.episode.reward == 0.0


async def test_code_put_back_after_the_tests_loaded_the_agents_version_is_still_tampering(
    provider: PodmanProvider, run_id: str, tmp_path: Path
) -> None:
    """A kept service swaps the harness for its own, waits for the tests to load it, then writes
    the original back (same content as the image's): what the tests ran is judged, not what is
    left. The task's test.sh lingers 3 s after the tests, so the original is back by the end."""
    task_dir = tmp_path / "lingers"
    shutil.copytree(GUARDED, task_dir)
    test_sh = task_dir / "tests" / "test.sh"
    test_sh.write_text(test_sh.read_text() + "sleep 3\n")
    commands = survivor(
        "if 'orig' not in dir():",
        "    orig = open('/opt/harness/pytest.py').read(); open('/opt/harness/pytest.py', 'w').write('import os; os._exit(0)'); t0 = time.time()",
        "if time.time() - t0 > 2 and orig: open('/opt/harness/pytest.py', 'w').write(orig); orig = ''",
    )
    result = await episode(provider, commands, run_id, task=load_task(task_dir))
    assert result.verify is not None
    assert (result.verify.outcome, result.verify.cause) == CODE, result.verify.error
    assert "/opt/harness/pytest.py" in (result.verify.error or "")


async def test_a_sparse_reward_file_and_hostile_output_stay_bounded_and_printable(
    provider: PodmanProvider, run_id: str, tmp_path: Path
) -> None:
    """The tests run an agent program that makes the reward file a 100 GiB sparse file and prints
    escape sequences and invalid UTF-8: the reward is refused after reading 64 KiB (no copy of
    the rest), and what reaches records and logs is bounded and printable."""
    task_dir = tmp_path / "sparse"
    shutil.copytree(GUARDED, task_dir)
    (task_dir / "tests" / "test.sh").write_text("#!/bin/bash\nbash /app/run.sh\n")
    run = script(
        "/app/run.sh",
        "truncate -s 100G /logs/verifier/reward.txt",
        "head -c 10000000 /dev/zero | tr '\\0' x",
        "printf '\\033]0;owned\\007\\033[2J\\377\\376 done\\n'",
    )
    result = await episode(provider, [run], run_id, task=load_task(task_dir))
    vres = result.verify
    assert vres is not None and vres.outcome == "verifier-error" and result.episode.reward == 0.0
    assert "too large" in (vres.error or "")
    assert "done" in vres.log_tail and "\\x1b" in vres.log_tail  # shown escaped
    assert "\x1b" not in vres.log_tail and "\x07" not in vres.log_tail and len(vres.log_tail) <= 3100
    assert vres.duration_s < 30


@pytest.mark.parametrize(
    ("commands", "expected"),
    [
        (
            ["printf '#!/bin/sh\\nexit 0\\n' > /usr/local/bin/python3; chmod +x /usr/local/bin/python3"],
            ("tampered", "system_files"),
        ),
        (["printf 'import sys\\nsys.exit(0)\\n' > /app/pytest.py"], ("tampered", "system_files")),
        (["rm -rf /logs && ln -s / /logs"], FAIL),
    ],
    ids=["python3 on PATH", "pytest.py in the working directory", "/logs a link to the root"],
)
async def test_without_private_verification_the_listed_checks_still_hold(
    run_id: str, commands: list[str], expected: tuple[str, str | None]
) -> None:
    """Rootless podman or docker (or `private_verification=False`): the tests run inside the
    sandbox after the `podman diff` scan of the listed system paths."""
    provider = PodmanProvider(cli=CLI, shell_grace_s=3, private_verification=False)
    try:
        result = await episode(provider, commands, run_id)
    finally:
        await provider.aclose()
    assert result.verify is not None
    assert (result.verify.outcome, result.verify.cause) == expected, result.verify.error
    assert not Path("/verifier").exists()
