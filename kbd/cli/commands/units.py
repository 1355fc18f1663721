"""``kbd units show|install``: the systemd files this kbd ships (systemd/README.md)."""

from __future__ import annotations

from pathlib import Path

import click

from kbd.cli.app import Ctx, main, pass_ctx, write_stdout

_NAMES = ["kbd.socket", "kbd.service", "kbd.sysusers", "kbd.tmpfiles"]
_NEXT = (
    "then: systemd-sysusers kbd.conf && systemd-tmpfiles --create kbd.conf && systemctl daemon-reload "
    "&& systemctl enable --now kbd.socket"
)


def _kbd_bin_option(f: click.decorators.FC) -> click.decorators.FC:
    return click.option(
        "--kbd-bin", type=click.Path(path_type=Path), metavar="PATH",
        help="The kbd executable the service runs (default: the one beside this Python, e.g. /opt/kbd/bin/kbd).",
    )(f)  # fmt: skip


@main.group("units", invoke_without_command=False)
def units() -> None:
    """The systemd files this kbd ships: kbd.socket, kbd.service, sysusers.d and tmpfiles.d.

    kbd.service names the kbd executable and the installed docs; both are
    filled in for this host (systemd expands no variable there)."""


@units.command("show")
@click.argument("names", nargs=-1, type=click.Choice(_NAMES), metavar="[NAME]...")
@_kbd_bin_option
@pass_ctx
def show(c: Ctx, names: tuple[str, ...], kbd_bin: Path | None) -> None:
    """Print the files NAME (default: all), filled in, each after a `# DESTINATION` line.

    \b
    EXAMPLES
      kbd units show kbd.service
      kbd units show --kbd-bin /opt/kbd/bin/kbd > /tmp/units.txt
    """
    from kbd.service import units as svc

    files = svc.shipped(list(names) or None, kbd_bin=kbd_bin or svc.this_kbd())
    text = "\n".join(f"# /{f.destination}\n{f.text}" if len(files) > 1 else f.text for f in files)
    write_stdout(text.encode())


@units.command("install")
@click.option("--dest", type=click.Path(file_okay=False, path_type=Path), default=Path("/"), show_default=True,
              help="Install beneath this folder (a package build's DESTDIR).")  # fmt: skip
@click.option("--force", is_flag=True, help="Replace files that exist with other contents.")
@_kbd_bin_option
@pass_ctx
def install(c: Ctx, dest: Path, force: bool, kbd_bin: Path | None) -> None:
    """Install the units, /etc/sysusers.d/kbd.conf and /etc/tmpfiles.d/kbd.conf.

    A file that exists with other contents is kept, and nothing is written,
    unless --force (keep local changes in a drop-in: systemctl edit kbd.service).

    \b
    EXAMPLES
      sudo /opt/kbd/bin/kbd units install
      kbd units install --dest "$DESTDIR" --kbd-bin /usr/bin/kbd
    """
    from kbd.service import units as svc

    files = svc.shipped(None, kbd_bin=kbd_bin or svc.this_kbd())
    for path in svc.install(files, dest=dest, force=force):
        click.echo(f"installed: {path}")
    if dest == Path("/"):
        click.echo(_NEXT, err=True)
