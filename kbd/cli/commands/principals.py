"""``kbd principals``: list, add, disable, enable, remove, token."""

from __future__ import annotations

import os
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING

import click

from kbd import ops
from kbd.cli.app import (
    Ctx,
    F,
    as_option,
    complete_principals,
    dry_run_option,
    json_option,
    main,
    pass_ctx,
)
from kbd.core.identifiers import one_line
from kbd.errors import (
    InvalidInput,
    UsageError,
    from_oserror,
)

if TYPE_CHECKING:
    from kbd.service.principals import PrincipalChanged

# -- principals ----------------------------------------------------------------------------


@main.group()
def principals() -> None:
    """Users and services known to this host."""


@principals.command("list")
@as_option
@json_option
@pass_ctx
def principals_list(c: Ctx, as_: str | None, as_json: bool) -> None:
    """List principals: ID, kind, flags (admin, disabled, token, uid=N) and label."""
    if (result := c.shown(ops.PrincipalsList(), as_, as_json)) is None:
        return
    if not result.principals:
        click.echo("no principals: principals.yaml lists none")
    for p in result.principals:
        flags = [f for f, on in (("admin", p.admin), ("disabled", p.disabled), ("token", p.has_token)) if on]
        flags += [f"uid={p.uid}"] if p.uid is not None else []  # the local user it maps, as --json says
        label = f"  {one_line(p.label, limit=200)}" if p.label is not None else ""
        click.echo(f"{p.id:<20} {p.kind:<8} {' '.join(flags)}{label}")


def _force_option(action: str) -> Callable[[F], F]:
    return click.option(
        "--force", is_flag=True, help=f"{action.capitalize()} even the last enabled admin (then only a hand edit of "
        "principals.yaml, or `kbd principals enable` on the root, brings an admin back)."
    )  # fmt: skip


def _changed_line(result: PrincipalChanged, done: str) -> str:
    pid = one_line(result.principal.id)
    return f"{done} principal {pid}" if result.changed else f"principal {pid} was already {done}"


@principals.command("add")
@click.argument("name")
@click.option("--uid", type=int, metavar="N", help="Map the principal to this uid (peer-uid authentication).")
@click.option("--user", "login", metavar="LOGIN", help="Map it to LOGIN's uid on this host.")
@click.option("--admin", is_flag=True, help="An admin: may manage any workflow and read anything.")
@click.option(
    "--service", is_flag=True, help="A service (an execution host): may open sessions for any workflow."
)
@click.option("--label", metavar="TEXT", help="A name for people (one line).")
@as_option
@json_option
@pass_ctx
def principals_add(c: Ctx, name: str, uid: int | None, login: str | None, admin: bool, service: bool,
                   label: str | None, as_: str | None, as_json: bool) -> None:  # fmt: skip
    """Add principal NAME mapped to a uid (--uid N or --user LOGIN).

    principals.yaml is edited in place: its comments, blank lines and order stay.

    \b
    EXAMPLES
      kbd principals add alice --user alice --label "Alice"
      kbd principals add exec-host --user kbd-runner --service
    """
    if (uid is None) == (login is None):
        raise UsageError("pass exactly one of --uid N and --user LOGIN",
                         hint="kbd principals add NAME --uid 1000   (or --user alice)")  # fmt: skip
    if admin and service:
        raise UsageError("pass at most one of --admin and --service: a service principal is never an admin",
                         hint="add the service and an admin as two principals")  # fmt: skip
    if (
        result := c.shown(
            ops.PrincipalAdd(name, uid, login, "service" if service else "user", admin, label), as_, as_json
        )
    ) is None:
        return
    p = result.principal
    role = "admin" if p.admin else p.kind
    user = result.user
    click.echo(f"added principal {one_line(p.id)} ({role}, uid {p.uid}" + (f" = {user})" if user else ")"))
    if user is None:
        click.echo(f"kbd: note: uid {p.uid} has no passwd entry on this host", err=True)


@principals.command("disable")
@click.argument("name", shell_complete=complete_principals)
@_force_option("disable")
@dry_run_option
@as_option
@json_option
@pass_ctx
def principals_disable(c: Ctx, name: str, force: bool, dry_run: bool, as_: str | None, as_json: bool) -> None:
    """Disable NAME: refused everywhere from the daemon's next request on; the
    commands it started are ended (or marked stale) by revocation."""
    if c.previewed(ops.PrincipalChange("disable", name, force), dry_run, as_, as_json):
        return
    if (result := c.shown(ops.PrincipalChange("disable", name, force), as_, as_json)) is not None:
        click.echo(_changed_line(result, "disabled"))


@principals.command("enable")
@click.argument("name", shell_complete=complete_principals)
@dry_run_option
@as_option
@json_option
@pass_ctx
def principals_enable(c: Ctx, name: str, dry_run: bool, as_: str | None, as_json: bool) -> None:
    """Enable NAME again."""
    if c.previewed(ops.PrincipalChange("enable", name), dry_run, as_, as_json):
        return
    if (result := c.shown(ops.PrincipalChange("enable", name), as_, as_json)) is not None:
        click.echo(_changed_line(result, "enabled"))


@principals.command("remove")
@click.argument("name", shell_complete=complete_principals)
@_force_option("remove")
@dry_run_option
@as_option
@json_option
@pass_ctx
def principals_remove(c: Ctx, name: str, force: bool, dry_run: bool, as_: str | None, as_json: bool) -> None:
    """Remove NAME's entry from principals.yaml (other lines stay as they are)."""
    if c.previewed(ops.PrincipalChange("remove", name, force), dry_run, as_, as_json):
        return
    if (result := c.shown(ops.PrincipalChange("remove", name, force), as_, as_json)) is not None:
        click.echo(_changed_line(result, "removed"))


@principals.command("token")
@click.argument("name", shell_complete=complete_principals)
@click.option("--output", "output", metavar="F", type=click.Path(dir_okay=False, path_type=Path),
              help="Write the token to F, created 0600 (never an existing file), instead of printing it.")  # fmt: skip
@as_option
@json_option
@pass_ctx
def principals_token(c: Ctx, name: str, output: Path | None, as_: str | None, as_json: bool) -> None:
    """Issue a new API token for NAME (printed once; only its hash is stored;
    the old token stops working).

    \b
    EXAMPLES
      kbd principals token exec-host --output /etc/kbd/exec-host.token
    """
    if output is None:
        if (result := c.shown(ops.PrincipalToken(name), as_, as_json)) is not None:
            click.echo(result.token)
        return
    if as_json:
        raise UsageError("pass one of --output and --json: --json would print the token too")
    # Made, with room for the token, before the token is issued: a file that cannot be made (or a
    # full disk) leaves the old token working.
    fd = _new_private_file(output)
    try:
        os.posix_fallocate(fd, 0, 256)
        os.ftruncate(fd, 0)
    except OSError as exc:
        os.close(fd)
        output.unlink(missing_ok=True)
        raise InvalidInput(f"cannot write {output}: {exc.strerror}; the current token still works") from None
    try:
        issued = c.result(ops.PrincipalToken(name), as_)
    except BaseException:
        os.close(fd)
        output.unlink(missing_ok=True)
        raise
    try:
        os.write(fd, issued.token.encode() + b"\n")
        os.fsync(fd)
    except OSError as exc:
        # Issued: the old token no longer works, and this one is lost with its file.
        output.unlink(missing_ok=True)
        err = from_oserror(exc, what=f"write {output}")
        err.message = (f"{one_line(name)}'s old token no longer works, and the new one could not be written to "
                       f"{output} ({exc.strerror})")  # fmt: skip
        err.hint = f"issue another: kbd principals token {name} --output FILE"
        raise err from None
    finally:
        os.close(fd)
    click.echo(
        f"wrote {one_line(issued.principal)}'s new token to {output} (mode 0600); the old one no longer works"
    )


def _new_private_file(path: Path) -> int:
    """``path`` created for the owner alone (0600), never an existing file or a link's target."""
    try:
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC, 0o600)
    except FileExistsError:
        raise InvalidInput(f"{path} exists: the token is written only to a new file",
                           hint="name a file that does not exist yet") from None  # fmt: skip
    except OSError as exc:
        raise InvalidInput(f"cannot create {path}: {exc.strerror}") from None
    os.fchmod(fd, 0o600)  # exactly, whatever the umask
    return fd
