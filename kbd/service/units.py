"""``kbd units``: the systemd files shipped in the package, filled for this host
and installed (systemd/README.md "The units"). Filling is pure
(:mod:`kbd.core.units`); this module finds the files and writes them."""

from __future__ import annotations

import os
import stat
import sys
from pathlib import Path

from kbd.core.units import DESTINATIONS, UnitFile, fill
from kbd.errors import InvalidInput, PermissionDenied, UsageError
from kbd.fs.atomic import write_atomic
from kbd.fs.datafiles import data_path

#: Where the files go when no DESTDIR is given.
SYSTEM = Path("/")


def this_kbd() -> Path:
    """The ``kbd`` executable beside the running interpreter (a virtualenv's
    ``bin/kbd``, never resolved through symlinks: the unit names the path the
    operator installed). UsageError when there is none (``python -m kbd`` from
    a checkout without a console script)."""
    candidate = Path(sys.executable).parent / "kbd"
    if candidate.is_file() and os.access(candidate, os.X_OK):
        return candidate
    raise UsageError(
        f"no kbd executable beside {sys.executable}",
        hint="name the one the service should run: --kbd-bin PATH",
    )


def docs_folder() -> Path:
    """The docs/ shipped with this kbd (the package's ``kbd.docs``, or the checkout's)."""
    return data_path("docs", "docs", "README.md").parent


def shipped(names: list[str] | None, *, kbd_bin: Path) -> list[UnitFile]:
    """The shipped files ``names`` (all when None), filled for ``kbd_bin``
    (made absolute, symlinks kept)."""
    kbd_bin = Path(os.path.abspath(kbd_bin))
    if not (kbd_bin.is_file() and os.access(kbd_bin, os.X_OK)):
        raise UsageError(f"--kbd-bin: {kbd_bin} is not an executable file")
    # kbd.service runs it as root: whoever could replace it, or its interpreter, would be root.
    for program in (kbd_bin, *_interpreter(kbd_bin)):
        if (problem := unsafe_for_root(program)) is not None:
            raise PermissionDenied(
                f"kbd.service runs {kbd_bin} as root, but {problem}",
                hint="install kbd as root into a folder only root can change (e.g. /opt/kbd: docs/multi-user.md), "
                "or name such a kbd with --kbd-bin",
            )
    docs = docs_folder()
    out = []
    for name in names or list(DESTINATIONS):
        if name not in DESTINATIONS:
            raise UsageError(f"kbd ships no file named {name!r}; it ships {', '.join(DESTINATIONS)}")
        text = data_path("units", "systemd", name).read_text(encoding="utf-8")
        out.append(fill(name, text, kbd_bin=str(kbd_bin), docs=str(docs)))
    return out


def install(files: list[UnitFile], *, dest: Path = SYSTEM, force: bool = False) -> list[Path]:
    """Write ``files`` beneath ``dest`` (0644, folders 0755), each atomically.
    A file there already with other bytes (an operator's edit: systemd's way
    is a drop-in) is kept, and nothing is written, unless ``force``. Returns
    the paths written or already identical, in order."""
    targets = [(f, dest / f.destination) for f in files]
    differ = [str(path) for f, path in targets if _differs(path, f.text.encode())]
    if differ and not force:
        raise InvalidInput(
            f"{len(differ)} file(s) exist with other contents: {', '.join(differ)}",
            hint="keep local changes in a drop-in (systemctl edit kbd.service) and replace the files with "
            "--force, or install into another --dest",
        )
    for f, path in targets:
        path.parent.mkdir(mode=0o755, parents=True, exist_ok=True)
        write_atomic(path, f.text.encode(), mode=0o644, keep_owner=False, keep_mode=False)
    return [path for _, path in targets]


def unsafe_for_root(path: Path) -> str | None:
    """Why a root service must not run ``path`` (None: it may): the file, the
    file a link leads to, and every folder above either must be root's and
    writable by no group or other user (a world-writable folder only with the
    sticky bit, as /tmp, where nobody else may replace root's entries)."""
    chain = [Path(os.path.abspath(path)), path.resolve()]
    for item in chain:
        for p in (item, *item.parents):
            try:
                st = os.lstat(p)
            except OSError as exc:
                return f"{p} cannot be checked ({exc.strerror})"
            if st.st_uid != 0:
                return f"{p} is owned by uid {st.st_uid}, not root"
            if stat.S_ISLNK(st.st_mode):
                continue  # a link's own mode means nothing; where it leads is checked as well
            sticky = stat.S_ISDIR(st.st_mode) and st.st_mode & stat.S_ISVTX
            if st.st_mode & 0o022 and not sticky:
                return f"{p} is writable by its group or by others (mode {stat.S_IMODE(st.st_mode):04o})"
    return None


def _interpreter(program: Path) -> list[Path]:
    """The interpreter a script's ``#!`` line names (none for a binary)."""
    try:
        with open(program, "rb") as fh:
            head = fh.read(256)
    except OSError:
        return []
    if not head.startswith(b"#!"):
        return []
    words = head[2:].split(b"\n", 1)[0].split()
    return [Path(os.fsdecode(words[0]))] if words and words[0].startswith(b"/") else []


def _differs(path: Path, data: bytes) -> bool:
    try:
        return path.read_bytes() != data
    except FileNotFoundError:
        return False
