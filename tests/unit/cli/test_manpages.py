"""Man pages from the CLI's own definitions (kbd/cli/manpages.py): one per
command, each with the usage and every option ``--help`` shows, rendered by
the system's own groff without a warning."""

from __future__ import annotations

import subprocess
from pathlib import Path

import click

from kbd.cli.manpages import commands, page, pages


def test_every_command_has_a_page_naming_its_usage_and_options() -> None:
    made = pages(date="2026-01-01")
    listed = commands()
    assert len(made) == len(listed) > 50
    for words, cmd in listed:
        text = made["-".join(words) + ".1"]
        assert text.startswith(f'.TH "{"-".join(words).upper()}" "1" "2026-01-01"')
        assert f".B {' '.join(words)}\n" in text
        for param in cmd.params:
            if isinstance(param, click.Option) and not param.hidden:
                assert any(o in text for o in param.opts), (words, param.opts)
    assert "kbd-sources-attach.1" in made and "kbd-exec.1" in made


def test_text_that_roff_would_read_as_a_request_is_escaped() -> None:
    cmd = click.Command("x", help=".SH FAKE\n\nback\\slash\n\n'quote")
    text = page(["kbd", "x"], cmd, date="2026-01-01")
    assert "\n.SH FAKE" not in text and "\\&.SH FAKE" in text
    assert "back\\eslash" in text and "\\&'quote" in text


def test_groff_renders_every_page_without_a_warning(tmp_path: Path) -> None:
    """groff (Debian's groff-base, which man uses; .ci/run installs it) with every warning on."""
    files = []
    for name, text in pages().items():
        (tmp_path / name).write_text(text)
        files.append(str(tmp_path / name))
    r = subprocess.run(
        ["groff", "-man", "-Tutf8", "-ww", "-z", *files], capture_output=True, text=True, check=False
    )
    assert (r.returncode, r.stderr) == (0, "")
