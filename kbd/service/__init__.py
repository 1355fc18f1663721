"""The one operations layer: every product operation, for every interface.

The CLI (:mod:`kbd.cli.commands`), the HTTP API (:mod:`kbd.daemon.routes`) and any future
interface (an MCP server, a builder UI) only parse their input, call a function
here, and render its result: text for people, or ``to_json()`` — which *is* the JSON shape of docs/cli.md
"JSON shapes" — for ``--json`` and HTTP.

Every operation takes an explicit actor (a :class:`kbd.core.principals.Principal`,
or for session operations an :data:`kbd.core.principals.Actor`; there is no ``None``
meaning "trusted"), returns a frozen dataclass, and raises only
:class:`kbd.errors.KbdError`. The operations build on :class:`kbd.service.root.Root`
(the root context: config, principals, registry, audit log) and
:class:`kbd.service.sessions.RootSessions` (the session store, running commands
and plans).

* :mod:`kbd.service.auth` — who is acting: bearer tokens, uid mapping, the
  disabled check, ``--as`` / ``$KBD_AS``.
* :mod:`kbd.service.workflows` — workflows, sources, candidates, writer grants.
* :mod:`kbd.service.sessions` — open (and copied children), show, environment, list, close,
  revoke, path checks.
* :mod:`kbd.service.browse` — reading and listing an attached KB.
* :mod:`kbd.service.notes` — contributed note writes.
* :mod:`kbd.service.history` — a note's versions: log, show, diff, restore.
* :mod:`kbd.service.command_notes` — what ``kbd exec`` of a write plan holds and
  audits in the ``notes/`` it may write.
* :mod:`kbd.service.admin` — init, doctor, validate, principals and tokens, the
  daemon's health and counters, the audit log.
* :mod:`kbd.service.principals` — adding, disabling, enabling and removing
  principals and giving them new tokens (principals.yaml edited in place, audited).
"""

from __future__ import annotations

import base64
import binascii
import dataclasses
import functools
import typing
from typing import Any, Literal, TypeAlias

from kbd.core.records import Keys, Record
from kbd.errors import InvalidInput

# A JSON object as the contract spells it: the one true JSON boundary, where
# values of any JSON type meet. Results are typed; only their to_json() is this.
JsonObject: TypeAlias = dict[str, Any]

#: A file's bytes in a result's JSON (``kbd read``, ``kbd notes show``): its ``size``, then UTF-8
#: text as is, anything else base64 (never altered: ``encoding`` says which).
CONTENT_KEYS: dict[str, Any] = {"size": int, "encoding": Literal["utf-8", "base64"], "content": str}


def shown(data: bytes) -> tuple[Literal["utf-8", "base64"], str]:
    """``data`` as text: itself when it is UTF-8, else its base64."""
    try:
        return "utf-8", data.decode()
    except UnicodeDecodeError:
        return "base64", base64.b64encode(data).decode()


def content_json(data: bytes) -> JsonObject:
    """``data`` as :data:`CONTENT_KEYS` spell it."""
    encoding, content = shown(data)
    return {"size": len(data), "encoding": encoding, "content": content}


def content_bytes(keys: JsonObject, where: str) -> bytes:
    """The bytes :func:`content_json` wrote (InvalidInput for base64 that is not)."""
    if keys["encoding"] == "utf-8":
        return str(keys["content"]).encode()
    try:
        return base64.b64decode(keys["content"], validate=True)
    except binascii.Error:
        raise InvalidInput(f"{where}.content: not base64") from None


class ContentRecord(Record):
    """A record holding a file's bytes in its field ``data``, written as
    :data:`CONTENT_KEYS` after its other fields (plain JSON values, written as
    they are): its JSON is not its fields, so its codec is this, once."""

    data: bytes

    @classmethod
    def _plain(cls) -> tuple[str, ...]:
        return tuple(f.name for f in dataclasses.fields(cls) if f.name != "data")  # type: ignore[arg-type]

    @classmethod
    @functools.cache
    def _keys(cls) -> Keys:
        hints = typing.get_type_hints(cls)
        return Keys(lambda: {**{name: hints[name] for name in cls._plain()}, **CONTENT_KEYS})

    def to_json(self) -> JsonObject:
        return {**{name: getattr(self, name) for name in self._plain()}, **content_json(self.data)}

    @classmethod
    def from_json(cls, data: object, where: str = "") -> typing.Self:
        k = cls._keys().read(cls, data, where)
        values: dict[str, Any] = {name: k[name] for name in cls._plain()}
        return cls(**values, data=content_bytes(k, where or cls.__name__))  # type: ignore[call-arg]

    @classmethod
    def json_schema(cls, defs: dict[str, JsonObject] | None = None) -> JsonObject:
        return cls._keys().schema(cls, defs)
