"""The chunk keys of one request: what the request itself changes about its KV (its cache salt,
its LoRA adapter's name and weights) enters the root of its key chain, so only requests that
compute the same KV share blocks. Runs in vLLM's scheduler process.

A request without salt or adapter keeps the namespace's own root (the keys of plain prompts);
under key_scheme "sglang" both seed the chain as SGLang does (`sglang_chain_seed`). Multimodal
and prompt-embedding requests, whose KV is not a function of their token ids and these, bypass
the store.
"""

from __future__ import annotations

import hashlib
import json
import logging
from collections import OrderedDict
from pathlib import Path

from kvstore.connectors.vllm.config import EngineKV
from kvstore.errors import KVStoreError
from kvstore.fingerprint import model_fingerprint
from kvstore.keys import KEY_BYTES, chained_keys
from kvstore.keys_sglang import sglang_chain_seed

logger = logging.getLogger(__name__)

_REQUEST_PERSON = b"kvstore-req1"
_ADAPTERS_MAX = 256  # adapter fingerprints remembered (a miss costs a re-hash of its files)

BYPASS_MULTIMODAL = "multimodal"
BYPASS_PROMPT_EMBEDS = "prompt_embeds"
BYPASS_LORA_NOT_LOCAL = "lora_not_local"


def request_root(namespace_root: bytes, cache_salt: str, lora: tuple[str, str] | None) -> bytes:
    """The chain root of a request: the namespace's root when it has neither salt nor adapter,
    else a hash of that root and both (canonically encoded, so no two pairs collide)."""
    if not cache_salt and lora is None:
        return namespace_root
    extras = json.dumps({"cache_salt": cache_salt, "lora": lora}, sort_keys=True).encode()
    digest = hashlib.blake2b(namespace_root, digest_size=KEY_BYTES, person=_REQUEST_PERSON)
    digest.update(extras)
    return digest.digest()


class RequestKeys:
    """Keys and bypass decisions for the scheduler's requests; remembers adapter fingerprints."""

    def __init__(self, kv: EngineKV) -> None:
        self.kv = kv
        self._adapters: OrderedDict[tuple[str, str], str] = OrderedDict()

    def bypass_reason(self, request) -> str | None:
        """Why the store must neither load nor save this request, or None."""
        if getattr(request, "mm_features", None):
            return BYPASS_MULTIMODAL
        if getattr(request, "prompt_embeds", None) is not None or request.prompt_token_ids is None:
            return BYPASS_PROMPT_EMBEDS
        lora = getattr(request, "lora_request", None)
        if lora is not None and self._adapter_fingerprint(lora) is None:
            return BYPASS_LORA_NOT_LOCAL
        return None

    def keys(self, request) -> list[bytes]:
        """Chain keys of the prompt's chunks (call only for a request with no bypass reason)."""
        salt, adapter = self._extras(request)
        if self.kv.key_scheme == "sglang":
            extra = None if adapter is None else ":".join(adapter)
            seed = sglang_chain_seed(extra, salt or None)
            return self.kv.chain_keys(request.prompt_token_ids, seed)
        root = request_root(self.kv.root, salt, adapter)
        return chained_keys(root, request.prompt_token_ids, self.kv.layout.chunk_tokens)

    def root(self, request) -> bytes | None:
        """The root `keys` chains from, which a tail with no whole chunk before it chains on;
        None under the "sglang" scheme (its chain starts from SGLang's seed: there a tail
        needs a whole chunk before it)."""
        if self.kv.key_scheme == "sglang":
            return None
        return request_root(self.kv.root, *self._extras(request))

    def _extras(self, request) -> tuple[str, tuple[str, str] | None]:
        """(cache salt, (adapter name, adapter fingerprint) or None) of a request."""
        lora = getattr(request, "lora_request", None)
        adapter = None
        if lora is not None:
            adapter = (lora.lora_name, self._adapter_fingerprint(lora))
        return getattr(request, "cache_salt", None) or "", adapter

    def _adapter_fingerprint(self, lora) -> str | None:
        """A hash of every byte of the adapter's files; None when its path is not a local
        directory (a hub id the workers resolve themselves: the scheduler cannot hash it)."""
        memo = (lora.lora_name, lora.lora_path)
        if getattr(lora, "load_inplace", False):
            self._adapters.pop(memo, None)  # its files were replaced: hash them again
        fingerprint = self._adapters.get(memo)
        if fingerprint is None:
            if not lora.lora_path or not Path(lora.lora_path).is_dir():
                return None
            try:
                fingerprint = model_fingerprint(lora.lora_path)
            except (OSError, KVStoreError) as exc:
                logger.warning(
                    "LoRA adapter %s not fingerprinted (%s): bypassing the store",
                    lora.lora_name,
                    exc,
                )
                return None
            self._adapters[memo] = fingerprint
            while len(self._adapters) > _ADAPTERS_MAX:
                self._adapters.popitem(last=False)
        self._adapters.move_to_end(memo)
        return fingerprint
