"""The grammar of ``kbd exec``, once: the lean path (:mod:`kbd.cli.entry`) and
the click command (:mod:`kbd.cli.commands`) both parse with :func:`parse_exec`,
so a malformed invocation gets the same error and exit code whichever path
sees it. Standard library only: the lean path imports it before every agent
shell command."""

from __future__ import annotations

from kbd.errors import UsageError

# Not ``typing.TYPE_CHECKING``: ``typing`` costs ≈7 ms of imports on the lean path.
TYPE_CHECKING = False
if TYPE_CHECKING:
    from collections.abc import Sequence

EXEC_USAGE = "kbd exec SID [--cwd DIR] [--as P] [--strict-contributions] [--json] -- CMD [ARG...]"
HELP_FLAGS = ("-h", "--help")
# exec's own options; each takes a value (``--cwd DIR`` or ``--cwd=DIR``).
EXEC_OPTIONS = ("--cwd", "--as", "--socket")
#: exec's options that take no value (docs/notes.md "Staged contributions").
EXEC_FLAGS = ("--strict-contributions", "--json")
_SEE_HELP = "see `kbd exec --help`"


class ExecArgs:
    """One ``kbd exec`` invocation: the session, the command and exec's options
    (plain data, compared by value; not a dataclass, for import time)."""

    __slots__ = ("as_", "command", "cwd", "json", "sid", "socket", "strict")

    def __init__(
        self,
        sid: str,
        command: tuple[str, ...],
        cwd: str | None = None,
        as_: str | None = None,
        socket: str | None = None,  # the daemon to run it through (else KBD_SOCKET, else the root's socket)
        strict: bool = False,  # --strict-contributions
        json: bool = False,  # --json: the contributions report and the refusals, JSON lines on stderr
    ) -> None:
        self.sid, self.command, self.cwd, self.as_, self.socket = sid, command, cwd, as_, socket
        self.strict, self.json = strict, json

    def with_socket(self, socket: str | None) -> ExecArgs:
        return ExecArgs(self.sid, self.command, cwd=self.cwd, as_=self.as_, socket=socket, strict=self.strict,
                        json=self.json)  # fmt: skip

    @property
    def flags(self) -> int:
        """The wire's flags byte (kbd.core.wire FLAG_STRICT, FLAG_JSON)."""
        return (1 if self.strict else 0) | (2 if self.json else 0)

    def _key(self) -> tuple[object, ...]:
        return (self.sid, self.command, self.cwd, self.as_, self.socket, self.strict, self.json)

    def __eq__(self, other: object) -> bool:
        return isinstance(other, ExecArgs) and self._key() == other._key()

    def __hash__(self) -> int:
        return hash(self._key())

    def __repr__(self) -> str:
        return (f"ExecArgs(sid={self.sid!r}, command={self.command!r}, cwd={self.cwd!r}, as_={self.as_!r}, "
                f"socket={self.socket!r}, strict={self.strict!r}, json={self.json!r})")  # fmt: skip


def _take_options(args: Sequence[str], i: int, values: dict[str, str]) -> int | None:
    """Read exec's options from ``args[i:]`` into ``values`` (a later one wins);
    the index of the first word after them (past a ``--``, which ends them), or
    None when help is asked for."""
    while i < len(args):
        word = args[i]
        if word == "--":
            return i + 1
        if word in HELP_FLAGS:
            return None
        if word == "-" or not word.startswith("-"):
            return i
        if word in EXEC_FLAGS:
            values[word] = "1"
            i += 1
            continue
        name, has_value, value = word.partition("=")
        if name in EXEC_FLAGS:
            raise UsageError(f"Option '{name}' does not take a value.", hint=_SEE_HELP)
        if name not in EXEC_OPTIONS:
            # Never a command: `kbd exec SID --bogus` must not run `--bogus`.
            raise UsageError(
                f"No such option '{name}'.", hint=f"{EXEC_USAGE} (the command's own options go after --)"
            )
        if not has_value:
            if i + 1 >= len(args) or args[i + 1] == "--":
                raise UsageError(f"Option '{name}' requires an argument.", hint=_SEE_HELP)
            value, i = args[i + 1], i + 1
        values[name] = value
        i += 1
    return i


def parse_exec(args: Sequence[str]) -> ExecArgs | None:
    """Parse what follows ``exec``: ``[OPTIONS] SID [OPTIONS] [--] CMD [ARG...]``.

    None when the invocation asks for help (``-h``/``--help`` where an option
    may stand: the click command prints it). A malformed invocation is a
    UsageError (exit 2) naming what is wrong; its messages for a missing SID or
    command are click's, as they always were."""
    values: dict[str, str] = {}
    i = _take_options(args, 0, values)
    if i is None:
        return None
    if i >= len(args):
        raise UsageError("Missing argument 'SID'.", hint=_SEE_HELP)
    sid = args[i]
    if i + 1 >= len(args):
        raise UsageError("Missing argument 'COMMAND...'.", hint=_SEE_HELP)
    j = _take_options(args, i + 1, values)
    if j is None:
        return None
    if j >= len(args):
        raise UsageError("no command given", hint=EXEC_USAGE)
    if values.get("--socket") == "":
        raise UsageError("--socket was given an empty path", hint="pass --socket PATH, or leave --socket out")
    return ExecArgs(
        sid,
        tuple(args[j:]),
        cwd=values.get("--cwd"),
        as_=values.get("--as"),
        socket=values.get("--socket"),
        strict="--strict-contributions" in values,
        json="--json" in values,
    )


def wants_help(args: Sequence[str]) -> bool:
    try:
        return parse_exec(args) is None
    except UsageError:
        return False
