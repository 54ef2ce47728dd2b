"""Which agent commands podman's session shell may run without saving a snapshot: only those whose
text shows they cannot change the shell's state (`_stateless_words`). A wrong "stateless" loses
the agent's `cd` or `export` the next time a command is killed, so the rule errs towards saving."""

from __future__ import annotations

import pytest

from agentrl.sandbox.podman.shell import _stateless_words


@pytest.mark.parametrize(
    ("cmd", "words"),
    [
        ("echo 7", ["echo"]),
        ("ls -la /tmp | head -n 3", ["ls", "head"]),
        ("python3 x.py > out.txt 2>&1", ["python3", "1"]),  # `1` of `2>&1`: one more name checked
        ("grep -rn 'a b' src && echo ok", ["grep", "echo"]),
        ("ls --color=auto *.py", ["ls"]),
        ("sleep 10 &", ["sleep"]),
    ],
)
def test_plain_commands_skip_the_save_after_checking_their_command_words(cmd: str, words: list[str]) -> None:
    assert _stateless_words(cmd) == words


@pytest.mark.parametrize(
    "cmd",
    [
        "cd /tmp",
        "export X=1",
        "X=1",
        "FOO=1 ls",  # an assignment word first
        "echo $HOME",  # any expansion
        "echo `cd /`",
        "x=$(date)",
        "ls; (cd /)",
        "echo a; export X=1",
        "echo a | cd /",
        "ls\ncd /",  # a newline separates commands
        "time cd /",
        "! cd /",
        "\\cd /",
        "'cd' /",
        '"cd" /',
        "c? /",  # a glob in the command word could name anything
        "printf -v X 1",
        "read X",
        "source env.sh",
        ". env.sh",
        "eval cd /",
        "exec bash",
        "set -e",
        "shopt -s extglob",
        "alias ll=ls",
        "unset X",
        "declare -a a",
        "trap '' INT",
        "umask 027",
        "pushd /tmp",
        "if true; then cd /; fi",
        "for i in 1; do cd /; done",
        "{ cd /; }",
        "cat <<EOF",
        "ls # cd /",
    ],
)
def test_anything_that_can_change_the_shell_always_saves(cmd: str) -> None:
    assert _stateless_words(cmd) is None
