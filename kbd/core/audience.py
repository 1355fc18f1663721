"""Who may read, write, manage and grant (docs/access.md). Pure functions.

``audience(w)`` is everyone who can read ``w``'s outputs: effective owners,
editors and readers. A workflow with no effective owner (no ``access.owners``
and no ``created_by``) is *legacy*: account-visible under the host's rules.

Decisions recorded here (docs/access.md "Access rules"):

* Enabled admins never narrow: they can read anything, so an admin in a
  consumer's audience is not required to be in the source's audience.
  Disabled admins are ordinary members (fail closed).
* Principal IDs in an audience that are unknown or disabled still count as
  members: removing a principal from principals.yaml must not widen what a
  consumer may attach.
* Unknown list-valued ``access`` tiers count in a consumer's audience, never in
  a source's (see :class:`kbd.core.manifest.AccessBlock`).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from kbd.errors import workflow_not_found

if TYPE_CHECKING:  # types only: principals.yaml loading stays out of the pure core
    from kbd.core.manifest import Manifest
    from kbd.core.principals import Principal, Principals


def audience(m: Manifest) -> frozenset[str]:
    """Who can read ``m`` as a source."""
    return frozenset(m.effective_owners) | frozenset(m.access.editors) | frozenset(m.access.readers)


def consumer_audience(m: Manifest) -> frozenset[str]:
    """Who can read what ``m`` produces, including tiers kbd does not model."""
    return audience(m) | frozenset(m.access.other_tiers)


def can_read(consumer: Manifest, source: Manifest, principals: Principals) -> bool:
    """May the whole audience of ``consumer`` read ``source``?"""
    if source.is_legacy:
        return True
    if consumer.is_legacy:
        # Account-visible consumer: everyone on the account would see the source.
        return False
    allowed = audience(source)
    return all(p in allowed or principals.is_enabled_admin(p) for p in consumer_audience(consumer))


def can_write(consumer: Manifest, source: Manifest, principals: Principals) -> bool:
    """can_read, a non-legacy source, and the source's owner named the consumer."""
    return (
        can_read(consumer, source, principals)
        and not source.is_legacy
        and consumer.id in source.access.allowed_kb_writers
    )


def not_admitted(consumer: Manifest, source: Manifest, principals: Principals) -> tuple[str, ...]:
    """The members of ``consumer``'s audience that ``source`` does not admit (enabled admins never
    narrow): whom ``source``'s readers would have to gain for :func:`can_read` to hold (a legacy
    consumer is account-visible: no list of readers admits it)."""
    admitted = audience(source)
    return tuple(sorted(p for p in consumer_audience(consumer)
                        if p not in admitted and not principals.is_enabled_admin(p)))  # fmt: skip


def may_use_session(actor: Principal, opened_by: str, m: Manifest, *, readers_may_open: bool) -> bool:
    """May ``actor`` use a session of ``m`` that ``opened_by`` opened (its plan, notes, checks,
    children, close, revoke)? Services and enabled admins; its opener while it may still open
    this kind of session. The daemon's pushed revocation and a preview ask the same."""
    if actor.disabled:
        return False
    if actor.is_service or actor.enabled_admin:
        return True
    return actor.id == opened_by and can_open_session(actor, m, readers_may_open=readers_may_open)


def can_inspect(actor: Principal, m: Manifest) -> bool:
    """May ``actor`` see ``m``'s configuration and attachment statuses?"""
    if actor.disabled:
        return False
    if actor.enabled_admin or actor.is_service or m.is_legacy:
        return True
    return actor.id in consumer_audience(m)


def can_manage_sources(actor: Principal, m: Manifest) -> bool:
    """Owners and editors (any enabled account user on a legacy workflow) or an admin."""
    if actor.disabled:
        return False
    if actor.enabled_admin:
        return True
    if m.is_legacy:
        return not actor.is_service
    return actor.id in m.effective_owners or actor.id in m.access.editors


def can_grant_writers(actor: Principal, source: Manifest) -> bool:
    """Only the source's effective owners or an admin."""
    if actor.disabled:
        return False
    return actor.enabled_admin or actor.id in source.effective_owners


def can_open_session(actor: Principal, m: Manifest, *, readers_may_open: bool) -> bool:
    """Services for any workflow on the host; owners, editors and admins for any
    kind (any enabled user on a legacy workflow); readers for reviewer kinds only."""
    if actor.disabled:
        return False
    if actor.is_service or actor.enabled_admin:
        return True
    if m.is_legacy or actor.id in m.effective_owners or actor.id in m.access.editors:
        return True
    return readers_may_open and actor.id in consumer_audience(m)


def require_inspectable(actor: Principal, m: Manifest, wid: str) -> None:
    """Unless ``actor`` may inspect ``m``, raise the one answer an outsider gets:
    word for word a missing workflow's (:func:`kbd.errors.workflow_not_found`
    for ``wid``, the ID asked for), so IDs cannot be probed (docs/access.md "Invisible is not found"). Every
    refusal that would otherwise confirm a workflow exists checks this first."""
    if not can_inspect(actor, m):
        raise workflow_not_found(wid, outsider=True)
