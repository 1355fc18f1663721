"""``kbd init --system``: the groups, owners and modes of a service host's root.

The decided layout (README "Deploying on a host"):

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
from kbd.core.layout import CONFIG_NAME, PRINCIPALS_NAME, STATE_DIR
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
