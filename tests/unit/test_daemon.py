"""The daemon's pure decisions: connection caps and the socket-folder rule (docs/api.md "Limits" and "Socket and authentication")."""

from __future__ import annotations

import pytest

from kbd.daemon.limits import (
    FD_RESERVE,
    MAX_CONNECTIONS,
    MAX_CONNECTIONS_PER_UID,
    ConnectionLimits,
    connection_caps,
)
from kbd.daemon.listen import unsafe_folder


@pytest.mark.parametrize("nofile", [64, 1024, 4096, 20000, 1 << 20])
def test_caps_leave_room_for_accept_bursts_and_share_between_uids(nofile: int) -> None:
    total, per_uid = connection_caps(nofile)
    assert total <= MAX_CONNECTIONS and per_uid <= MAX_CONNECTIONS_PER_UID
    assert per_uid * 4 <= total or per_uid == 4, "one uid may take at most a quarter"
    if nofile > FD_RESERVE + 16:
        assert total + FD_RESERVE <= nofile, "a full house still leaves the reserve free"


def test_limits_count_per_uid_and_in_total() -> None:
    lim = ConnectionLimits(total=5, per_uid=2)
    assert lim.admit(1000) and lim.admit(1000)
    assert not lim.admit(1000), "a third connection of the same uid"
    assert lim.admit(0) and lim.admit(None) and lim.admit(1001)
    assert not lim.admit(1002), "the total cap"
    lim.release(1000)
    assert lim.admit(1002) and not lim.admit(1003)
    for uid in (1000, 0, None, 1001, 1002):
        lim.release(uid)
    assert not lim.open and lim.admit(1000)


@pytest.mark.parametrize(
    ("mode", "unsafe"),
    [(0o40755, False), (0o40750, False), (0o41777, False), (0o40777, True), (0o40772, True),
     (0o40775, False), (0o43777, False), (0o42777, True)],
)  # fmt: skip
def test_a_folder_others_may_write_is_unsafe_unless_sticky(mode: int, unsafe: bool) -> None:
    assert unsafe_folder(mode) is unsafe
