"""The eviction-policy interface and its registry.

A policy orders the resident blocks of ONE tier and names the next victim. It runs inside the
process that owns the tier (the node agent, or replay); it is not thread-safe: the store calls
it under its own lock. A policy never removes anything itself; the store does, then calls `remove`.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Callable

from kvstore.errors import ConfigError
from kvstore.keys import BlockKey

CanEvict = Callable[[BlockKey], bool]


class EvictionPolicy(ABC):
    """Tracks resident keys of one tier and picks victims."""

    name: str = ""

    @abstractmethod
    def insert(self, key: BlockKey, parent: BlockKey | None) -> None:
        """`key` became resident (committed); `parent` is its prefix predecessor (None: first).

        The parent need not be resident in this tier. Inserting a resident key is an error.
        """

    @abstractmethod
    def touch(self, key: BlockKey) -> None:
        """`key` was hit (read or pinned for reading). Unknown keys are ignored."""

    @abstractmethod
    def remove(self, key: BlockKey) -> None:
        """`key` left the tier (evicted, demoted or released). Unknown keys are ignored."""

    @abstractmethod
    def victim(self, can_evict: CanEvict) -> BlockKey | None:
        """The key to evict next among those for which `can_evict` is true, or None.

        Does not change residency: the store evicts the key and then calls `remove`.
        """

    @abstractmethod
    def __len__(self) -> int:
        """Number of resident keys tracked."""

    @abstractmethod
    def __contains__(self, key: object) -> bool:
        """Whether `key` is tracked as resident."""


_REGISTRY: dict[str, Callable[..., EvictionPolicy]] = {}


def register_policy(name: str) -> Callable[[type[EvictionPolicy]], type[EvictionPolicy]]:
    """Class decorator: make a policy constructible by `make_policy(name)`."""

    def decorate(cls: type[EvictionPolicy]) -> type[EvictionPolicy]:
        if name in _REGISTRY:
            raise ConfigError(f"eviction policy {name!r} registered twice")
        cls.name = name
        _REGISTRY[name] = cls
        return cls

    return decorate


def policy_names() -> list[str]:
    """Names accepted by `make_policy`, sorted."""
    return sorted(_REGISTRY)


def make_policy(name: str, **options: object) -> EvictionPolicy:
    """A new policy by registered name; unknown names raise ConfigError listing the known ones."""
    try:
        factory = _REGISTRY[name]
    except KeyError:
        raise ConfigError(
            f"unknown eviction policy {name!r}; choose one of {', '.join(policy_names())}"
        ) from None
    return factory(**options)
