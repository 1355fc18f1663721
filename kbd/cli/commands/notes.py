"""``kbd notes`` (write, log, show, diff, restore, pending, review, rejected, unreject) and ``kbd import``."""

from __future__ import annotations

import dataclasses
import io
import sys
import time
from pathlib import Path
from typing import TYPE_CHECKING

import click

from kbd import ops
from kbd.cli.app import (
    Ctx,
    as_option,
    complete_aliases,
    complete_sessions,
    complete_workflows,
    emit,
    json_option,
    main,
    pass_ctx,
    write_stdout,
)
from kbd.core.identifiers import one_line
from kbd.core.notes import MAX_NOTE_BYTES
from kbd.errors import (
    InvalidInput,
    NotFound,
    UsageError,
)

if TYPE_CHECKING:
    from kbd.core.history import Entry

# -- notes ----------------------------------------------------------------------------------


@main.group()
def notes() -> None:
    """Contributed notes in attached sources' notes/ folders."""


@notes.command("write")
@click.argument("sid", shell_complete=complete_sessions)
@click.argument("alias", shell_complete=complete_aliases)
@click.argument("relpath")
@click.option("--file", "file", metavar="F|-", help="Note content; - reads stdin (the default when piped).")
@click.option("--expected-version", "expected", metavar="V", default=None,
              help="Write only if the note is at version V now (sha256:..., see `kbd notes log`), or absent "
              "for `none`; otherwise exit 75 naming its current version.")  # fmt: skip
@as_option
@json_option
@pass_ctx
def notes_write(
    c: Ctx, sid: str, alias: str, relpath: str, file: str | None, expected: str | None, as_: str | None,
    as_json: bool,
) -> None:  # fmt: skip
    """Write RELPATH atomically, with provenance. RELPATH is relative to the
    source's KB root and beneath notes/ (notes/x.md), as kbd read names it; a
    RELPATH relative to notes/ (x.md) is deprecated: it still means notes/x.md,
    with a warning, for one release.

    \b
    EXAMPLES
      echo '# Router' | kbd notes write SID rts notes/router.md
      kbd notes write SID rts notes/r.md --file r.md --expected-version none
    """
    if file is None:
        if sys.stdin.isatty():
            # Reading a terminal would wait silently for input nobody knows to type.
            raise UsageError(
                "no note content: pass --file F, or pipe the content in",
                hint="kbd notes write SID ALIAS RELPATH --file note.md   (or: ... < note.md, or --file - to type it)",
            )
        file = "-"

    try:
        if file == "-":
            data = sys.stdin.buffer.read(MAX_NOTE_BYTES + 1)
        else:
            with open(file, "rb") as fh:
                data = fh.read(MAX_NOTE_BYTES + 1)
    except FileNotFoundError as exc:
        raise NotFound(f"{file} does not exist", hint="pass an existing file, or - for stdin") from exc
    except OSError as exc:
        raise InvalidInput(f"cannot read {file}: {exc.strerror}") from exc
    result = c.result(ops.NoteWrite(sid, alias, relpath, data, expected), as_)
    if result.warning is not None:  # on stderr, so --json's stdout stays the answer alone
        click.echo(f"kbd: warning: {one_line(result.warning)}", err=True)
    if as_json:
        emit(result)
    else:
        click.echo(f"wrote {one_line(result.path)} in {one_line(result.workflow_id)} ({result.bytes} bytes)")


# -- import ------------------------------------------------------------------------------


@main.command("import")
@click.argument("wf", shell_complete=complete_workflows)
@click.argument("folder", metavar="DIR", type=click.Path(path_type=Path, file_okay=False))
@click.option("--dry-run", is_flag=True, help="Report what would change; write nothing.")
@click.option("--update", is_flag=True, help="Replace documents whose source changed since the last import.")
@click.option("--quiet", "-q", is_flag=True, help="Print only the summary line (and no progress).")
@click.option("--verbose", "-v", is_flag=True, help="Also list the documents left unchanged.")
@as_option
@json_option
@pass_ctx
def import_docs(
    c: Ctx, wf: str, folder: Path, dry_run: bool, update: bool, quiet: bool, verbose: bool, as_: str | None,
    as_json: bool,
) -> None:  # fmt: skip
    """Import the Markdown files under DIR into WF's knowledgebase/context/.

    Container = each file's parent folder, title = its `title:` frontmatter or
    first `# H1`; target context/<container>/<title>.md. DIR is read by you, as
    you (links, FIFOs and devices skipped); only the documents travel.

    Prints what was created, updated or skipped and a summary (--verbose: the
    unchanged documents too; --quiet: the summary alone); on a terminal, a
    progress bar on stderr while it works.

    \b
    EXAMPLES
      kbd import research ~/docs/eng --dry-run
      kbd import research ~/docs/eng --update --quiet
    """
    from kbd.fs.importing import read_folder

    if quiet and verbose:
        raise UsageError("--quiet and --verbose exclude each other")
    shown = not (quiet or as_json) and sys.stderr.isatty()
    if shown:
        click.echo(f"reading {one_line(str(folder))} …", err=True)
    found = read_folder(folder)
    batches = ops.import_batches(wf, found.folder, found.docs, found.skipped, dry_run=dry_run, update=update)
    answers = []
    with click.progressbar(length=len(found.docs) + len(found.skipped), label=f"importing into {one_line(wf)}",
                           file=sys.stderr if shown else io.StringIO(), show_pos=True) as bar:  # fmt: skip
        for op in batches:
            answers.append(c.result(op, as_))
            bar.update(len(op.docs) + len(op.skipped))
    # One result for the whole import; the batches report the reader's skips
    # after the documents: one order for the whole import.
    result = dataclasses.replace(
        answers[0],
        created=tuple(i for a in answers for i in a.created),
        updated=tuple(i for a in answers for i in a.updated),
        unchanged=tuple(i for a in answers for i in a.unchanged),
        skipped=tuple(sorted((i for a in answers for i in a.skipped), key=lambda i: i.file)),
    )
    if as_json:
        emit(result)
        return
    listed = () if quiet else (("created", result.created), ("updated", result.updated),
                               *((("unchanged", result.unchanged),) if verbose else ()))  # fmt: skip
    for key, done in listed:
        for d in done:
            click.echo(f"{key:<9} {one_line(d.path)}  <- {one_line(d.file)}")
    for s in () if quiet else result.skipped:
        click.echo(f"skipped   {one_line(s.file)}: {one_line(s.reason)}")
    counts = ", ".join(f"{len(items)} {k}" for k, items in (("created", result.created), ("updated", result.updated),
                                                            ("unchanged", result.unchanged), ("skipped", result.skipped)))  # fmt: skip
    tail = " (dry run: nothing written)" if result.dry_run else ""
    click.echo(f"import into {one_line(result.workflow_id)}: {counts}{tail}")


def _version_line(v: Entry) -> str:
    """One version per line: a write that named no expected version is marked
    ``unchecked``: if its previous version is not what its writer read, that
    is a lost update (`kbd notes diff --version V` shows what it replaced)."""
    who = v.principal or v.workflow or "-"
    at = time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime(v.at))
    unchecked = "  unchecked" if v.how == "write" and v.expected is None else ""
    return f"{v.version}  {at}  {v.how:<7}  {one_line(str(who))}  {v.size} bytes{unchecked}"


@notes.command("log")
@click.argument("source_wf", shell_complete=complete_workflows)
@click.argument("relpath")
@as_option
@json_option
@pass_ctx
def notes_log(c: Ctx, source_wf: str, relpath: str, as_: str | None, as_json: bool) -> None:
    """The kept versions of a note, newest first (RELPATH relative to the KB root: notes/x.md)."""
    if (result := c.shown(ops.NoteLog(source_wf, relpath), as_, as_json)) is None:
        return
    click.echo(f"{one_line(result.relpath)} in {one_line(result.workflow_id)}: "
               f"now {result.current or 'absent'}")  # fmt: skip
    for v in result.versions:
        click.echo(_version_line(v))


@notes.command("show")
@click.argument("source_wf", shell_complete=complete_workflows)
@click.argument("relpath")
@click.option(
    "--version", "version", metavar="V", default=None, help="The version to print (default: newest)."
)
@as_option
@json_option
@pass_ctx
def notes_show(
    c: Ctx, source_wf: str, relpath: str, version: str | None, as_: str | None, as_json: bool
) -> None:
    """Print one kept version of a note (RELPATH relative to the KB root)."""
    if (result := c.shown(ops.NoteShow(source_wf, relpath, version), as_, as_json)) is None:
        return
    write_stdout(result.data)


@notes.command("diff")
@click.argument("source_wf", shell_complete=complete_workflows)
@click.argument("relpath")
@click.option("--version", "version", metavar="V", default=None, help="The newer side (default: newest).")
@click.option("--against", "against", metavar="V", default=None,
              help="The older side (default: the version before --version).")  # fmt: skip
@as_option
@json_option
@pass_ctx
def notes_diff(
    c: Ctx, source_wf: str, relpath: str, version: str | None, against: str | None, as_: str | None,
    as_json: bool,
) -> None:  # fmt: skip
    """Unified diff of two kept versions of a note (default: previous vs newest)."""
    if (result := c.shown(ops.NoteDiff(source_wf, relpath, version, against), as_, as_json)) is None:
        return
    write_stdout(result.diff.encode())


@notes.command("restore")
@click.argument("source_wf", shell_complete=complete_workflows)
@click.argument("relpath")
@click.option("--version", "version", metavar="V", default=None,
              help="The version to restore (default: the one before the newest).")  # fmt: skip
@as_option
@json_option
@pass_ctx
def notes_restore(
    c: Ctx, source_wf: str, relpath: str, version: str | None, as_: str | None, as_json: bool
) -> None:
    """Make a kept version the note's content again (source owners and admins; audited)."""
    if (result := c.shown(ops.NoteRestore(source_wf, relpath, version), as_, as_json)) is None:
        return
    click.echo(f"restored {one_line(result.relpath)} in {one_line(result.workflow_id)} to "
               f"{result.version} ({result.bytes} bytes)")  # fmt: skip


@notes.command("pending")
@click.argument("source_wf")
@as_option
@json_option
@pass_ctx
def notes_pending(c: Ctx, source_wf: str, as_: str | None, as_json: bool) -> None:
    """Contributed notes in SOURCE_WF's notes/ no owner has reviewed (owners and admins)."""
    if (result := c.shown(ops.NotesPending(source_wf), as_, as_json)) is None:
        return
    if not result.pending:
        click.echo(f"no contributions wait for review in {one_line(result.workflow_id)}")
    for p in result.pending:
        # Who and when as far as known: a note with neither provenance nor a command kbd saw write it
        # says no time rather than a made-up one.
        who = one_line(p.contributed_by_workflow)
        if p.contributed_by_session:
            who += f" (session {one_line(p.contributed_by_session)})"
        when = f" at {one_line(p.contributed_at)}" if p.contributed_at else ""
        click.echo(f"{one_line(p.relpath)}  by {who}{when}  {p.digest}  ({p.bytes} bytes)")
    if result.truncated:
        click.echo("(more are waiting: review these first)")


@notes.command("review")
@click.argument("source_wf")
@click.argument("relpath")
@click.option("--approve", is_flag=True, help="Approve version V of the note (needs --expected-version).")
@click.option("--reject", is_flag=True, help="Move the note out of notes/ into kbd's state (restorable).")
@click.option(
    "--expected-version",
    "expected",
    metavar="V",
    default=None,
    help="Decide only if the note is still version V (the digest `kbd notes pending` showed); else exit 75. "
    "Required with --approve.",
)
@as_option
@json_option
@pass_ctx
def notes_review(
    c: Ctx, source_wf: str, relpath: str, approve: bool, reject: bool, expected: str | None, as_: str | None,
    as_json: bool,
) -> None:  # fmt: skip
    """Approve or reject the contributed note RELPATH (relative to the KB root: notes/x.md).

    \b
    EXAMPLES
      kbd notes review research notes/x.md --approve --expected-version sha256:...
      kbd notes review research notes/x.md --reject
    """
    if approve == reject:
        raise UsageError(
            "pass exactly one of --approve and --reject",
            hint="kbd notes review SOURCE_WF notes/x.md --approve --expected-version sha256:<hex>",
        )
    if (
        result := c.shown(
            ops.NotesReview(source_wf, relpath, "approve" if approve else "reject", expected), as_, as_json
        )
    ) is None:
        return
    who = f"contributed by {one_line(result.contributed_by_workflow)} at {one_line(result.contributed_at or '?')}"
    if result.decision == "approved":
        click.echo(f"approved {one_line(result.relpath)} in {one_line(result.workflow_id)} ({who})")
    else:
        click.echo(f"rejected {one_line(result.relpath)} in {one_line(result.workflow_id)} ({who}); "
                   f"moved out of notes/ and kept as rejected #{result.rejected_id}")  # fmt: skip


@notes.command("rejected")
@click.argument("source_wf", shell_complete=complete_workflows)
@as_option
@json_option
@pass_ctx
def notes_rejected(c: Ctx, source_wf: str, as_: str | None, as_json: bool) -> None:
    """Rejected notes kept for SOURCE_WF (each restorable with `kbd notes unreject`)."""
    if (result := c.shown(ops.NotesRejected(source_wf), as_, as_json)) is None:
        return
    if not result.rejected:
        click.echo(f"no rejected notes kept for {one_line(source_wf)}")
    for r in result.rejected:
        at = time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime(r.rejected_at))
        click.echo(f"#{r.id}  {one_line(r.relpath)}  rejected by {one_line(r.rejected_by)} at {at}  "
                   f"{r.bytes} bytes")  # fmt: skip


@notes.command("unreject")
@click.argument("source_wf", shell_complete=complete_workflows)
@click.argument("rejected_id", type=int, metavar="ID")
@as_option
@json_option
@pass_ctx
def notes_unreject(c: Ctx, source_wf: str, rejected_id: int, as_: str | None, as_json: bool) -> None:
    """Put rejected note ID back where it was, byte for byte (unreviewed again)."""
    if (result := c.shown(ops.NotesUnreject(source_wf, rejected_id), as_, as_json)) is None:
        return
    click.echo(f"restored rejected #{result.rejected_id} to {one_line(result.relpath)} in "
               f"{one_line(result.workflow_id)} (unreviewed)")  # fmt: skip
