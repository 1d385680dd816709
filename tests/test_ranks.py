"""course_lib.distributed.ranks: starting ranks on gloo, and failing cleanly (errors, time limits, workers
that cannot be imported, no process left behind)."""

import importlib
import sys
import time

import pytest
import torch
from process_tools import alive

from course_lib.distributed.ranks import Ranks, _check_importable, _free_port
from course_lib.distributed.workers import all_reduce_demo

WORLD = 2


def _fails_on_rank_1(rank, world_size):
    if rank == 1:
        raise ArithmeticError("rank 1 gives up")
    torch.distributed.barrier()  # rank 0 waits for a peer that is gone


def _sleeps(rank, world_size):
    time.sleep(600)


def test_a_failing_rank_reports_its_traceback_and_stops_the_others():
    ranks = Ranks(WORLD, timeout=120)
    pids = ranks.pids
    with pytest.raises(RuntimeError, match=r"(?s)rank 1 of 2 failed.*ArithmeticError: rank 1 give"):
        ranks.run(_fails_on_rank_1)
    assert ranks.closed and not any(alive(pid) for pid in pids)
    with pytest.raises(ValueError, match="closed"):
        ranks.run(all_reduce_demo)


def test_a_run_past_its_time_limit_is_stopped():
    ranks = Ranks(WORLD, timeout=120)
    pids = ranks.pids
    ranks.run(all_reduce_demo)  # started and joined
    start = time.monotonic()
    with pytest.raises(TimeoutError, match="within 1.0 s"):
        ranks.run(_sleeps, timeout=1)
    assert time.monotonic() - start < 30
    assert ranks.closed and not any(alive(pid) for pid in pids)


def _local_function(rank, world_size):
    def inner():
        pass
    return inner


@pytest.mark.parametrize("worker", [lambda r, w: None, _local_function(0, 1), 42],
                         ids=["lambda", "nested", "not-callable"])
def test_workers_that_cannot_be_imported_are_refused(worker):
    with pytest.raises(ValueError, match="worker must be"):
        _check_importable(worker)


def test_a_notebook_function_is_refused_with_the_reason():
    def notebook_function(rank, world_size):
        return rank
    notebook_function.__module__ = "__main__"
    with pytest.raises(ValueError, match="notebook cell"):
        _check_importable(notebook_function)


def test_a_worker_written_beside_the_notebook_runs_as_edited(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    monkeypatch.setattr(sys, "path", ["", *sys.path])  # a kernel imports from its folder
    source = "def worker(rank, world_size):\n    return {}\n"
    (tmp_path / "edited_worker.py").write_text(source.format("rank"))
    try:
        worker = importlib.import_module("edited_worker").worker
        with Ranks(WORLD) as ranks:
            assert ranks.run(worker) == [0, 1]
            (tmp_path / "edited_worker.py").write_text(source.format("10 * rank + 5"))
            assert ranks.run(worker) == [5, 15]  # the edit runs, not the first import
    finally:
        sys.modules.pop("edited_worker", None)


@pytest.mark.parametrize("kwargs,name", [({"world_size": 0}, "world_size"),
                                         ({"world_size": 2.0}, "world_size"),
                                         ({"world_size": 99}, "world_size"),
                                         ({"timeout": 0}, "timeout"),
                                         ({"timeout": "1"}, "timeout")])
def test_bad_arguments_raise_value_error_naming_them(kwargs, name):
    with pytest.raises(ValueError, match=name):
        Ranks(**kwargs)


def test_free_port_is_a_port():
    assert 0 < _free_port() < 65536
