"""Name rules for files kbd writes into a source's notes/ (decision, README "Security").

``_index.json`` belongs to the source: contributors never write it. A name is
treated as the index when it equals ``_index.json`` after Unicode NFKC
normalisation and case folding, so ``_INDEX.json`` or a full-width
``U+FF3F index.json`` (full-width low line) cannot sneak past a case-insensitive reader or a normalising
filesystem. Characters that merely look alike without folding (dotless i, U+0131) make a
different name. Reads take names literally.
"""

from __future__ import annotations

import unicodedata

INDEX_NAME = "_index.json"


def fold(name: str) -> str:
    return unicodedata.normalize("NFKC", unicodedata.normalize("NFKC", name).casefold())


def is_index_name(name: str) -> bool:
    """True when ``name`` (a single path component) folds to ``_index.json``."""
    return fold(name) == INDEX_NAME
