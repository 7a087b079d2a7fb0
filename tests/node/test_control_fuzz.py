"""Fuzzing the control socket of a live node agent (hypothesis, bounded): random bytes, random
frame lengths and every request type with random fields. Whatever arrives, the agent answers
with an error or closes that connection, keeps serving proper workers, and leaks no pin,
reservation or connection."""

import socket
import struct

import pytest
from hypothesis import HealthCheck, example, given, settings
from hypothesis import strategies as st

from kvstore.client import KVStoreClient
from kvstore.v1 import agent_pb2 as pb
from tests.metadata.servers import wait_until
from tests.node.agents import running_agent

FUZZ = settings(
    max_examples=120, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture]
)
key = st.one_of(st.binary(min_size=16, max_size=16), st.binary(max_size=20))
keys = st.lists(key, max_size=6)
tenants = st.text(max_size=70)
requests = st.one_of(
    st.builds(
        lambda w, c: pb.AgentRequest(hello=pb.HelloRequest(worker=w, credential=c)),
        st.text(max_size=30),
        st.text(max_size=30),
    ),
    st.builds(
        lambda t, k, lo: pb.AgentRequest(
            lookup=pb.LookupKeysRequest(tenant=t, keys=k, local_only=lo)
        ),
        tenants,
        keys,
        st.booleans(),
    ),
    st.builds(
        lambda t, k, ms: pb.AgentRequest(load=pb.LoadRequest(tenant=t, keys=k, timeout_ms=ms)),
        tenants,
        keys,
        st.integers(0, 50),
    ),
    st.builds(
        lambda i: pb.AgentRequest(release=pb.ReleaseRequest(load_id=i)), st.integers(0, 2**64 - 1)
    ),
    st.builds(
        lambda t, k, p, n: pb.AgentRequest(
            save=pb.SaveRequest(tenant=t, keys=k, first_parent=p, payload_bytes=n)
        ),
        tenants,
        keys,
        st.binary(max_size=20),
        st.integers(0, 2**64 - 1),
    ),
    st.builds(
        lambda i, k, c: pb.AgentRequest(commit=pb.CommitRequest(save_id=i, keys=k, checksums=c)),
        st.integers(0, 2**64 - 1),
        keys,
        st.lists(st.integers(0, 2**64 - 1), max_size=3),
    ),
    st.builds(
        lambda i: pb.AgentRequest(abort=pb.AbortRequest(save_id=i)), st.integers(0, 2**64 - 1)
    ),
    st.just(pb.AgentRequest(stats=pb.AgentStatsRequest())),
    st.just(pb.AgentRequest()),
)


@pytest.fixture(scope="module")
def agent(tmp_path_factory):
    directory = tmp_path_factory.mktemp("fuzz")
    with running_agent(directory, control_frame_timeout_s=0.2, orphan_pin_ttl_s=0.5) as agent:
        yield agent


def _exchange(agent, data: bytes) -> None:
    """Send `data` on a fresh connection and read whatever comes back until the agent closes
    or goes quiet; never raises for what the agent does."""
    with socket.socket(socket.AF_UNIX) as conn:
        conn.connect(str(agent.config.socket_path))
        conn.settimeout(0.5)
        try:
            conn.sendall(data)
            conn.shutdown(socket.SHUT_WR)
            while conn.recv(1 << 16):
                pass
        except OSError:
            pass  # the agent closed on us: one of the allowed answers


def _frame(message) -> bytes:
    body = message.SerializeToString()
    return struct.pack("<I", len(body)) + body


def _still_serving(agent) -> None:
    with KVStoreClient(agent.config.socket_path) as client:
        assert client.lookup("t", [bytes(16)]).total == 0
    assert wait_until(lambda: agent.control.connections == 0, timeout_s=5)
    assert wait_until(lambda: not len(agent.control.orphans), timeout_s=5)  # their lease ran out
    assert agent.store.pins_held() == 0 and agent.store.writes_pending() == 0
    assert not agent.control.sessions


@FUZZ
@given(data=st.binary(max_size=512))
def test_random_bytes(agent, data):
    _exchange(agent, data)


@FUZZ
@given(length=st.integers(0, 2**32 - 1), body=st.binary(max_size=64))
def test_random_frame_lengths(agent, length, body):
    _exchange(agent, struct.pack("<I", length) + body)


@FUZZ
@given(calls=st.lists(requests, min_size=1, max_size=6), hello_first=st.booleans())
# always one lookup a session answers: random lists rarely hold one (all keys 16 bytes, after
# a hello), and the last test checks that the fuzzing reached the sessions
@example(
    calls=[pb.AgentRequest(lookup=pb.LookupKeysRequest(tenant="t", keys=[bytes(16)]))],
    hello_first=True,
)
def test_every_request_type_with_random_fields(agent, calls, hello_first):
    hello = _frame(pb.AgentRequest(hello=pb.HelloRequest(worker="fuzz"))) if hello_first else b""
    _exchange(agent, hello + b"".join(_frame(call) for call in calls))


def test_the_agent_still_serves_after_the_fuzzing(agent):
    assert agent.counters.snapshot()["lookup_asked"] > 0, "the fuzzing reached the sessions"
    _still_serving(agent)
