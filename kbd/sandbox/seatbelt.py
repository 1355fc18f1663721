"""macOS Seatbelt profiles (docs/sandbox.md "Seatbelt"): rendered from ``sandbox-profiles/kbd.sb``.

Paths never become profile text: each grant refers to ``(param "NAME")`` and
the path travels as ``sandbox-exec -D NAME=path``, an argv word. The grant
section is generated from the plan:

* each readable folder: ``(allow file-read* (subpath (param R_i)))``;
* each writable folder: ``(allow file-write* (require-all (subpath W_i)
  (require-not (literal W_i_RO_j)) …))`` so a read-only file inside (a
  contributed ``notes/_index.json``) stays read-only, plus read access;
* hidden paths: ``(deny file-read* file-write* (subpath H_i))`` after the allows;
* every ancestor of a protected path inside a writable folder cannot be
  unlinked or renamed (``file-write-unlink``), so the protection cannot be
  side-stepped by moving the folder that holds it.

:func:`sbpl_string` is the one escaping function for any literal string kbd
ever needs in profile text (a hypothesis property checks nothing escapes it).
Rendered and tested on every platform; executed only on macOS.
"""

from __future__ import annotations

import re
from pathlib import Path

from kbd.core.plan import Plan

TEMPLATE = "kbd.sb"
MARKER = ";; @GRANTS@"
_PARAM_RE = re.compile(r'\(param "([A-Z0-9_]+)"\)')


def template_path() -> Path:
    # Imported here: rendering a profile (pure) must not load the filesystem shell.
    from kbd.fs.datafiles import data_path

    return data_path("sandbox_profiles", "sandbox-profiles", TEMPLATE)


def sbpl_string(value: str) -> str:
    """``value`` as one SBPL string literal: quotes and backslashes escaped,
    control characters as \\xNN escapes, so no input can end the string."""
    out = ['"']
    for ch in value:
        if ch in ('"', "\\"):
            out.append("\\" + ch)
        elif ord(ch) < 0x20 or ord(ch) == 0x7F:
            out.append(f"\\x{ord(ch):02x}")
        else:
            out.append(ch)
    out.append('"')
    return "".join(out)


def render(plan: Plan, *, template: str | None = None) -> tuple[str, dict[str, str]]:
    """The profile text and its parameters for ``plan``."""
    text = template if template is not None else template_path().read_text(encoding="utf-8")
    params: dict[str, str] = {}
    lines: list[str] = []
    writable = sorted({g.path for g in plan.grants if g.mode == "write"})
    protected = sorted({g.path for g in plan.grants if g.mode == "read_only"})
    hidden = sorted({g.path for g in plan.grants if g.mode == "hidden"})
    readable = sorted({g.path for g in plan.grants if g.mode == "read"})

    def param(prefix: str, path: Path) -> str:
        name = f"{prefix}_{len([k for k in params if k.startswith(prefix + '_')])}"
        params[name] = str(path)
        return f'(param "{name}")'

    for path in readable:
        lines.append(f"(allow file-read* (subpath {param('R', path)}))")
    for path in writable:
        w = param("W", path)
        inner = [p for p in protected if p == path or path in p.parents]
        nots = " ".join(f"(require-not (literal {param('RO', p)}))" for p in inner)
        lines.append(f"(allow file-read* (subpath {w}))")
        lines.append(f"(allow file-write* (require-all (subpath {w}){' ' + nots if nots else ''}))")
    for path in protected:
        # Read-only overlays stay readable; their ancestors inside writable
        # folders cannot be unlinked or renamed away.
        lines.append(f"(allow file-read* (literal {param('P', path)}))")
        for anc in [path, *path.parents]:
            if any(anc == w or w in anc.parents for w in writable):
                lines.append(f"(deny file-write-unlink (literal {param('A', anc)}))")
    for path in hidden:
        lines.append(f"(deny file-read* file-write* (subpath {param('H', path)}))")
    params["TMPDIR"] = "/private/tmp/kbd"
    return text.replace(MARKER, "\n".join(lines)), params


def declared_params(profile: str) -> set[str]:
    return set(_PARAM_RE.findall(profile))


def sandbox_exec_argv(profile: str, params: dict[str, str], command: list[str]) -> list[str]:
    argv = ["/usr/bin/sandbox-exec", "-p", profile]
    for name, value in sorted(params.items()):
        argv += ["-D", f"{name}={value}"]
    return [*argv, *command]
