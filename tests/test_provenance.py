"""The provenance rule (`agentrl.sandbox.provenance.agent_code`) on its own: which agent-made files
the verifier used make an episode `tampered`. The podman backend that reports them is exercised in
`tests/test_adversarial_podman.py` and `tests/test_provenance_podman.py`."""

from __future__ import annotations

import pytest

from agentrl.sandbox.provenance import Opened, agent_code, is_code, module_name


@pytest.mark.parametrize(
    ("path", "executed", "code"),
    [
        ("/usr/local/bin/tool", True, True),  # any program executed, whatever its name
        ("/usr/lib/python3/dist-packages/x.pth", False, True),
        ("/usr/lib/x86_64-linux-gnu/libhook.so.1.2", False, True),
        ("/root/.local/lib/python3.11/site-packages/usercustomize.py", False, True),
        ("/usr/lib/python311.zip", False, True),
        ("/app/out.txt", False, False),  # data the tests read is the agent's work
        ("/etc/passwd", False, False),
    ],
)
def test_code_is_what_runs_or_loads(path: str, executed: bool, code: bool) -> None:
    assert is_code(Opened(path, executed)) is code


def test_module_names_of_working_directory_files() -> None:
    assert module_name("/app/json.py", "/app") == "json"
    assert module_name("/app/pytest/__init__.py", "/app") == "pytest"
    assert module_name("/app/_speedups.cpython-311-x86_64-linux-gnu.so", "/app") == "_speedups"
    assert module_name("/app/run.sh", "/app") is None
    assert module_name("/app/notes.txt", "/app") is None


def test_graded_work_is_allowed_unless_it_shadows_what_the_verifier_provides() -> None:
    opened = [Opened("/app/solution.py"), Opened("/app/run.sh", True), Opened("/app/json.py")]
    assert agent_code(opened, workdir="/app", provided={"json"}.__contains__) == ["/app/json.py"]
    assert agent_code(opened, workdir="/app") == []


def test_code_outside_the_work_is_tampering_unless_the_solution_installs_it() -> None:
    opened = [
        Opened("/usr/bin/greet", True),
        Opened("/usr/lib/python3/dist-packages/evil.py"),
        Opened("/srv/data.csv"),
    ]
    assert agent_code(opened, workdir="/app") == ["/usr/bin/greet", "/usr/lib/python3/dist-packages/evil.py"]
    assert agent_code(opened, workdir="/app", trusted={"/usr/bin/greet"}) == [
        "/usr/lib/python3/dist-packages/evil.py"
    ]


def test_a_working_directory_of_root_exempts_nothing() -> None:
    assert agent_code([Opened("/usr/bin/python3", True)], workdir="/") == ["/usr/bin/python3"]
    assert agent_code([Opened("/usr/bin/python3", True)], workdir=None) == ["/usr/bin/python3"]
