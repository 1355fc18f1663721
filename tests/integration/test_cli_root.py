"""The root through the real CLI: `kbd init` (and `--demo`), the default root,
strict config files, `kbd doctor` and `kbd validate` (docs/on-disk.md, docs/cli.md)."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import yaml

from tests.helpers import CliResult, KbRoot

ERROR_LINE = re.compile(r"^error\[[a-z][a-z-]*\]: (?P<message>.+)$")


def run_kbd(*args: str, cwd: Path, env: dict[str, str | None] | None = None) -> CliResult:
    """Run `kbd` WITHOUT --root: the root comes from the environment."""
    full = {k: v for k, v in os.environ.items() if not k.startswith("KBD_")}
    for key, value in (env or {}).items():
        if value is None:
            full.pop(key, None)
        else:
            full[key] = value
    proc = subprocess.run(
        [sys.executable, "-m", "kbd", *args],
        capture_output=True,
        env=full,
        cwd=cwd,
        timeout=60,
        check=False,
    )
    return CliResult(proc.returncode, proc.stdout.decode(), proc.stderr.decode())


def tree(root: Path) -> dict[str, bytes]:
    """Every file of the root but kbd's parse cache (state/cache/): the cache of a
    config file that validated may be written by any command once the file has
    settled (datafiles.read_yaml_cached), which is not a change to the root's data."""
    cache = root / "state" / "cache"
    return {
        str(p.relative_to(root)): p.read_bytes()
        for p in sorted(root.rglob("*"))
        if p.is_file() and cache not in p.parents
    }


def error_message(r: CliResult) -> str:
    lines = r.err.strip().splitlines()
    assert lines, f"no error output (exit {r.code}, stdout {r.out!r})"
    m = ERROR_LINE.match(lines[0])
    assert m is not None, f"stderr does not start with error[<code>]: …\n{r.err}"
    assert any(line.startswith("hint: ") for line in lines[1:]), f"no hint: line\n{r.err}"
    assert "Traceback" not in r.err
    return m.group("message")


# -- kbd init ---------------------------------------------------------------------------


def test_init_writes_config_and_principals(tmp_path: Path) -> None:
    root = tmp_path / "root"
    r = KbRoot(root).cli("init", "--host", "exec-1", "--json")
    assert r.code == 0, r.err
    assert r.json() == {
        "root": str(root.resolve()),
        "host": "exec-1",
        "demo_workflows": [],
        "replaced": False,
    }
    config = yaml.safe_load((root / "kbd.yaml").read_text())
    assert config["host"] == "exec-1"
    assert config["workflow_roots"] == ["workflows"]
    principals = yaml.safe_load((root / "principals.yaml").read_text())["principals"]
    assert len(principals) >= 1
    # The operator running init is an admin mapped to their uid, so the CLI works without --as.
    assert any(p.get("admin") is True and p.get("uid") == os.getuid() for p in principals)
    assert (root / "workflows").is_dir()
    assert (root / "state").is_dir()
    listed = KbRoot(root).cli("workflows", "list", "--json")
    assert listed.code == 0, listed.err
    assert listed.json() == {"workflows": []}
    doctor = KbRoot(root).cli("doctor")
    assert doctor.code == 0, doctor.out + doctor.err


@pytest.mark.parametrize("existing", ["empty-folder", "folder-without-kbd-yaml"])
def test_init_accepts_a_folder_without_kbd_yaml(tmp_path: Path, existing: str) -> None:
    root = tmp_path / "root"
    root.mkdir()
    if existing == "folder-without-kbd-yaml":
        (root / "README.txt").write_text("operator notes\n")
    # In process (KbRoot.call); test_init_writes_config_and_principals runs `kbd init` for real.
    r = KbRoot(root).call("init", "--host", "h")
    assert r.code == 0, r.err
    assert (root / "kbd.yaml").is_file()
    assert (root / "principals.yaml").is_file()
    if existing == "folder-without-kbd-yaml":
        assert (root / "README.txt").read_text() == "operator notes\n"


@pytest.mark.parametrize("extra", [[], ["--demo"], ["--host", "other"]], ids=["plain", "demo", "host"])
def test_init_refuses_an_existing_root(kb: KbRoot, extra: list[str]) -> None:
    kb.workflow("mine", access={"owners": ["alice"]})
    with (kb.root / "kbd.yaml").open("a") as fh:
        fh.write("# operator edit\n")
    before = tree(kb.root)
    r = kb.call("init", *extra)  # in process: the refusal is the subject (KbRoot.call)
    assert r.code == 65, r.out + r.err
    message = error_message(r)
    assert str(kb.root) in message and "kbd.yaml" in message
    assert "--force" in r.err.split("hint:", 1)[1]
    assert tree(kb.root) == before


def test_init_force_rewrites_config_but_keeps_workflows(kb: KbRoot) -> None:
    mine = kb.workflow("mine", access={"owners": ["alice"]})
    with (kb.root / "kbd.yaml").open("a") as fh:
        fh.write("# operator edit\n")
    workflow_files = tree(mine)
    r = kb.cli("init", "--force", "--host", "rebuilt")
    assert r.code == 0, r.err
    text = (kb.root / "kbd.yaml").read_text()
    assert "# operator edit" not in text
    assert yaml.safe_load(text)["host"] == "rebuilt"
    assert tree(mine) == workflow_files


def test_init_demo_shows_every_status(tmp_path: Path) -> None:
    root = tmp_path / "demo"
    r = KbRoot(root).cli("init", "--demo", "--json")
    assert r.code == 0, r.err
    assert len(r.json()["demo_workflows"]) >= 4
    listed = KbRoot(root).cli("workflows", "list", "--as", "ops", "--json")
    assert listed.code == 0, listed.err
    ok = [w for w in listed.json()["workflows"] if w["status"] == "ok"]
    assert len(ok) >= 4

    r = KbRoot(root).cli("workflows", "show", "wf_perf", "--as", "alice", "--json")
    assert r.code == 0, r.err
    sources: list[dict[str, Any]] = r.json()["sources"]
    reads = [a for a in sources if a["available"] and a["access"] == "read"]
    granted = [a for a in sources if a["available"] and a["write"] and a["write"]["available"]]
    pending = [
        a for a in sources if a["available"] and a["write"] and a["write"]["reason"] == "write_not_granted"
    ]
    unavailable = [a for a in sources if not a["available"]]
    assert reads and all(a["write"] is None and a["path"] for a in reads)
    assert granted and all(a["write"]["reason"] is None for a in granted)
    assert pending and all(a["write"]["available"] is False and a["path"] for a in pending)
    assert unavailable
    for a in unavailable:
        assert a["reason"] in (
            "not_found",
            "ambiguous_id",
            "manifest_unreadable",
            "audience_denied",
            "other_host",
            "kb_missing",
            "kb_not_dir",
            "kb_symlinked",
            "kb_mountpoint",
            "invalid_entry",
        )
        assert a["message"] and a["path"] is None
    assert r.json()["writes_into"] == [a["workflow_id"] for a in granted]


# -- the default root --------------------------------------------------------------------


@pytest.mark.parametrize(
    ("kbd_root", "xdg", "expected"),
    [
        pytest.param("explicit", "xdg", "explicit", id="KBD_ROOT-wins"),
        pytest.param(None, "xdg", "xdg/kbd", id="XDG_DATA_HOME"),
        pytest.param(None, None, "home/.local/share/kbd", id="HOME-fallback"),
        pytest.param(None, "relative/xdg", "home/.local/share/kbd", id="relative-XDG-ignored"),
    ],
)
def test_default_root_follows_environment(
    tmp_path: Path, kbd_root: str | None, xdg: str | None, expected: str
) -> None:
    home = tmp_path / "home"
    home.mkdir()
    env: dict[str, str | None] = {
        "HOME": str(home),
        "KBD_ROOT": str(tmp_path / kbd_root) if kbd_root else None,
        # A relative XDG_DATA_HOME is stated as given: the XDG spec says to ignore it.
        "XDG_DATA_HOME": (xdg if xdg.startswith("relative") else str(tmp_path / xdg)) if xdg else None,
    }
    r = run_kbd("init", "--host", "h", "--json", cwd=tmp_path, env=env)
    assert r.code == 0, r.err
    want = tmp_path / expected
    assert r.json()["root"] == str(want.resolve())
    assert (want / "kbd.yaml").is_file()
    assert not (tmp_path / "relative").exists()
    # Later commands find the same root the same way.
    (want / "principals.yaml").write_text(yaml.safe_dump({"principals": [{"id": "alice"}]}))
    KbRoot(want).workflow("here", access={"owners": ["alice"]})
    listed = run_kbd("workflows", "list", "--as", "alice", "--json", cwd=tmp_path, env=env)
    assert listed.code == 0, listed.err
    assert [w["id"] for w in listed.json()["workflows"]] == ["here"]


def test_root_option_beats_kbd_root(tmp_path: Path) -> None:
    r = run_kbd(
        "--root",
        str(tmp_path / "flag"),
        "init",
        "--host",
        "h",
        "--json",
        cwd=tmp_path,
        env={"KBD_ROOT": str(tmp_path / "env")},
    )
    assert r.code == 0, r.err
    assert (tmp_path / "flag" / "kbd.yaml").is_file()
    assert not (tmp_path / "env").exists()


def test_missing_default_root_is_a_clear_error(tmp_path: Path) -> None:
    r = run_kbd("workflows", "list", "--as", "alice", cwd=tmp_path, env={"KBD_ROOT": str(tmp_path / "none")})
    assert r.code == 65
    message = error_message(r)
    assert str(tmp_path / "none") in message
    assert "kbd init" in r.err.split("hint:", 1)[1]


# -- strict config -------------------------------------------------------------------------

KBD_YAML_CASES = [
    pytest.param(
        "host: test-host\n", "host: test-host\nnetwrk: none\n", ["unknown key netwrk"], id="top-unknown"
    ),
    pytest.param(
        "  network: none",
        "  netwrk: none",
        ["unknown key sandbox.netwrk", "allowed:", "network"],
        id="nested-unknown",
    ),
    pytest.param(
        "  immediate: false",
        "  immediat: false",
        ["unknown key revocation.immediat", "immediate"],
        id="nested-unknown-revocation",
    ),
    pytest.param(
        "host: test-host\n", "host: test-host\nhost: other\n", ["duplicate key 'host'"], id="dup-top"
    ),
    pytest.param(
        "  network: none",
        "  network: none\n  network: host",
        ["duplicate key 'network'"],
        id="dup-nested",
    ),
    pytest.param(
        "  network: none",
        "  network: maybe",
        ["sandbox.network", "'maybe'", "allowed: none, host"],
        id="bad-network",
    ),
    pytest.param(
        "  network: none",
        "  network: off",
        ["sandbox.network", "none", "host"],
        id="bad-network-yaml-bool",
    ),
    pytest.param(
        "  backend: auto",
        "  backend: docker",
        ["sandbox.backend", "'docker'", "auto, bwrap, landlock"],
        id="bad-backend",
    ),
    pytest.param(
        "  unsafe_no_sandbox: false",
        "  unsafe_no_sandbox: sure",
        ["sandbox.unsafe_no_sandbox", "true or false"],
        id="bad-bool",
    ),
    pytest.param(
        "  timeout_seconds: 10",
        "  timeout_seconds: -1",
        ["locks.timeout_seconds", "between 0", "3600"],
        id="bad-number",
    ),
]


@pytest.mark.parametrize(("old", "new", "fragments"), KBD_YAML_CASES)
def test_kbd_yaml_is_strict(kb: KbRoot, old: str, new: str, fragments: list[str]) -> None:
    path = kb.root / "kbd.yaml"
    text = path.read_text()
    assert old in text
    path.write_text(text.replace(old, new, 1))
    before = tree(kb.root)
    r = kb.call("workflows", "list", "--as", "alice", "--json")
    assert r.code == 65, r.out + r.err
    message = error_message(r)
    assert "kbd.yaml" in message
    for fragment in fragments:
        assert fragment in message, f"{fragment!r} not in {message!r}"
    assert tree(kb.root) == before


PRINCIPALS_CASES = [
    pytest.param(
        "principals:\n- id: alice\n- id: bob\n  admn: true\n",
        ["unknown key principals[1].admn", "allowed:", "admin"],
        id="entry-unknown-key",
    ),
    pytest.param(
        "principals:\n- id: alice\nusers:\n- id: bob\n",
        ["unknown key users", "allowed: principals"],
        id="top-unknown-key",
    ),
    pytest.param(
        "principals:\n- id: alice\n  admin: false\n  admin: true\n",
        ["duplicate key 'admin'"],
        id="dup-key-in-entry",
    ),
    pytest.param(
        "principals:\n- id: alice\nprincipals:\n- id: ops\n  admin: true\n",
        ["duplicate key 'principals'"],
        id="dup-top-key",
    ),
    pytest.param(
        "principals:\n- id: alice\n  kind: robot\n",
        ["principals[0].kind", "'robot'", "allowed: user, service"],
        id="bad-kind",
    ),
    pytest.param(
        "principals:\n- id: alice\n  admin: maybe\n",
        ["principals[0].admin", "true or false"],
        id="bad-admin",
    ),
    pytest.param(
        "principals:\n- id: alice\n- id: alice\n",
        ["principals[1].id", "'alice'", "listed twice"],
        id="dup-id",
    ),
]


@pytest.mark.parametrize(("text", "fragments"), PRINCIPALS_CASES)
def test_principals_yaml_is_strict(kb: KbRoot, text: str, fragments: list[str]) -> None:
    (kb.root / "principals.yaml").write_text(text)
    before = tree(kb.root)
    r = kb.call("workflows", "list", "--as", "alice", "--json")
    assert r.code == 65, r.out + r.err
    message = error_message(r)
    assert "principals.yaml" in message
    for fragment in fragments:
        assert fragment in message, f"{fragment!r} not in {message!r}"
    assert tree(kb.root) == before


def test_doctor_reports_a_bad_config(kb: KbRoot) -> None:
    path = kb.root / "kbd.yaml"
    path.write_text(path.read_text().replace("  network: none", "  netwrk: none", 1))
    r = kb.cli("doctor")
    assert r.code != 0
    assert "sandbox.netwrk" in r.out + r.err
    assert "kbd.yaml" in r.out + r.err


# -- kbd doctor ----------------------------------------------------------------------------


def test_doctor_passes_on_a_good_root(kb: KbRoot) -> None:
    kb.workflow("a", access={"owners": ["alice"]})
    kb.workflow("b", access={"owners": ["bob"]}, sources=[{"workflow_id": "a", "alias": "a"}])
    r = kb.cli("doctor")
    assert r.code == 0, r.out + r.err
    assert "FAIL" not in r.out
    j = kb.cli("doctor", "--json")
    assert j.code == 0, j.err
    data = j.json()
    assert data["ok"] is True
    assert data["checks"] and all(c["ok"] for c in data["checks"])


def test_doctor_names_an_ambiguous_id(kb: KbRoot) -> None:
    kb.workflow("fine", access={"owners": ["alice"]})
    first = kb.workflow("wf_shared", folder="original", access={"owners": ["alice"]})
    second = kb.workflow("wf_shared", folder="copied", access={"owners": ["alice"]})
    r = kb.cli("doctor")
    assert r.code != 0, r.out
    assert "wf_shared" in r.out
    assert "ambiguous_id" in r.out
    assert str(first) in r.out and str(second) in r.out
    j = kb.cli("doctor", "--json")
    assert j.code != 0
    data = j.json()
    assert data["ok"] is False
    failed = [c for c in data["checks"] if not c["ok"]]
    assert failed and any("wf_shared" in c["detail"] for c in failed)


# -- kbd validate --------------------------------------------------------------------------

GOOD_MANIFEST: dict[str, Any] = {
    "id": "wf_good",
    "label": "Good",
    "access": {"owners": ["alice"], "allowed_kb_writers": ["wf_other"]},
    "knowledgebase_sources": [
        {"workflow_id": "wf_a", "alias": "a"},
        {"workflow_id": "wf_b", "alias": "b_2", "access": "write"},
    ],
    "schedule": {"anything": [1, 2.5, "x"]},
}


def test_validate_accepts_a_good_manifest(tmp_path: Path) -> None:
    f = tmp_path / "workflow.json"
    f.write_text(json.dumps(GOOD_MANIFEST))
    # validate needs no root: it checks syntax and field rules, not reachability.
    r = KbRoot(tmp_path / "no-root").cli("validate", str(f))
    assert r.code == 0, r.err
    assert "valid" in r.out
    j = KbRoot(tmp_path / "no-root").cli("validate", str(f), "--json")
    assert j.code == 0, j.err
    assert j.json()["valid"] is True
    assert j.json()["problems"] == []


BAD_ENTRIES: list[Any] = [
    {"workflow_id": "wf_a", "alias": "Bad"},
    {"workflow_id": "wf_b", "alias": "b", "path": "/srv/kb"},
    {"workflow_id": "../wf_c", "alias": "c"},
    {"workflow_id": "wf_d", "alias": "d", "access": "admin"},
    {"workflow_id": "wf_bad", "alias": "me"},
    {"workflow_id": "wf_e", "alias": "access"},
]
BAD_PROBLEMS = [
    ("knowledgebase_sources[0]", "alias 'Bad'"),
    ("knowledgebase_sources[1]", "unknown key 'path'"),
    ("knowledgebase_sources[2]", "looks like a path"),
    ("knowledgebase_sources[3]", "access 'admin' is not allowed"),
    ("knowledgebase_sources[4]", "names this workflow itself"),
    ("knowledgebase_sources[5]", "'access' is reserved"),
]


def test_validate_lists_each_problem(tmp_path: Path) -> None:
    f = tmp_path / "workflow.json"
    f.write_text(json.dumps({"id": "wf_bad", "knowledgebase_sources": BAD_ENTRIES}))
    before = f.read_bytes()
    r = KbRoot(tmp_path / "no-root").cli("validate", str(f))
    assert r.code == 65, r.out + r.err
    message = error_message(r)
    assert message.startswith(f"{f}: {len(BAD_PROBLEMS)} problem(s)")
    # One line per problem on stdout (docs/on-disk.md "Validation": no longer
    # joined with " | " into the error line), each starting with the entry it names.
    segments = [line.removeprefix(f"{f}: ") for line in r.out.splitlines()]
    assert len(segments) == len(BAD_PROBLEMS), segments
    for segment, (where, what) in zip(segments, BAD_PROBLEMS, strict=True):
        assert segment.startswith(f"{where}: ") and what in segment, segment
    j = KbRoot(tmp_path / "no-root").cli("validate", str(f), "--json")
    assert j.code == 65
    data = j.json()
    assert data["valid"] is False
    assert len(data["problems"]) == len(BAD_PROBLEMS)
    for problem, (where, what) in zip(data["problems"], BAD_PROBLEMS, strict=True):
        assert problem.startswith(f"{where}: ") and what in problem
    assert f.read_bytes() == before


@pytest.mark.parametrize(
    ("doc", "fragments"),
    [
        pytest.param(
            {
                "id": "x",
                "knowledgebase_sources": [{"workflow_id": f"w{i}", "alias": f"a{i}"} for i in range(21)],
            },
            ["knowledgebase_sources[20]", "more than 20 sources"],
            id="more-than-20",
        ),
        pytest.param(
            {
                "id": "x",
                "knowledgebase_sources": [
                    {"workflow_id": "a", "alias": "s"},
                    {"workflow_id": "b", "alias": "s"},
                ],
            },
            ["knowledgebase_sources[1]", "alias 's' is used by more than one entry"],
            id="duplicate-alias",
        ),
        pytest.param(
            {
                "id": "x",
                "knowledgebase_sources": [
                    {"workflow_id": "a", "alias": "s"},
                    {"workflow_id": "a", "alias": "t"},
                ],
            },
            ["knowledgebase_sources[1]", "workflow 'a' is attached more than once"],
            id="duplicate-source",
        ),
        pytest.param(
            {"id": "x", "knowledgebase_sources": {"workflow_id": "a"}},
            ["knowledgebase_sources must be a list"],
            id="sources-not-a-list",
        ),
        pytest.param(
            {"id": "x", "access": {"owners": "alice"}},
            ["access.owners must be a list of principal IDs"],
            id="owners-not-a-list",
        ),
        pytest.param({"label": "no id"}, ["has no id"], id="missing-id"),
    ],
)
def test_validate_rejects(tmp_path: Path, doc: dict[str, Any], fragments: list[str]) -> None:
    f = tmp_path / "workflow.json"
    f.write_text(json.dumps(doc))
    r = KbRoot(tmp_path / "no-root").call("validate", str(f))
    assert r.code == 65, r.out + r.err
    # Entry and field problems are listed on stdout, one per line (docs/on-disk.md "Validation"); whole-file
    # problems stay in the error line.
    message = error_message(r) + "\n" + r.out
    for fragment in fragments:
        assert fragment in message, f"{fragment!r} not in {message!r}"


def test_validate_lists_every_top_level_problem_naming_the_file(tmp_path: Path) -> None:
    """Not only the first: each field that makes the file unreadable is its own line, and the
    file is called by its name (a draft is rarely named workflow.json)."""
    f = tmp_path / "draft.json"
    doc = {"label": 7, "access": {"owners": "alice", "readers": ["bad id"], "allowed_kb_writers": "x"},
           "knowledgebase_sources": {"workflow_id": "a"}}  # fmt: skip
    f.write_text(json.dumps(doc))
    before = f.read_bytes()
    r = KbRoot(tmp_path / "no-root").cli("validate", str(f))
    assert r.code == 65, r.out + r.err
    lines = r.out.splitlines()
    for fragment in ("draft.json has no id", "label must be a string", "access.owners must be a list",
                     "access.readers[0]", "access.allowed_kb_writers must be a list", "knowledgebase_sources must be a list"):  # fmt: skip
        assert sum(fragment in line for line in lines) == 1, (fragment, lines)
    assert all(line.startswith(f"{f}: ") for line in lines) and "workflow.json" not in r.out
    j = KbRoot(tmp_path / "no-root").cli("validate", str(f), "--json")
    assert j.code == 65 and j.json()["valid"] is False and len(j.json()["problems"]) == 6
    assert j.json()["workflow_id"] is None and "error" not in j.json()
    assert f.read_bytes() == before
    # A file that is not JSON at all is still one error, named by its file.
    f.write_text('{"id": "x",')
    bad = KbRoot(tmp_path / "no-root").cli("validate", str(f))
    assert bad.code == 65 and "draft.json is not valid JSON" in error_message(bad)


def test_validate_rejects_invalid_json_and_duplicate_keys(tmp_path: Path) -> None:
    for text, fragment in [
        ('{"id": "x",', "not valid JSON"),
        ('{"id": "x", "id": "y"}', "duplicate key 'id'"),
    ]:
        f = tmp_path / "workflow.json"
        f.write_text(text)
        r = KbRoot(tmp_path / "no-root").cli("validate", str(f))
        assert r.code == 65, r.out + r.err
        assert fragment in error_message(r)


def test_force_warns_and_demo_never_lands_in_a_real_root(tmp_path: Path) -> None:
    kb = KbRoot.create(tmp_path / "root")
    kb.workflow("mine", access={"owners": ["alice"]})
    before = (kb.workflows / "mine" / "workflow.json").read_bytes()
    r = kb.cli("init", "--demo", "--force")
    assert r.code == 65 and "--demo only initialises an empty or demo root" in r.err
    assert (kb.workflows / "mine" / "workflow.json").read_bytes() == before
    r = kb.cli("init", "--force", "--host", "h2")
    assert r.code == 0 and "WARNING: --force rewrote" in r.err


def test_validate_checks_writer_grants_and_folder_grants(tmp_path: Path) -> None:
    f = tmp_path / "workflow.json"
    f.write_text(
        json.dumps(
            {
                "id": "w",
                "access": {"allowed_kb_writers": ["w", " a", "a", "a"]},
                "folder_access": [{"alias": "X", "path": "rel", "access": "rw"}],
            }
        )
    )
    r = KbRoot(tmp_path / "no-root").cli("validate", str(f), "--json")
    assert r.code == 65
    problems = r.json()["problems"]
    assert any("names the workflow itself" in p for p in problems)
    assert any("whitespace" in p for p in problems)
    assert any("repeats 'a'" in p for p in problems)
    assert any(p.startswith("folder_access[0]") for p in problems)
