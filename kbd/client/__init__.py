"""The host-side client library: a long-running execution host talks to the
kbd daemon over its Unix socket (docs/api.md, docs/daemon.md) without a Python start per call.

    from kbd.client import Client

    with Client() as kbd:                    # $KBD_SOCKET, else the root's default socket
        plan = kbd.open_session("my-workflow", kind="execution", kb_access="read")
        env = kbd.env(plan["session_id"])    # WORKFLOW_KB_* for the agent's shell
        for event in kbd.events(follow=True):  # resumes by itself after a dropped connection
            ...

Authentication is the daemon's: the peer uid (mapped in principals.yaml), or a
bearer token (``token=``, else ``$KBD_TOKEN``; never put one in argv). Every
error the daemon answers arrives as the :mod:`kbd.errors` class of its code
(:func:`error_from`), with its message and hint; a daemon that cannot be
reached is :class:`kbd.errors.Unavailable` (exit code 69).

:meth:`Client.exec` runs a command in a session's sandbox through the daemon's
exec broker (one socket, one protocol, docs/daemon.md) with descriptors the host
provides, so a host pays the sandbox's cost per command, not a Python start.
"""

from __future__ import annotations

TYPE_CHECKING = False  # not typing's: the lean exec path imports kbd.client.brokered
if TYPE_CHECKING:
    from kbd.client.library import Client, default_socket, error_from, socket_of

__all__ = ["Client", "default_socket", "error_from", "socket_of"]


def __getattr__(name: str) -> object:
    """The library's names, imported when first used: importing this package
    (as the lean ``kbd exec`` path does, for :mod:`kbd.client.brokered`) must not
    import httpx."""
    if name in __all__:
        from kbd.client import library

        return getattr(library, name)
    raise AttributeError(f"module 'kbd.client' has no attribute {name!r}")
