"""`--check` of `kvstore serve | node | metadata`: validates every setting a start would use,
without starting anything (no listening socket, no arena, no LMDB, nothing created).

Runs in the CLI process, on configs built exactly as the start builds them. Every problem is
collected, so one run names all of them; ConfigError (exit 2) if there is any, else "ok".
"""

from __future__ import annotations

import importlib.util
import os
import ssl
import stat
from collections.abc import Callable
from pathlib import Path

from kvstore.config import read_secret_file
from kvstore.errors import ConfigError
from kvstore.eviction import policy_names
from kvstore.metadata.server.auth import load_tokens
from kvstore.metadata.server.server import MetadataConfig
from kvstore.node.agent import NodeConfig
from kvstore.node.identity import WorkerCredentials
from kvstore.serve_secrets import ServeSecrets
from kvstore.tiers.base import pages_for

SHM_DIR = Path("/dev/shm")
_MAX_SOCKET_PATH_BYTES = 107  # sun_path holds 108 bytes, the last one a NUL


class Problems:
    """The problems found so far; `attempt` runs one check and records its ConfigError."""

    def __init__(self) -> None:
        self.messages: list[str] = []
        self.warnings: list[str] = []

    def attempt(self, check: Callable[..., object], *args: object) -> None:
        try:
            check(*args)
        except ConfigError as exc:
            self.messages.append(str(exc))

    def add(self, message: str) -> None:
        self.messages.append(message)


def check_metadata(config: MetadataConfig) -> int:
    return _report(_metadata_problems(config))


def check_node(config: NodeConfig) -> int:
    return _report(_node_problems(config))


def check_embedded(metadata: MetadataConfig, node: NodeConfig, own: ServeSecrets) -> int:
    """`own`: the secrets a start makes where missing; those present must be safe."""
    problems = _metadata_problems(metadata, embedded=True)
    problems.attempt(own.check)
    node_problems = _node_problems(node, embedded=True, own_secrets=own.made_on_start())
    problems.messages += node_problems.messages
    problems.warnings += node_problems.warnings
    return _report(problems)


def _report(problems: Problems) -> int:
    for warning in problems.warnings:
        print(f"warning: {warning}")
    if problems.messages:
        raise ConfigError("check failed:\n  - " + "\n  - ".join(problems.messages))
    print("ok")
    return 0


def _metadata_problems(config: MetadataConfig, embedded: bool = False) -> Problems:
    """`embedded`: serve's service, whose tokens the start makes (serve_secrets.py)."""
    problems = Problems()
    problems.attempt(check_address, config.listen, "listen", False)
    if config.metrics_listen:
        problems.attempt(check_address, config.metrics_listen, "metrics_listen", True)
    if config.backend == "lmdb":
        problems.attempt(check_writable_dir, config.data_dir, "data_dir")
    if config.backend == "redis":
        problems.attempt(check_redis_url, config.redis_url)
    if config.backend == "redis-cluster":
        from kvstore.metadata.index.redis_cluster import cluster_seeds

        problems.attempt(cluster_seeds, config.redis_url)
    if config.token_file is not None:
        problems.attempt(check_token_file, config.token_file)
    if not config.auth_configured() and not embedded:
        problems.warnings.append(
            f"auth is off: any process that reaches {config.listen} may read and publish "
            "every tenant's keys; give --token-file"
        )
    problems.attempt(check_kube_api, config)
    if config.tls_cert is not None:
        problems.attempt(check_tls, config.tls_cert, config.tls_key, config.tls_client_ca)
    if config.key_quota_per_tenant < 0:
        problems.add("key_quota_per_tenant must be 0 (unlimited) or positive")
    if config.max_events <= 0:
        problems.add("max_events must be positive")
    return problems


def _node_problems(
    config: NodeConfig, embedded: bool = False, own_secrets: tuple[Path, ...] = ()
) -> Problems:
    problems = Problems()
    problems.attempt(pages_for, config.host_capacity_bytes, config.page_size_bytes, "host")
    _check_shm_size(config.host_capacity_bytes, problems)
    for name in ("host_policy", "disk_policy"):
        if getattr(config, name) not in policy_names():
            problems.add(f"{name} {getattr(config, name)!r} unknown; use one of {policy_names()}")
    if config.disk_dir is not None:
        problems.attempt(pages_for, config.disk_capacity_bytes, config.page_size_bytes, "disk")
        problems.attempt(check_writable_dir, config.disk_dir, "disk_dir")
    if config.private_buffer_bytes < config.largest_block_bytes:
        problems.add(
            "private_buffer_bytes must hold at least one block (max_block_bytes, or one page)"
        )
    problems.attempt(check_socket_path, config.socket_path)
    if config.metadata_address and not embedded:
        problems.attempt(check_address, config.metadata_address, "metadata_address", False)
    _check_transfer(config, problems)
    if config.metrics_listen:
        problems.attempt(check_address, config.metrics_listen, "metrics_listen", True)
    for name, what in (
        ("metadata_token_file", "metadata token"),
        ("cluster_secret_file", "cluster secret"),
    ):
        path = getattr(config, name)
        if path is not None and path not in own_secrets:
            problems.attempt(read_secret_file, path, what)
    if config.metadata_tls_ca is not None:
        problems.attempt(check_ca_file, config.metadata_tls_ca, "metadata_tls_ca")
    if config.worker_credentials is not None:
        problems.attempt(WorkerCredentials.from_file, config.worker_credentials)
    return problems


def _check_transfer(config: NodeConfig, problems: Problems) -> None:
    if config.transfer == "none":
        return
    if config.transfer == "ucx" and importlib.util.find_spec("ucxx") is None:
        problems.add("transfer 'ucx' needs ucxx (pip install 'kvstore[ucx]')")
    if not config.cluster_secret_file:  # so insecure_transfer (NodeConfig refuses otherwise)
        problems.warnings.append(
            f"insecure_transfer: the {config.transfer} transfer engine would serve every block "
            "to any process that reaches its port; give --cluster-secret-file"
        )
    if not 0 <= config.transfer_port <= 65535:
        problems.add(f"transfer_port {config.transfer_port} is not a port (0-65535)")
    if not config.transfer_host.strip():
        problems.add("transfer_host is empty; use an address to bind, e.g. 0.0.0.0")
    if config.advertise_host.startswith("$("):
        problems.add(
            f"advertise_host {config.advertise_host!r} is an unexpanded variable; "
            "define it in the container's env (Kubernetes expands $(NAME) from env only)"
        )


def _check_shm_size(capacity_bytes: int, problems: Problems) -> None:
    """A warning only: the arena is sparse, so a start succeeds and fails later (SIGBUS)."""
    try:
        info = os.statvfs(SHM_DIR)
    except OSError:
        problems.warnings.append(f"{SHM_DIR} is missing: the host arena cannot be created")
        return
    size_bytes = info.f_blocks * info.f_frsize
    if capacity_bytes > size_bytes:
        problems.warnings.append(
            f"host_capacity_bytes {capacity_bytes} exceeds the size of {SHM_DIR} here "
            f"({size_bytes}); back /dev/shm with a memory volume at least that large"
        )


def check_address(address: str, name: str, wildcard_ok: bool) -> None:
    """`host:port` as the services parse it (`rpartition(':')`), port a number 0-65535."""
    host, sep, port = address.rpartition(":")
    if not sep or not port.isdigit() or not 0 <= int(port) <= 65535:
        raise ConfigError(f"{name} {address!r} is not host:port (e.g. 0.0.0.0:9100)")
    if not host and not wildcard_ok:
        raise ConfigError(f"{name} {address!r} names no host (e.g. 0.0.0.0:{port})")
    if host.startswith("$("):
        raise ConfigError(f"{name} {address!r} holds an unexpanded variable {host}")


def check_writable_dir(directory: Path, name: str) -> None:
    """An existing writable directory, or one that can be created (nothing is created)."""
    existing = directory
    while not existing.exists():
        if existing.parent == existing:
            break
        existing = existing.parent
    if not existing.is_dir():
        raise ConfigError(f"{name} {directory}: {existing} is not a directory")
    if not os.access(existing, os.W_OK | os.X_OK):
        verb = "is not writable" if existing == directory else f"cannot be created in {existing}"
        raise ConfigError(f"{name} {directory} {verb} by uid {os.getuid()}")


def check_socket_path(socket_path: Path) -> None:
    """What `kvstore.node.control.secure_socket_dir` and the bind would refuse."""
    if len(os.fsencode(socket_path)) > _MAX_SOCKET_PATH_BYTES:
        raise ConfigError(
            f"socket_path {socket_path} is longer than {_MAX_SOCKET_PATH_BYTES} bytes"
        )
    directory = socket_path.parent
    try:
        info = directory.lstat()
    except FileNotFoundError:
        check_writable_dir(directory, "socket directory")
        return
    if stat.S_ISLNK(info.st_mode) or not stat.S_ISDIR(info.st_mode):
        raise ConfigError(f"socket directory {directory} is not a plain directory")
    if info.st_uid != os.getuid():
        raise ConfigError(
            f"socket directory {directory} belongs to uid {info.st_uid}, not this agent's "
            f"uid {os.getuid()}; chown it or choose another --socket-path"
        )
    if info.st_mode & 0o022:
        raise ConfigError(
            f"socket directory {directory} is writable by group or others (mode "
            f"{stat.S_IMODE(info.st_mode):o}); chmod it to 750 or choose another --socket-path"
        )
    if socket_path.exists() and not socket_path.is_socket():
        raise ConfigError(f"socket_path {socket_path} exists and is not a socket")


def check_redis_url(url: str) -> None:
    from redis.connection import parse_url

    try:
        parse_url(url)
    except ValueError as exc:
        raise ConfigError(f"redis_url: {exc}") from None


def check_kube_api(config: MetadataConfig) -> None:
    """With agent service accounts: the API server's address and this service's own
    credentials (token, CA) for TokenReviews; nothing is asked of the API server."""
    api = config.kube_api()
    if api is not None:
        api.check()


def check_token_file(path: Path) -> None:
    try:
        tokens = load_tokens(path)
    except OSError as exc:
        raise ConfigError(f"cannot read token file {path}: {exc}") from None
    if not tokens:
        raise ConfigError(f"token file {path} holds no 'TOKEN TENANT' line; auth would be off")


def check_tls(cert: Path, key: Path | None, client_ca: Path | None) -> None:
    """The certificate and key parse and belong together (what the gRPC bind needs)."""
    context = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
    try:
        context.load_cert_chain(cert, key)
    except (OSError, ssl.SSLError) as exc:
        raise ConfigError(f"TLS certificate {cert} / key {key} cannot be loaded: {exc}") from None
    if client_ca is not None:
        check_ca_file(client_ca, "tls_client_ca")


def check_ca_file(path: Path, name: str) -> None:
    context = ssl.SSLContext(ssl.PROTOCOL_TLS_CLIENT)
    try:
        context.load_verify_locations(cafile=path)
    except (OSError, ssl.SSLError) as exc:
        raise ConfigError(f"{name} {path} is not a readable PEM CA certificate: {exc}") from None
