"""``kbd init``: create a root's config files, and optionally the demo workflows."""

from __future__ import annotations

import contextlib
import getpass
import os
import re
import socket
import stat
from pathlib import Path
from typing import Any

import orjson
import yaml

from kbd.core.identifiers import id_problem
from kbd.core.layout import CONFIG_NAME, INDEX_NAME, KB_DIR, MANIFEST, NOTES_DIR, PRINCIPALS_NAME, STATE_DIR
from kbd.errors import RootError, RootExists
from kbd.fs.atomic import write_atomic

CONFIG_TEMPLATE = """\
# kbd host configuration. Unknown keys are errors.
host: {host}
# Folders searched (recursively) for workflow folders holding workflow.json.
# Relative paths are relative to this root.
workflow_roots: [workflows]
# Operator-approved roots that folder_access grants must lie under.
folder_roots: [folders]
locks:
  timeout_seconds: 10        # how long a writer waits for a notes/ or manifest lock
sandbox:
  backend: auto              # auto | bwrap | landlock
  network: none              # none | host: network inside `kbd exec` sandboxes
  unsafe_landlock_writes: false
  unsafe_no_sandbox: false
# Per-command resource limits (null = no limit). The cgroup ones need the controller
# in the cgroup v2 hierarchy (pids also works through a cgroup v1 pids hierarchy);
# `kbd doctor` lists which ones this host enforces. Sizes take K, M, G, T.
limits:
  pids_max: 512              # processes + threads per command (the fork-bomb bound)
  memory_max: 4G             # cgroup memory.max per command
  cpu_weight: 50             # cgroup cpu.weight (100 = an ordinary process)
  cpu_max: null              # CPUs per command (e.g. 1.5); null = no quota
  file_size_max: 1G          # RLIMIT_FSIZE: largest file a command may write
  open_files_max: 4096       # RLIMIT_NOFILE
  address_space_max: null    # RLIMIT_AS (breaks runtimes that reserve address space)
  cpu_time_max: null         # RLIMIT_CPU seconds
  tmpfs_size: 512M           # the sandbox's /tmp and /dev/shm (bubblewrap backend)
revocation:
  immediate: {immediate:<5}           # terminate running commands when their grants shrink
  grace_seconds: 5
notes_quota:                 # each source's notes/, enforced by notes writes and after commands
  max_bytes: 268435456       # 256 MiB of regular files
  max_files: 10000           # entries of any kind (files, folders, links); at most 50000
"""


ROOT_FOLDERS = ("workflows", "folders", STATE_DIR)


def _refuse_non_folder(root: Path, sub: str) -> None:
    """Raise RootError when ``root/sub`` exists and is not a real folder (a
    symbolic link to one included). A missing one is fine: init creates it."""
    try:
        st = os.lstat(root / sub)
    except FileNotFoundError:
        return
    except NotADirectoryError:
        return  # root itself is missing or not a folder: reported elsewhere
    if stat.S_ISLNK(st.st_mode):
        raise RootError(
            f"{root / sub} is a symbolic link; kbd init never follows a link for {sub}/",
            hint=f"remove the link and run `kbd init` again (kbd creates {sub}/ itself), "
            "or point --root at the folder you mean",
        )
    if not stat.S_ISDIR(st.st_mode):
        raise RootError(f"{root / sub} exists and is not a folder", hint=f"remove or rename {root / sub}")


def _make_folders(root: Path) -> None:
    """Create the root's folders beneath the pinned root, never following a link:
    ``mkdir`` does not follow a final link, and the ``O_NOFOLLOW`` open that
    confirms each one refuses a link swapped in after the check above."""
    root_fd = os.open(root, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
    try:
        for sub in ROOT_FOLDERS:
            with contextlib.suppress(FileExistsError):
                os.mkdir(sub, 0o750, dir_fd=root_fd)
            try:
                fd = os.open(sub, os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC, dir_fd=root_fd)
            except OSError as exc:
                _refuse_non_folder(root, sub)
                raise RootError(f"{root / sub} cannot be opened: {exc.strerror}") from None
            os.close(fd)
    finally:
        os.close(root_fd)


def _safe_name(value: str, fallback: str) -> str:
    cleaned = re.sub(r"[^A-Za-z0-9._-]", "-", value).strip("-.") or fallback
    return cleaned if id_problem(cleaned) is None else fallback


def init_root(
    root: Path, *, host: str | None, force: bool, demo: bool, grant_group: str | None = None
) -> dict[str, Any]:
    """Write kbd.yaml and principals.yaml (and the demo) into ``root``.

    Refuses a root that already has kbd.yaml unless ``force``. Never deletes.
    ``grant_group``: written as ``sandbox.grant_group`` (``kbd init --system``).
    """
    if root.exists() and not root.is_dir():
        raise RootError(f"{root} exists and is not a folder")
    # Before anything is written: a pre-placed link would make kbd keep its
    # state, or discover workflows, somewhere the operator never chose.
    for sub in ROOT_FOLDERS:
        _refuse_non_folder(root, sub)
    existing = (root / CONFIG_NAME).exists()
    if existing and not force:
        raise RootExists(f"{root} already holds a kbd root ({CONFIG_NAME} exists)")
    if existing and demo:
        known = {folder for folder, _, _ in DEMO}
        others = [p.name for p in (root / "workflows").iterdir()] if (root / "workflows").is_dir() else []
        if any(name not in known for name in others):
            # The demo maps an admin to the caller's uid: never into a real root.
            raise RootExists(
                f"{root} holds workflows of its own; --demo only initialises an empty or demo root",
                hint="use a new --root for the demo",
            )
    host_name = host if host is not None else _safe_name(socket.gethostname(), "localhost")
    if (problem := id_problem(host_name)) is not None:
        raise RootError(f"--host {problem}")
    root.mkdir(parents=True, exist_ok=True, mode=0o750)
    _make_folders(root)
    # A service host's users are not its operator: there a shrunk grant ends the
    # commands still using it (docs/daemon.md "Pushed revocation").
    config = CONFIG_TEMPLATE.format(host=host_name, immediate="true" if grant_group is not None else "false")
    if grant_group is not None:
        config = config.replace(
            "  unsafe_no_sandbox: false\n",
            "  unsafe_no_sandbox: false\n"
            f"  grant_group: {grant_group}        # no members, ever: added to sandboxed commands only\n",
        )
    write_atomic(root / CONFIG_NAME, config.encode(), mode=0o640)
    principals = demo_principals() if demo else default_principals()
    write_atomic(
        root / PRINCIPALS_NAME,
        yaml.safe_dump({"principals": principals}, sort_keys=False).encode(),
        mode=0o640,
    )
    created: list[str] = []
    if demo:
        created = create_demo_workflows(root / "workflows")
    return {
        "root": str(root.resolve()),
        "host": host_name,
        "demo_workflows": created,
        "replaced": existing,  # kbd.yaml and principals.yaml (tokens, uid maps) were rewritten
    }


def default_principals() -> list[dict[str, Any]]:
    """One admin mapped to the uid running init, so the CLI works without --as."""
    try:
        name = getpass.getuser()
    except (KeyError, OSError):
        name = "operator"
    return [{"id": _safe_name(name, "operator"), "kind": "user", "admin": True, "uid": os.getuid()}]


def demo_principals() -> list[dict[str, Any]]:
    return [
        {"id": "alice", "kind": "user"},
        {"id": "bob", "kind": "user"},
        {"id": "carol", "kind": "user"},
        {"id": "ops", "kind": "user", "admin": True, "uid": os.getuid()},
        {"id": "exec-host", "kind": "service"},
        {"id": "mallory", "kind": "user", "disabled": True},
    ]


# (folder, manifest, {file relative to the knowledge base: content}) — wired so `workflows show wf_perf`
# shows each status the README walks through.
DEMO: list[tuple[str, dict[str, Any], dict[str, str]]] = [
    (
        "rts",
        {
            "id": "wf_rts",
            "label": "RTS platform",
            "access": {"owners": ["alice"], "readers": ["bob"]},
            "schedule": {"cron": "0 6 * * *"},
        },
        {
            "context/architecture.md": "# RTS architecture\nEdge -> router -> livekit SFU.\n",
            "notes/services.md": "# Services\n- router: routes rooms (verified 2026-11-02)\n",
        },
    ),
    (
        "security",
        {
            "id": "wf_security",
            "label": "Security review",
            "access": {"owners": ["bob"], "readers": ["alice"], "allowed_kb_writers": ["wf_perf"]},
            "knowledgebase_sources": [{"workflow_id": "wf_rts", "alias": "rts", "access": "read"}],
        },
        {
            "context/threat-model.md": "# Threat model\nTenants must not read each other's rooms.\n",
            "notes/findings.md": "# Findings\n- TURN credentials rotate daily.\n",
        },
    ),
    (
        "cost",
        {
            "id": "wf_cost",
            "label": "Cost tracking",
            "access": {"owners": ["carol"], "readers": ["alice"]},
        },
        {"notes/budget.md": "# Budget\nSFU egress is 62% of spend.\n"},
    ),
    (
        "payroll",
        {"id": "wf_payroll", "label": "Payroll (private)", "access": {"owners": ["carol"]}},
        {"notes/salaries.md": "# Private\n"},
    ),
    (
        "docs",
        {"id": "wf_docs", "label": "Shared docs (legacy, no owner)"},
        {"context/glossary.md": "# Glossary\nSFU: selective forwarding unit.\n"},
    ),
    (
        "perf",
        {
            "id": "wf_perf",
            "label": "RTS performance",
            "access": {"owners": ["alice"]},
            "knowledgebase_sources": [
                {"workflow_id": "wf_rts", "alias": "rts", "access": "read"},
                {"workflow_id": "wf_security", "alias": "security", "access": "write"},
                {"workflow_id": "wf_cost", "alias": "cost", "access": "write"},
                {"workflow_id": "wf_payroll", "alias": "payroll", "access": "read"},
                {"workflow_id": "wf_archived", "alias": "archive", "access": "read"},
            ],
        },
        {"notes/latency.md": "# Latency\np99 join time 840 ms.\n"},
    ),
]


def create_demo_workflows(workflows: Path) -> list[str]:
    created = []
    for folder, manifest, kb_files in DEMO:
        base = workflows / folder
        if base.exists():
            continue
        for sub in (
            f"{KB_DIR}/context",
            f"{KB_DIR}/{NOTES_DIR}",
            "soul",
            "learnings",
            "runs",
            "credentials",
        ):
            (base / sub).mkdir(parents=True, exist_ok=True)
        notes = f"{NOTES_DIR}/"
        index = {
            "notes": [
                {"path": name.removeprefix(notes), "title": body.splitlines()[0].lstrip("# ")}
                for name, body in kb_files.items()
                if name.startswith(notes)
            ]
        }
        files = {
            **{f"{KB_DIR}/{name}": body for name, body in kb_files.items()},
            f"{KB_DIR}/{NOTES_DIR}/{INDEX_NAME}": orjson.dumps(index, option=orjson.OPT_INDENT_2).decode()
            + "\n",
            "soul/persona.md": f"# {manifest['label']} persona (private)\n",
            "learnings/lessons.md": "# Lessons (private)\n",
            "credentials/token": f"secret-token-of-{manifest['id']}\n",
        }
        for name, body in files.items():
            (base / name).write_text(body, encoding="utf-8")
        (base / MANIFEST).write_bytes(orjson.dumps(manifest, option=orjson.OPT_INDENT_2) + b"\n")
        created.append(manifest["id"])
    return created
