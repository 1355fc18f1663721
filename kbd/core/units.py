"""The systemd files kbd ships (systemd/README.md), made ready for one host (pure).

``kbd.service`` names two placeholders, because systemd expands no variable in an
executable path or a ``Documentation=`` URI: ``{{KBD_BIN}}`` (the kbd executable)
and ``{{KBD_DOCS}}`` (the folder holding the installed docs/). A file with a
placeholder left unfilled is never produced: it would fail ``systemd-analyze
verify`` and never start.
"""

from __future__ import annotations

import re
from dataclasses import dataclass

from kbd.errors import UsageError

#: Each shipped file: where it goes beneath DESTDIR, in install order.
DESTINATIONS: dict[str, str] = {
    "kbd.socket": "etc/systemd/system/kbd.socket",
    "kbd.service": "etc/systemd/system/kbd.service",
    "kbd.sysusers": "etc/sysusers.d/kbd.conf",
    "kbd.tmpfiles": "etc/tmpfiles.d/kbd.conf",
}
PLACEHOLDER = re.compile(r"\{\{[A-Z_]+\}\}")
# One word of plain characters: systemd splits ExecStart at spaces and expands
# % and $; a Documentation= URI takes no space either.
_PLAIN_PATH = re.compile(r"/[A-Za-z0-9._/+-]*")


@dataclass(frozen=True)
class UnitFile:
    name: str  # as shipped: kbd.service
    destination: str  # beneath DESTDIR: etc/systemd/system/kbd.service
    text: str  # placeholders filled


def plain_path(value: str, *, what: str) -> str:
    """``value`` if it is an absolute path systemd takes as one word, else a
    UsageError naming ``what`` and what is allowed."""
    if not _PLAIN_PATH.fullmatch(value) or "//" in value or "/../" in f"{value}/" or "/./" in f"{value}/":
        raise UsageError(
            f"{what} must be a normalised absolute path of the characters [A-Za-z0-9._/+-] "
            f"(systemd splits at spaces and expands % and $): {value!r}"
        )
    return value


def fill(name: str, text: str, *, kbd_bin: str, docs: str) -> UnitFile:
    """Shipped file ``name`` with its placeholders filled. UsageError for a
    file kbd does not ship, a path systemd would split or expand, or a
    placeholder this function does not know (a newer unit than this kbd)."""
    destination = DESTINATIONS.get(name)
    if destination is None:
        raise UsageError(f"kbd ships no file named {name!r}; it ships {', '.join(DESTINATIONS)}")
    values = {"{{KBD_BIN}}": plain_path(kbd_bin, what="the kbd executable (--kbd-bin)"),
              "{{KBD_DOCS}}": plain_path(docs, what="the docs folder")}  # fmt: skip
    filled = PLACEHOLDER.sub(lambda m: values.get(m.group(0), m.group(0)), text)
    left = PLACEHOLDER.search(filled)
    if left is not None:
        raise UsageError(f"{name} holds {left.group(0)}, which this kbd does not fill")
    return UnitFile(name, destination, filled)
