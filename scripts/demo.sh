#!/usr/bin/env bash
# `make demo`: build a fresh demo root and walk through what kbd resolves.
set -euo pipefail
kbd=$1
root=$2
rm -rf -- "$root"
export KBD_ROOT=$root
step() { printf '\n\033[1m$ %s\033[0m\n' "$*"; "$@"; }
step "$kbd" init --demo --host demo-host
step "$kbd" workflows list --as ops
step "$kbd" workflows show wf_perf --as alice
step "$kbd" sources candidates wf_perf --as alice
printf '\n# bob owns wf_security and already granted wf_perf; carol has not granted wf_cost yet:\n'
step "$kbd" writers grant wf_cost wf_perf --as carol
step "$kbd" sources list wf_perf --as alice
printf '\n# bob may not grant writers on a source he does not own (exit 77):\n'
if "$kbd" writers grant wf_rts wf_cost --as bob; then exit 1; fi
printf '\ndemo root left at %s (KBD_ROOT=%s kbd --help)\n' "$root" "$root"
