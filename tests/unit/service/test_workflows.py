"""docs/on-disk.md validation of attachments and write grants, at the operations layer
(kbd.service.workflows, and kbd.service.auth for who is acting): one case per
rule, each a direct call on a real temporary root, no CLI and no subprocess.

Every refusal asserts what the CLI tests asserted of the same case before they
moved here: the error's exit code (the CLI exits with it), its message naming
the entry/field and what is allowed (the CLI prints it as ``error[<code>]:
message``), a hint (the CLI's ``hint:`` line), an error from the one tree (never
a traceback), and that every workflow.json under the root is byte-identical
afterwards. tests/integration/test_cli_validation.py keeps smoke cases of each
table through the real CLI and checks that it prints exactly these errors.
"""

from __future__ import annotations

import os
from collections.abc import Callable
from typing import Any

import pytest

from kbd.errors import KbdError
from kbd.service import auth, workflows
from tests.helpers import KbRoot
from tests.sources_world import ALIAS_RULE, FIRST, build, workflow_files


@pytest.fixture
def world(kb: KbRoot) -> KbRoot:
    return build(kb)


def refused(kb: KbRoot, operation: Callable[[], object], code: int, fragments: list[str]) -> KbdError:
    """Run ``operation`` (which must refuse) and check the refusal and the unchanged tree."""
    before = workflow_files(kb)
    with pytest.raises(KbdError) as info:
        operation()
    err = info.value
    assert err.exit_code == code, f"exit {err.exit_code}, expected {code}: error[{err.code}]: {err.message}"
    for fragment in fragments:
        assert fragment in err.message, f"{fragment!r} not in error message {err.message!r}"
    assert err.hint.strip(), f"no hint for error[{err.code}]: {err.message}"
    assert workflow_files(kb) == before, "a rejected request changed a file"
    return err


# -- sources set: one rule per case ---------------------------------------------------
# (`stdin is not valid JSON` is the CLI's own parse: test_cli_validation keeps it.)

SET_REJECTIONS = [
    pytest.param(
        [{"workflow_id": f"w{i}", "alias": f"a{i}"} for i in range(21)],
        65,
        ["knowledgebase_sources", "21 entries", "at most 20"],
        id="more-than-20",
    ),
    pytest.param(
        [FIRST, {"workflow_id": "src2", "alias": "Upper"}],
        65,
        ["knowledgebase_sources[1]", "alias 'Upper'", ALIAS_RULE],
        id="alias-uppercase",
    ),
    pytest.param(
        [{"workflow_id": "src2", "alias": "2fast"}],
        65,
        ["knowledgebase_sources[0]", "alias '2fast'", ALIAS_RULE],
        id="alias-leading-digit",
    ),
    pytest.param(
        [{"workflow_id": "src2", "alias": "a" * 49}],
        65,
        ["knowledgebase_sources[0]", "alias 'aaaa", "1-48 characters", ALIAS_RULE],
        id="alias-49-chars",
    ),
    pytest.param(
        [{"workflow_id": "src2", "alias": "../escape"}],
        65,
        ["knowledgebase_sources[0]", "alias '../escape'", ALIAS_RULE],
        id="alias-path",
    ),
    pytest.param(
        [{"workflow_id": "src2", "alias": ""}],
        65,
        ["knowledgebase_sources[0]", "alias ''", ALIAS_RULE],
        id="alias-empty",
    ),
    pytest.param(
        [{"workflow_id": "src2", "alias": 7}],
        65,
        ["knowledgebase_sources[0]", "alias must be a string"],
        id="alias-non-string",
    ),
    pytest.param(
        [{"workflow_id": "src2", "alias": "access"}],
        65,
        ["knowledgebase_sources[0]", "'access' is reserved", "WORKFLOW_KB_ACCESS"],
        id="alias-reserved",
    ),
    pytest.param(
        [FIRST, {"workflow_id": "src2", "alias": "s"}],
        65,
        ["knowledgebase_sources[1]", "alias 's' is already used by entry 0"],
        id="duplicate-alias",
    ),
    pytest.param(
        [FIRST, {"workflow_id": "src", "alias": "s2"}],
        65,
        ["knowledgebase_sources[1]", "workflow 'src' is already attached as entry 0"],
        id="duplicate-source",
    ),
    pytest.param(
        [{"workflow_id": "con", "alias": "me"}],
        65,
        ["knowledgebase_sources[0]", "workflow_id names this workflow itself"],
        id="self-reference",
    ),
    pytest.param(
        [{"workflow_id": "../other", "alias": "o"}],
        65,
        ["knowledgebase_sources[0]", "workflow_id", "looks like a path", "workflow ID"],
        id="id-relative-path",
    ),
    pytest.param(
        [{"workflow_id": "/abs/path", "alias": "o"}],
        65,
        ["knowledgebase_sources[0]", "workflow_id", "looks like a path", "workflow ID"],
        id="id-absolute-path",
    ),
    pytest.param(
        [{"workflow_id": "src2", "alias": "t", "access": "admin"}],
        65,
        ["knowledgebase_sources[0]", "access 'admin' is not allowed", "allowed: read, write"],
        id="unknown-access-mode",
    ),
    pytest.param(
        [{"workflow_id": "src2", "alias": "t", "path": "/srv/kb"}],
        65,
        ["knowledgebase_sources[0]", "unknown key 'path'", "allowed: workflow_id, alias, access"],
        id="unknown-key",
    ),
    pytest.param(
        [{"alias": "t"}],
        65,
        ["knowledgebase_sources[0]", "workflow_id is required"],
        id="missing-workflow-id",
    ),
    pytest.param(
        [{"workflow_id": "src2"}],
        65,
        ["knowledgebase_sources[0]", "alias is required"],
        id="missing-alias",
    ),
    pytest.param(
        ["src2"],
        65,
        ["knowledgebase_sources[0]", "must be an object with workflow_id, alias and access"],
        id="entry-not-object",
    ),
    pytest.param(
        {"workflow_id": "src2", "alias": "t"},
        65,
        ["knowledgebase_sources must be a JSON array", "got a mapping"],
        id="non-array",
    ),
    pytest.param(
        [FIRST, {"workflow_id": "ghost", "alias": "g"}],
        66,
        ["'ghost'", "not_found"],
        id="missing-workflow",
    ),
    pytest.param(
        [{"workflow_id": "remote", "alias": "r"}],
        65,
        ["'remote'", "other_host", "'elsewhere'"],
        id="other-host",
    ),
    pytest.param(
        [{"workflow_id": "private", "alias": "p"}],
        77,
        ["'private'", "audience_denied"],
        id="audience-denied",
    ),
    pytest.param(
        [{"workflow_id": "nokb", "alias": "n"}],
        65,
        ["'nokb'", "kb_missing", "knowledgebase/"],
        id="no-knowledgebase",
    ),
    pytest.param(
        [{"workflow_id": "legacy", "alias": "l", "access": "write"}],
        65,
        ["'legacy'", "write access", "no owner"],
        id="write-on-legacy",
    ),
]


@pytest.mark.parametrize(("raw", "code", "fragments"), SET_REJECTIONS)
def test_set_sources_rejects(world: KbRoot, raw: Any, code: int, fragments: list[str]) -> None:
    host = world.host()
    refused(
        world, lambda: workflows.set_sources(host, "con", raw, actor=host.actor("alice")), code, fragments
    )


# -- attach: one rule per case --------------------------------------------------------
# (A bad --alias is refused by the CLI before this operation, naming the flag:
# test_cli_validation keeps those cases.)

ATTACH_REJECTIONS = [
    pytest.param(
        ("src2", "s", "read"), 65, ["knowledgebase_sources[1]", "alias 's' is already used"], id="dup-alias"
    ),
    pytest.param(
        ("src", "s2", "read"),
        65,
        ["knowledgebase_sources[1]", "workflow 'src' is already attached"],
        id="dup-source",
    ),
    pytest.param(("con", "me", "read"), 65, ["names this workflow itself"], id="self-reference"),
    pytest.param(
        ("../other", "o", "read"), 65, ["workflow_id", "looks like a path", "workflow ID"], id="id-rel-path"
    ),
    pytest.param(
        ("/abs/path", "o", "read"), 65, ["workflow_id", "looks like a path", "workflow ID"], id="id-abs-path"
    ),
    pytest.param(("ghost", "g", "read"), 66, ["'ghost'", "not_found"], id="missing-workflow"),
    pytest.param(("remote", "r", "read"), 65, ["'remote'", "other_host", "'elsewhere'"], id="other-host"),
    pytest.param(("private", "p", "read"), 77, ["'private'", "audience_denied"], id="audience-denied"),
    pytest.param(("nokb", "n", "read"), 65, ["'nokb'", "kb_missing"], id="no-knowledgebase"),
    pytest.param(("legacy", "l", "write"), 65, ["'legacy'", "no owner"], id="write-on-legacy"),
]


@pytest.mark.parametrize(("entry", "code", "fragments"), ATTACH_REJECTIONS)
def test_attach_rejects(world: KbRoot, entry: tuple[str, str, str], code: int, fragments: list[str]) -> None:
    source, alias, access = entry
    host = world.host()

    def attach() -> object:
        return workflows.attach(host, "con", source, alias=alias, access=access, actor=host.actor("alice"))

    refused(world, attach, code, fragments)


def test_attach_to_a_missing_consumer_is_not_found(world: KbRoot) -> None:
    host = world.host()
    refused(
        world,
        lambda: workflows.attach(host, "ghost", "src", alias="x", access="read", actor=host.actor("alice")),
        66,
        ["'ghost'"],
    )


# -- who may attach -----------------------------------------------------------------------
# A member of the audience who may not manage it is refused by the operation; a
# disabled, unknown or unmapped principal never becomes an actor (kbd.service.auth,
# as the CLI resolves --as, $KBD_AS or the caller's uid).


def _cli_actor(kb: KbRoot, name: str | None) -> object:
    return auth.named_or_mapped(kb.host().principals, flag=name, env=None, uid=os.getuid())


ACTOR_REJECTIONS = [
    pytest.param("bob", True, ["'bob' may not manage the sources of 'con'"], id="reader"),
    pytest.param("svc", True, ["'svc'"], id="service-not-member"),
    pytest.param("mallory", False, ["principal 'mallory' is disabled"], id="disabled"),
    pytest.param("exadmin", False, ["principal 'exadmin' is disabled"], id="disabled-admin"),
    pytest.param("nobody", False, ["unknown principal 'nobody'"], id="unknown-principal"),
    pytest.param(None, False, ["no principal is mapped to uid"], id="no-as-no-uid-mapping"),
]


@pytest.mark.parametrize(("name", "is_principal", "fragments"), ACTOR_REJECTIONS)
def test_attach_refused_for_actor(
    world: KbRoot, name: str | None, is_principal: bool, fragments: list[str]
) -> None:
    host = world.host()
    if is_principal:
        assert name is not None
        actor = _cli_actor(world, name)
        assert actor == host.actor(name)

        def attach() -> object:
            return workflows.attach(host, "con", "src2", alias="t", access="read", actor=host.actor(name))

        refused(world, attach, 77, fragments)
    else:
        refused(world, lambda: _cli_actor(world, name), 77, fragments)


# -- writers grant ----------------------------------------------------------------------

GRANT_REJECTIONS = [
    pytest.param(
        ("src", "con", "bob"),
        77,
        ["'bob' may not change who writes into 'src'", "only its owners or an admin"],
        id="non-owner-editor",
    ),
    pytest.param(("src", "con", "carol"), 77, ["'carol'", "only its owners"], id="reader"),
    pytest.param(("src", "ghost", "alice"), 66, ["'ghost'"], id="unknown-consumer"),
    pytest.param(("ghost", "con", "alice"), 66, ["'ghost'"], id="unknown-source"),
    pytest.param(
        ("src", "src", "alice"), 65, ["allowed_kb_writers", "names the source workflow itself"], id="self"
    ),
    pytest.param(
        ("src", "  src ", "alice"),
        65,
        ["allowed_kb_writers", "names the source workflow itself"],
        id="self-padded",
    ),
    pytest.param(
        ("src", "../con", "alice"), 65, ["allowed_kb_writers", "must not contain '/'"], id="path-not-id"
    ),
    pytest.param(
        ("legacy", "con", "ops"),
        65,
        ["'legacy' has no owner", "cannot grant write access"],
        id="legacy-source-admin",
    ),
    pytest.param(
        ("legacy", "con", "alice"),
        77,
        ["'alice' may not change who writes into 'legacy'"],
        id="legacy-source-non-admin",
    ),
]


@pytest.mark.parametrize(("grant", "code", "fragments"), GRANT_REJECTIONS)
def test_grant_rejects(world: KbRoot, grant: tuple[str, str, str], code: int, fragments: list[str]) -> None:
    source, consumer, actor = grant
    host = world.host()
    refused(world, lambda: workflows.grant(host, source, consumer, actor=host.actor(actor)), code, fragments)


@pytest.mark.parametrize(
    ("name", "fragments"),
    [("mallory", ["'mallory' is disabled"]), ("nobody", ["unknown principal 'nobody'"])],
    ids=["disabled", "unknown-principal"],
)
def test_grant_is_never_made_by_a_principal_that_cannot_act(
    world: KbRoot, name: str, fragments: list[str]
) -> None:
    refused(world, lambda: _cli_actor(world, name), 77, fragments)
