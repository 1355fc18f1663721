"""The text of a ``--dry-run`` answer (docs/access.md "Previews")."""

from __future__ import annotations

from collections.abc import Iterator

from kbd.core.identifiers import one_line
from kbd.service.preview import Preview


def preview_lines(p: Preview) -> Iterator[str]:
    yield "dry run: nothing was changed"
    if not (p.sessions or p.commands or p.consumers or p.unseen):
        yield "no session, running command or attachment would change"
        return
    for s in p.sessions:
        yield f"session {s.session_id} ({one_line(s.workflow_id)}):"
        yield from (f"  + {c.kind} {one_line(c.target, limit=300)}" for c in s.gained)
        yield from (f"  - {c.kind} {one_line(c.target, limit=300)}" for c in s.lost)
    for c in p.commands:
        yield f"command {c.pid} of session {c.session_id}: would be {c.effect}"
    for a in p.consumers:
        why = f" ({one_line(a.reason)})" if a.reason else ""
        yield f"attachment {one_line(a.workflow_id)}/{one_line(a.alias)}: would be {a.status}{why}"
    if p.unseen:
        yield f"and {p.unseen} more in workflows you cannot see"
