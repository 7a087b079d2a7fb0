"""Names defined once: every table of tiers and of error codes is read from kvstore/tier.py
and kvstore/metadata/status.py, so they cannot disagree; the agent's errors map in the one
table the metadata service's clients use (DEADLINE_EXCEEDED was missing from the agent's)."""

import grpc
import pytest

from kvstore import errors, tier
from kvstore.client import TIER_OF_CODE, TIERS, _error
from kvstore.connectors.vllm import events as vllm_events
from kvstore.connectors.vllm import scheduler
from kvstore.events_zmq import MEDIUM_OF_TIER
from kvstore.metadata import status, wire
from kvstore.metadata.records import TIERS as STORED_TIERS
from kvstore.node.session import REMOTE_CODE, TIER_CODES
from kvstore.v1 import agent_pb2, metadata_pb2


def test_the_proto_enum_and_the_tiers_agree():
    assert [stored.proto for stored in tier.STORED] == [
        metadata_pb2.TIER_DEVICE,
        metadata_pb2.TIER_HOST,
        metadata_pb2.TIER_DISK,
    ]
    assert STORED_TIERS == ("device", "host", "disk")
    assert {name: wire.PROTO_TO_TIER[proto] for name, proto in wire.TIER_TO_PROTO.items()} == {
        name: name for name in STORED_TIERS
    }


def test_a_lookup_answers_codes_read_back_as_their_tiers():
    assert TIERS == ("host", "disk", "remote")
    written = {name: bytes([code]) for name, code in TIER_CODES.items()} | {"remote": REMOTE_CODE}
    assert {TIER_OF_CODE[code.decode()] for code in written.values()} == set(TIERS)
    assert all(TIER_OF_CODE[code.decode()] == name for name, code in written.items())
    assert {name: code.decode() for name, code in written.items()} == scheduler._CODE_OF_TIER


def test_vllm_media_are_the_same_in_both_event_paths():
    assert (
        MEDIUM_OF_TIER
        == vllm_events.MEDIUM_OF_TIER
        == {
            "device": "GPU",
            "host": "CPU",
            "disk": "STORAGE",
        }
    )


@pytest.mark.parametrize("code", list(grpc.StatusCode))
def test_an_agent_error_maps_as_the_services_status_does(code):
    raised = _error(agent_pb2.AgentError(code=code.name, message="why"))
    assert type(raised) is type(status.error_for(code, "why"))
    assert str(raised) == f"{code.name}: why"


def test_a_deadline_the_agent_reports_is_unavailable_not_an_internal_error():
    raised = _error(agent_pb2.AgentError(code="DEADLINE_EXCEEDED", message="slow peer"))
    assert isinstance(raised, errors.UnavailableError)
