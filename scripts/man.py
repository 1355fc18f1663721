"""Write kbd's man pages (kbd/cli/manpages.py) into a folder: `make man`."""

from __future__ import annotations

import sys
from pathlib import Path

from kbd.cli.manpages import pages

out = Path(sys.argv[1] if len(sys.argv) > 1 else "build/man")
out.mkdir(parents=True, exist_ok=True)
for name, text in pages().items():
    (out / name).write_text(text)
print(f"{len(pages())} man pages in {out}/ (read one: man -l {out}/kbd-exec.1)")
