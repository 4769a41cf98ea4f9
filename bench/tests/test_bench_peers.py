"""bench.peers: gemlite's tuned configs go to the run's own folder, and nowhere when no run set one."""
import json
import os
import sys
import types

from bench import peers


def fake_gemlite(monkeypatch):
    def cache_config(filename):
        with open(filename, "w") as file:
            json.dump({"GEMV": {"(1, 4096, 4096)": {"num_warps": 4}}}, file)

    monkeypatch.setitem(sys.modules, "gemlite", types.SimpleNamespace(cache_config=cache_config))


def test_tuned_configs_go_to_the_runs_folder(tmp_path, monkeypatch):
    fake_gemlite(monkeypatch)
    monkeypatch.setenv(peers.GEMLITE_TUNED, str(tmp_path))
    peers.save_gemlite_tuning()
    assert os.listdir(tmp_path) == [f"{os.getpid()}.json"]


def test_no_run_folder_saves_nothing(tmp_path, monkeypatch):
    fake_gemlite(monkeypatch)
    monkeypatch.delenv(peers.GEMLITE_TUNED, raising=False)
    monkeypatch.chdir(tmp_path)
    peers.save_gemlite_tuning()
    assert os.listdir(tmp_path) == []
