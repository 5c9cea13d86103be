"""``moe-bench ep`` on CPU with gloo: a spawned group of two ranks (CI's smoke test), the
torchrun path in this process (a one-rank group from the environment), the argument errors."""

from __future__ import annotations

import json
import os
import socket
import sys

import pytest
import torch.distributed as dist

from moe_tools import cli, ep

pytestmark = pytest.mark.skipif(
    not (dist.is_available() and dist.is_gloo_available()), reason="torch.distributed with gloo"
)


def test_spawned_group_of_two(tmp_path, capsys):
    out = tmp_path / "ep.json"
    argv = ["ep", "--device", "cpu", "--world-sizes", "2", "--shapes", "tiny", "--tokens", "16"]
    assert cli.main([*argv, "--warmup", "1", "--iters", "1", "--json", str(out)]) == 0
    text = capsys.readouterr().out
    assert "dropless" in text and "padded" in text
    rows = {r["mode"]: r for r in json.loads(out.read_text())["rows"]}
    assert set(rows) == set(ep.MODES)
    for row in rows.values():
        assert row["status"] == "ok" and row["world"] == 2 and row["tokens"] == 16
        assert row["ep_ms"] > 0 and row["single_ms"] > 0 and row["sent_mib"] > 0
    dropless = rows["dropless"]
    # exact but for the CPU GEMMs' rounding of other row blocks (docs/expert_parallel.md)
    assert dropless["max_err"] <= 1e-6 and dropless["dropped"] == 0
    padded = rows["padded"]  # capacity 1.25x the mean load: any drop shows in the error
    assert padded["dropped"] > 0 or padded["max_err"] <= 1e-6


def test_torchrun_path_in_process(monkeypatch):
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    env = dict(RANK="0", WORLD_SIZE="1", LOCAL_RANK="0", MASTER_ADDR="127.0.0.1")
    for k, v in {**env, "MASTER_PORT": str(port)}.items():
        monkeypatch.setenv(k, v)
    res = ep.run(device="cpu", shapes=["tiny"], tokens=8, modes=["dropless"], iters=1)
    assert not dist.is_initialized()  # the group it made is gone
    (row,) = res.rows
    assert row["world"] == 1 and row["bitwise"] is True and row["sent_mib"] == 0
    assert res.extra["world_sizes"] == [1]
    with pytest.raises(ValueError, match="torchrun"):
        ep.run(device="cpu", shapes=["tiny"], world_sizes=[2])


def test_other_ranks_are_quiet(monkeypatch):
    monkeypatch.setattr(sys, "stdout", sys.stdout)  # restored afterwards
    for k, v in dict(RANK="1", WORLD_SIZE="2").items():
        monkeypatch.setenv(k, v)
    args = cli.build_parser().parse_args(["ep", "--json", "x.json"])
    ep.quiet_other_ranks(args)
    assert args.json is None and sys.stdout.name == os.devnull


def test_errors(capsys):
    with pytest.raises(ValueError, match="unknown shapes"):
        ep.run(device="cpu", shapes=["huge"])
    with pytest.raises(ValueError, match="unknown shapes"):
        ep.run(device="cpu", modes=["sparse"])
    for bad in (["ep", "--world-sizes", "0"], ["ep", "--capacity-factor", "0"]):
        with pytest.raises(SystemExit):
            cli.build_parser().parse_args(bad)
    capsys.readouterr()
