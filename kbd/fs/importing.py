"""Markdown import on disk: reading the caller's folder, and the confined
writes into a workflow's ``knowledgebase/context/`` (docs/search.md "Importing markdown").

Reading (:func:`read_folder`) runs in the caller's own process, as the caller:
the folder it names is opened as any program of theirs would open it, and
everything *beneath* it is walked one descriptor at a time without following
a link (a linked file or folder is reported as skipped, never read), a FIFO,
socket or device is never opened (it is refused from an ``O_PATH`` fstat), and
a document over :data:`kbd.core.importing.MAX_DOC_BYTES` is reported, not read.
Hidden names (``.git``…) are passed over. The daemon never reads a folder for
anyone: it receives the documents' bytes (:mod:`kbd.service.importing`).

Writing goes beneath the pinned KB through :mod:`kbd.fs.confined` only:
``context/`` and each container folder are opened with no link followed and
no mount crossed, and each document replaces its target atomically (temp file,
fsync, rename, folder fsync); an existing link, folder or special file at a
target is refused, never written through.
"""

from __future__ import annotations

import contextlib
import errno
import os
import stat
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path

from kbd.core.importing import MAX_DOC_BYTES, is_markdown, shown, undecodable
from kbd.core.layout import CONTEXT_DIR
from kbd.errors import KbdError, PathNotFound, PathRefused, from_oserror
from kbd.fs.confined import open_beneath, read_file_stat, replace_file

#: Folders deeper than this below the imported folder are reported, not walked.
MAX_DEPTH = 32
#: Documents one import reads; the rest are reported as skipped.
MAX_DOCS = 10_000
_DIR_HINT = "name a folder holding Markdown files, e.g. one folder per container: DIR/ENG/Onboarding.md"


@dataclass
class FolderRead:
    """What :func:`read_folder` found: the folder's own name (the container of
    the files directly in it), the documents, and what it skipped and why."""

    folder: str
    docs: list[tuple[str, bytes]] = field(default_factory=list)
    skipped: list[tuple[str, str]] = field(default_factory=list)


def _kind(mode: int) -> str:
    if stat.S_ISLNK(mode):
        return "a symbolic link (kbd never follows links)"
    if stat.S_ISFIFO(mode):
        return "a FIFO (not opened)"
    if stat.S_ISSOCK(mode):
        return "a socket (not opened)"
    if stat.S_ISCHR(mode) or stat.S_ISBLK(mode):
        return "a device (not opened)"
    return "not a regular file"


def read_folder(path: Path) -> FolderRead:
    """The Markdown documents beneath ``path``, in name order (see the module
    docstring). Raises PathNotFound / PathRefused only for ``path`` itself."""
    try:
        top = os.open(path, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
    except FileNotFoundError:
        raise PathNotFound(f"{str(path)[:200]!r} does not exist", hint=_DIR_HINT) from None
    except NotADirectoryError:
        raise PathRefused(f"{str(path)[:200]!r} is not a folder", why="not_dir", hint=_DIR_HINT) from None
    except OSError as exc:
        raise from_oserror(exc, what=f"open {str(path)[:200]!r}") from None
    # Its name is the container of the files directly in it: one that is not
    # UTF-8 is used escaped (docs/search.md "Importing markdown").
    out = FolderRead(shown(Path(os.path.abspath(path)).name))
    try:
        _walk(top, "", 0, out)
    finally:
        os.close(top)
    return out


def _walk(dfd: int, rel: str, depth: int, out: FolderRead) -> None:
    for name in sorted(os.listdir(dfd)):
        if name.startswith("."):
            continue
        child = f"{rel}{name}"
        if undecodable(name):  # reported escaped; never opened, never sent on
            _skip_undecodable(dfd, name, child, out)
            continue
        try:
            st = os.stat(name, dir_fd=dfd, follow_symlinks=False)
        except OSError:
            continue  # gone since the listing
        if stat.S_ISDIR(st.st_mode):
            if depth >= MAX_DEPTH:
                out.skipped.append((child + "/", f"deeper than {MAX_DEPTH} folders; not walked"))
                continue
            try:
                sub = open_beneath(dfd, name, os.O_RDONLY | os.O_DIRECTORY)
            except KbdError as err:
                out.skipped.append((child + "/", err.message))
                continue
            try:
                _walk(sub, child + "/", depth + 1, out)
            finally:
                os.close(sub)
        elif stat.S_ISLNK(st.st_mode):
            out.skipped.append((child, _kind(st.st_mode)))
        elif not is_markdown(name):
            continue
        elif not stat.S_ISREG(st.st_mode):
            out.skipped.append((child, _kind(st.st_mode)))
        elif len(out.docs) >= MAX_DOCS:
            out.skipped.append((child, f"more than {MAX_DOCS} documents in one import"))
        elif st.st_size > MAX_DOC_BYTES:
            out.skipped.append((child, f"larger than {MAX_DOC_BYTES} bytes"))
        else:
            try:
                # Hard links are the caller's own business when reading their folder.
                data, _ = read_file_stat(dfd, name, limit=MAX_DOC_BYTES, allow_hardlinks=True)
            except KbdError as err:
                out.skipped.append((child, err.message))
                continue
            out.docs.append((child, data))


def _skip_undecodable(dfd: int, name: str, child: str, out: FolderRead) -> None:
    """Report a folder or Markdown file whose name is not UTF-8 (it cannot be
    a container, a title's source or an ``imported_from``); other files are
    passed over as any non-Markdown file is."""
    try:
        st = os.stat(name, dir_fd=dfd, follow_symlinks=False)
    except OSError:
        return  # gone since the listing
    if stat.S_ISDIR(st.st_mode):
        out.skipped.append((shown(child) + "/", "the folder name is not valid UTF-8; not walked"))
    elif is_markdown(name):
        out.skipped.append((shown(child), "the file name is not valid UTF-8"))


# -- the workflow's context/ -----------------------------------------------------------------


@contextlib.contextmanager
def open_context(kb_fd: int, *, create: bool) -> Iterator[int | None]:
    """``context/`` beneath the pinned KB, open for the block: created when
    missing and ``create`` (owner, group and mode like ``knowledgebase/``'s),
    else None (a dry run writes nothing)."""
    try:
        fd = open_beneath(kb_fd, CONTEXT_DIR, os.O_RDONLY | os.O_DIRECTORY)
    except PathNotFound:
        if not create:
            yield None
            return
        with contextlib.suppress(FileExistsError):
            os.mkdir(CONTEXT_DIR, 0o700, dir_fd=kb_fd)
            _like_parent(kb_fd, CONTEXT_DIR)
        fd = open_beneath(kb_fd, CONTEXT_DIR, os.O_RDONLY | os.O_DIRECTORY)
    try:
        yield fd
    finally:
        os.close(fd)


def _like_parent(parent_fd: int, name: str) -> None:
    """A folder kbd made gets its parent's owner, group and permission bits
    (with set-gid), set through its own descriptor, never by path."""
    pst = os.fstat(parent_fd)
    fd = open_beneath(parent_fd, name, os.O_RDONLY | os.O_DIRECTORY)
    try:
        if os.geteuid() == 0:
            os.fchown(fd, pst.st_uid, pst.st_gid)
        os.fchmod(fd, (pst.st_mode & 0o2777) | 0o700)
    finally:
        os.close(fd)


def existing(context_fd: int | None, container: str, name: str) -> bytes | None:
    """The bytes at ``<container>/<name>`` beneath ``context/`` (``name`` itself
    for an empty ``container``; None: nothing there). Raises KbdError when
    something is there that kbd must not touch: a link, a folder, a special
    file, a hard-linked or oversized file."""
    if context_fd is None:
        return None
    try:
        rel = f"{container}/{name}" if container else name
        data, _ = read_file_stat(context_fd, rel, limit=MAX_DOC_BYTES + 64 * 1024)
    except PathNotFound:
        return None
    return data


def file_mode(context_fd: int) -> int:
    """The mode of a document kbd writes: owner read-write, and read for the
    group and others as far as ``context/`` lets them list it."""
    m = os.fstat(context_fd).st_mode
    return 0o600 | (m & 0o044)


def write_doc(context_fd: int, container: str, name: str, data: bytes) -> None:
    """Create or atomically replace ``<container>/<name>`` beneath ``context/``
    (``name`` itself for an empty ``container``; the container folder made when
    missing, like ``context/``). Running as root, the file gets ``context/``'s
    owner and group: it is the workflow's."""
    try:
        cfd = open_beneath(context_fd, container, os.O_RDONLY | os.O_DIRECTORY)  # "": context/ itself
    except PathNotFound:
        try:
            os.mkdir(container, 0o700, dir_fd=context_fd)
            _like_parent(context_fd, container)
        except FileExistsError:
            pass
        except OSError as exc:
            if exc.errno in (errno.EACCES, errno.EPERM, errno.EROFS):
                raise PathRefused(f"cannot make context/{container[:100]}/ ({exc.strerror})",
                                  why="os_error") from None  # fmt: skip
            raise
        cfd = open_beneath(context_fd, container, os.O_RDONLY | os.O_DIRECTORY)
    try:
        st = os.fstat(context_fd)
        owner = (st.st_uid, st.st_gid) if os.geteuid() == 0 else None
        replace_file(cfd, name, data, mode=file_mode(context_fd), owner=owner)
    finally:
        os.close(cfd)


def kb_key(kb_fd: int) -> str:
    """The identity of the pinned KB: what the import lock is keyed by (it
    exists before ``context/`` does)."""
    st = os.fstat(kb_fd)
    return f"{st.st_dev}:{st.st_ino}"
