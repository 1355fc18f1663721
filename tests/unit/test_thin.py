"""The thin ``kbd exec`` client's pure parts (kbd/client/brokered.py): its copy of the
default root and of the boundary's error lines must never drift from the
originals, and the request it sends is the wire codec's."""

from __future__ import annotations

import os
import socket
import time
from pathlib import Path

import pytest

from kbd.client import brokered as thin
from kbd.core import wire
from kbd.core.config import default_root
from kbd.errors import PermissionDenied, render

ENVS = [
    {"KBD_ROOT": "/srv/kbd", "HOME": "/home/a"},
    {"XDG_DATA_HOME": "/data", "HOME": "/home/a"},
    {"XDG_DATA_HOME": "relative", "HOME": "/home/a"},
    {"KBD_ROOT": "", "HOME": "/home/b"},
    {"HOME": "/home/c"},
]


@pytest.mark.parametrize("env", ENVS)
def test_default_root_is_the_configs(env: dict[str, str]) -> None:
    assert thin.default_root(env) == str(default_root(env))


@pytest.mark.parametrize("hint", ["", "ask an owner"])
def test_errors_print_exactly_as_the_boundary_prints_them(
    capsys: pytest.CaptureFixture[str], hint: str
) -> None:
    err = PermissionDenied("no way", hint=hint or None)
    render.print_error(err)
    expected = capsys.readouterr().err
    thin.print_error(err.code, err.message, err.hint or "")
    assert capsys.readouterr().err == expected


def test_the_request_is_the_wire_codecs() -> None:
    data = thin.request_bytes("s_1", ["sh", b"-c\xff", "x"], cwd="sub", as_principal="ops", root="/r",
                              env={"LANG": "C", "HOME": "/x"}, token="t0k")  # fmt: skip
    head = wire.parse_request_head(data)
    assert head is not None and head.headers["authorization"] == "Bearer t0k"
    assert wire.decode_request(data[head.size :]) == wire.Request(
        "s_1", [b"sh", b"-c\xff", b"x"], cwd=b"sub", env={"LANG": "C"}, as_principal="ops", root=b"/r"
    )


def test_a_daemon_that_accepts_and_never_answers_is_refused_not_waited_for(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A listener that takes the request and says nothing (hung daemon, a stray
    program on the socket): the client gives up with 69 and a specific message,
    instead of hanging the agent's command forever."""
    monkeypatch.setattr(thin, "ANSWER_TIMEOUT", 0.3)
    path = str(tmp_path / "kbd.sock")
    with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as listener:
        listener.bind(path)
        listener.listen(1)
        with open(os.devnull, "rb") as null_in, open(os.devnull, "wb") as null_out:
            stdio = (null_in.fileno(), null_out.fileno(), null_out.fileno())
            start = time.monotonic()
            with pytest.raises(thin.Refused) as refused:
                thin.call(path, "s_1", ["/bin/true"], stdio=stdio)
        took = time.monotonic() - start
    assert refused.value.exit_code == 69 and refused.value.code == "unavailable"
    assert refused.value.message == "the kbd daemon did not answer within 0.3 s; nothing was run"
    assert took < 5
