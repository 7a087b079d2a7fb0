"""The secrets `kvstore serve` keeps in its data dir: made on the first start, 0600 from their
first byte, reused after; one that another user could have read, or that is not a plain file
of this user, stops the start with a message saying what to do."""

import os
import stat
import subprocess
import sys

import pytest

from kvstore.errors import ConfigError
from kvstore.metadata.server.auth import load_tokens
from kvstore.serve_secrets import ServeSecrets, read_own_secret


def mode(path) -> int:
    return stat.S_IMODE(os.lstat(path).st_mode)


def test_the_first_start_makes_each_secret_0600_and_later_starts_reuse_them(tmp_path):
    own = ServeSecrets(tmp_path / "data")
    own.ensure("host-1")
    assert mode(own.data_dir) == 0o700
    made = {path: read_own_secret(path) for path in own.made_on_start()}
    assert all(mode(path) == 0o600 for path in [*made, own.tokens_file])
    assert len(set(made.values())) == 3 and all(len(s) >= 40 for s in made.values())
    assert [p.name for p in own.data_dir.iterdir() if p.name.startswith(".")] == []
    own.ensure("host-1")
    assert {path: read_own_secret(path) for path in own.made_on_start()} == made
    tokens = load_tokens(own.tokens_file)
    assert tokens[made[own.agent_token_file]].node == "host-1"
    assert tokens[made[own.operator_token_file]].tenant == "*"
    assert own.operator_token() == made[own.operator_token_file]


def test_secrets_are_never_open_to_others_even_under_a_permissive_umask(tmp_path):
    previous = os.umask(0)
    try:
        ServeSecrets(tmp_path / "data").ensure("n")
    finally:
        os.umask(previous)
    assert {mode(p) for p in (tmp_path / "data").iterdir() if p.is_file()} == {0o600}


def test_an_operators_token_file_is_granted_beside_serves_own(tmp_path):
    theirs = tmp_path / "tokens.txt"
    theirs.write_text("alice-token-0123456789 alice\n")
    own = ServeSecrets(tmp_path / "data")
    own.ensure("n", more_tokens=theirs)
    tokens = load_tokens(own.tokens_file)
    assert tokens["alice-token-0123456789"].tenant == "alice" and len(tokens) == 3


@pytest.mark.parametrize("loose", [0o640, 0o604, 0o660], ids=oct)
def test_a_secret_others_could_read_is_refused(tmp_path, loose):
    own = ServeSecrets(tmp_path / "data")
    own.ensure("n")
    own.cluster_secret_file.chmod(loose)
    for attempt in (lambda: own.ensure("n"), own.check):
        with pytest.raises(ConfigError, match=f"open to group or others \\(mode {loose:o}\\)"):
            attempt()


def test_a_secret_that_is_not_a_plain_file_of_this_user_is_refused(tmp_path):
    own = ServeSecrets(tmp_path / "data")
    own.ensure("n")
    target = tmp_path / "elsewhere"
    target.write_text("x" * 43)
    target.chmod(0o600)
    own.agent_token_file.unlink()
    own.agent_token_file.symlink_to(target)
    with pytest.raises(ConfigError, match=r"agent\.token is a symbolic link"):
        own.ensure("n")
    own.agent_token_file.unlink()
    own.agent_token_file.mkdir(mode=0o700)
    with pytest.raises(ConfigError, match=r"agent\.token is not a regular file"):
        own.ensure("n")
    os.chown(own.operator_token_file, 4242, 4242)
    with pytest.raises(ConfigError, match="belongs to uid 4242"):
        own.operator_token()


def test_an_empty_secret_is_refused_and_a_missing_operator_token_says_where_it_comes_from(
    tmp_path,
):
    own = ServeSecrets(tmp_path / "data")
    with pytest.raises(ConfigError, match="start `kvstore serve --data-dir"):
        own.operator_token()
    own.ensure("n")
    own.cluster_secret_file.write_text("")
    with pytest.raises(ConfigError, match=r"cluster\.secret is empty"):
        own.ensure("n")


def test_serve_refuses_to_start_on_a_group_readable_secret_without_a_traceback(tmp_path):
    own = ServeSecrets(tmp_path / "data")
    own.ensure("n")
    own.operator_token_file.chmod(0o644)
    for check in ([], ["--check"]):
        result = subprocess.run(
            [sys.executable, "-m", "kvstore", "serve", "--data-dir", str(own.data_dir), *check],
            capture_output=True,
            text=True,
            timeout=120,
        )
        assert result.returncode == 2, result.stderr
        assert "operator.token is open to group or others (mode 644)" in result.stderr
        assert "Traceback" not in result.stderr
