"""The deployment recipe of docs/multi-user.md "Deploying on a host", run verbatim
as far as this machine allows: everything but systemd as PID 1.

The recipe runs as root in a private mount namespace whose /etc, /opt,
/usr/local/bin, /var/lib and /run are overlays on the host's (the host's files
show through; every change stays in the test's folder and is gone with it):
the system-interpreter venv, the `pip install`, the `kbd units install`,
systemd-sysusers and systemd-tmpfiles, `kbd init --system`, the principal and
the group membership, `kbd doctor`. Its one placeholder, ``/path/to/kbd``, is
a copy of this checkout's sources. ``systemctl`` is a stand-in: ``daemon-reload``
does nothing, ``enable --now kbd.socket`` starts what the installed units say
(ListenStream, SocketMode, SocketGroup, DirectoryMode, Environment, UMask,
ExecStart) under systemd-socket-activate. Then the recipe's last line, "as
alice (through the daemon)", runs as a real user alice, followed by a session
and a sandboxed command of hers: the host works as the page promises.
"""

from __future__ import annotations

import pwd
import re
import shlex
import shutil
import subprocess
from pathlib import Path

import pytest

pytestmark = [pytest.mark.requires_bwrap, pytest.mark.requires_landlock, pytest.mark.timeout(900)]

REPO = Path(__file__).resolve().parents[2]
RECIPE_PAGE = REPO / "docs" / "multi-user.md"
SECTION = "## Deploying on a host"
# What `pip install /path/to/kbd` needs of the checkout (tests/packaging/test_wheel.py copies the same).
SOURCES = ("pyproject.toml", "README.md", "LICENSE", "kbd", "policies", "sandbox-profiles", "systemd", "docs")
OVERLAID = ("/etc", "/opt", "/usr/local/bin", "/var/lib", "/run")
# What a host that never had kbd lacks: removed inside the namespace only (whiteouts in the overlays).
PRISTINE = ("/opt/kbd", "/usr/local/bin/kbd", "/var/lib/kbd", "/run/kbd", "/etc/systemd/system/kbd.socket",
            "/etc/systemd/system/kbd.service", "/etc/sysusers.d/kbd.conf", "/etc/tmpfiles.d/kbd.conf")  # fmt: skip


def recipe() -> tuple[list[str], str]:
    """The recipe's command lines (comments kept: bash ignores them) and the
    command its last line says alice runs."""
    text = RECIPE_PAGE.read_text()
    section = text[text.index(SECTION) :]
    block = re.search(r"^```sh\n(.*?)^```", section, re.M | re.S)
    assert block is not None, f"{RECIPE_PAGE}: no ```sh block under {SECTION!r}"
    lines = block.group(1).splitlines()
    last = re.fullmatch(r"# then, as alice \(through the daemon\):\s+(kbd .+)", lines[-1])
    assert last is not None, f"the recipe's last line names what alice runs: {lines[-1]!r}"
    return lines[:-1], last.group(1)


SYSTEMCTL = r"""#!/bin/bash
# systemctl without systemd as PID 1: what the recipe asks of it (tests/system/test_deploy_recipe.py).
set -euo pipefail
echo "$*" >> "$WORK/systemctl.log"
unit() { sed -n "s/^$2=//p" "/etc/systemd/system/$1"; }
case "$*" in
  daemon-reload) exit 0 ;;
  "enable --now kbd.socket")
    listen=$(unit kbd.socket ListenStream)
    install -d -m "$(unit kbd.socket DirectoryMode)" "$(dirname "$listen")"
    envs=(); for e in $(unit kbd.service Environment); do envs+=("--setenv=$e"); done
    read -r -a exec_start <<< "$(unit kbd.service ExecStart)"
    umask "$(unit kbd.service UMask)"
    setsid systemd-socket-activate "--listen=$listen" "${envs[@]}" "${exec_start[@]}" \
      </dev/null >"$WORK/daemon.log" 2>&1 &
    echo $! > "$WORK/daemon.pid"
    for _ in $(seq 100); do [ -S "$listen" ] && break; sleep 0.1; done
    [ -S "$listen" ] || { echo "systemctl: no socket at $listen" >&2; exit 1; }
    chown "$(unit kbd.socket SocketUser):$(unit kbd.socket SocketGroup)" "$listen"
    chmod "$(unit kbd.socket SocketMode)" "$listen"
    ;;
  *) echo "systemctl (test stand-in): not part of the recipe: $*" >&2; exit 1 ;;
esac
"""


# The names the recipe creates: its builder, and the groups of systemd/kbd.sysusers.
RECIPE_USERS = ("alice",)
RECIPE_GROUPS = ("alice", "kbd", "kbd-grant")


def recipe_accounts() -> dict[str, bool]:
    """Which of the recipe's users and groups the host's own files hold."""
    users = {line.split(":", 1)[0] for line in Path("/etc/passwd").read_text().splitlines()}
    groups = {line.split(":", 1)[0] for line in Path("/etc/group").read_text().splitlines()}
    return {
        **{f"user {u}": u in users for u in RECIPE_USERS},
        **{f"group {g}": g in groups for g in RECIPE_GROUPS},
    }


def free_uid() -> int:
    taken = {p.pw_uid for p in pwd.getpwall()}
    return next(u for u in range(62000, 64000) if u not in taken)


def script(work: Path, src: Path, lines: list[str], as_alice: str) -> str:
    mounts = "\n".join(
        f"mkdir -p {work}/up{d} {work}/wk{d}\n"
        f"mount -t overlay overlay -o lowerdir={d},upperdir={work}/up{d},workdir={work}/wk{d} {d}"
        for d in OVERLAID
    )
    steps = "\n".join(line.replace("/path/to/kbd", str(src)) for line in lines)
    alice = ["setpriv", "--reuid=alice", "--regid=alice", "--init-groups", "env", "-i", "HOME=/",
             "PATH=/usr/local/bin:/usr/bin:/bin"]  # fmt: skip
    run_as = " ".join(shlex.quote(a) for a in alice)
    return f"""set -euo pipefail
export WORK={work}
{mounts}
rm -rf {" ".join(PRISTINE)}
trap '[ -f {work}/daemon.pid ] && kill "$(cat {work}/daemon.pid)" 2>/dev/null; true' EXIT
# The builder the recipe names exists on a real host already (an ordinary login).
useradd --no-create-home --shell /bin/sh --uid {free_uid()} alice
export PATH={work}/shim:$PATH
echo "== the recipe"
{steps}
echo "== as alice"
{run_as} bash -c {shlex.quote(as_alice)}
stat -c '%U:%G %a' /var/lib/kbd/workflows/research
sid=$({run_as} kbd session open research --kind execution --kb-access read --json \
      | sed -n 's/.*"session_id": "\\([^"]*\\)".*/\\1/p')
{run_as} kbd exec "$sid" -- sh -c 'echo "ran as $(id -un)"; ls knowledgebase'
"""


def test_the_deploy_recipe_runs_verbatim(tmp_path: Path) -> None:
    for tool in (
        "unshare",
        "setpriv",
        "useradd",
        "systemd-sysusers",
        "systemd-tmpfiles",
        "systemd-socket-activate",
    ):
        assert shutil.which(tool), f"{tool} is missing (.ci/run installs util-linux, passwd and systemd)"
    lines, as_alice = recipe()
    before = {path: Path(path).exists() for path in PRISTINE}
    accounts = recipe_accounts()
    assert any("kbd units install" in line for line in lines), "the recipe installs the units with kbd"
    src = tmp_path / "src"
    src.mkdir()
    for name in SOURCES:
        if (REPO / name).is_dir():
            shutil.copytree(REPO / name, src / name, ignore=shutil.ignore_patterns("__pycache__"))
        else:
            shutil.copy2(REPO / name, src / name)
    (tmp_path / "shim").mkdir()
    (tmp_path / "shim" / "systemctl").write_text(SYSTEMCTL)
    (tmp_path / "shim" / "systemctl").chmod(0o755)
    run = subprocess.run(["unshare", "--mount", "--propagation", "private", "bash", "-c",
                          script(tmp_path, src, lines, as_alice)],
                         capture_output=True, text=True, timeout=840, check=False)  # fmt: skip
    daemon_log = (tmp_path / "daemon.log").read_text() if (tmp_path / "daemon.log").exists() else ""
    assert run.returncode == 0, f"{run.stdout[-4000:]}\n{run.stderr[-6000:]}\ndaemon:\n{daemon_log[-3000:]}"
    out = run.stdout.split("== as alice\n", 1)[1].splitlines()
    assert out[0] == "created workflow research for alice at /var/lib/kbd/workflows/research", out
    assert out[1] == "alice:kbd-grant 2750", out  # docs/multi-user.md: the builder's workflow folder
    assert out[2] == "ran as alice" and set(out[3:]) == {"context", "notes"}, out
    assert (tmp_path / "systemctl.log").read_text().splitlines() == [
        "daemon-reload",
        "enable --now kbd.socket",
    ]
    # Nothing of it reached the host.
    assert {path: Path(path).exists() for path in PRISTINE} == before
    # Only the recipe's own names are compared: tests running beside this one add and remove users.
    assert recipe_accounts() == accounts
