"""kv_connector_extra_config as vLLM passes it (JSON): typed values are taken as they are and
a value of another type is refused by name, never converted."""

import pytest

from kvstore.connectors.vllm.config import ConnectorSettings
from kvstore.errors import ConfigError


@pytest.mark.parametrize("value", [True, 150.9, -0.5, "256"])
@pytest.mark.parametrize("name", ["chunk_tokens", "stage_threads", "events_max_chunks"])
def test_regression_integer_settings_refuse_bools_fractions_and_text(name, value):
    """The old parser passed each value through int(): `true` became 1, `150.9` 150, `-0.5`
    0 (then refused as not positive, or taken where 0 was allowed)."""
    with pytest.raises(ConfigError) as refused:
        ConnectorSettings.from_extra_config({name: value})
    where = f"kv_connector_extra_config key {name!r}"
    assert str(refused.value) == f"{name} must be an integer, got {value!r} ({where})"


@pytest.mark.parametrize("value", ["false", "no", 0, None])
def test_regression_verify_checksums_takes_only_a_json_bool(value):
    """The old parser turned any string but "1", "true" and "yes" into False."""
    with pytest.raises(ConfigError, match="verify_checksums must be true or false"):
        ConnectorSettings.from_extra_config({"verify_checksums": value})


@pytest.mark.parametrize(
    ("extra", "message"),
    [
        ({"chunk_tokens": 0}, "chunk_tokens must be > 0, got 0"),
        ({"head_group_size": -1}, "head_group_size must be >= 0, got -1"),
        ({"load_timeout_s": -0.5}, "load_timeout_s must be >= 0, got -0.5"),
        ({"codec": "int4"}, "codec 'int4' unknown; use one of raw, fp8"),
        ({"load_thread": "gpu"}, "load_thread 'gpu' unknown; use one of auto, thread, inline"),
        ({"chunk_token": 256}, "unknown setting(s) ['chunk_token'] in kv_connector_extra_config"),
    ],
)
def test_out_of_range_values_and_unknown_keys_are_refused_by_name(extra, message):
    with pytest.raises(ConfigError) as refused:
        ConnectorSettings.from_extra_config(extra)
    assert str(refused.value).startswith(message)


def test_typed_values_are_taken_as_they_are():
    extra = {"chunk_tokens": 512, "load_timeout_s": 3, "verify_checksums": False}
    settings = ConnectorSettings.from_extra_config(extra)
    assert (settings.chunk_tokens, settings.load_timeout_s) == (512, 3.0)
    assert settings.verify_checksums is False
    assert ConnectorSettings.from_extra_config(None) == ConnectorSettings()
