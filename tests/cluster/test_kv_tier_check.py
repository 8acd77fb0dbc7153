"""``nalar serve`` refuses a second KV tier this host cannot hold, before Ray starts."""

from __future__ import annotations

import logging
import os
import re
import shutil
import socket
from types import SimpleNamespace

import psutil
import pytest

from cluster.cli import main
from cluster.config import ClusterConfig
from cluster.runtime import TierStoreError, check_kv_tier

MiB = 1 << 20


def tier_config(tmp_path, **fields) -> ClusterConfig:
    fields = {"num_workers": 2, "kv_tier_mib": 256, "kv_tier_dir": str(tmp_path),
              "worker_gpus": 0, "namespace_secret": "s", **fields}
    return ClusterConfig(**fields)


def with_free_disk(monkeypatch, free: int) -> None:
    monkeypatch.setattr(shutil, "disk_usage", lambda path: SimpleNamespace(free=free))


def test_a_tier_the_disk_holds_passes(tmp_path, monkeypatch):
    with_free_disk(monkeypatch, 512 * MiB)  # exactly 2 x 256 MiB
    check_kv_tier(tier_config(tmp_path))


def test_no_tier_checks_nothing(tmp_path):
    check_kv_tier(tier_config(tmp_path / "nowhere", kv_tier_mib=0))


@pytest.mark.parametrize(("where", "says"), [
    ("nowhere", "is not a directory (--kv-tier-dir)"),
    ("a-file", "is not a directory (--kv-tier-dir)"),
])
def test_a_tier_directory_that_is_not_one_is_refused(tmp_path, where, says):
    (tmp_path / "a-file").write_text("")
    with pytest.raises(TierStoreError, match=r"2 x --kv-tier-mib 256, disk\) cannot be had: "
                                             rf".*{where} {re.escape(says)}"):
        check_kv_tier(tier_config(tmp_path / where))


def test_a_read_only_tier_directory_is_refused(tmp_path, monkeypatch):
    # Root passes a permission check on a chmod-ed directory, so the read-only mount (EROFS,
    # which access() reports to root too) is stood in for by access() itself.
    monkeypatch.setattr(os, "access", lambda path, mode: False)
    with pytest.raises(TierStoreError, match=r"is not writable \(--kv-tier-dir\)"):
        check_kv_tier(tier_config(tmp_path))


def test_a_disk_short_of_every_workers_tier_is_refused(tmp_path, monkeypatch):
    with_free_disk(monkeypatch, 300 * MiB)  # holds one worker's 256 MiB, not two
    with pytest.raises(TierStoreError, match="has 300 MiB free, and the tiers need 512 MiB"):
        check_kv_tier(tier_config(tmp_path))


def test_a_host_tier_beyond_the_available_memory_is_refused(tmp_path, monkeypatch):
    monkeypatch.setattr(psutil, "virtual_memory",
                        lambda: SimpleNamespace(available=1000 * MiB))
    config = tier_config(tmp_path, kv_tier_medium="host", kv_tier_mib=600)
    with pytest.raises(TierStoreError, match=r"host\) cannot be had: the host has 1000 MiB of "
                                             "memory available, and the tiers need 1200 MiB"):
        check_kv_tier(config)
    check_kv_tier(tier_config(tmp_path, kv_tier_medium="host", kv_tier_mib=500))


def test_a_joined_cluster_only_warns(tmp_path, caplog):
    with caplog.at_level(logging.WARNING, logger="cluster.runtime"):
        check_kv_tier(tier_config(tmp_path / "nowhere"), other_nodes=True)
    assert "workers on other nodes may still have it" in caplog.text


def test_serve_says_so_and_exits_before_starting_ray(tmp_path, capsys):
    missing = tmp_path / "nowhere"
    with socket.socket() as probe:  # a free port, so the port check passes
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    assert main(["serve", "--port", str(port), "--kv-tier-mib", "64",
                 "--kv-tier-dir", str(missing)]) == 1
    err = capsys.readouterr().err
    assert f"nalar: cannot serve: the second KV tier (2 x --kv-tier-mib 64, disk) " \
           f"cannot be had: {missing} is not a directory (--kv-tier-dir)" in err
