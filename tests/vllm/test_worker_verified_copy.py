"""The worker half's load path against a real node agent, without an engine: the paged KV it
fills is either exactly the bytes that were saved or reported as load errors, even when the
connection breaks mid-load and other workers reuse the arena meanwhile (regression: the
agent unpinned a broken connection's pages while the load thread still copied from them, and
the stale views read the next block's bytes, 0xbb where 0xaa was loaded)."""

import os
import threading

import torch

from kvstore.block import HEADER_BYTES
from kvstore.client import KVStoreClient
from kvstore.connectors.vllm.config import ConnectorSettings, EngineKV
from kvstore.connectors.vllm.metadata import KVStoreConnectorMetadata, LoadSpec, SaveSpec
from kvstore.connectors.vllm.worker import WorkerSide
from kvstore.keys import Namespace, chunk_keys
from kvstore.layout import KVLayout
from tests.node.agents import running_agent

LAYOUT = KVLayout(num_layers=2, num_kv_heads=2, head_dim=8, dtype="float32", chunk_tokens=32)
BLOCK = 16
KV = EngineKV(LAYOUT, Namespace("sha256:m", LAYOUT.layout_id), BLOCK)
PAGE = 1 << 14  # 4 pages of the arena below hold every block of this test
AGENT = {"host_capacity_bytes": 4 * PAGE, "page_size_bytes": PAGE}
CHAIN = chunk_keys(Namespace("sha256:m", "chain"), range(LAYOUT.chunk_tokens), LAYOUT.chunk_tokens)


def paged(fill: float, num_blocks: int = 4) -> dict[str, torch.Tensor]:
    shape = (num_blocks, LAYOUT.num_kv_heads, BLOCK, 2 * LAYOUT.head_dim)
    return {f"layer{i}": torch.full(shape, fill) + i for i in range(LAYOUT.num_layers)}


def save(worker: WorkerSide, caches: dict[str, torch.Tensor]) -> None:
    meta = KVStoreConnectorMetadata(saves=[SaveSpec("r", CHAIN, b"", [[0, 1]])])
    for name, tensor in caches.items():
        worker.save_layer(meta, name, tensor)
    worker.finish_save()


def overwrite_the_arena(socket_path) -> None:
    """Another worker saves enough new blocks (0xbb...) to evict and reuse every free page."""
    with KVStoreClient(socket_path, "other") as other:
        for round_ in range(8):
            keys = chunk_keys(Namespace("sha256:m", f"other{round_}"), range(32), 32)
            reservation = other.save("default", keys, LAYOUT.payload_bytes)
            for view in reservation.payloads:
                if view is not None:
                    view.fill_(0xBB)
            other.commit(reservation)


def saved_chunk_and_reader(agent):
    """A worker that saved one chunk (blocks 0-1), and a reader about to load it (blocks 2-3)."""
    settings = ConnectorSettings(socket_path=str(agent.config.socket_path))
    writer = WorkerSide(settings, KV)
    saved = paged(0.5)
    writer.register(saved)
    save(writer, saved)
    reader = WorkerSide(settings, KV)
    target = paged(0.0)
    reader.register(target)
    return writer, saved, reader, target


def test_a_broken_connection_mid_load_never_yields_wrong_kv(tmp_path):
    with running_agent(tmp_path, **AGENT) as agent:
        writer, saved, reader, target = saved_chunk_and_reader(agent)
        copy_layer = reader._copy_layer_in

        def copy_after_the_connection_broke(layer, *args):
            if layer == 0:
                reader.agent.client._break()  # e.g. a timeout: the client drops the connection
                overwrite_the_arena(agent.config.socket_path)
            copy_layer(layer, *args)

        reader._copy_layer_in = copy_after_the_connection_broke
        reader.start_load(KVStoreConnectorMetadata(loads=[LoadSpec("r", CHAIN, [[2, 3]], 0)]))
        reader.finish_load()

        failed = reader.take_failed_block_ids()
        for name in saved:
            if not failed:
                assert torch.equal(target[name][2:4], saved[name][0:2]), "wrong KV was served"
            else:
                assert failed == {2, 3}
        assert reader.stats["loaded_blocks"] + reader.stats["load_failures"] == 1
        writer.close()
        reader.close()


def test_a_page_rewritten_under_a_pinned_view_is_a_load_error_not_kv(tmp_path):
    """Verification happens on the private copy as it is made, not once at load time."""
    with running_agent(tmp_path, **AGENT) as agent:
        writer, _, reader, _ = saved_chunk_and_reader(agent)
        copy_layer = reader._copy_layer_in

        def copy_after_the_page_changed(layer, *args):
            if layer == 1:  # layer 0 is already in the engine; the rest of the page changes
                host = agent.store.slots[0].tier
                page = host.pages[host.page_index(KV.rank_key(CHAIN[0]))]
                start, stop = LAYOUT.layer_range(1)
                page[HEADER_BYTES + start : HEADER_BYTES + stop].fill_(0xBB)
            copy_layer(layer, *args)

        reader._copy_layer_in = copy_after_the_page_changed
        reader.start_load(KVStoreConnectorMetadata(loads=[LoadSpec("r", CHAIN, [[2, 3]], 0)]))
        reader.finish_load()
        assert reader.take_failed_block_ids() == {2, 3}
        assert reader.stats["verify_failures"] == 1 and reader.stats["loaded_blocks"] == 0
        writer.close()
        reader.close()


def test_a_request_with_saves_is_reported_finished_once_they_are_committed(tmp_path):
    """vLLM's delayed free (CUDA, where saves outlive their step): the scheduler keeps the
    blocks of a request that had saves until every worker reports it through get_finished; a
    report that never comes leaks them. The pipeline's bookkeeping is the same on the CPU."""
    with running_agent(tmp_path, **AGENT) as agent:
        worker = WorkerSide(ConnectorSettings(socket_path=str(agent.config.socket_path)), KV)
        assert not worker.saves.delayed_frees, "on the CPU a save commits within its step"
        worker.saves.delayed_frees = True
        caches = paged(0.25)
        worker.register(caches)
        meta = KVStoreConnectorMetadata(
            saves=[
                SaveSpec("saved", CHAIN, b"", [[0, 1]]),
                SaveSpec("unreached", CHAIN[:0], b"", [[]]),
            ]
        )
        worker.start_load(meta)
        for name, tensor in caches.items():
            worker.save_layer(meta, name, tensor)
        assert worker.finished_saving({"other"}) == set(), "never delayed: never reported"
        worker.finish_save()
        assert worker.stats["saved_blocks"] == 1
        assert worker.finished_saving({"saved", "unreached"}) == {"saved", "unreached"}
        assert worker.finished_saving({"saved"}) == set(), "reported once"
        worker.close()


def test_a_load_shared_with_a_helper_copies_and_verifies_every_chunk(tmp_path):
    """The CPU's load helper (layerwise.py) copies every other chunk on its own thread; each
    chunk still arrives whole and verified, and a page changed under the helper's copy is a
    load error from that chunk on."""
    chain = chunk_keys(Namespace("sha256:m", "two"), range(64), LAYOUT.chunk_tokens)
    with running_agent(tmp_path, host_capacity_bytes=8 * PAGE, page_size_bytes=PAGE) as agent:
        settings = ConnectorSettings(socket_path=str(agent.config.socket_path))
        writer, saved = WorkerSide(settings, KV), paged(0.5, num_blocks=8)
        writer.register(saved)
        meta = KVStoreConnectorMetadata(saves=[SaveSpec("w", chain, b"", [[0, 1, 2, 3]])])
        for name, tensor in saved.items():
            writer.save_layer(meta, name, tensor)
        writer.finish_save()
        reader, target = WorkerSide(settings, KV), paged(0.0, num_blocks=8)
        reader.register(target)
        reader._helper_cpus = frozenset(os.sched_getaffinity(0))  # as if vLLM left cores free
        threads = helped_threads(reader)
        reader.start_load(KVStoreConnectorMetadata(loads=[LoadSpec("r", chain, [[4, 5, 6, 7]], 0)]))
        for name in target:
            reader.wait_for_layer(name)
        assert reader.take_failed_block_ids() == set()
        for name in saved:
            assert torch.equal(target[name][4:8], saved[name][0:4])
        assert threads == {"kvstore-load-helper"} and reader.stats["loaded_blocks"] == 2

        host = agent.store.slots[0].tier
        page = host.pages[host.page_index(KV.rank_key(chain[1]))]
        page[HEADER_BYTES : HEADER_BYTES + 64].fill_(0xBB)  # the helper's chunk, changed
        reader.start_load(KVStoreConnectorMetadata(loads=[LoadSpec("r", chain, [[4, 5, 6, 7]], 0)]))
        assert reader.take_failed_block_ids() == {6, 7}
        writer.close()
        reader.close()


def helped_threads(reader: WorkerSide) -> set[str]:
    """The names of the threads that copy with the reader's helper copier, as they do."""
    threads: set[str] = set()
    load_layers = reader._helper.load_layers

    def recorded(*args, **kwargs):
        threads.add(threading.current_thread().name)
        return load_layers(*args, **kwargs)

    reader._helper.load_layers = recorded
    return threads
