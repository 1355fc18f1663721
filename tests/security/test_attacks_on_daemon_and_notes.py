"""Attacks on the hardening of docs/multi-user.md "Threat model", as merged (an adversarial review): each test
failed on the merged branch before the fix beside it. Real CLI, real daemon."""

from __future__ import annotations

import contextlib
import os
import select
import socket
import stat
import time
from pathlib import Path

import pytest

from kbd.daemon.limits import BODY_TIMEOUT, HEADER_TIMEOUT, MAX_CONNECTIONS_PER_UID, WRITE_STALL_TIMEOUT
from tests.helpers import KbRoot
from tests.integration.daemon import issue_tokens, serving

NOBODY = 65534


@pytest.mark.parametrize("via_link", [False, True])
def test_serve_refuses_a_socket_folder_another_user_owns(kb: KbRoot, tmp_path: Path, via_link: bool) -> None:
    """Item 11: a folder owned by someone else (mode 0755, so no "writable by
    others" bit) lets its owner rename kbd's socket away and put their own in its
    place, then collect the bearer tokens clients send. Reached directly or
    through a symlink (the merged check stat()ed the lexical path only)."""
    theirs = tmp_path / "theirs"
    theirs.mkdir(mode=0o755)
    os.chown(theirs, NOBODY, NOBODY)
    folder = theirs
    if via_link:
        folder = tmp_path / "link"
        folder.symlink_to(theirs)
    r = kb.cli("serve", "--socket", str(folder / "kbd.sock"))
    assert r.code == 65, (r.code, r.out, r.err)
    assert r.err.startswith("error[unsafe-socket-folder]: "), r.err
    assert f"uid {NOBODY}" in r.err and "Traceback" not in r.err, r.err
    assert list(theirs.iterdir()) == [], "kbd created its socket in a folder another user owns"


def test_serve_refuses_a_link_on_the_socket_path_another_user_owns(kb: KbRoot, tmp_path: Path) -> None:
    """Item 11: a link owned by someone else may be retargeted by its owner
    between kbd's check and its bind (also in a sticky folder: the link is
    theirs), though it points at a folder kbd may use now."""
    ours = tmp_path / "ours"
    ours.mkdir(mode=0o755)
    link = tmp_path / "link"
    link.symlink_to(ours)
    os.lchown(link, NOBODY, NOBODY)
    r = kb.cli("serve", "--socket", str(link / "kbd.sock"))
    assert r.code == 65, (r.code, r.out, r.err)
    assert r.err.startswith("error[unsafe-socket-folder]: "), r.err
    assert f"link owned by uid {NOBODY}" in r.err, r.err
    assert list(ours.iterdir()) == []


def test_a_body_that_never_arrives_does_not_hold_a_uids_connections_forever(kb: KbRoot) -> None:
    """Item 7: the header timer stops at the end of the headers. A client that
    then sends a partial body (or none) held each connection forever, so one
    process of a uid could take all of that uid's slots for good (every later
    request from the uid: 503 "too many open connections"). Now the body is on
    a clock too: each stalled request is answered 408 and closed."""
    tokens = issue_tokens(kb.root, ["alice"])
    with serving(kb.root) as d:
        stalled = []
        for _ in range(MAX_CONNECTIONS_PER_UID + 8):
            s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
            s.connect(str(d.sock))
            s.sendall(
                b"POST /v1/sessions HTTP/1.1\r\nhost: kbd\r\ncontent-type: application/json\r\n"
                b"content-length: 100\r\n\r\n{"
            )
            stalled.append(s)
        try:
            deadline = time.monotonic() + BODY_TIMEOUT + 10
            for s in stalled:
                s.settimeout(max(0.1, deadline - time.monotonic()))
                try:
                    answer = b"".join(iter(lambda s=s: s.recv(65536), b""))  # type: ignore[misc]
                except TimeoutError:
                    answer = b"(still open)"
                except ConnectionResetError:  # an over-cap one, closed before reading all we sent
                    answer = b""
                # 408 for an admitted one, 503 over the cap: closed either way.
                assert answer == b"" or answer.startswith((b"HTTP/1.1 408 ", b"HTTP/1.1 503 ")), answer[:200]
            with d.client(tokens["alice"]) as c:
                t0 = time.monotonic()
                r = c.get("/v1/health")
                assert r.status_code == 200 and time.monotonic() - t0 < 1.0, (r.status_code, r.text)
        finally:
            for s in stalled:
                s.close()


@pytest.mark.parametrize("since", ["99999999999999d", "9999999w", "999999999999999999999999s"])
def test_audit_since_too_far_back_is_a_usage_error(kb: KbRoot, since: str) -> None:
    """Item 12/13: an out-of-range --since was answered error[internal] (exit 70,
    "this is a bug in kbd") from an OverflowError; it is bad input (exit 2)."""
    r = kb.call("audit", "--since", since)
    assert r.code == 2, (r.code, r.err)
    assert r.err.startswith("error[usage]: --since: ") and since in r.err, r.err


def test_an_endless_header_is_cut_off_at_the_header_cap(kb: KbRoot) -> None:
    """Item 7: the HTTP parser buffers a header until it ends, so within the 5 s
    header timeout one connection made the daemon hold tens of MiB (32 such
    connections: 1.3 GiB). Now the request line and headers are capped: the
    connection is answered 431 and closed as soon as it passes the cap."""
    with serving(kb.root) as d:
        s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        s.connect(str(d.sock))
        try:
            t0 = time.monotonic()
            s.sendall(b"GET /v1/health HTTP/1.1\r\nhost: kbd\r\nx-filler: ")
            sent = 0
            with contextlib.suppress(BrokenPipeError, ConnectionResetError):
                while sent < 8 * 1024 * 1024 and time.monotonic() - t0 < HEADER_TIMEOUT:
                    s.sendall(b"a" * 65536)
                    sent += 65536
            s.settimeout(HEADER_TIMEOUT + 5)
            answer = b"".join(iter(lambda: s.recv(65536), b""))
            elapsed = time.monotonic() - t0
        finally:
            s.close()
        assert answer.startswith(b"HTTP/1.1 431 "), answer[:200]
        assert b'"too-large"' in answer, answer
        assert sent < 4 * 1024 * 1024, f"the daemon kept reading {sent} bytes of one header"
        assert elapsed < HEADER_TIMEOUT, elapsed


def test_an_answer_the_client_never_reads_is_dropped(kb: KbRoot) -> None:
    """Item 7: a client that asks for a large file and never reads the answer
    made the daemon hold the unsent bytes for as long as the connection stayed
    open (200 such connections: over 1 GiB). An answer that makes no progress
    for WRITE_STALL_TIMEOUT is abandoned: the connection is dropped."""
    owners = {"owners": ["alice"]}
    src = kb.workflow("src", access=owners)
    (src / "knowledgebase" / "context" / "big.md").write_bytes(b"a" * (1900 * 1024))
    kb.workflow("con", access=owners, sources=[{"workflow_id": "src", "alias": "big"}])
    tokens = issue_tokens(kb.root, ["alice"])
    with serving(kb.root) as d:
        s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        s.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
        s.connect(str(d.sock))
        try:
            s.sendall(
                b"GET /v1/workflows/con/sources/big/file?path=context/big.md HTTP/1.1\r\nhost: kbd\r\n"
                + f"authorization: Bearer {tokens['alice']}\r\n\r\n".encode()
            )
            # The client reads nothing meanwhile. POLLRDHUP reports the daemon's
            # close without reading a byte, so the wait ends when the connection is
            # dropped (a daemon that keeps it fails below: the whole answer arrives).
            poller = select.poll()
            poller.register(s, select.POLLRDHUP)
            dropped = poller.poll((WRITE_STALL_TIMEOUT + 10) * 1000)
            assert dropped, "the daemon kept the connection of an answer nobody reads"
            s.settimeout(10)
            got = b""
            with contextlib.suppress(ConnectionResetError):
                got = b"".join(iter(lambda: s.recv(1 << 20), b""))
        finally:
            s.close()
    head, _, body = got.partition(b"\r\n\r\n")
    assert head.startswith(b"HTTP/1.1 200 "), got[:300]
    length = int(
        next(ln.split(b":")[1] for ln in head.split(b"\r\n") if ln.lower().startswith(b"content-length"))
    )
    assert length > 1900 * 1024, length
    assert len(body) < length, "the stalled answer was kept until the client came back to read it"


@pytest.mark.parametrize("umask", [0o077, 0o000])
def test_folders_notes_write_creates_have_one_mode_whatever_the_umask(kb: KbRoot, umask: int) -> None:
    """Item 8: the note is 0644 whatever the umask, but the folders `kbd notes
    write` created for it took the writer's umask (077: 0700, so the source's
    own agents under another uid could not reach the note)."""
    owners = {"owners": ["alice"]}
    src = kb.workflow("src", access=owners)
    kb.workflow("con", access=owners, sources=[{"workflow_id": "src", "alias": "src", "access": "write"}])
    assert kb.cli("writers", "grant", "src", "con", "--as", "alice").code == 0
    sid = kb.open_session("con", kind="execution", kb_access="read-write", actor="alice")
    old = os.umask(umask)
    try:
        r = kb.cli("notes", "write", sid, "src", "a/b/n.md", "--as", "alice", input=b"a finding\n")
    finally:
        os.umask(old)
    assert r.code == 0, r.err
    notes = src / "knowledgebase" / "notes"
    for folder in (notes / "a", notes / "a" / "b"):
        assert stat.S_IMODE(os.lstat(folder).st_mode) == 0o755, (folder, oct(os.lstat(folder).st_mode))
    assert stat.S_IMODE(os.lstat(notes / "a" / "b" / "n.md").st_mode) == 0o644
