"""Contributed notes: one write into an attached source's ``notes/``.

Split in two steps for the daemon: :func:`prepare` needs the session's plan
(under its state lock); :func:`commit` runs the injection gate and waits for the
source's notes mutex (outside it). :func:`write` does both for the CLI. Every
refusal is audited by :mod:`kbd.notes`.
"""

from __future__ import annotations

from dataclasses import dataclass

from kbd import notes
from kbd.core.principals import Actor
from kbd.notes import PreparedNote as PreparedNote  # re-exported: what prepare() hands to commit()
from kbd.service import JsonObject
from kbd.service.sessions import RootSessions

MAX_NOTE_BYTES = notes.MAX_NOTE_BYTES


@dataclass(frozen=True)
class NoteWritten:
    workflow_id: str  # the source whose notes/ now holds the note
    alias: str
    path: str  # relative to the source's KB root: notes/...
    bytes: int

    def to_json(self) -> JsonObject:
        return {"workflow_id": self.workflow_id, "alias": self.alias, "path": self.path, "bytes": self.bytes}


def prepare(
    sessions: RootSessions, sid: str, alias: str, relpath: str, data: bytes, *, actor: Actor
) -> PreparedNote:
    return notes.prepare_note(sessions, sid, alias, relpath, data, actor=actor)


def commit(prepared: PreparedNote) -> NoteWritten:
    r = notes.commit_note(prepared)
    return NoteWritten(r["workflow_id"], r["alias"], r["path"], r["bytes"])


def write(
    sessions: RootSessions, sid: str, alias: str, relpath: str, data: bytes, *, actor: Actor
) -> NoteWritten:
    """Write RELPATH (relative to the source's notes/) atomically, with provenance."""
    return commit(prepare(sessions, sid, alias, relpath, data, actor=actor))
