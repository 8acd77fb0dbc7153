"""The authentication flags of ``nalar serve`` and their configuration fields (no cluster)."""

from __future__ import annotations

import pytest

from cluster.cli import _auth, build_parser, serve_config
from cluster.config import ClusterConfig


def _config(argv: list[str]) -> ClusterConfig:
    return serve_config(build_parser().parse_args(["serve", *argv]))


def _keys(config: ClusterConfig) -> list[str]:
    return [key.get_secret_value() for key in config.api_keys]


def test_serve_help_lists_the_auth_flags(capsys):
    with pytest.raises(SystemExit) as exit_info:
        build_parser().parse_args(["serve", "--help"])
    assert exit_info.value.code == 0
    help_text = capsys.readouterr().out
    assert "--api-key KEY" in help_text and "--api-keys-file PATH" in help_text
    assert "$NALAR_API_KEY" in help_text


def test_api_key_is_repeatable_and_comma_separated(monkeypatch):
    monkeypatch.delenv("NALAR_API_KEY", raising=False)
    config = _config(["--api-key", "sk-a, sk-b", "--api-key", "sk-c"])
    assert _keys(config) == ["sk-a", "sk-b", "sk-c"]
    assert _keys(_config([])) == []


def test_env_key_applies_unless_the_flag_is_given(monkeypatch):
    monkeypatch.setenv("NALAR_API_KEY", "sk-env-1,sk-env-2")
    assert _keys(_config([])) == ["sk-env-1", "sk-env-2"]
    assert _keys(_config(["--api-key", "sk-flag"])) == ["sk-flag"]  # vLLM's precedence


def test_serve_config_args_accept_a_string_or_a_list(monkeypatch):
    monkeypatch.delenv("NALAR_API_KEY", raising=False)
    assert _keys(ClusterConfig(api_keys="sk-1,sk-2")) == ["sk-1", "sk-2"]
    assert _keys(ClusterConfig(api_keys=["sk-1", "sk-2,sk-3"])) == ["sk-1", "sk-2", "sk-3"]


def test_keys_file_path_is_made_absolute(monkeypatch, tmp_path):
    monkeypatch.chdir(tmp_path)
    assert _config(["--api-keys-file", "keys.txt"]).api_keys_file == str(tmp_path / "keys.txt")


def test_keys_never_show_in_the_config_or_the_start_line(monkeypatch, tmp_path):
    monkeypatch.delenv("NALAR_API_KEY", raising=False)
    config = _config(["--api-key", "sk-secret-one", "--api-keys-file", str(tmp_path / "k")])
    for text in (repr(config), str(config), config.model_dump_json(), _auth(config)):
        assert "sk-secret-one" not in text
    assert _auth(config) == f"auth by 1 API key(s) + the keys in {tmp_path / 'k'}"
    assert _auth(_config([])) == "no API key (open to anyone who can reach the port)"
