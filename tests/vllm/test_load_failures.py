"""The vLLM connector's halves when a load fails, as vLLM 0.32 drives them: the chunks a step
computes over blocks that were never loaded are not saved (they would be wrong KV for every
later hit); load errors are known when vLLM asks for them, before wait_for_save (speculative
decoding asks first); the worker's per-request save bookkeeping ends with the request. The
real SchedulerSide and WorkerSide over a real node agent; the steps are driven by hand."""

from types import SimpleNamespace

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
PAGE = 1 << 14
AGENT = {"host_capacity_bytes": 8 * PAGE, "page_size_bytes": PAGE}
CHAIN = chunk_keys(Namespace("sha256:m", "chain"), range(3 * 32), 32)  # 3 chunks


def paged(fill: float, num_blocks: int = 8) -> dict[str, torch.Tensor]:
    shape = (num_blocks, LAYOUT.num_kv_heads, BLOCK, 2 * LAYOUT.head_dim)
    return {f"layer{i}": torch.full(shape, fill) + i for i in range(LAYOUT.num_layers)}


def forward(worker: WorkerSide, meta, caches, before_layer=None):
    """What vLLM's model runner does in one step (sync load): start_load_kv, then per layer
    wait_for_layer_load + save_kv_layer, then wait_for_save."""
    worker.start_load(meta)
    for index, (name, tensor) in enumerate(caches.items()):
        if before_layer is not None:
            before_layer(index)
        worker.wait_for_layer(name)
        worker.save_layer(meta, name, tensor)


def held(socket_path, chain_keys) -> int:
    with KVStoreClient(socket_path, "probe") as probe:
        return probe.lookup("default", KV.block_keys(chain_keys), local_only=True).total


def scheduler_step_meta(sched, prompt, external, scheduled, block_ids):
    """SchedulerSide as vLLM drives it for a new request: update_state_after_alloc with
    `external` tokens to load, then build_connector_meta of the step that schedules it."""
    from kvstore.connectors.vllm.scheduler import SchedulerSide  # noqa: F401

    request = SimpleNamespace(
        request_id="r",
        prompt_token_ids=prompt,
        mm_features=None,
        prompt_embeds=None,
        lora_request=None,
        cache_salt=None,
    )
    sched._state(request).computed_at_load = 0  # get_num_new_matched_tokens(request, 0)
    sched.after_alloc(request, None, external)
    output = SimpleNamespace(
        scheduled_new_reqs=[
            SimpleNamespace(
                req_id="r",
                block_ids=(block_ids,),
                num_computed_tokens=external,
                prompt_token_ids=prompt,
            )
        ],
        scheduled_cached_reqs=SimpleNamespace(
            req_ids=[], new_block_ids=[], resumed_req_ids=set(), num_computed_tokens=[]
        ),
        num_scheduled_tokens={"r": scheduled},
    )
    return sched.build_meta(output)


def test_saves_computed_over_a_failed_load_are_not_committed(tmp_path):
    """A 96-token prompt whose chunk 0 kvstore supplies: the step loads chunk 0 into blocks
    1-2 and saves chunks 1-2 from blocks 3-6. Chunk 0 is gone from the store when the worker
    fetches it (evicted after the lookup): blocks 1-2 are load errors, vLLM recomputes from
    there, and chunks 1-2, computed by attention over blocks never loaded, are not committed
    (they were: every later hit on this prefix, on any engine, loaded wrong KV that the
    checksums could not catch, being of the wrong bytes)."""
    from kvstore.connectors.vllm.scheduler import SchedulerSide

    with running_agent(tmp_path, **AGENT) as agent:
        settings = ConnectorSettings(socket_path=str(agent.config.socket_path))
        sched = SchedulerSide(settings, KV)
        meta = scheduler_step_meta(sched, list(range(96)), 32, 64, [1, 2, 3, 4, 5, 6])
        sched.lookups.close()
        assert [(s.req_id, len(s.keys)) for s in meta.loads] == [("r", 1)]
        assert [(s.req_id, len(s.keys), s.block_ids) for s in meta.saves] == [
            ("r", 2, [[3, 4, 5, 6]])
        ]
        worker = WorkerSide(settings, KV)
        caches = paged(0.5)
        worker.register(caches)
        forward(worker, meta, caches)
        worker.finish_load()  # wait_for_save: loads first ...
        worker.finish_save()  # ... then this step's saves
        failed = worker.take_failed_block_ids()
        assert failed == {1, 2}, "chunk 0 was not in the store: a load error vLLM recomputes"
        saved = meta.saves[0].keys
        assert held(agent.config.socket_path, saved[:1]) == 0, (
            "chunks 1-2, computed this step over the unloaded blocks 1-2, were committed to "
            f"kvstore (worker stats: {worker.stats})"
        )
        assert worker.stats["saves_dropped_after_load_errors"] == 2
        worker.close()


def test_load_errors_are_reported_before_wait_for_save(tmp_path):
    """With speculative decoding vLLM 0.32 calls get_block_ids_with_load_errors() at the end
    of the target forward and wait_for_save() only after the drafter (gpu_model_runner.py:
    defer_kv_connector_finalize). A chunk whose page changed while it was copied is reported
    then (it was reported one step late, after vLLM had accepted the step's output)."""
    with running_agent(tmp_path, **AGENT) as agent:
        settings = ConnectorSettings(socket_path=str(agent.config.socket_path))
        writer = WorkerSide(settings, KV)
        saved = paged(0.5)
        writer.register(saved)
        save_meta = KVStoreConnectorMetadata(saves=[SaveSpec("w", CHAIN[:1], b"", [[1, 2]])])
        forward(writer, save_meta, saved)
        writer.finish_load()
        writer.finish_save()

        reader = WorkerSide(settings, KV)
        target = paged(0.0)
        reader.register(target)

        def corrupt_page(layer):
            if layer == 1:  # layer 0 already copied; the rest of the page changes under us
                host = agent.store.slots[0].tier
                page = host.pages[host.page_index(KV.rank_key(CHAIN[0]))]
                start, stop = LAYOUT.layer_range(1)
                page[HEADER_BYTES + start : HEADER_BYTES + stop].fill_(0xBB)

        meta = KVStoreConnectorMetadata(loads=[LoadSpec("r", CHAIN[:1], [[2, 3]], 0)])
        forward(reader, meta, target, before_layer=corrupt_page)
        # the end of the target forward under defer_finalize: vLLM collects load errors now
        reported_now = reader.take_failed_block_ids()
        reader.finish_load()  # wait_for_save, after the drafter
        reported_late = reader.take_failed_block_ids()
        assert reported_late == set() and reported_now == {2, 3}, (
            f"load errors reported at the end of the forward: {reported_now}; "
            f"only after wait_for_save: {reported_late}"
        )
        writer.close()
        reader.close()


def test_an_asynchronous_load_finishes_and_fails_per_request(tmp_path):
    """A model of several KV cache groups loads in vLLM's asynchronous mode (vLLM 0.32 stops
    its engine core on block-level load errors there): every load is reported finished for
    its request, a failed one (its chunk 1 is not in the store) also as failed, and no block
    id is reported; the good load's blocks hold what was saved."""
    with running_agent(tmp_path, **AGENT) as agent:
        settings = ConnectorSettings(socket_path=str(agent.config.socket_path))
        writer = WorkerSide(settings, KV)
        saved = paged(0.5)
        writer.register(saved)
        forward(
            writer, KVStoreConnectorMetadata(saves=[SaveSpec("w", CHAIN[:1], b"", [[1, 2]])]), saved
        )
        writer.finish_save()

        reader = WorkerSide(settings, KV)
        target = paged(0.0)
        reader.register(target)
        loads = [
            LoadSpec("good", CHAIN[:1], [[2, 3]], 0, asynchronous=True),
            LoadSpec("bad", CHAIN[:2], [[4, 5, 6, 7]], 0, asynchronous=True),
        ]
        forward(reader, KVStoreConnectorMetadata(loads=loads), target)
        assert reader.take_failed_block_ids() == set()
        assert reader.take_finished_loads() == ({"good", "bad"}, {"bad"})
        assert reader.take_finished_loads() == (set(), set())
        for name in saved:
            assert torch.equal(target[name][2:4], saved[name][1:3])
        assert reader.stats["loaded_blocks"] == 1
        writer.close()
        reader.close()


def test_worker_save_bookkeeping_is_bounded_on_the_cpu(tmp_path):
    """On the CPU (no delayed frees) the save pipeline tracked every request that ever saved,
    and nothing removed it: a long-running worker grew by one entry per request."""
    with running_agent(tmp_path, **AGENT) as agent:
        worker = WorkerSide(ConnectorSettings(socket_path=str(agent.config.socket_path)), KV)
        assert not worker.saves.delayed_frees
        caches = paged(0.25)
        worker.register(caches)
        for i in range(50):
            keys = chunk_keys(Namespace("sha256:m", f"r{i}"), range(32), 32)
            meta = KVStoreConnectorMetadata(saves=[SaveSpec(f"r{i}", keys, b"", [[1, 2]])])
            forward(worker, meta, caches)
            worker.finish_load()
            worker.finish_save()
            worker.finished_saving({f"r{i}"})  # vLLM: get_finished(finished_req_ids)
        assert len(worker.saves._uncommitted) == 0, (
            f"{len(worker.saves._uncommitted)} finished requests still tracked"
        )
        worker.close()


def test_saves_are_waited_for_before_a_forward_only_after_a_preemption(tmp_path):
    """vLLM calls handle_preemptions before every forward, and the worker waited there for
    every save still on the copy stream (CUDA): a host sync per step. It waits only after a
    preemption now (of any request: one aborted since has no state left, and its freed
    blocks may be another's in this step). The preempted request's saves are then done, and
    it owes vLLM no delayed free: reported by finished_saving after vLLM had freed it (aborted
    during an asynchronous load), it failed vLLM's `assert req_id in self.requests`."""
    from types import SimpleNamespace

    from kvstore.connectors.vllm.connector import KVStoreConnector
    from kvstore.connectors.vllm.scheduler import SchedulerSide

    with running_agent(tmp_path, **AGENT) as agent:
        settings = ConnectorSettings(socket_path=str(agent.config.socket_path))
        sched = SchedulerSide(settings, KV)
        sched.delay_frees = True  # as on CUDA
        meta = scheduler_step_meta(sched, list(range(96)), 0, 64, [1, 2, 3, 4, 5, 6])
        assert meta.saves and not meta.flush_saves
        worker = WorkerSide(settings, KV)
        worker.saves.delayed_frees = True
        caches = paged(0.5)
        worker.register(caches)
        forward(worker, meta, caches)
        worker.finish_save()

        idle = SimpleNamespace(
            scheduled_new_reqs=[],
            num_scheduled_tokens={},
            scheduled_cached_reqs=SimpleNamespace(
                req_ids=[], new_block_ids=[], resumed_req_ids=set(), num_computed_tokens=[]
            ),
        )
        flushes = {}
        for preempted in (None, set(), {"gone"}, {"r"}):
            idle.preempted_req_ids = preempted
            flushes[str(preempted)] = sched.build_meta(idle).flush_saves
        assert flushes == {"None": False, "set()": False, "{'gone'}": True, "{'r'}": True}
        step = sched.build_meta(idle)  # "r" preempted: the workers commit, then forget it
        connector = SimpleNamespace(worker=worker)
        KVStoreConnector.handle_preemptions(connector, step)
        assert worker.finished_saving({"r"}) == set()
        assert sched.finished(SimpleNamespace(request_id="r")) is False  # no delayed free
        sched.delay_frees = False  # the CPU: saves commit within their step
        assert not sched.build_meta(idle).flush_saves
        sched.lookups.close()
        worker.close()
