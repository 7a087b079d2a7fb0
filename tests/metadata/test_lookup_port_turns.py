"""The lookup port takes turns with the rest of the service's loop: however many connections
have frames waiting, a turn of the loop answers lookups for at most TURN_BUDGET_S (its first
always), so a heartbeat, whose gRPC call needs a few turns of that loop, waits for a few
lookups, not for every connection's. Real service on loopback; each lookup holds the loop
for LOOKUP_S (a large prompt's lookup; a sleep, so the machine's load does not change it).
(A version answered up to 64 frames of each connection in one turn: with 8 connections of 20
pipelined frames, the heartbeat below waited ~3 s, behind all 160.)"""

import socket
import time

from kvstore.metadata.index.memory import MemoryIndex
from kvstore.metadata.records import NodeRecord
from kvstore.metadata.server.server import MetadataConfig, MetadataServer
from kvstore.v1 import metadata_pb2 as pb
from tests.metadata.servers import FAST_LIMITS, LOOKUP_KEYS, client_for, publish
from tests.metadata.test_lookup_port import LENGTH, OK, answer, connect, hello

LOOKUP_S = 0.02
CONNECTIONS, FRAMES = 8, 20  # 160 lookups: 3.2 s of the loop


class SlowLookupIndex(MemoryIndex):
    """Every lookup holds the loop (it runs there: in memory, reads never block) LOOKUP_S."""

    def lookup(self, *args, **kwargs):
        time.sleep(LOOKUP_S)
        return super().lookup(*args, **kwargs)


def test_a_heartbeat_waits_for_a_few_lookups_not_for_every_connection_s_frames():
    config = MetadataConfig(listen="127.0.0.1:0", backend="memory", limits=FAST_LIMITS)
    server = MetadataServer(config, index=SlowLookupIndex())
    server.start()
    sockets: list[socket.socket] = []
    try:
        with client_for(server) as agent:
            publish(agent)
            lease, _ = agent.register_node(NodeRecord("agent"), 10_000)
            request = pb.LookupRequest(tenant="t", keys=LOOKUP_KEYS).SerializeToString()
            frames = (LENGTH.pack(len(request)) + request) * FRAMES
            for _ in range(CONNECTIONS):
                sockets.append(sock := connect(server))
                assert hello(sock, server).status_code == OK
            for sock in sockets:
                sock.sendall(frames)
            time.sleep(0.1)  # the frames are in; the loop answers them
            started = time.monotonic()
            agent.heartbeat("agent", lease, timeout_s=5.0)
            waited_s = time.monotonic() - started
            answers = [
                [answer(sock).response.prefix_length for _ in range(FRAMES)] for sock in sockets
            ]
        assert answers == [[5] * FRAMES] * CONNECTIONS  # every frame answered, in order
        assert waited_s < 1.0, f"the heartbeat waited {waited_s:.2f} s behind the lookups"
    finally:
        for sock in sockets:
            sock.close()
        server.stop(grace_s=0.5)
