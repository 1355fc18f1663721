"""Which sandbox layer `kbd exec` uses, and that it refuses (exit 69) when this
host has none. The host here has both layers, so their absence is simulated by
replacing the two probes (the only fakes in the sandbox tests)."""

from __future__ import annotations

import pytest

from kbd.errors import Unavailable
from kbd.sandbox import bwrap
from kbd.service import execute
from tests.helpers import OPERATOR, KbRoot


def set_backend(kb: KbRoot, backend: str, *, unsafe_none: bool = False) -> None:
    cfg = kb.root / "kbd.yaml"
    text = cfg.read_text().replace("backend: auto", f"backend: {backend}")
    if unsafe_none:
        text = text.replace("unsafe_no_sandbox: false", "unsafe_no_sandbox: true")
    cfg.write_text(text)


def test_auto_prefers_bubblewrap_then_landlock(kb: KbRoot, monkeypatch: pytest.MonkeyPatch) -> None:
    assert execute.choose_backend(kb.host()) == "bwrap"
    monkeypatch.setattr(bwrap, "bwrap_path", lambda: None)
    assert execute.choose_backend(kb.host()) == "landlock"


def test_no_usable_layer_refuses_with_69(kb: KbRoot, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(bwrap, "bwrap_path", lambda: None)
    monkeypatch.setattr(execute, "landlock_abi", lambda: 0)
    with pytest.raises(Unavailable, match="no sandbox layer is usable") as info:
        execute.choose_backend(kb.host())
    assert info.value.exit_code == 69
    kb.workflow("con", access={"owners": ["alice"]})
    h = kb.host()
    from kbd.service import sessions as session_ops
    from kbd.service.sessions import RootSessions

    sid = str(
        session_ops.open_session(
            RootSessions(h), "con", actor=h.actor("alice"), kind="reviewer_strategic"
        ).session_id
    )
    with pytest.raises(Unavailable):
        execute.run(kb.root, sid, ["true"], actor=OPERATOR)


def test_explicit_bwrap_without_bwrap_refuses(kb: KbRoot, monkeypatch: pytest.MonkeyPatch) -> None:
    set_backend(kb, "bwrap")
    monkeypatch.setattr(bwrap, "bwrap_path", lambda: None)
    with pytest.raises(Unavailable, match="bubblewrap is not installed"):
        execute.choose_backend(kb.host())


def test_unsafe_no_sandbox_is_explicit_and_warns(
    kb: KbRoot, monkeypatch: pytest.MonkeyPatch, capfd: pytest.CaptureFixture[str]
) -> None:
    set_backend(kb, "auto", unsafe_none=True)
    monkeypatch.setattr(bwrap, "bwrap_path", lambda: None)
    monkeypatch.setattr(execute, "landlock_abi", lambda: 0)
    assert execute.choose_backend(kb.host()) == "none"
    kb.workflow("con", access={"owners": ["alice"]})
    h = kb.host()
    from kbd.service import sessions as session_ops
    from kbd.service.sessions import RootSessions

    sid = str(
        session_ops.open_session(
            RootSessions(h), "con", actor=h.actor("alice"), kind="reviewer_strategic"
        ).session_id
    )
    for _ in range(2):
        assert execute.run(kb.root, sid, ["true"], actor=OPERATOR) == 0
        assert "WARNING: unsafe_no_sandbox" in capfd.readouterr().err
