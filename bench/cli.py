"""A CLI command on a service root (docs/multi-user.md): a non-root builder's
`kbd sources list WF` through the daemon, beside the same command run by root
directly on the root, and the floors measured in the same run.

The root is laid out as a service host's (``root:G 0750``, ``kbd.yaml``
``0640 root:G``, ``state/`` 0700, the socket 0660 group G); the builder is a
real user made for the run (``useradd``, removed afterwards) in group G, whose
uid is mapped to the workflow's owner. Every row is a fresh process of this
venv's interpreter (``python -m kbd``), started the same way:

- floor ``python3 -S -c pass`` (the interpreter alone), and the same under
  ``setpriv`` as the builder (what changing user costs);
- root, direct: ``kbd sources list con --as alice`` on the root;
- builder, through the daemon: ``kbd sources list con`` with only
  ``KBD_ROOT`` set: kbd finds it cannot use the root, probes the socket named
  in kbd.yaml, and asks the daemon as the builder's principal (peer uid);
- builder, ``--socket`` named: the same without the probe.
Rows are interleaved; medians and minimums of RUNS runs.
"""

from __future__ import annotations

import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import yaml

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

from tests.helpers import KbRoot  # noqa: E402
from tests.integration.daemon import serving  # noqa: E402
from tests.integration.hostusers import User, throwaway_user  # noqa: E402

RUNS = int(os.environ.get("KBD_BENCH_RUNS", "30"))


def main() -> None:
    if os.geteuid() != 0:
        sys.exit("bench/cli.py makes a throwaway user: run it as root")
    with throwaway_user("kbb") as u:
        run(u)


def run(u: User) -> None:
    base = Path(tempfile.mkdtemp(prefix="kbd-bench-cli-", dir="/tmp"))
    os.chmod(base, 0o755)  # noqa: S103 - the way to the socket folder, as / is
    try:
        kb = KbRoot.create(base / "root")
        (base / "run").mkdir(mode=0o750)
        os.chown(base / "run", 0, u.group_gid)
        sock = base / "run" / "kbd.sock"
        config = kb.root / "kbd.yaml"
        doc = yaml.safe_load(config.read_text())
        doc["socket"] = str(sock)
        config.write_text(yaml.safe_dump(doc))
        people = yaml.safe_load((kb.root / "principals.yaml").read_text())
        for entry in people["principals"]:
            if entry["id"] == "alice":
                entry["uid"] = u.uid
        (kb.root / "principals.yaml").write_text(yaml.safe_dump(people))
        for n in range(20):
            kb.workflow(f"src{n:02d}", access={"owners": ["alice"]})
        kb.workflow("con", access={"owners": ["alice"]},
                    sources=[{"workflow_id": f"src{n:02d}", "alias": f"s{n:02d}"} for n in range(20)])  # fmt: skip
        os.chown(kb.root, 0, u.group_gid)
        os.chmod(kb.root, 0o750)  # noqa: S103 - group G is the way in, as on a service host
        os.chown(config, 0, u.group_gid)
        os.chmod(config, 0o640)
        os.chmod(kb.root / "state", 0o700)
        env = {"PATH": "/usr/bin:/bin", "HOME": "/nonexistent", "PYTHONPATH": str(REPO), "LANG": "C.UTF-8"}
        as_builder = ["setpriv", "--reuid", str(u.uid), "--regid", str(u.gid), "--init-groups"]
        kbd = [sys.executable, "-m", "kbd"]
        with serving(kb.root, sock=sock, home=base / "home") as served:
            os.chown(served.sock, 0, u.group_gid)
            os.chmod(served.sock, 0o660)
            rows = {
                "floor: python3 -S -c pass": (["/usr/bin/python3", "-S", "-c", "pass"], env),
                "floor: the same as the builder (setpriv)": ([*as_builder, "/usr/bin/python3", "-S", "-c", "pass"], env),
                "root, direct on the root": ([*kbd, "--root", str(kb.root), "sources", "list", "con", "--as", "alice"], env),
                "builder, through the daemon (found)": ([*as_builder, *kbd, "sources", "list", "con"],
                                                        {**env, "KBD_ROOT": str(kb.root)}),
                "builder, through the daemon (--socket)": ([*as_builder, *kbd, "--socket", str(sock), "sources", "list",
                                                            "con"], env),
            }  # fmt: skip
            for argv, e in rows.values():  # each must work, and warm the page cache
                r = subprocess.run(argv, env=e, capture_output=True, check=False, cwd="/")
                assert r.returncode == 0, (argv, r.stderr.decode())
                assert argv[-1] == "pass" or r.stdout.count(b"available") == 20, r.stdout
            samples: dict[str, list[float]] = {name: [] for name in rows}
            for _ in range(RUNS):
                for name, (argv, e) in rows.items():
                    t0 = time.perf_counter()
                    subprocess.run(argv, env=e, stdout=subprocess.DEVNULL, check=True, cwd="/")
                    samples[name].append((time.perf_counter() - t0) * 1000)
    finally:
        shutil.rmtree(base, ignore_errors=True)
    print(f"`kbd sources list WF` (20 sources) on a service root, {RUNS} interleaved runs each (ms)")
    print(f"{'row':<44} {'p50':>8} {'min':>8}")
    for name, xs in samples.items():
        print(f"{name:<44} {statistics.median(xs):>8.1f} {min(xs):>8.1f}")
    through = statistics.median(samples["builder, through the daemon (found)"])
    direct = statistics.median(samples["root, direct on the root"])
    print(f"through the daemon / direct: {through / direct:.2f}x")


if __name__ == "__main__":
    main()
