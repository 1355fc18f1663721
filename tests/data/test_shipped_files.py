"""Invariants of every shipped data file: Seatbelt profiles and policies."""

from __future__ import annotations

import re
import shutil
import subprocess
from pathlib import Path

import pytest
from hypothesis import given
from hypothesis import strategies as st

from kbd.core import policy
from kbd.core.folders import FolderStatus
from kbd.core.plan import build_plan
from kbd.core.resolve import Attachment, WriteStatus
from kbd.fs import datafiles
from kbd.sandbox import seatbelt

PROFILES = sorted((Path(__file__).resolve().parents[2] / "sandbox-profiles").glob("*.sb"))
WF = Path("/Users/agent/workflows")


def att(alias: str, path: Path, *, writable: bool) -> Attachment:
    return Attachment(
        alias=alias, workflow_id=alias, label=alias, access="write" if writable else "read", available=True,
        reason=None, message=None, write=WriteStatus(True, None) if writable else None,
        path=path, kb_identity=(1, 1),
    )  # fmt: skip


def write_plan(kb_path: Path = WF / "src" / "knowledgebase", own: Path = WF / "con") -> object:
    return build_plan(
        workflow_id="con", workflow_folder=own, policy=datafiles.consumer_kind("execution"), kb_access="read-write",
        item_kb_write=False, attachments=[att("src", kb_path, writable=True)],
        folders=[FolderStatus("f", "read_only", True, None, None, WF / "shared")],
    )  # fmt: skip


def tokens_outside_strings(text: str) -> str:
    """Profile text with comments and string literals removed."""
    out = re.sub(r";[^\n]*", "", text)
    return re.sub(r'"(?:[^"\\]|\\.)*"', '""', out)


@pytest.mark.parametrize("path", PROFILES, ids=lambda p: p.name)
def test_every_shipped_profile_starts_from_deny_default(path: Path) -> None:
    text = path.read_text()
    code = tokens_outside_strings(text)
    assert "(deny default)" in code
    assert "(allow default)" not in code
    assert code.index("(deny default)") < code.index("(allow")
    assert seatbelt.MARKER in text


def test_rendered_profile_invariants() -> None:
    plan = write_plan()
    profile, params = seatbelt.render(plan)  # type: ignore[arg-type]
    used = seatbelt.declared_params(profile)
    assert used == set(params), "every parameter used is supplied, and every supplied one is used"
    for value in params.values():
        assert value not in profile, "paths travel as -D parameters, never as profile text"
    # Writes into the contributed notes/ exclude its _index.json.
    notes = str(WF / "src" / "knowledgebase" / "notes")
    w = next(k for k, v in params.items() if v == notes and k.startswith("W_"))
    ro = next(k for k, v in params.items() if v == notes + "/_index.json" and k.startswith("RO_"))
    assert (
        f'(allow file-write* (require-all (subpath (param "{w}")) (require-not (literal (param "{ro}")))))'
        in profile
    )
    # The index and the notes/ folder holding it cannot be unlinked or renamed.
    anchors = {params[k] for k in used if k.startswith("A_")}
    assert {notes + "/_index.json", notes} <= anchors
    # Nothing writable outside the plan's write paths.
    writable = {params[k] for k in used if k.startswith("W_")}
    assert writable == set(plan.write)  # type: ignore[attr-defined]
    argv = seatbelt.sandbox_exec_argv(profile, params, ["cat", "x"])
    assert argv[:3] == ["/usr/bin/sandbox-exec", "-p", profile] and argv[-2:] == ["cat", "x"]


hostile = st.text(
    alphabet=st.characters(blacklist_categories=["Cs"], blacklist_characters="\x00/"), min_size=1, max_size=40
).filter(lambda n: n not in {".", ".."})  # never a folder name the registry yields


@given(names=st.lists(hostile, min_size=2, max_size=2))
def test_no_path_can_break_out_of_the_profile(names: list[str]) -> None:
    """Quotes, parentheses, semicolons, newlines, unicode: the profile text does
    not depend on the characters of any path, only on the plan's shape."""
    profile, params = seatbelt.render(write_plan(WF / names[0] / "knowledgebase", WF / names[1]))  # type: ignore[arg-type]
    # The same shape with harmless names (same order and equality).
    safe = {n: f"n{i}" for i, n in enumerate(sorted(set(names)))}
    shape, _ = seatbelt.render(write_plan(WF / safe[names[0]] / "knowledgebase", WF / safe[names[1]]))  # type: ignore[arg-type]
    assert profile == shape
    assert str(WF / names[0] / "knowledgebase") in params.values()
    assert seatbelt.declared_params(profile) == set(params)


@given(value=st.text(max_size=60))
def test_sbpl_string_is_one_closed_literal(value: str) -> None:
    lit = seatbelt.sbpl_string(value)
    assert lit.startswith('"') and lit.endswith('"') and len(lit) >= 2
    body = lit[1:-1]
    # Scan as an SBPL string: an unescaped quote would end it early.
    i = 0
    while i < len(body):
        assert body[i] != '"', lit
        assert body[i] not in "\n\r\x00"
        i += 2 if body[i] == "\\" else 1
    decoded = re.sub(r"\\x([0-9a-f]{2})", lambda m: chr(int(m.group(1), 16)), body)
    decoded = re.sub(r"\\(.)", r"\1", decoded)
    assert decoded == value or "\\x" in value


def test_shipped_consumer_kind_policy_is_complete_and_strict() -> None:
    table = datafiles.consumer_kinds()
    assert set(table) == set(policy.KINDS)
    assert not any(
        k.source_write
        for k in table.values()
        if k.name in ("builder", "kb_maintenance") or k.name.startswith("reviewer_")
    )
    assert all(not k.may_write_kb for k in table.values() if k.name.startswith("reviewer_"))


@pytest.mark.parametrize(
    ("mutation", "message"),
    [
        (lambda d: d["kinds"].pop("builder"), "kind 'builder' is not defined"),
        (lambda d: d["kinds"].update(relay=d["kinds"]["builder"]), "unknown kind 'relay'"),
        (lambda d: d["kinds"]["builder"].update(extra=1), "unknown key kinds.builder.extra"),
        (lambda d: d["kinds"]["builder"].update(own_folder="everything"), "allowed: read-write, read-only"),
        (lambda d: d.update(version=2), "version must be 1"),
    ],
)
def test_policy_rejections(mutation: object, message: str) -> None:
    import copy

    from kbd.core.strict import load_yaml
    from kbd.errors import InvalidConfig

    doc = load_yaml(datafiles.policy_path("consumer_kinds.yaml").read_text(), source="p")
    bad = copy.deepcopy(doc)
    mutation(bad)  # type: ignore[operator]
    with pytest.raises(InvalidConfig, match=re.escape(message)):
        policy.parse_policy(bad, source="p")


SYSTEMD = Path(__file__).resolve().parents[2] / "systemd"


def unit(name: str) -> dict[str, list[str]]:
    out: dict[str, list[str]] = {}
    for line in (SYSTEMD / name).read_text().splitlines():
        line = line.strip()
        if line.startswith("#") or not line:
            continue
        # systemd has no inline comments: a '#' after a value would become part of it.
        assert "#" not in line, f"{name}: inline comment in {line!r}"
        if "=" in line and not line.startswith("["):
            key, value = line.split("=", 1)
            out.setdefault(key.strip(), []).append(value.strip())
    return out


def test_socket_unit_is_group_only() -> None:
    sock = unit("kbd.socket")
    # DirectoryMode was 0750, which locked group kbd out (docs/api.md "Socket and authentication"): see the next test.
    assert sock["SocketMode"] == ["0660"] and sock["DirectoryMode"] == ["0755"]
    assert sock["ListenStream"][0].startswith("/") and sock["Accept"] == ["no"]


def rendered_socket(sock: dict[str, list[str]]) -> tuple[tuple[int, str], tuple[int, str, str]]:
    """What systemd makes of a socket unit: the socket's folder (mode, group) and the
    socket (mode, user, group). systemd creates missing parent folders root:root with
    DirectoryMode (default 0755); SocketUser/SocketGroup/SocketMode apply to the socket
    node only."""
    folder = (int(sock.get("DirectoryMode", ["0755"])[-1], 8), "root")
    node = (int(sock.get("SocketMode", ["0666"])[-1], 8), sock.get("SocketUser", ["root"])[-1],
            sock.get("SocketGroup", ["root"])[-1])  # fmt: skip
    return folder, node


def reachable_by_group(group: str, folder: tuple[int, str], node: tuple[int, str, str]) -> bool:
    """A member of ``group`` (not root, not the owner) can traverse the folder and connect
    (connecting to a Unix socket needs write permission on it)."""
    (dmode, dgroup), (smode, _, sgroup) = folder, node
    traverse = bool(dmode & (0o010 if dgroup == group else 0o001))
    connect = bool(smode & (0o020 if sgroup == group else 0o002))
    return traverse and connect


def test_socket_unit_renders_a_socket_group_kbd_can_reach_and_others_cannot() -> None:
    folder, node = rendered_socket(unit("kbd.socket"))
    assert node == (0o660, "root", "kbd")
    assert reachable_by_group("kbd", folder, node), "group kbd cannot reach the socket"
    assert not reachable_by_group("users", folder, node), "others can connect"
    assert not folder[0] & 0o022, "the socket's folder is writable by group or others"
    # The rule itself: the previous unit (0750 root:root) is refused.
    assert not reachable_by_group("kbd", (0o750, "root"), node)


def test_units_pass_systemd_analyze_verify(tmp_path: Path) -> None:
    """When systemd-analyze exists, it parses both units (ExecStart pointed at a real binary)."""
    tool = shutil.which("systemd-analyze")
    for name in ("kbd.socket", "kbd.service"):
        text = (SYSTEMD / name).read_text()
        (tmp_path / name).write_text(re.sub(r"(?m)^ExecStart=\S+", "ExecStart=/bin/true", text))
    if tool is None:
        return  # the parse-based tests above still hold
    proc = subprocess.run([tool, "verify", "kbd.socket", "kbd.service"], cwd=tmp_path, capture_output=True,
                          text=True, timeout=60, check=False)  # fmt: skip
    assert proc.returncode == 0 and not proc.stderr.strip(), proc.stderr


def test_service_unit_keeps_bubblewrap_working() -> None:
    svc = unit("kbd.service")
    # The executable is filled in at install (`kbd units install`), never a fixed path.
    assert svc["ExecStart"] == ["{{KBD_BIN}} serve"]
    assert "RestrictNamespaces" not in svc, "bubblewrap needs namespaces"
    assert "PrivateUsers" not in svc
    for f in svc.get("SystemCallFilter", []):
        # An allow-list must name @mount, a deny-list (~…) must not (systemd/README.md: a deny-list).
        assert ("@mount" in f) != f.startswith("~"), "a syscall filter without @mount breaks bubblewrap"
    assert svc["NoNewPrivileges"] == ["yes"] and svc["UMask"] == ["0027"]
    # Every directive in the Service section has a comment on its line or just above.
    lines = (SYSTEMD / "kbd.service").read_text().splitlines()
    hardening = [
        i for i, ln in enumerate(lines) if re.match(r"(Protect|Restrict|Lock|NoNew|Private)\w*=", ln)
    ]
    assert hardening and all(lines[i - 1].startswith("#") for i in hardening)
