"""A metadata token file read again as it is replaced (kubelet rotation), checked at most every
`recheck_s`, keeping its last token where the file goes away."""

import os

import pytest

from kvstore.errors import ConfigError
from kvstore.metadata.client.token_file import TokenFile


def test_a_replaced_file_is_read_again_after_the_recheck_interval(tmp_path, monkeypatch):
    now = [100.0]
    monkeypatch.setattr("kvstore.metadata.client.token_file.time.monotonic", lambda: now[0])
    path = tmp_path / "token"
    path.write_text("first-token\n")
    token_file = TokenFile.read(path)
    replacement = tmp_path / "token.new"
    replacement.write_text("second-token")
    os.replace(replacement, path)
    assert token_file.current() == "first-token"  # within recheck_s: not looked at
    now[0] += 1.0
    assert token_file.current() == "second-token"


def test_the_last_token_is_kept_where_the_file_goes_away(tmp_path, caplog):
    path = tmp_path / "token"
    path.write_text("only-token")
    token_file = TokenFile(path, recheck_s=0.0)
    assert token_file.current() == "only-token"
    path.unlink()
    assert token_file.current() == "only-token"
    assert "using the last token read" in caplog.text


def test_a_token_file_that_was_never_readable_is_a_config_error(tmp_path):
    with pytest.raises(ConfigError, match="cannot read metadata token from"):
        TokenFile.read(tmp_path / "absent")
    (tmp_path / "empty").write_text("\n")
    with pytest.raises(ConfigError, match="is empty"):
        TokenFile.read(tmp_path / "empty")
