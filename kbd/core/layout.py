"""On-disk names kbd relies on, and the racy-timestamp window. Pure constants.

Spelled once here so the path layer, the planner, the sandbox and the notes
writer can never disagree about which folder is a workflow's knowledge base or
which file is a source's index.
"""

from __future__ import annotations

MANIFEST = "workflow.json"  # marks a workflow folder
KB_DIR = "knowledgebase"  # <workflow>/knowledgebase: what sources share
NOTES_DIR = "notes"  # <workflow>/knowledgebase/notes: where contributors write
INDEX_NAME = "_index.json"  # <notes>/_index.json: the source's own index, never contributors'
# Like git's "racy clean" rule: a file modified within this window of the moment
# it was read is never trusted from a cache, because coarse file timestamps could
# hide a second change in the same tick. 200 ms is well above any granularity.
RACY_NS = 200_000_000
