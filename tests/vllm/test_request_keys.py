"""Keys that cover what changes KV, on vLLM's own Request and LoRARequest: a cache salt or a LoRA
adapter roots a request's chain elsewhere (same salt and adapter share, others never), plain
prompts keep the namespace's keys, and what cannot be keyed bypasses the store."""

import pytest

from kvstore.connectors.vllm.config import EngineKV
from kvstore.connectors.vllm.request_keys import (
    BYPASS_LORA_NOT_LOCAL,
    BYPASS_PROMPT_EMBEDS,
    RequestKeys,
    request_root,
)
from kvstore.fingerprint import model_fingerprint
from kvstore.keys import Namespace, chunk_keys
from kvstore.keys_sglang import sglang_chain_seed
from kvstore.layout import KVLayout
from tests.vllm.adapters import build_tiny_lora

NS = Namespace("blake2b:model", "L2-H2-D32-float32-T128")
CHUNK = 128
KV = EngineKV(KVLayout(2, 2, 32, "float32", CHUNK), NS, 32)
TOKENS = list(range(5, 5 + 3 * CHUNK + 7))


def make_request(request_id="r", tokens=TOKENS, **kwargs):
    from vllm import SamplingParams
    from vllm.v1.request import Request

    return Request(request_id, list(tokens), SamplingParams(max_tokens=1), None, **kwargs)


def lora(path, name="adapter", int_id=1):
    from vllm.lora.request import LoRARequest

    return LoRARequest(name, int_id, str(path))


@pytest.fixture(scope="module")
def adapters(tmp_path_factory, tiny_llama_fp32):
    root = tmp_path_factory.mktemp("adapters")
    return [build_tiny_lora(tiny_llama_fp32, root / f"lora{seed}", seed) for seed in (1, 2)]


def test_a_plain_prompt_keeps_the_namespace_keys():
    keys = RequestKeys(KV)
    assert keys.keys(make_request()) == chunk_keys(NS, TOKENS, CHUNK)
    assert request_root(b"root", "", None) == b"root"


def test_the_same_salt_shares_and_different_salts_never_do():
    keys = RequestKeys(KV)
    plain = keys.keys(make_request("p"))
    salted = keys.keys(make_request("a", cache_salt="tenant-a"))
    assert salted == keys.keys(make_request("a2", cache_salt="tenant-a"))
    other = keys.keys(make_request("b", cache_salt="tenant-b"))
    assert not set(salted) & set(other) and not set(salted) & set(plain)
    assert len(salted) == 3


def test_under_the_sglang_scheme_a_salt_seeds_the_chain_as_sglang_does():
    kv = EngineKV(KVLayout(2, 2, 32, "float32", CHUNK), NS, 32, key_scheme="sglang")
    keys = RequestKeys(kv)
    plain = keys.keys(make_request("p"))
    salted = keys.keys(make_request("a", cache_salt="tenant-a"))
    assert plain == kv.chain_keys(TOKENS)
    assert salted == kv.chain_keys(TOKENS, sglang_chain_seed(None, "tenant-a"))
    assert len(salted) == 3 and not set(salted) & set(plain)


def test_an_adapter_shares_only_with_itself(adapters):
    keys = RequestKeys(KV)
    first = keys.keys(make_request("1", lora_request=lora(adapters[0])))
    again = keys.keys(make_request("1b", lora_request=lora(adapters[0], int_id=7)))
    other = keys.keys(make_request("2", lora_request=lora(adapters[1])))
    renamed = keys.keys(make_request("3", lora_request=lora(adapters[0], name="other")))
    plain = keys.keys(make_request("p"))
    assert first == again
    for different in (other, renamed, plain):
        assert not set(first) & set(different)
    salted = keys.keys(make_request("4", lora_request=lora(adapters[0]), cache_salt="s"))
    assert not set(salted) & set(first)


def test_an_adapter_rewritten_in_place_is_hashed_again(adapters, tmp_path):
    import shutil

    from vllm.lora.request import LoRARequest

    path = tmp_path / "adapter"
    shutil.copytree(adapters[0], path)
    keys = RequestKeys(KV)
    before = keys.keys(make_request("1", lora_request=lora(path)))
    shutil.copy(adapters[1] / "adapter_model.safetensors", path / "adapter_model.safetensors")
    reload = LoRARequest("adapter", 1, str(path), load_inplace=True)
    assert not set(keys.keys(make_request("2", lora_request=reload))) & set(before)


def test_what_cannot_be_keyed_bypasses_the_store(tmp_path):
    import torch

    keys = RequestKeys(KV)
    assert keys.bypass_reason(make_request()) is None
    hub_adapter = make_request(lora_request=lora("some-org/some-adapter"))
    assert keys.bypass_reason(hub_adapter) == BYPASS_LORA_NOT_LOCAL
    from vllm import SamplingParams
    from vllm.v1.request import Request

    embeds = Request(
        "e", None, SamplingParams(max_tokens=1), None, prompt_embeds=torch.zeros(CHUNK * 2, 64)
    )
    assert keys.bypass_reason(embeds) == BYPASS_PROMPT_EMBEDS


def namespace_of(model, **engine_args):
    from vllm.engine.arg_utils import EngineArgs

    from kvstore.connectors.vllm.config import ConnectorSettings, engine_kv

    args = EngineArgs(model=str(model), dtype="float32", block_size=32, **engine_args)
    return engine_kv(args.create_engine_config(), ConnectorSettings(chunk_tokens=CHUNK)).namespace


def test_engine_settings_that_change_kv_change_the_namespace(vllm_inprocess_env, tiny_llama_fp32):
    plain = namespace_of(tiny_llama_fp32)
    assert namespace_of(tiny_llama_fp32, max_model_len=1024) == plain, "irrelevant to KV"
    rope = namespace_of(tiny_llama_fp32, hf_overrides={"rope_theta": 5000.0})
    window = namespace_of(tiny_llama_fp32, disable_sliding_window=True)
    assert len({plain.model_fingerprint, rope.model_fingerprint, window.model_fingerprint}) == 3
    # a plain engine's is the model files' alone, as the SGLang backend computes it
    assert plain.model_fingerprint == model_fingerprint(tiny_llama_fp32)
