"""``kbd init --system``: the groups, owners and modes of a service host's root.

The decided layout (docs/multi-user.md "The permission model"):

    <root>/              root:<group>  0750   members of <group> reach workflows/
      kbd.yaml           root:root     0640   only the daemon reads it (builders use the socket)
      principals.yaml    root:root     0600   token digests: the daemon's alone
      workflows/         root:<group>  0750   each workflow folder is its owner's, group <grant>
      folders/           root:root     0750
      state/             root:root     0700   sessions, audit log, locks: the daemon's alone

``<group>`` (default ``kbd``) may reach the socket and traverse the root;
``<grant>`` (default ``kbd-grant``) has no members, ever: the daemon adds it to
the commands it sandboxes. Both are created (``groupadd --system``) if missing.
Applying the layout is idempotent: it only sets owners and modes.
"""

from __future__ import annotations

import grp
import os
import pwd
import shutil
import subprocess
from pathlib import Path

from kbd.core.config import is_group_name
from kbd.core.layout import CONFIG_NAME, KB_DIR, NOTES_DIR, PRINCIPALS_NAME, STATE_DIR
from kbd.errors import RootError, UsageError

# (relative path, owner group: "group" or None for root's, mode)
LAYOUT: tuple[tuple[str, str | None, int], ...] = (
    ("", "group", 0o750),
    (CONFIG_NAME, None, 0o640),
    (PRINCIPALS_NAME, None, 0o600),
    ("workflows", "group", 0o750),
    ("folders", None, 0o750),
    (STATE_DIR, None, 0o700),
)


def check_names(group: str, grant_group: str) -> None:
    for flag, name in (("--group", group), ("--grant-group", grant_group)):
        if not is_group_name(name):
            raise UsageError(
                f"{flag} must be a group name (lower-case letters, digits, _ and -), not {name!r}"
            )
    if group == grant_group:
        raise UsageError("--group and --grant-group must differ: the grant group has no members, ever")


def members(gid: int, name: str) -> list[str]:
    """Who is in the group: listed members, and accounts whose primary group it is."""
    found = list(grp.getgrgid(gid).gr_mem)
    found += [p.pw_name for p in pwd.getpwall() if p.pw_gid == gid and p.pw_name not in found]
    return found


def ensure_group(name: str) -> tuple[int, bool]:
    """(gid, created): the group ``name``, made with ``groupadd --system`` if missing."""
    try:
        return grp.getgrnam(name).gr_gid, False
    except KeyError:
        pass
    groupadd = shutil.which("groupadd") or "/usr/sbin/groupadd"
    done = subprocess.run([groupadd, "--system", name], capture_output=True, text=True, check=False)  # noqa: S603
    if done.returncode != 0:
        raise RootError(
            f"cannot create group {name!r}: {done.stderr.strip() or f'groupadd exit {done.returncode}'}"
        )
    return grp.getgrnam(name).gr_gid, True


def apply_layout(root: Path, *, group: str, grant_group: str) -> list[str]:
    """Create the groups if missing and set the root's owners and modes; the
    groups created. Refuses a grant group that has members."""
    if os.geteuid() != 0:
        raise RootError("kbd init --system must run as root (it creates groups and sets owners)")
    created = []
    gid, made = ensure_group(group)
    if made:
        created.append(group)
    grant_gid, made = ensure_group(grant_group)
    if made:
        created.append(grant_group)
    if who := members(grant_gid, grant_group):
        raise RootError(
            f"the grant group {grant_group!r} has members ({', '.join(who)}); it must have none, ever",
            hint=f"remove them (gpasswd -d USER {grant_group}) or choose another --grant-group",
        )
    root_fd = os.open(root, os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC)
    try:
        for rel, owner, mode in LAYOUT:
            fd = (
                root_fd
                if not rel
                else os.open(rel, os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC, dir_fd=root_fd)
            )
            try:
                os.fchown(fd, 0, gid if owner == "group" else 0)
                os.fchmod(fd, mode)
            finally:
                if fd != root_fd:
                    os.close(fd)
    finally:
        os.close(root_fd)
    return created


# -- doctor -----------------------------------------------------------------------------


def grant_group_problems(name: str) -> list[str]:
    """Why the grant group ``name`` breaks the model, if it does."""
    try:
        gid = grp.getgrnam(name).gr_gid
    except KeyError:
        return [f"sandbox.grant_group {name!r} is not a group on this host; fix: groupadd --system {name}"]
    who = members(gid, name)
    if who:
        return [
            f"grant group {name!r} has members ({', '.join(who)}): they read every workflow folder outside "
            f"any sandbox; fix: gpasswd -d USER {name} (and give no account it as primary group)"
        ]
    return []


def _mode_problem(path: Path, st: os.stat_result, *, gid: int, group: str, mode: int) -> str | None:
    got = st.st_mode & 0o7777
    if st.st_gid == gid and got == mode:
        return None
    fix = f"chgrp {group} {path} && chmod {mode:o} {path}" if st.st_gid != gid else f"chmod {mode:o} {path}"
    try:
        has = grp.getgrgid(st.st_gid).gr_name
    except KeyError:
        has = str(st.st_gid)
    return f"{path}: group {has}, mode {got:o}; want group {group}, mode {mode:o}; fix: {fix}"


def workflow_problems(folder: Path, *, grant_group: str) -> list[str]:
    """A workflow folder of a host with a grant group: the folder, its KB and
    context/ ``2750``, notes/ ``2770``, all of group ``grant_group`` (never
    following a link: lstat)."""
    try:
        gid = grp.getgrnam(grant_group).gr_gid
    except KeyError:
        return []  # reported once, by grant_group_problems
    out = []
    kb = Path(KB_DIR)
    want = ((Path(), 0o2750), (kb, 0o2750), (kb / "context", 0o2750), (kb / NOTES_DIR, 0o2770))
    for rel, mode in want:
        path = folder / rel
        try:
            st = os.lstat(path)
        except FileNotFoundError:
            continue  # a KB without context/ or notes/ is the registry's to report
        except OSError as exc:
            out.append(f"{path}: cannot be checked ({exc.strerror})")
            continue
        if (problem := _mode_problem(path, st, gid=gid, group=grant_group, mode=mode)) is not None:
            out.append(problem)
    return out


def root_problems(root: Path) -> list[str]:
    """The service root's own folders and files (see LAYOUT): nothing open to others."""
    out = []
    for rel, owner, mode in LAYOUT:
        path = root / rel if rel else root
        try:
            st = os.lstat(path)
        except OSError:
            continue
        got = st.st_mode & 0o7777
        if got & ~mode or st.st_uid != 0 or (owner is None and st.st_gid != 0):
            chgrp = f"chown root:root {path} && " if owner is None else f"chown root {path} && "
            out.append(
                f"{path}: owner {st.st_uid}, group {st.st_gid}, mode {got:o}; fix: {chgrp}chmod {mode:o} {path}"
            )
    return out


def others_cannot_use(path: Path, *, run: bool) -> str | None:
    """Why a user who is neither the owner nor in the group of ``path`` (where it
    really lies, links resolved) could not use it — a folder above it not
    searchable (o+x), the file not readable (o+r) or, with ``run``, not executable
    (o+x) — or None. A venv made from an interpreter under ``/root`` (pyenv's)
    links to a folder other users cannot enter: every user but root gets "bad
    interpreter" while root sees nothing wrong (docs/multi-user.md "Deploying on a host")."""
    real = Path(os.path.realpath(path))
    for folder in reversed(real.parents):
        try:
            mode = os.stat(folder).st_mode
        except OSError as exc:
            return f"{folder}: cannot be checked ({exc.strerror})"
        if not mode & 0o001:
            return f"{real}: other users cannot reach it: {folder} is mode {mode & 0o7777:04o} (no o+x)"
    try:
        mode = os.stat(real).st_mode
    except OSError as exc:
        return f"{real}: cannot be checked ({exc.strerror})"
    need = 0o005 if run else 0o004
    if mode & need != need:
        what = "run" if run else "read"
        return f"{real}: other users cannot {what} it (mode {mode & 0o7777:04o})"
    return None
