"""free_port: a port for a server started next, never from the ephemeral range, where any
outgoing connection on the machine may take it before the server binds it."""

from __future__ import annotations

import random
import socket

import pytest

from kubellm.fleet import processes


@pytest.mark.parametrize(
    ("ephemeral", "inside"),
    [
        ((32768, 60999), range(processes.LOW_PORT, 32768)),  # Linux's default: below it
        ((49152, 65535), range(processes.LOW_PORT, 49152)),  # IANA's range: below it
        ((1024, 60000), range(60001, 65536)),  # no room below: above it
    ],
)
def test_candidates_avoid_the_ephemeral_range(ephemeral, inside):
    ports = processes.port_candidates(ephemeral, random.Random(7), 500)
    assert len(ports) == 500
    assert all(p in inside for p in ports)
    assert len(set(ports)) > 100  # spread, so two callers rarely try the same port


def test_no_room_outside_the_range_gives_no_candidates():
    assert processes.port_candidates((1024, 65000), random.Random(7), 10) == []


def test_the_range_is_read_from_the_kernel_file(tmp_path):
    f = tmp_path / "range"
    f.write_text("40000\t50000\n")
    assert processes.ephemeral_range(str(f)) == (40000, 50000)
    f.write_text("garbage")
    assert processes.ephemeral_range(str(f)) == (32768, 60999)
    assert processes.ephemeral_range(str(tmp_path / "missing")) == (32768, 60999)


def test_free_port_is_outside_this_machines_ephemeral_range_and_bindable():
    low, high = processes.ephemeral_range()
    for _ in range(20):
        port = processes.free_port()
        assert not low <= port <= high
        with socket.socket() as sock:
            sock.bind(("127.0.0.1", port))


def test_a_listening_port_is_never_returned(monkeypatch):
    with socket.socket() as busy:
        busy.bind(("127.0.0.1", 0))
        busy.listen()
        taken = busy.getsockname()[1]
        # every candidate but the last is the busy port: free_port must skip them
        monkeypatch.setattr(
            processes, "port_candidates", lambda *a, **k: [taken] * 5 + [processes.LOW_PORT + 7]
        )
        assert processes.free_port() == processes.LOW_PORT + 7
