"""course_lib.measurement.allocator: the pure helpers and the "not on CUDA" results on the CPU; the readings
and the fresh-process probe on a GPU."""

import json
import shutil
import subprocess

import pytest
import torch

from course_lib.measurement import allocator as al
from course_lib.units import MiB

needs_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")


def reading(**kw):
    values = dict(allocated=10 * MiB, reserved=14 * MiB, free=1000 * MiB, total=1600 * MiB)
    return al._Reading(**(values | kw))


# --------------------------------------------------------------------------- pure helpers

def test_reading_derives_what_is_cached():
    r = reading(peak_allocated=12 * MiB, peak_reserved=16 * MiB)
    assert r.cached == 4 * MiB             # reserved - allocated


def test_context_bytes_is_free_memory_taken_beyond_the_reserved():
    after_init = reading(allocated=0, reserved=2 * MiB, free=14000 * MiB, total=15360 * MiB)
    assert al._Probe(False, 14500 * MiB, (("CUDA initialised", after_init),)).context == 498 * MiB


def test_parse_alloc_conf():
    assert al._parse_alloc_conf("") == {}
    assert al._parse_alloc_conf("max_split_size_mb:128, expandable_segments:True") == {
        "max_split_size_mb": "128", "expandable_segments": "True"}
    for bad in ("expandable_segments", ":True"):
        with pytest.raises(ValueError, match="key:value"):
            al._parse_alloc_conf(bad)


def test_alloc_conf_env_keeps_other_options_and_replaces_the_setting():
    env = {"HOME": "/root", "PYTORCH_CUDA_ALLOC_CONF": "max_split_size_mb:128,expandable_segments:False"}
    on = al._alloc_conf_env(env, True)
    assert on == {"HOME": "/root",
                  "PYTORCH_CUDA_ALLOC_CONF": "max_split_size_mb:128,expandable_segments:True"}
    assert env["PYTORCH_CUDA_ALLOC_CONF"].endswith("False")  # a copy: the input is unchanged
    assert al._alloc_conf_env({}, False) == {"PYTORCH_CUDA_ALLOC_CONF": "expandable_segments:False"}
    # the newer generic variable, read first by torch >= 2.8, is updated where it is set
    both = al._alloc_conf_env({"PYTORCH_ALLOC_CONF": "backend:native"}, True)
    assert both == {"PYTORCH_ALLOC_CONF": "backend:native,expandable_segments:True"}


def test_expandable_segments_enabled():
    assert not al._expandable_segments_enabled({})
    assert al._expandable_segments_enabled(al._alloc_conf_env({}, True))
    assert not al._expandable_segments_enabled(al._alloc_conf_env({}, False))
    assert al._expandable_segments_enabled({"PYTORCH_CUDA_ALLOC_CONF": "expandable_segments:true"})
    # PYTORCH_ALLOC_CONF decides when both are set
    assert not al._expandable_segments_enabled({"PYTORCH_ALLOC_CONF": "backend:native",
                                               "PYTORCH_CUDA_ALLOC_CONF": "expandable_segments:True"})


def probe_data(expandable):
    stages = [("CUDA initialised", dict(allocated=0, reserved=0, free=14000 * MiB, total=15360 * MiB)),
              ("first matmul", dict(allocated=8 * MiB, reserved=30 * MiB, free=13900 * MiB,
                                    total=15360 * MiB)),
              ("growing requests", dict(allocated=68 * MiB, reserved=(90 if expandable else 398) * MiB,
                                        free=(13840 if expandable else 13532) * MiB, total=15360 * MiB)),
              ("empty_cache", dict(allocated=8 * MiB, reserved=30 * MiB, free=13900 * MiB,
                                   total=15360 * MiB))]
    return {"available": True, "expandable_segments": expandable, "free_before_init": 14400 * MiB,
            "stages": stages}


def test_probe_from_the_processes_json():
    default = al._Probe.from_dict(json.loads(json.dumps(probe_data(False))))
    expandable = al._Probe.from_dict(probe_data(True))
    assert default.context == 400 * MiB       # 14400 - 14000 - 0
    assert default.cublas_workspace == 8 * MiB
    assert default.library_code == (14400 - 13900 - 30 - 400) * MiB
    assert default.fragmentation == 330 * MiB and expandable.fragmentation == 22 * MiB
    name, allocated, reserved, process, outside = default.rows()[2]
    assert (name, process, outside) == ("growing requests", 868 * MiB, 470 * MiB)
    assert "process (smi)" in default.table() and "growing requests" in default.table()
    assert default.stage("empty_cache").reserved == 30 * MiB
    with pytest.raises(ValueError, match="name must be one of"):
        default.stage("later")


# --------------------------------------------------------------------------- not on CUDA

def test_not_on_cuda_is_falsy_and_says_why():
    missing = al._not_on_cuda("cpu")
    assert not missing and str(missing).startswith("not on CUDA") and "cpu" in missing.reason
    with pytest.raises(ValueError, match="device"):
        al._not_on_cuda(object())


@pytest.mark.skipif(torch.cuda.is_available(), reason="the CPU path")
def test_without_cuda_every_measurement_returns_not_on_cuda():
    for result in (al._read(), al.probe(), al.probe(True)):
        assert isinstance(result, al._NotOnCUDA) and not result
        assert "no CUDA device" in result.reason
    data = al._measure(123, 0, (1, 2))  # what the probing process prints
    assert data == {"available": False, "reason": al._not_on_cuda(0).reason}


def test_bad_arguments():
    with pytest.raises(ValueError, match="expandable_segments"):
        al.probe("True")
    with pytest.raises(ValueError, match="device"):
        al.probe(device=-1)
    with pytest.raises(ValueError, match="sizes_mib"):
        al.probe(sizes_mib=(32, 0))


# --------------------------------------------------------------------------- on a GPU

@pytest.mark.gpu
@needs_cuda
def test_read_on_cuda():
    r = al._read()
    assert r.total == torch.cuda.get_device_properties(0).total_memory and r.reserved >= r.allocated
    x = torch.ones(1024, 1024, device="cuda")
    torch.cuda.reset_peak_memory_stats()
    before = al._read()
    (x @ x).sum().item()
    after = al._read()
    assert after.peak_allocated >= before.allocated + 4 * MiB  # the product
    assert after.peak_reserved >= after.peak_allocated
    assert after.total - after.free >= after.reserved  # nvidia-smi's Memory-Usage


@pytest.mark.gpu
@needs_cuda
def test_probe_sees_context_workspace_and_expandable_segments():
    default, expandable = al.probe(False), al.probe(True)
    assert not default.expandable_segments and expandable.expandable_segments
    assert default.context > 50 * MiB            # hundreds of MiB on every card seen so far
    assert default.cublas_workspace > 0
    # eight growing requests of 32..60 MiB: each a new segment by default; one growing segment
    assert default.fragmentation >= 200 * MiB
    assert expandable.fragmentation < default.fragmentation / 2
    assert default.stage("empty_cache").reserved < default.stage("growing requests").reserved


# --------------------------------------------------------------------------- nvidia-smi

@needs_cuda
def test_smi_total_is_above_what_pytorch_reports():
    if shutil.which("nvidia-smi") is None:
        pytest.skip("no nvidia-smi here")
    props = torch.cuda.get_device_properties(0)
    smi = subprocess.run(["nvidia-smi", f"--id=GPU-{props.uuid}", "--query-gpu=memory.total",
                          "--format=csv,noheader,nounits"], capture_output=True, text=True,
                         check=True).stdout
    assert int(smi) * MiB >= props.total_memory
