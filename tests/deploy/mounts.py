"""A rendered container's mounts rebuilt under a temporary root, so `kvstore ... --check` can
read what the pod would: each mounted Secret key becomes a file of its kind (token table,
token, worker credentials, TLS material, TOML), each projected service-account token a token
and the cluster CA its certificate, each other volume a directory; the container's args and env
are rewritten to those paths, downward-API variables expanded, and the kubelet's own variables
(the API server's address) set as in every pod."""

from __future__ import annotations

import datetime
import re
from pathlib import Path

TOKEN = "t0k3n-agent-" + "a" * 20
FIELD_VALUES = {
    "spec.nodeName": "gpu-node-7",
    "metadata.name": "vllm-0",
    "status.podIP": "10.1.2.3",
}


def _self_signed() -> tuple[bytes, bytes]:
    from cryptography import x509
    from cryptography.hazmat.primitives import hashes, serialization
    from cryptography.hazmat.primitives.asymmetric import ec
    from cryptography.x509.oid import NameOID

    key = ec.generate_private_key(ec.SECP256R1())
    name = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, "kvstore-metadata")])
    now = datetime.datetime.now(datetime.UTC)
    cert = (
        x509.CertificateBuilder()
        .subject_name(name)
        .issuer_name(name)
        .public_key(key.public_key())
        .serial_number(x509.random_serial_number())
        .not_valid_before(now)
        .not_valid_after(now + datetime.timedelta(days=1))
        .add_extension(x509.BasicConstraints(ca=True, path_length=None), critical=True)
        .sign(key, hashes.SHA256())
    )
    key_pem = key.private_bytes(
        serialization.Encoding.PEM,
        serialization.PrivateFormat.PKCS8,
        serialization.NoEncryption(),
    )
    return cert.public_bytes(serialization.Encoding.PEM), key_pem


_CERT, _KEY = _self_signed()
SECRET_CONTENT = {  # by Secret key: what the operator's Secret holds (see values.yaml)
    "tokens.txt": f"{TOKEN} *\n{'b' * 24} alice\n".encode(),
    "agent.token": f"{TOKEN}\n".encode(),
    "cluster.secret": b"c" * 64,
    "workers.conf": b"uid:10001 * shared\ngid:2000 alice private\n",
    "tls.crt": _CERT,
    "tls.key": _KEY,
    "ca.crt": _CERT,
    "metadata.toml": b'[metadata]\nredis_url = "redis://:s3cret@redis.redis.svc:6379/0"\n',
}


CONFIG_MAP_CONTENT = {("kube-root-ca.crt", "ca.crt"): _CERT}  # by (ConfigMap, key)
PROJECTED_TOKEN = "eyJhbGciOiJSUzI1NiJ9.eyJhdWQiOlsia3ZzdG9yZSJdfQ.c2lnbmF0dXJl"
KUBELET_ENV = {"KUBERNETES_SERVICE_HOST": "10.96.0.1", "KUBERNETES_SERVICE_PORT": "443"}


def _write_projected(volume: dict, local: Path) -> None:
    """A projected volume's files: service-account tokens and ConfigMap keys."""
    for source in volume["projected"]["sources"]:
        if "serviceAccountToken" in source:
            (local / source["serviceAccountToken"]["path"]).write_text(PROJECTED_TOKEN)
        for item in source.get("configMap", {}).get("items", []):
            content = CONFIG_MAP_CONTENT.get((source["configMap"]["name"], item["key"]))
            if content is None:
                raise AssertionError(f"no fake content for ConfigMap key {item['key']!r}")
            (local / item["path"]).write_bytes(content)


def build_mounts(pod: dict, container: dict, root: Path) -> dict[str, Path]:
    """Creates the container's mounts under `root`; returns mountPath -> local path."""
    volumes = {v["name"]: v for v in pod.get("volumes", [])}
    mounts = {}
    for mount in container.get("volumeMounts", []):
        local = root / mount["mountPath"].lstrip("/")
        local.mkdir(mode=0o750, parents=True, exist_ok=True)
        local.chmod(0o750)
        volume = volumes.get(mount["name"], {})
        if "secret" in volume:
            for item in volume["secret"]["items"]:
                if item["key"] not in SECRET_CONTENT:
                    raise AssertionError(f"no fake content for Secret key {item['key']!r}")
                (local / item["path"]).write_bytes(SECRET_CONTENT[item["key"]])
        if "projected" in volume:
            _write_projected(volume, local)
        mounts[mount["mountPath"]] = local
    return mounts


def _expand(value: str, env: dict[str, str]) -> str:
    return re.sub(r"\$\(([A-Za-z_][A-Za-z0-9_]*)\)", lambda m: env.get(m[1], m[0]), value)


def _relocate(value: str, mounts: dict[str, Path]) -> str:
    if not value.startswith("/"):
        return value
    for mount_path in sorted(mounts, key=len, reverse=True):
        if value == mount_path or value.startswith(mount_path.rstrip("/") + "/"):
            return str(mounts[mount_path]) + value[len(mount_path) :]
    raise AssertionError(f"{value} is not inside any of the container's mounts {sorted(mounts)}")


def container_env(container: dict, mounts: dict[str, Path]) -> dict[str, str]:
    """Plain values and downward-API fields; a secret in env is refused (files only)."""
    env = dict(KUBELET_ENV)
    for var in container.get("env", []):
        source = var.get("valueFrom", {})
        assert "secretKeyRef" not in source, f"{var['name']} takes a secret from env"
        if "fieldRef" in source:
            env[var["name"]] = FIELD_VALUES[source["fieldRef"]["fieldPath"]]
        else:
            value = var["value"]
            env[var["name"]] = (
                _relocate(value, mounts) if var["name"].startswith("KVSTORE_") else value
            )
    return env


def container_args(container: dict, env: dict[str, str], mounts: dict[str, Path]) -> list[str]:
    return [_relocate(_expand(arg, env), mounts) for arg in container["args"]]
