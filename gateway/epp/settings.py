"""The endpoint picker's settings, each default stated here once (`cli.py`'s flags read
them). Light to import: the CLI builds its parsers before any component loads."""

from __future__ import annotations

from dataclasses import dataclass, field

from kubellm.gateway.routing.settings import SchedulerSettings

# The protocol's names (docs/proposals/004-endpoint-picker-protocol): the header and the
# dynamic-metadata namespace that carry the picked endpoints (`messages` writes them).
DESTINATION = "x-gateway-destination-endpoint"
METADATA_NAMESPACE = "envoy.lb"


@dataclass
class PickerSettings:
    """The endpoint picker's own settings; the routing core's are `scheduler`."""

    max_body_bytes: int = 8 * 1024 * 1024
    # Bounds against ext_proc peers that never finish (the port has no authentication):
    # a stream's request must be whole within `body_timeout` seconds of the stream's start
    # (else a 408), at most `max_streams` streams at once (more are refused with
    # RESOURCE_EXHAUSTED, which Envoy handles as its failure mode says), and at most
    # `max_buffered_bytes` of request bodies held across all streams (else a 503).
    body_timeout: float = 30.0
    max_streams: int = 4096
    max_buffered_bytes: int = 256 * 1024 * 1024
    destination_header: str = DESTINATION
    metadata_namespace: str = METADATA_NAMESPACE
    # host:port of the fallback forwarder Service (a name is resolved to its address, since
    # the gateway's ORIGINAL_DST cluster takes an address)
    fallback_forwarder: str | None = None
    # Endpoints listed per answer, best first. Gateways that retry down the list (the
    # protocol allows it) can use more; Envoy's ORIGINAL_DST cluster reads one address.
    endpoints_per_answer: int = 1
    scheduler: SchedulerSettings = field(default_factory=SchedulerSettings)
