#!/usr/bin/env bash
# Install kbd the ways docs/multi-user.md "Service notes" says, into a throwaway prefix, and check each
# result works (docs/multi-user.md "Service notes"). Run as root on a Debian host (CI does, through
# tests/packaging/test_install_check.py); nothing outside the temporary folder
# is touched: no /opt/kbd, no /etc/systemd, no /var/lib/kbd.
#
#   1. build: a copy of the checkout → the kbd wheel, plus a wheelhouse of every
#      dependency, pip/setuptools/wheel (the installers' bootstrap) — the only
#      step that reads the package index;
#   2. pip into a venv laid out like /opt/kbd (the service's ExecStart);
#   3. pipx install and 4. uv tool install of the checkout, both offline
#      (--no-index, the wheelhouse only);
#   5. the units installed by the prefix's kbd (`kbd units install`),
#      then `systemd-analyze verify` (clean) and `systemd-analyze security`;
#   6. `kbd init` of a temporary root and `kbd doctor` there, with each kbd;
#   7. the service install of docs/multi-user.md "Deploying on a host": `kbd init --system` (with throwaway group
#      names, removed at exit), a principal added, `kbd doctor` clean.
#
# usage: scripts/install-check.sh [PYTHON]     (default /usr/bin/python3)
set -euo pipefail
repo=$(cd "$(dirname "$0")/.." && pwd)
python=${1:-/usr/bin/python3}
work=$(mktemp -d /tmp/kbd-install-check.XXXXXX)
# Every user traverses it, as they do /opt and /var/lib on a host: doctor's install check (other users
# must be able to run the installed kbd) then judges the install, not this scratch folder.
chmod 0755 "$work"
tag=$RANDOM$RANDOM
group="kbdic$tag" grant="kbdicg$tag"  # step 7's throwaway groups (never the host's kbd)
cleanup() { rm -rf "$work"; groupdel "$grant" 2>/dev/null || true; groupdel "$group" 2>/dev/null || true; }
trap cleanup EXIT
step() { printf '== %s\n' "$*"; }
fail() { printf 'install-check: FAIL: %s\n' "$*" >&2; exit 1; }

step "1. build (wheel and wheelhouse)"
# A copy, so building leaves no build/ or *.egg-info in the checkout, and so a
# file the package needs but the copy lacks fails here, as it would for a user.
mkdir "$work/src"
cp -r "$repo/pyproject.toml" "$repo/README.md" "$repo/LICENSE" "$repo/kbd" "$repo/policies" \
  "$repo/sandbox-profiles" "$repo/systemd" "$repo/docs" "$work/src/"
find "$work/src" -name __pycache__ -prune -exec rm -rf {} +
"$python" -m venv "$work/tools"
"$work/tools/bin/pip" install -q pipx uv 2>&1 | { grep -v "^WARNING: Location" || true; }
"$work/tools/bin/pip" wheel -q -w "$work/wheelhouse" "$work/src"
"$work/tools/bin/pip" download -q -d "$work/wheelhouse" pip setuptools wheel
ls "$work/wheelhouse"/kbd-*.whl >/dev/null || fail "no kbd wheel was built"
# From here on, no index: whatever is not in the wheelhouse cannot be installed.
export PIP_NO_INDEX=1 PIP_FIND_LINKS="$work/wheelhouse" PIP_DISABLE_PIP_VERSION_CHECK=1

step "2. pip install into $work/opt/kbd"
"$python" -m venv "$work/opt/kbd"
"$work/opt/kbd/bin/pip" install -q kbd

step "3. pipx install (offline)"
PIPX_HOME="$work/pipx" PIPX_BIN_DIR="$work/pipx-bin" PIPX_MAN_DIR="$work/pipx-man" \
  "$work/tools/bin/pipx" install --python "$python" "$work/src" >"$work/pipx.log" 2>&1 \
  || fail "pipx install: $(tail -n 30 "$work/pipx.log")"

step "4. uv tool install (offline)"
UV_TOOL_DIR="$work/uv-tools" UV_TOOL_BIN_DIR="$work/uv-bin" UV_CACHE_DIR="$work/uv-cache" \
  UV_PYTHON_DOWNLOADS=never "$work/tools/bin/uv" tool install --offline --no-index \
  --find-links "$work/wheelhouse" --python "$python" "$work/src" >"$work/uv.log" 2>&1 \
  || fail "uv tool install: $(tail -n 30 "$work/uv.log")"

step "5. systemd units (installed by the prefix's kbd: kbd units install, from the package's data)"
"$work/opt/kbd/bin/kbd" units install --dest "$work/dest" >/dev/null || fail "kbd units install"
units="$work/dest/etc/systemd/system"
grep -q "^ExecStart=$work/opt/kbd/bin/kbd serve\$" "$units/kbd.service" || fail "ExecStart not written"
verify=$(cd "$units" && systemd-analyze verify kbd.socket kbd.service 2>&1) || fail "verify: $verify"
[ -z "$verify" ] || fail "systemd-analyze verify is not clean: $verify"
(cd "$units" && systemd-analyze security --offline=yes kbd.service | tail -1)

step "6. kbd --help, --version, init, doctor with each installed kbd"
version=$(sed -n 's/^version = "\(.*\)"$/\1/p' "$repo/pyproject.toml")
for kbd in "$work/opt/kbd/bin/kbd" "$work/pipx-bin/kbd" "$work/uv-bin/kbd"; do
  [ -x "$kbd" ] || fail "$kbd was not installed"
  root="$work/root-$(basename "$(dirname "$(dirname "$kbd")")")-$RANDOM"
  (
    cd "$work"  # never the checkout: the installed package must be the one imported
    env -u PYTHONPATH "$kbd" --help | grep -q "Usage: kbd" || fail "$kbd --help"
    env -u PYTHONPATH "$kbd" --version | grep -qF "$version" || fail "$kbd --version"
    env -u PYTHONPATH "$kbd" --root "$root" init --host install-check >/dev/null || fail "$kbd init"
    env -u PYTHONPATH "$kbd" --root "$root" doctor >"$work/doctor.txt" || fail "$kbd doctor: $(cat "$work/doctor.txt")"
    grep -q '^ok  ' "$work/doctor.txt" || fail "$kbd doctor printed no check"
  )
  echo "ok $kbd"
done
step "7. the service install: init --system, a principal, doctor"
(
  cd "$work"
  kbd="$work/opt/kbd/bin/kbd" root="$work/var-lib-kbd"
  env -u PYTHONPATH "$kbd" --root "$root" init --system --group "$group" --grant-group "$grant" \
    --host install-check >/dev/null || fail "init --system"
  [ "$(stat -c '%a %U %G' "$root")" = "750 root $group" ] || fail "root layout: $(stat -c '%a %U %G' "$root")"
  [ "$(stat -c '%a' "$root/state")" = "700" ] || fail "state/ is not 0700"
  getent group "$grant" >/dev/null || fail "init --system made no grant group"
  env -u PYTHONPATH "$kbd" --root "$root" principals add builder --uid 4242 >/dev/null 2>&1 || fail "principals add"
  env -u PYTHONPATH "$kbd" --root "$root" doctor >"$work/doctor.txt" || fail "doctor: $(cat "$work/doctor.txt")"
  ! grep -q '^FAIL' "$work/doctor.txt" || fail "doctor: $(grep '^FAIL' "$work/doctor.txt")"
)
echo "ok service install"
echo "install-check: all installs work"
