"""docs/notes.md "Quota" and docs/cli.md "Browsing": bounded work on attacker-shaped trees.

Listings are paged (``--limit``/``--after``, JSON says ``truncated`` and
``next``); the post-command audit walks a bounded number of entries and says
``truncated``; a per-source notes/ quota refuses ``kbd notes write`` and, once a
shell command left notes/ over it, the next write command until it is back under.
Real CLI, real sandbox, real trees.
"""

from __future__ import annotations

import json
from typing import Any

import pytest
import yaml

from tests.helpers import KbRoot


def _set_quota(kb: KbRoot, **quota: int) -> None:
    path = kb.root / "kbd.yaml"
    doc = yaml.safe_load(path.read_text())
    doc["notes_quota"] = quota
    path.write_text(yaml.safe_dump(doc))


def _events(kb: KbRoot, name: str) -> list[dict[str, Any]]:
    return [e for e in kb.cli("audit", "--json").json()["events"] if e["event"] == name]


@pytest.fixture(scope="module")
def big(tmp_path_factory: pytest.TempPathFactory) -> KbRoot:
    """A folder of 5,000 files, built once: the tests that use it only read it
    (listings and refused limits), and building it costs seconds on a busy host."""
    kb = KbRoot.create(tmp_path_factory.mktemp("big") / "root")
    src = kb.workflow("src", access={"owners": ["alice"]})
    kb.workflow("con", access={"owners": ["alice"]}, sources=[{"workflow_id": "src", "alias": "s"}])
    many = src / "knowledgebase" / "context" / "many"
    many.mkdir()
    for i in range(5000):
        (many / f"f{i:05d}.txt").touch()
    return kb


def test_listings_are_paged_and_say_when_truncated(big: KbRoot) -> None:
    first = big.cli("ls", "con", "s", "context/many", "--as", "alice", "--json")
    assert first.code == 0, first.err
    page = first.json()
    assert len(page["entries"]) == 1000 and page["truncated"] is True and page["next"] == "f00999.txt"
    seen: list[str] = []
    after: str | None = None
    while True:
        args = ["--limit", "1500"] + (["--after", after] if after else [])
        # The pages in process (KbRoot.call); the first and the text page are real processes.
        r = big.call("ls", "con", "s", "context/many", *args, "--as", "alice", "--json")
        assert r.code == 0, r.err
        doc = r.json()
        seen += [e["name"] for e in doc["entries"]]
        if not doc["truncated"]:
            assert doc["next"] is None
            break
        after = doc["next"]
    assert seen == [f"f{i:05d}.txt" for i in range(5000)]
    text = big.cli("ls", "con", "s", "context/many", "--limit", "2", "--as", "alice")
    assert text.out.splitlines() == ["f00000.txt", "f00001.txt"] and "--after f00001.txt" in text.err


@pytest.mark.parametrize(
    ("limit", "message"),
    [("0", "from 1 to 10000, not 0"), ("-1", "from 1 to 10000, not -1"), ("10001", "from 1 to 10000, not 10001"),
     ("x", "'x' is not a valid integer")],
)  # fmt: skip
def test_bad_listing_limits_are_usage_errors(big: KbRoot, limit: str, message: str) -> None:
    r = big.call("ls", "con", "s", "context/many", "--limit", limit, "--as", "alice")
    assert r.code == 2 and "--limit" in r.err and message in r.err, r.err


def _writer(kb: KbRoot) -> str:
    kb.workflow("src", access={"owners": ["bob"], "readers": ["alice"], "allowed_kb_writers": ["con"]})
    kb.workflow(
        "con",
        access={"owners": ["alice"]},
        sources=[{"workflow_id": "src", "alias": "src", "access": "write"}],
    )
    r = kb.call("session", "open", "con", "--kind", "execution", "--kb-access", "read-write", "--as", "alice",
               "--json")  # fmt: skip
    assert r.code == 0, r.err
    return str(r.json()["session_id"])


@pytest.mark.requires_bwrap
@pytest.mark.requires_landlock(abi=2)  # the inner helper of write plans
def test_a_command_that_floods_notes_stops_at_the_quota(kb: KbRoot) -> None:
    """Staged (docs/notes.md "Staged contributions"): each note is committed through
    the write path, so the quota refuses the ones past it; notes/ never goes over."""
    _set_quota(kb, max_files=20, max_bytes=1 << 20)
    sid = _writer(kb)
    flood = 'cd "$WORKFLOW_KB_SRC/notes" && for i in $(seq 40); do echo "note $i" > n$i.md; done'
    r = kb.cli("exec", sid, "--json", "--", "sh", "-c", flood)
    assert r.code == 0, r.err
    report = json.loads(next(line for line in r.err.splitlines() if line.startswith("{")))["contributions"]
    notes = kb.workflows / "src" / "knowledgebase" / "notes"
    assert len(list(notes.iterdir())) <= 20
    assert report["refused"] and {x["code"] for x in report["refused"]} == {"quota-exceeded"}
    assert len(report["committed"]) + len(report["refused"]) == 40
    assert not _events(kb, "notes_quota_exceeded")  # never over: nothing to mark


def test_notes_write_refuses_a_note_that_would_exceed_the_byte_quota(kb: KbRoot) -> None:
    _set_quota(kb, max_files=100, max_bytes=4096)
    sid = _writer(kb)
    assert kb.cli("notes", "write", sid, "src", "a.md", input=b"a" * 1000).code == 0
    r = kb.cli("notes", "write", sid, "src", "b.md", input=b"b" * 4000)
    assert r.code == 65 and "error[quota-exceeded]" in r.err and "4096 bytes" in r.err, r.err
    notes = kb.workflows / "src" / "knowledgebase" / "notes"
    assert not (notes / "b.md").exists()
    # Replacing a note counts only the difference.
    assert kb.cli("notes", "write", sid, "src", "a.md", input=b"a" * 2000).code == 0
    r = kb.cli("notes", "write", sid, "src", "deep/er/c.md", input=b"c")
    assert r.code == 0, r.err


@pytest.mark.parametrize(
    ("quota", "message"),
    [({"max_files": 0}, "notes_quota.max_files"), ({"max_bytes": "1G"}, "notes_quota.max_bytes"),
     ({"files": 3}, "notes_quota.files")],
)  # fmt: skip
def test_bad_notes_quota_config_is_refused(kb: KbRoot, quota: dict[str, Any], message: str) -> None:
    _set_quota(kb, **quota)
    r = kb.cli("doctor")
    assert r.code == 65 and message in r.out + r.err, r.out + r.err


@pytest.mark.requires_bwrap
@pytest.mark.requires_landlock(abi=2)  # the inner helper of write plans
def test_a_commit_offers_at_most_the_quota_and_reports_deep_folders(kb: KbRoot) -> None:
    """A command's commit reads at most the quota's bytes of its changes (the
    rest is refused unread) and never drops a path silently: a folder too deep
    to walk is reported."""
    _set_quota(kb, max_files=1000, max_bytes=3 * 1024 * 1024)
    sid = _writer(kb)
    deep = "/".join(f"l{i}" for i in range(20))
    script = (
        'cd "$WORKFLOW_KB_SRC/notes" && for i in 1 2 3 4 5; do head -c 900000 /dev/zero | tr "\\0" x '
        f"> big$i.md; done && mkdir -p {deep} && echo deep > {deep}/n.md"
    )
    r = kb.cli("exec", sid, "--json", "--", "sh", "-c", script)
    assert r.code == 0, r.err
    report = json.loads(next(line for line in r.err.splitlines() if line.startswith("{")))["contributions"]
    refused = {x["relpath"]: x["code"] for x in report["refused"]}
    assert sorted(report["committed"]) == ["notes/big1.md", "notes/big2.md", "notes/big3.md"]
    assert refused["notes/big4.md"] == refused["notes/big5.md"] == "quota-exceeded"
    assert any(p.startswith("notes/l0/") and "l16" in p for p in refused), refused


def test_the_api_refuses_a_note_over_quota_with_413(kb: KbRoot) -> None:
    from tests.integration.daemon import issue_tokens, serving

    _set_quota(kb, max_files=100, max_bytes=2048)
    sid = _writer(kb)
    token = issue_tokens(kb.root, ["alice"])["alice"]
    with serving(kb.root) as daemon:
        client = daemon.client(token)
        body = {"alias": "src", "path": "big.md", "content": "x" * 4096}
        r = client.post(f"/v1/sessions/{sid}/notes", json=body)
        assert r.status_code == 413 and r.json()["error"]["code"] == "quota-exceeded", r.text
        assert str(kb.root) not in r.text
        ok = client.post(f"/v1/sessions/{sid}/notes", json={**body, "path": "small.md", "content": "small\n"})
        assert ok.status_code == 201, ok.text
    assert not (kb.workflows / "src" / "knowledgebase" / "notes" / "big.md").exists()
