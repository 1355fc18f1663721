#!/usr/bin/env bash
# Install kbd's systemd files (docs/multi-user.md "The permission model"), with the kbd executable written
# into kbd.service's ExecStart (systemd expands no variable in an executable path):
#
#   systemd/kbd.socket, systemd/kbd.service  -> DESTDIR/etc/systemd/system/
#   systemd/kbd.sysusers                     -> DESTDIR/etc/sysusers.d/kbd.conf
#   systemd/kbd.tmpfiles                     -> DESTDIR/etc/tmpfiles.d/kbd.conf
#
# usage: scripts/install-units.sh KBD_BIN [DESTDIR]    (e.g. /opt/kbd/bin/kbd; DESTDIR default /)
# Then: systemd-sysusers kbd.conf && systemd-tmpfiles --create kbd.conf && systemctl daemon-reload
set -euo pipefail
repo=$(cd "$(dirname "$0")/.." && pwd)
usage() { printf 'install-units: %s\nusage: %s KBD_BIN [DESTDIR]\n' "$1" "$0" >&2; exit 2; }
[ $# -ge 1 ] && [ $# -le 2 ] || usage "expected the kbd executable and an optional DESTDIR"
kbd_bin=$1
dest=${2:-}
# One word of plain characters: systemd splits ExecStart at spaces and expands % and $.
[[ $kbd_bin =~ ^/[A-Za-z0-9._/+-]+$ ]] || usage "KBD_BIN must be an absolute path of [A-Za-z0-9._/+-]: $kbd_bin"
[ -f "$kbd_bin" ] && [ -x "$kbd_bin" ] || usage "$kbd_bin is not an executable file"
install -d -m 0755 "$dest/etc/systemd/system" "$dest/etc/sysusers.d" "$dest/etc/tmpfiles.d"
for unit in kbd.socket kbd.service; do
  tmp="$dest/etc/systemd/system/.$unit.tmp"
  sed "s|{{KBD_BIN}}|$kbd_bin|g" "$repo/systemd/$unit" >"$tmp"
  if grep -q "{{KBD_BIN}}" "$tmp"; then rm -f "$tmp"; usage "$unit still holds {{KBD_BIN}}"; fi
  chmod 0644 "$tmp"
  mv -f "$tmp" "$dest/etc/systemd/system/$unit"
done
install -m 0644 "$repo/systemd/kbd.sysusers" "$dest/etc/sysusers.d/kbd.conf"
install -m 0644 "$repo/systemd/kbd.tmpfiles" "$dest/etc/tmpfiles.d/kbd.conf"
printf 'installed: %s\n' "$dest/etc/systemd/system/kbd.socket" "$dest/etc/systemd/system/kbd.service" \
  "$dest/etc/sysusers.d/kbd.conf" "$dest/etc/tmpfiles.d/kbd.conf"
