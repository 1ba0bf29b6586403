"""protocol/sse.py: whole events from a stream's pieces, however it is cut, bounded."""

from kubellm.gateway.protocol.sse import MAX_EVENT_BYTES, Framer

STREAM = b'data: {"a":1}\n\ndata: {"b":2}\n\ndata: [DONE]\n\n'


def test_every_cut_gives_the_same_whole_events() -> None:
    for cut in range(1, len(STREAM)):
        framer = Framer()
        out = b"".join(framer.feed(p)[0] for p in (STREAM[:cut], STREAM[cut:]))
        assert out == STREAM, cut
        assert framer.end() == b""


def test_whole_pieces_need_no_framing_and_a_carry_does() -> None:
    framer = Framer()
    assert framer.whole(b"data: x\n\n")
    assert framer.feed(b"data: x\n\ndata: y") == (b"data: x\n\n", b"")
    assert not framer.whole(b"\n\n")
    assert framer.end() == b"data: y"


def test_an_event_past_the_bound_is_given_up_not_kept() -> None:
    framer = Framer()
    huge = b"data: " + b"x" * MAX_EVENT_BYTES
    assert framer.feed(huge) == (b"", huge)
    assert framer.carry == b""
