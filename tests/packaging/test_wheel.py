"""Packaging (docs/multi-user.md "Service notes"): the wheel `pip wheel --no-deps` builds holds the
whole package and its data files and nothing else, and installed into a
throwaway venv it gives a `kbd` that works away from the checkout: --help,
init, doctor and a sandboxed `kbd exec` whose write plan runs the Landlock
helper from the installed package."""

from __future__ import annotations

import email.parser
import os
import re
import shutil
import subprocess
import sys
import tomllib
import zipfile
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest
import yaml

from tests.helpers import KbRoot

pytestmark = pytest.mark.timeout(600)

REPO = Path(__file__).resolve().parents[2]
# What a build needs (scripts/install-check.sh copies the same).
SOURCES = ("pyproject.toml", "README.md", "LICENSE", "kbd", "policies", "sandbox-profiles", "systemd", "docs")


@dataclass(frozen=True)
class Built:
    wheel: Path
    venv: Path

    @property
    def kbd(self) -> Path:
        return self.venv / "bin" / "kbd"


def _run(argv: list[str | Path], *, cwd: Path, env: dict[str, str] | None = None,
         timeout: float = 300) -> subprocess.CompletedProcess[str]:  # fmt: skip
    return subprocess.run([str(a) for a in argv], cwd=cwd, env=env, capture_output=True, text=True,
                          timeout=timeout, check=False)  # fmt: skip


@pytest.fixture(scope="module")
def built(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Built]:
    """The wheel, built from a copy of the checkout (a build leaves build/ behind),
    and a venv with it installed (dependencies from the configured index)."""
    base = tmp_path_factory.mktemp("packaging")
    src = base / "src"
    src.mkdir()
    for name in SOURCES:
        path = REPO / name
        if path.is_dir():
            shutil.copytree(path, src / name, ignore=shutil.ignore_patterns("__pycache__"))
        else:
            shutil.copy2(path, src / name)
    dist = base / "dist"
    r = _run([sys.executable, "-m", "pip", "wheel", "--no-deps", "-q", "-w", dist, src], cwd=base)
    assert r.returncode == 0, r.stderr
    (wheel,) = dist.glob("kbd-*.whl")
    venv = base / "venv"
    r = _run([sys.base_prefix + "/bin/python3", "-m", "venv", venv], cwd=base)
    assert r.returncode == 0, r.stderr
    r = _run([venv / "bin" / "pip", "install", "-q", wheel], cwd=base)
    assert r.returncode == 0, r.stderr
    yield Built(wheel, venv)


def test_license_file_matches_the_metadata() -> None:
    meta = tomllib.loads((REPO / "pyproject.toml").read_text())["project"]
    assert meta["license"] == "Apache-2.0"
    text = (REPO / "LICENSE").read_text()
    assert "Apache License" in text and "Version 2.0, January 2004" in text
    assert "END OF TERMS AND CONDITIONS" in text


def source_modules() -> set[str]:
    """Every module of the checkout's package, as a wheel path."""
    return {f"kbd/{p.relative_to(REPO / 'kbd')}" for p in (REPO / "kbd").rglob("*.py")
            if "__pycache__" not in p.parts}  # fmt: skip


def test_wheel_holds_the_package_and_its_data_and_nothing_else(built: Built) -> None:
    names = set(zipfile.ZipFile(built.wheel).namelist())
    missing = source_modules() - names
    assert not missing, f"modules left out of the wheel (add their package to pyproject): {sorted(missing)}"
    data = {f"kbd/policies/{p.name}" for p in (REPO / "policies").glob("*.yaml")}
    data |= {f"kbd/sandbox_profiles/{p.name}" for p in (REPO / "sandbox-profiles").glob("*.sb")}
    # The Knowledge page's assets (kbd ui serves them from the package: no CDN, docs/knowledge-page.md).
    assets = {f"kbd/ui/assets/{p.name}" for p in (REPO / "kbd" / "ui" / "assets").iterdir()}
    assert {"kbd/ui/assets/index.html", "kbd/ui/assets/app.js", "kbd/ui/assets/app.css"} <= assets
    data |= assets
    # What deployment needs: the systemd files (`kbd units`) and the docs their Documentation= names.
    data |= {
        f"kbd/units/{n}" for n in ("kbd.socket", "kbd.service", "kbd.sysusers", "kbd.tmpfiles", "README.md")
    }
    data |= {f"kbd/docs/{p.name}" for p in (REPO / "docs").glob("*.md")} | {"kbd/docs/workflow.schema.json"}
    assert data and data <= names, sorted(data - names)
    assert not [n for n in names if n.startswith("kbd/docs/") and n not in data], "docs: the text pages only"
    assert {"kbd/py.typed", "kbd/sandbox/landlock_helper.py", "kbd/__main__.py"} <= names
    info = next(n.split("/")[0] for n in names if n.endswith(".dist-info/METADATA"))
    assert f"{info}/licenses/LICENSE" in names
    tops = {n.split("/")[0] for n in names}
    assert tops == {"kbd", info}, "only the package and its metadata (no tests/, bench/, scripts/)"
    assert not any("__pycache__" in n or n.endswith(".pyc") for n in names)
    with zipfile.ZipFile(built.wheel) as whl:
        meta = email.parser.Parser().parsestr(whl.read(f"{info}/METADATA").decode())
        entry = whl.read(f"{info}/entry_points.txt").decode()
    assert meta["License-Expression"] == "Apache-2.0"
    assert "kbd = kbd.cli.entry:main" in entry


def test_the_installed_kbd_installs_its_units_naming_itself_and_its_docs(
    built: Built, tmp_path: Path
) -> None:
    r = installed(built, tmp_path, "units", "install", "--dest", str(tmp_path / "dest"))
    assert r.returncode == 0, r.stderr
    service = (tmp_path / "dest" / "etc" / "systemd" / "system" / "kbd.service").read_text()
    assert f"\nExecStart={built.kbd} serve\n" in service
    (docs,) = re.findall(r"^Documentation=(.*)$", service, re.M)
    for uri in docs.split():
        assert uri.startswith("file://") and Path(uri[len("file://") :]).is_file(), uri
        assert Path(uri[len("file://") :]).is_relative_to(built.venv), (
            "the installed docs, not the checkout's"
        )
    assert "{{" not in service


def installed(built: Built, cwd: Path, *args: str) -> subprocess.CompletedProcess[str]:
    """The installed `kbd ARGS`, away from the checkout (no PYTHONPATH, cwd outside it)."""
    env = {k: v for k, v in os.environ.items() if not k.startswith(("KBD_", "PYTHON"))}
    env["KBD_NO_DAEMON"] = "1"
    return _run([built.kbd, *args], cwd=cwd, env=env, timeout=60)


def test_installed_kbd_imports_from_the_venv(built: Built, tmp_path: Path) -> None:
    r = _run([built.venv / "bin" / "python", "-c", "import kbd; print(kbd.__file__)"], cwd=tmp_path,
             env={"PATH": "/usr/bin:/bin"})  # fmt: skip
    assert r.returncode == 0, r.stderr
    assert Path(r.stdout.strip()).is_relative_to(built.venv), r.stdout


@pytest.mark.requires_bwrap
@pytest.mark.requires_landlock
def test_installed_kbd_inits_checks_and_runs_a_sandboxed_command(built: Built, tmp_path: Path) -> None:
    r = installed(built, tmp_path, "--help")
    assert r.returncode == 0 and "Usage: kbd" in r.stdout, r.stderr
    root = tmp_path / "root"
    r = installed(built, tmp_path, "--root", str(root), "init", "--host", "pkg")
    assert r.returncode == 0, r.stderr
    r = installed(built, tmp_path, "--root", str(root), "doctor")
    assert r.returncode == 0, r.stdout + r.stderr
    assert r.stdout.startswith("ok  "), r.stdout
    # A consumer with a write grant into a source's notes/: the plan needs the
    # installed Landlock helper, which refuses a symlink planted there.
    (root / "principals.yaml").write_text(yaml.safe_dump({"principals": [{"id": "alice"}]}))
    kb = KbRoot(root)
    kb.workflow("src", access={"owners": ["alice"], "allowed_kb_writers": ["con"]})
    kb.workflow("con", access={"owners": ["alice"]},
                sources=[{"workflow_id": "src", "alias": "src", "access": "write"}])  # fmt: skip
    r = installed(built, tmp_path, "--root", str(root), "session", "open", "con", "--kind", "execution",
                  "--kb-access", "read-write", "--as", "alice", "--json")  # fmt: skip
    assert r.returncode == 0, r.stderr
    sid = yaml.safe_load(r.stdout)["session_id"]
    script = (
        'cat "$WORKFLOW_KB_SRC/notes/fact.md"; echo new > "$WORKFLOW_KB_SRC/notes/new.md" && echo wrote; '
        'ln -s /etc/passwd "$WORKFLOW_KB_SRC/notes/link" 2>/dev/null && echo linked || echo no-link; '
        "cat credentials/token"
    )
    r = installed(built, tmp_path, "--root", str(root), "exec", sid, "--", "sh", "-c", script)
    assert r.returncode == 0, r.stderr
    assert r.stdout.split() == ["src", "wrote", "no-link", "secret-con"], r.stdout + r.stderr
    # Committed at exit through the write path (docs/notes.md "Staged contributions").
    assert (
        (root / "workflows" / "src" / "knowledgebase" / "notes" / "new.md").read_text().endswith("---\nnew\n")
    )
    assert not os.path.lexists(root / "workflows" / "src" / "knowledgebase" / "notes" / "link")


def test_the_mcp_sdk_is_an_extra_and_kbd_mcp_names_it(built: Built, tmp_path: Path) -> None:
    """`pip install kbd` leaves the MCP SDK out (it is the `kbd[mcp]` extra):
    the installed `kbd mcp` then exits 69 naming the extra, and the rest of kbd
    works without it."""
    with zipfile.ZipFile(built.wheel) as whl:
        info = next(n.split("/")[0] for n in whl.namelist() if n.endswith(".dist-info/METADATA"))
        meta = email.parser.Parser().parsestr(whl.read(f"{info}/METADATA").decode())
    sdk = [r for r in meta.get_all("Requires-Dist") or [] if r.split(";")[0].strip().startswith("mcp")]
    assert sdk and all("extra ==" in r and "mcp" in r.split(";")[1] for r in sdk), sdk
    r = _run([built.venv / "bin" / "python", "-c", "import mcp"], cwd=tmp_path, env={"PATH": "/usr/bin:/bin"})
    assert r.returncode != 0, "the plain install pulled the MCP SDK in"
    root = tmp_path / "root"
    r = installed(built, tmp_path, "--root", str(root), "init", "--host", "pkg")
    assert r.returncode == 0, r.stderr
    r = installed(built, tmp_path, "--root", str(root), "mcp", "s_0123456789abcdef0123")
    assert r.returncode == 69, r.stderr
    assert r.stderr.startswith("error[unavailable]: kbd mcp needs the MCP SDK"), r.stderr
    assert "pip install 'kbd[mcp]'" in r.stderr and r.stdout == "", r.stderr
