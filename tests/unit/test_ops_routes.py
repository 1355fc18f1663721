"""The operations table (kbd/ops.py): each operation's API request is spelled
once, by its Route, and the daemon rebuilds the same operation from it
(docs/architecture.md "Typed operations")."""

from __future__ import annotations

import dataclasses
import typing
from typing import Any

import pytest

from kbd import ops
from kbd.daemon import routes
from kbd.errors import UsageError


def _ops() -> list[type[ops.Op[Any]]]:
    found: list[type[ops.Op[Any]]] = []
    todo = list(ops.Op.__subclasses__())
    while todo:
        cls = todo.pop()
        found.append(cls)
        todo.extend(cls.__subclasses__())
    return sorted(found, key=lambda c: c.__name__)


# DryRun has no route of its own: it is its operation's request with ?dry_run=true (below).
ALL = [o for o in _ops() if o is not ops.DryRun]


def test_every_grant_change_is_previewed_through_its_own_route() -> None:
    """docs/access.md "Previews": --dry-run sends the operation's own request with dry_run=true."""
    previewable = [o for o in ALL if o.previewable]
    assert {o.__name__ for o in previewable} >= {"Attach", "Detach", "SetSources", "SetAccess", "Grant", "Revoke",
                                                  "ReadersGrant", "ReadersRevoke", "PrincipalChange"}  # fmt: skip
    grant = ops.Grant("src", "con")
    dry = ops.DryRun(grant).http()
    assert (dry.method, dry.path, dry.body, dry.params) == ("POST", "/v1/workflows/src/writers",
                                                             {"workflow_id": "con"}, {"dry_run": "true"})  # fmt: skip
    with pytest.raises(UsageError, match="no --dry-run"):
        ops.DryRun(ops.WorkflowsList())


def test_the_table_holds_every_command_the_cli_sends() -> None:
    assert len(ALL) >= 40


@pytest.mark.parametrize("op", ALL, ids=lambda c: c.__name__)
def test_each_route_names_only_fields_of_its_operation(op: type[ops.Op[Any]]) -> None:
    route = op.route
    fields = {f.name for f in dataclasses.fields(op)}  # type: ignore[arg-type]
    assert route.path.startswith("/v1/"), route
    for name in route.names:
        assert route.field_of(name) in fields, (op, name)
    for wire in (route.body or {}), route.query:
        assert set(wire.values()) <= fields, (op, wire)
    # Each field travels once: in the path, the body or the query.
    carried = [route.field_of(n) for n in route.names] + list((route.body or {}).values())
    carried += list(route.query.values())
    assert len(carried) == len(set(carried)), op


def _sample(hint: Any) -> Any:
    origin = typing.get_origin(hint)
    if origin is typing.Literal:
        return typing.get_args(hint)[-1]
    if hint is int or hint == int | None:
        return 7
    if hint is bool or hint == bool | None:
        return True
    if origin is tuple:
        return ("a", "b")
    return "x-1"


@pytest.mark.parametrize("op", [o for o in ALL if o in routes.SERVED], ids=lambda c: c.__name__)
def test_the_daemon_rebuilds_the_operation_the_client_sent(op: type[ops.Op[Any]]) -> None:
    """Op.http() → the values a served route receives → Op.from_wire() gives the operation back."""
    hints = typing.get_type_hints(op)
    sent = op(**{f.name: _sample(hints[f.name]) for f in dataclasses.fields(op)})  # type: ignore[arg-type]
    request = sent.http()
    values: dict[str, Any] = dict(request.body or {})
    template = op.route.path.split("/")
    for part, got in zip(template, request.path.split("/"), strict=True):
        if part.startswith("{"):
            name = part[1:-1]
            values[name] = int(got) if hints[op.route.field_of(name)] is int else got
    assert op.from_wire(values) == sent
    assert request.method == op.route.method and not request.params


def test_the_daemon_serves_from_the_table_every_operation_that_needs_nothing_else() -> None:
    """The routes still written out in kbd/daemon/routes.py are the ones with a
    reason (a query, an ETag, work outside the state lock, a stream)."""
    assert {o for o in ALL if o not in routes.SERVED} == set(routes.OWN_HANDLER)
    for op, body in routes.SERVED.items():
        assert (body is None) == (op.route.body is None), op
        if body is not None:
            assert set(op.route.body or ()) <= set(body.model_fields), op
