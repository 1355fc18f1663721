"""On-disk names kbd relies on, and the racy-timestamp rule. Pure.

Spelled once here so the path layer, the planner, the sandbox and the notes
writer can never disagree about which folder is a workflow's knowledge base or
which file is a source's index.
"""

from __future__ import annotations

import os
import re

CONFIG_NAME = "kbd.yaml"  # <root>/kbd.yaml: the host's config
PRINCIPALS_NAME = "principals.yaml"  # <root>/principals.yaml: who may act
STATE_DIR = "state"  # <root>/state: sessions, audit log, locks, caches
CACHE_DIR = "cache"  # <root>/state/cache: derived data (parsed YAML, the registry), safe to delete
MANIFEST = "workflow.json"  # marks a workflow folder
KB_DIR = "knowledgebase"  # <workflow>/knowledgebase: what sources share
NOTES_DIR = "notes"  # <workflow>/knowledgebase/notes: where contributors write
CONTEXT_DIR = "context"  # <workflow>/knowledgebase/context: the source's own documents
INDEX_NAME = "_index.json"  # <notes>/_index.json: the source's own index, never contributors'
# Like git's "racy clean" rule: a file modified within this window of the moment
# it was read is never trusted from a cache, because coarse file timestamps could
# hide a second change in the same tick. 200 ms is well above any granularity.
RACY_NS = 200_000_000


def racy(st: os.stat_result, now_ns: int) -> bool:
    """Whether a file with stat ``st`` changed within :data:`RACY_NS` of ``now_ns``
    (then a cache keyed on its stat signature must not be trusted)."""
    return max(st.st_mtime_ns, st.st_ctime_ns) >= now_ns - RACY_NS


# The names of the cgroups kbd makes for commands (kbd.sandbox.cgroup), which
# running-command records name (kbd.state.processes).
# <session id>.<kbd exec pid>.<random>: a record naming anything else is ignored.
SESSION_NAME = re.compile(r"s_[0-9a-f]{20}\.[0-9]{1,10}\.[0-9a-f]{8}")
# b_<random>.<launcher pid>.<random>: a cgroup the daemon's launcher made for a
# stub before any session was known (v2 cgroups cannot be renamed); only a
# process record that says ``broker`` ties one to a session.
BROKER_NAME = re.compile(r"b_[0-9a-f]{20}\.[0-9]{1,10}\.[0-9a-f]{8}")
