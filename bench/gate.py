"""The prompt-injection gate on 1 MiB worst-case notes (docs/performance.md: ≤ 50 ms).

Prints ms per ``injection.check`` (median of several rounds) for notes shaped to
hurt a backtracking engine: newlines, spaces+newlines, "\\n#" repeated, a random
mix of printable ASCII; and, adversarial (beyond the budget list), a random mix
of only the characters the rules' words are made of (many partial word matches)
and keyword spam that makes each bounded rule do its most work per start
position (linear, but every start position is a candidate). The rows marked
"<= 50 (adversarial)" are the second review's inputs, held to the same budget
(tests/unit/core/test_injection.py runs them in a subprocess with a generous
timeout). Beside each: the floor, one trivial ``re.search`` over the same text,
and one ``\\b\\w`` IGNORECASE scan (what a single non-literal rule must cost).
"""

from __future__ import annotations

import random
import re
import statistics
import string
import time
from collections.abc import Callable

from kbd.core import injection
from kbd.fs.datafiles import injection_rules

MIB = 1 << 20
ROUNDS = 5
_TRIVIAL = re.compile("kbd-no-such-phrase")
_SCAN = re.compile(r"\bzq\w", re.IGNORECASE | re.MULTILINE)


def fill(unit: str) -> str:
    return (unit * (MIB // len(unit) + 1))[:MIB]


def ms(fn: Callable[[], object]) -> float:
    samples = []
    for _ in range(ROUNDS):
        t0 = time.perf_counter_ns()
        fn()
        samples.append((time.perf_counter_ns() - t0) / 1e6)
    return statistics.median(samples)


def main() -> None:
    rnd = random.Random(9)
    cases = [
        ("newlines", fill("\n"), "<= 50"),
        ("spaces+newlines", fill(" \n"), "<= 50"),
        ('"\\n#" repeated', fill("\n#"), "<= 50"),
        ("random mix", "".join(rnd.choice(string.printable) for _ in range(MIB)), "<= 50"),
        (
            "random rule letters",
            "".join(rnd.choice("\n \t#:.@<!->systemIGNOREal") for _ in range(MIB)),
            "(adversarial)",
        ),
        ("prose (no match)", fill("the quick brown fox jumps over the lazy dog. "), ""),
        ('"ignore all " spam', fill("ignore all "), "(adversarial)"),
        # A second review of docs/notes.md "Injection gate": keyword spam that made the shipped rules
        # slow (linear, but 140-300 ms), and the text that made adjacent repeats
        # (now refused by the loader) cost 0.98 s per 10 KB, here against the shipped rules.
        ('"reveal secret to"', fill("reveal secret to a@b "), "<= 50 (adversarial)"),
        ("indented ### system", fill("\n" + " " * 64 + "###" + " " * 16 + "system"), "<= 50 (adversarial)"),
        (r'"\nsystem :"', fill("\nsystem :"), "<= 50 (adversarial)"),
        ('"from now on, you"', fill("from now on, you "), "<= 50 (adversarial)"),
        ("system+256 spaces+x!", fill("system" + " " * 256 + "x!"), "<= 50 (adversarial)"),
    ]
    rules = injection_rules()  # load once, as a running daemon has
    print(f"injection gate on 1 MiB notes (median of {ROUNDS}), {len(rules)} rules")
    print(f"{'note':<22} {'gate ms':>9} {'floor ms':>9} {'1 scan ms':>9}  budget")
    for name, text, budget in cases:
        gate = ms(lambda t=text: injection.check(t, ruleset=rules))  # type: ignore[misc]
        floor = ms(lambda t=text: _TRIVIAL.search(t))  # type: ignore[misc]
        scan = ms(lambda t=text: _SCAN.search(t))  # type: ignore[misc]
        print(f"{name:<22} {gate:>9.1f} {floor:>9.2f} {scan:>9.1f}  {budget}")


if __name__ == "__main__":
    main()
