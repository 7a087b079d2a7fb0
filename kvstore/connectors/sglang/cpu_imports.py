"""SGLang's host pools imported in a CPU environment without torchvision: tests and benchmarks
that build a real host pool outside an SGLang server (which brings its own torchvision).

`sglang.srt.mem_cache.pool_host` reaches `sglang.srt.configs`, whose InternVL-based config
imports `torchvision.transforms` for two constants. PyPI's Linux torchvision wheels are CUDA
builds, which fail to import next to the CPU torch ("operator torchvision::nms does not exist"),
so deploy/install.sh removes them and none can be installed in their place.
"""

from __future__ import annotations

import importlib.machinery
import sys
import types

_MODULES = ("torchvision", "torchvision.transforms", "torchvision.transforms.functional")


def allow_host_pool_imports() -> None:
    """Register inert torchvision modules where torchvision is missing, so SGLang's import
    chain completes; any use of them fails. Call before importing SGLang's host pools.
    transformers is asked first, and caches that torchvision is absent, so neither it nor
    vLLM takes the placeholders for a torchvision."""
    try:
        import torchvision  # noqa: F401
    except ImportError:
        import transformers.utils.import_utils as hf

        hf.is_torchvision_available()
        for name in _MODULES:
            sys.modules.setdefault(name, _placeholder_module(name))


def _placeholder_module(name: str) -> types.ModuleType:
    module = types.ModuleType(name)
    module.__spec__ = importlib.machinery.ModuleSpec(name, None, is_package=True)
    module.__path__ = []
    module.__getattr__ = lambda attr: _placeholder(f"{name}.{attr}")
    return module


def _placeholder(name: str) -> types.SimpleNamespace:
    if "__" in name.rsplit(".", 1)[-1]:
        raise AttributeError(name)
    return types.SimpleNamespace(name=name)
