"""Confined search over every KB a session's *current* plan may read (docs/search.md "Search": one seam, scope
derived from the caller, best effort).

The scope is computed from the plan at query time (:func:`scope`): the
session's own KB unless its mode is ``none``, and each available source the
plan grants reading — nothing else, so a detach or an audience change hides
hits at once. Each KB is pinned by the identity its resolution saw, and the
index rows are keyed by that identity, so a folder swapped in under a known
path matches nothing.

The searcher sits behind :class:`Searcher`, so a semantic one can be added;
:class:`FullTextSearcher` is SQLite FTS5 (BM25, recency tie-break) over
:mod:`kbd.state.search_index`. It refreshes a KB (a bounded, confined walk;
only changed files are read) when it was not verified within
``FRESH_SECONDS``: a CLI process verifies every KB it searches, the daemon at
most that often (a write is searchable within about a second).

Every candidate is then confirmed: the plan's path guard must allow reading
it, and the file is reopened beneath the pinned KB (no link, no special file,
singly linked) with the same inode, size, mtime and ctime as indexed; anything else
is dropped. Hits whose text the injection gate refuses are dropped and
counted (``dropped_by_gate``); unreviewed contributions are left out unless
asked for, and labelled when included.
"""

from __future__ import annotations

import logging
import os
import stat
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from datetime import UTC, datetime
from pathlib import Path
from typing import TYPE_CHECKING, Protocol

from kbd.core import knowledge as rules
from kbd.core.identifiers import one_line
from kbd.core.layout import KB_DIR, racy
from kbd.core.pathguard import LinkCheckNeeded, decide
from kbd.core.plan import Plan
from kbd.core.principals import Actor
from kbd.core.records import Record, key
from kbd.errors import InjectionRefused, KbdError, NotFound
from kbd.fs import confined
from kbd.fs.kbwalk import walk_notes
from kbd.state import reviews as review_store
from kbd.state.search_index import Doc, Row, SearchIndex

if TYPE_CHECKING:
    from kbd.service.sessions import RootSessions

#: The largest file indexed (the same cap as ``kbd read``).
MAX_INDEX_BYTES = 2 * 1024 * 1024
#: Files indexed per KB at most (a walk stops there).
MAX_INDEX_FILES = 50_000
#: How long a KB verified by a refresh is trusted without another walk, when
#: no watcher covers it (a CLI process; the daemon before its watch is up).
FRESH_SECONDS = 0.5
#: With the daemon's KB watcher, a KB is walked again after a reported change,
#: and at the latest after this long (events can be lost: a full inotify queue,
#: the watch limit).
WATCH_BACKSTOP_SECONDS = 10.0
#: A batch this large may hide lost events: every KB is walked again.
_LOSSY_BATCH = 2000
#: Folders of one KB the daemon's watch covers at most (inotify watches are a
#: per-user budget); a KB with more is verified by the freshness window.
MAX_WATCH_FOLDERS = 4096
# Candidates fetched per round, as a multiple of the hits asked for (some are
# dropped: gate, review, a file changed since indexing), and rounds at most.
_OVERSCAN = 3
_ROUNDS = 4

log = logging.getLogger("kbd.search")


@dataclass(frozen=True)
class Scope:
    """One KB the plan lets the session read, pinned by its resolved identity."""

    key: str  # "st_dev:st_ino" of the KB folder
    path: Path
    identity: tuple[int, int]
    alias: str | None  # None: the session's own KB
    workflow_id: str
    hidden: tuple[str, ...] = ()  # the plan's hidden grants inside this KB (none today)


@dataclass(frozen=True)
class SearchScope:
    session_id: str
    plan: Plan
    kbs: tuple[Scope, ...]


@dataclass(frozen=True)
class Hit(Record):
    alias: str | None
    workflow_id: str
    relpath: str
    title: str
    snippet: str
    score: float
    modified_at: str
    contributed_by_workflow: str | None
    review: rules.Review
    trust: rules.Trust


@dataclass(frozen=True)
class SearchResult(Record):
    session_id: str
    query: str
    hits: tuple[Hit, ...]
    dropped_by_gate: int
    # No hits: what to try instead (the query language, docs/search.md "Queries").
    hint: str | None = field(default=None, metadata=key(omit_none=True))


@dataclass(frozen=True)
class Candidate:
    """A match from a searcher, before the plan and the file system confirm it."""

    scope: Scope
    row: Row


class Searcher(Protocol):
    """The seam: the best ``limit`` candidates for ``query`` in ``kbs``, best
    first, the same order on every call while nothing changes. A searcher never
    decides access; the caller confirms every candidate against the plan and
    the file."""

    def refresh(self, kb: Scope) -> int: ...

    def candidates(self, kbs: Sequence[Scope], query: str, *, limit: int) -> list[Candidate]: ...

    def snippet(self, candidate: Candidate, query: str) -> str: ...


# -- the scope (needs the session's plan: under the daemon's state lock) -----------------------


def scope(sessions: RootSessions, sid: str, aliases: Sequence[str], *, actor: Actor) -> SearchScope:
    """The KBs session ``sid`` may read now, narrowed to ``aliases`` when given
    (each must be attached: NotFound otherwise)."""
    plan = sessions.plan(sid, actor=actor)
    return scope_of(plan, sid, aliases)


def scope_of(plan: Plan, sid: str, aliases: Sequence[str]) -> SearchScope:
    attached = {a.alias for a in plan.sources}
    for alias in aliases:
        if alias not in attached:
            raise NotFound(
                f"source {alias!r} is not attached to {plan.workflow_id!r}",
                hint="`kbd session show SID` lists the attached aliases",
            )
    kbs: list[Scope] = []
    if not aliases:
        own = _own_kb(plan)
        if own is not None:
            kbs.append(own)
    for att in plan.sources:
        if aliases and att.alias not in aliases:
            continue
        if not att.available or att.path is None or att.kb_identity is None:
            continue
        if not isinstance(decide(plan, str(att.path), "read"), LinkCheckNeeded):
            continue  # attached, but this session's mode reads no source
        dev, ino = att.kb_identity
        kbs.append(Scope(f"{dev}:{ino}", att.path, att.kb_identity, att.alias, att.workflow_id,
                         _hidden_inside(plan, att.path)))  # fmt: skip
    return SearchScope(sid, plan, tuple(kbs))


def _own_kb(plan: Plan) -> Scope | None:
    path = plan.workflow_folder / KB_DIR
    if not isinstance(decide(plan, str(path), "read"), LinkCheckNeeded):
        return None
    try:
        with confined.pin_dir(path) as kb:
            identity = (kb.dev, kb.ino)
    except KbdError:
        return None  # no KB (or a link where it should be): nothing to search
    return Scope(
        f"{identity[0]}:{identity[1]}", path, identity, None, plan.workflow_id, _hidden_inside(plan, path)
    )


def _hidden_inside(plan: Plan, kb: Path) -> tuple[str, ...]:
    """Paths the plan hides strictly inside ``kb`` (the per-hit check's narrowing)."""
    return tuple(str(g.path) for g in plan.grants if g.mode == "hidden" and kb in g.path.parents)


# -- the full-text searcher -------------------------------------------------------------------


class FullTextSearcher:
    """SQLite FTS5 over the index in ``<state>/search/``, refreshed lazily."""

    def __init__(self, state_dir: Path, *, fresh_seconds: float = FRESH_SECONDS, watch: bool = False) -> None:
        self.index = SearchIndex(state_dir)
        self.fresh_seconds = fresh_seconds
        self._verified: dict[str, float] = {}  # when the last completed walk *started*
        self._stale: dict[str, float] = {}  # when the watcher last reported a change
        self._locks: dict[str, threading.Lock] = {}
        self._guard = threading.Lock()
        self.watcher = KbWatcher(self.mark_stale) if watch else None

    def _fresh(self, key: str, now: float) -> bool:
        """Whether ``key``'s entries may be used without a walk: verified after
        the last change the watcher reported and within the backstop, or, for a
        KB no watcher covers, within ``fresh_seconds``."""
        verified = self._verified.get(key)
        if verified is None:
            return False
        if self.watcher is not None and self.watcher.covers(key):
            return verified > self._stale.get(key, -1.0) and now - verified < WATCH_BACKSTOP_SECONDS
        return now - verified < self.fresh_seconds

    def _lock(self, key: str) -> threading.Lock:
        with self._guard:
            return self._locks.setdefault(key, threading.Lock())

    def mark_stale(self, key: str | None = None) -> None:
        """A KB (or every KB) changed now: the next search walks it."""
        now = time.monotonic()
        with self._guard:
            for k in [key] if key is not None else list(self._verified):
                self._stale[k] = now

    def refresh(self, kb: Scope, *, force: bool = False) -> int:
        """Bring ``kb``'s entries up to date (only changed files are read); the
        number of files read. A KB that cannot be pinned as resolved is skipped
        (its hits are then refused by the confirmation anyway)."""
        with self._lock(kb.key):
            now = time.monotonic()
            if not force and self._fresh(kb.key, now):
                return 0
            folders: list[str] = []
            try:
                with confined.pin_dir(kb.path, expect=kb.identity) as pinned:
                    read = self._refresh_pinned(kb.key, pinned.fd, folders)
            except KbdError:
                return 0
            if self.watcher is not None:
                self.watcher.want(kb, folders)
            # The walk's start: a change reported while it ran is newer, so it
            # makes the next search walk again.
            self._verified[kb.key] = now
            return read

    def _refresh_pinned(self, key: str, kb_fd: int, folders: list[str]) -> int:
        known = self.index.signatures(key)
        docs: list[Doc] = []
        seen: set[str] = set()
        now_ns = time.time_ns()
        for f in walk_notes(kb_fd, max_files=MAX_INDEX_FILES, max_bytes=MAX_INDEX_BYTES, folders=folders):
            seen.add(f.rel)
            old = known.get(f.rel)
            if old is not None and not old.racy and (old.ino, old.size, old.mtime_ns, old.ctime_ns) == f[1:]:
                continue
            doc = read_doc(kb_fd, f.rel, now_ns)
            if doc is not None:
                docs.append(doc)
            else:
                seen.discard(f.rel)
        gone = [sig.id for rel, sig in known.items() if rel not in seen]
        self.index.apply(key, docs, gone)
        return len(docs)

    def candidates(self, kbs: Sequence[Scope], query: str, *, limit: int) -> list[Candidate]:
        match = rules.match_expression(query)
        found = [Candidate(kb, row) for kb in kbs for row in self.index.query(match, kb.key, limit=limit)]
        # BM25 first (lower is better in SQLite), then the most recent, then a fixed order.
        found.sort(key=lambda c: (c.row.score, -c.row.mtime_ns, c.scope.alias or "", c.row.relpath))
        return found[:limit]

    def snippet(self, candidate: Candidate, query: str) -> str:
        return self.index.snippet(rules.match_expression(query), candidate.scope.key, candidate.row.id)


class KbWatcher:
    """The daemon's watch on the KBs searched so far: every folder the last
    confined walk of each KB opened, watched non-recursively (as the daemon's
    own watcher does: a recursive inotify watch would follow a link planted in
    a KB into whatever it names), in one watchfiles RustNotify rebuilt when
    the set of folders changes, drained by one thread. A change in a KB's
    folder marks it stale (``on_change(key)``), so a write is searchable
    within the watch latency plus one walk of that KB; a new subfolder is a
    change in its parent, and the walk that follows adds it to the watch.
    Only an accelerator: a KB is trusted only while :meth:`covers` says its
    watch is up, walked again at the backstop anyway, and every hit is
    confirmed on disk whatever the index says."""

    def __init__(self, on_change: Callable[[str | None], None]) -> None:
        self._on_change = on_change
        self._wanted: dict[str, tuple[str, tuple[str, ...]]] = {}  # key -> (KB path, its folders)
        self._watching: frozenset[str] = frozenset()  # keys of the running notifier
        self._lock = threading.Lock()
        self._changed = threading.Event()
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    def covers(self, key: str) -> bool:
        return key in self._watching

    def want(self, kb: Scope, folders: Sequence[str]) -> None:
        """Watch ``kb``'s ``folders`` (relative to it, as the walk opened them);
        a KB with more than MAX_WATCH_FOLDERS is left to the freshness window."""
        root = str(kb.path)
        paths = tuple(sorted(f"{root}/{rel}" if rel else root for rel in folders))
        with self._lock:
            if len(paths) > MAX_WATCH_FOLDERS:
                if self._wanted.pop(kb.key, None) is not None:
                    self._changed.set()
                return
            if self._wanted.get(kb.key) == (root, paths):
                return
            self._wanted[kb.key] = (root, paths)
            self._changed.set()
            if self._thread is None:
                self._thread = threading.Thread(target=self._run, name="kbd-search-watch", daemon=True)
                self._thread.start()

    def close(self) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout=5)

    def _run(self) -> None:
        from kbd.fs.watch import rust_notify

        while not self._stop.is_set():
            with self._lock:
                wanted = dict(self._wanted)
                self._changed.clear()
            paths = sorted({p for _, folders in wanted.values() for p in folders})
            try:
                notifier = rust_notify(paths)
            except Exception as exc:
                # Not watched means every search re-checks its KBs (still correct, slower): say why.
                log.warning("search watch unavailable, searches re-check their KBs: %s", exc)
                self._watching = frozenset()
                self._stop.wait(1.0)
                continue
            try:
                # Changes before the watch was up were not seen: walk once more,
                # and only then trust the watch.
                for key in wanted:
                    self._on_change(key)
                self._watching = frozenset(wanted)
                while not self._stop.is_set() and not self._changed.is_set():
                    batch = notifier.watch(10, 5, 200, self._stop)
                    if isinstance(batch, set):
                        self._deliver(wanted, batch)
            except Exception as exc:
                log.warning("search watch failed, searches re-check their KBs until it is back: %s", exc)
                self._watching = frozenset()
                self._stop.wait(1.0)
            finally:
                notifier.close()

    def _deliver(self, wanted: dict[str, tuple[str, tuple[str, ...]]], batch: set[tuple[int, str]]) -> None:
        if len(batch) >= _LOSSY_BATCH:
            self._on_change(None)
            return
        for _change, path in batch:
            for kb_key, (root, _) in wanted.items():
                if path == root or path.startswith(root + "/"):
                    self._on_change(kb_key)


def read_doc(kb_fd: int, rel: str, now_ns: int) -> Doc | None:
    """One file's index entry, read through the confined layer (None: it is no
    longer a regular, singly-linked file of at most the cap)."""
    from kbd.core import injection
    from kbd.fs import datafiles

    try:
        data, st = confined.read_file_stat(kb_fd, rel, limit=MAX_INDEX_BYTES)
    except KbdError:
        return None
    text = data.decode("utf-8", "replace")
    try:
        injection.check(text, ruleset=datafiles.injection_rules())
        gated = False
    except InjectionRefused:
        gated = True
    prov = rules.provenance_fields(text)
    return Doc(rel, st.st_ino, st.st_size, st.st_mtime_ns, st.st_ctime_ns, racy(st, now_ns),
               rules.title_of(text, rel.rpartition("/")[2]), rules.body_of(text),
               prov.get("contributed_by_workflow"), rules.digest(data), gated)  # fmt: skip


# One searcher per state folder and process: the daemon keeps its verification times.
_SEARCHERS: dict[Path, FullTextSearcher] = {}
_SEARCHERS_LOCK = threading.Lock()


def searcher_for(state_dir: Path, *, watch: bool = False) -> FullTextSearcher:
    """This process's searcher for ``state_dir``; the daemon's (``watch``) keeps
    a watch on the KBs it has searched."""
    with _SEARCHERS_LOCK:
        found = _SEARCHERS.get(state_dir)
        if found is None:
            found = _SEARCHERS[state_dir] = FullTextSearcher(state_dir, watch=watch)
        return found


# -- the operation (outside the daemon's state lock) ---------------------------------------------


def run(
    state_dir: Path, where: SearchScope, query: str, *, limit: int | None = None, include_unreviewed: bool = False,
    searcher: Searcher | None = None,
) -> SearchResult:  # fmt: skip
    """Search ``where`` (see the module docstring for what is confirmed and dropped)."""
    rules.match_expression(query)  # a bad query is refused before any work
    size = rules.check_limit(limit)
    engine = searcher if searcher is not None else searcher_for(state_dir)
    for kb in where.kbs:
        engine.refresh(kb)
    hits: list[Hit] = []
    dropped = 0
    want, done = size * _OVERSCAN + 10, 0
    with _Pins() as pins:
        for _ in range(_ROUNDS):
            found = engine.candidates(where.kbs, query, limit=want)
            # Confirmed one at a time, best first, until enough hits are shown.
            for c in found[done:]:
                if len(hits) >= size:
                    break
                mtime_ns = _confirm(c, pins)
                if mtime_ns is None:
                    continue
                if c.row.gated:
                    dropped += 1
                    continue
                review, by = _review(state_dir, c)
                if review == "unreviewed" and not include_unreviewed:
                    continue
                hits.append(_hit(c, mtime_ns, review, by, engine.snippet(c, query)))
            done = len(found)
            if len(hits) >= size or len(found) < want:
                break
            want *= 4
    return SearchResult(
        where.session_id, query, tuple(hits), dropped, None if hits else rules.query_hint(query)
    )


def _review(state_dir: Path, c: Candidate) -> tuple[rules.Review, str | None]:
    """The hit's review status and contributing workflow: by its provenance, or
    by the review store's record of a shell command's bytes."""
    wid = c.scope.workflow_id
    key = (wid, c.row.relpath, c.row.digest)
    decision, shell_by = review_store.lookup(state_dir, {key}).get(key, (None, None))
    # What kbd saw a command write outranks what the bytes claim.
    by = rules.contributor(wid, shell_by) or rules.contributor(wid, c.row.contributed_by)
    return rules.review_of(wid, by, decision), by


def _hit(c: Candidate, mtime_ns: int, review: rules.Review, by: str | None, snippet: str) -> Hit:
    wid = c.scope.workflow_id
    modified = datetime.fromtimestamp(mtime_ns / 1e9, tz=UTC).strftime("%Y-%m-%dT%H:%M:%SZ")
    return Hit(c.scope.alias, wid, c.row.relpath, c.row.title, one_line(rules.plain_snippet(snippet), limit=400),
               round(-c.row.score, 6), modified, by, review, rules.trust_of(review, own_kb=c.scope.alias is None))  # fmt: skip


class _Pins:
    """KB folders pinned (by their resolved identity) for one search's confirmations."""

    def __init__(self) -> None:
        self._pins: dict[str, confined.Pinned | None] = {}

    def __enter__(self) -> _Pins:
        return self

    def __exit__(self, *exc: object) -> None:
        for p in self._pins.values():
            if p is not None:
                p.close()

    def fd(self, kb: Scope) -> int | None:
        if kb.key not in self._pins:
            try:
                self._pins[kb.key] = confined.pin_dir(kb.path, expect=kb.identity)
            except KbdError:
                self._pins[kb.key] = None
        pinned = self._pins[kb.key]
        return None if pinned is None else pinned.fd


def _confirm(c: Candidate, pins: _Pins) -> int | None:
    """The file's mtime when the plan lets the session read it and it is still
    the file indexed (same inode, size, mtime and ctime, regular, singly linked,
    reached without a link), else None. The plan allowed reading the KB
    (:func:`scope_of`); a grant deeper inside it can only narrow that by
    hiding (every other mode reads), so the file must lie in no hidden grant."""
    path = f"{c.scope.path}/{c.row.relpath}"
    if any(path == h or path.startswith(h + "/") for h in c.scope.hidden):
        return None
    kb_fd = pins.fd(c.scope)
    if kb_fd is None:
        return None
    try:
        fd = confined.open_beneath(kb_fd, c.row.relpath, os.O_PATH)
    except KbdError:
        return None
    try:
        st = os.fstat(fd)
    finally:
        os.close(fd)
    if not stat.S_ISREG(st.st_mode) or st.st_nlink > 1:
        return None
    # ctime too: an in-place rewrite of the same size with its mtime set back
    # (utime) must not keep the indexed bytes' digest, and so their review.
    if (st.st_ino, st.st_size, st.st_mtime_ns, st.st_ctime_ns) != (
        c.row.ino, c.row.size, c.row.mtime_ns, c.row.ctime_ns
    ):  # fmt: skip
        return None
    return st.st_mtime_ns


def search(
    sessions: RootSessions, sid: str, query: str, *, aliases: Sequence[str] = (), limit: int | None = None,
    include_unreviewed: bool = False, actor: Actor,
) -> SearchResult:  # fmt: skip
    """``kbd search``: :func:`scope` then :func:`run` (the CLI's direct mode)."""
    rules.match_expression(query)
    rules.check_limit(limit)
    where = scope(sessions, sid, aliases, actor=actor)
    return run(
        sessions.host.config.state_dir, where, query, limit=limit, include_unreviewed=include_unreviewed
    )
