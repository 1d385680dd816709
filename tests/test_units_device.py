import pytest
import torch

from course_lib import device, units


@pytest.mark.parametrize("dtype,size", [(torch.float32, 4), ("bf16", 2), ("fp16", 2),
                                       (torch.float64, 8), ("int8", 1)])
def test_dtype_bytes_matches_torch(dtype, size):
    assert units.dtype_bytes(dtype) == size


@pytest.mark.parametrize("bad", ["fp8", "float", 4, None])
def test_bad_dtype_names_the_allowed_values(bad):
    with pytest.raises(ValueError, match="dtype must be"):
        units.dtype_bytes(bad)


# --- distinct storages ----------------------------------------------------------------------

def _numel_bytes(tensors) -> int:
    """Independent count for tensors that each own a whole storage: numel * element_size."""
    return sum(t.numel() * t.element_size() for t in tensors)


@pytest.mark.parametrize("device", ["cpu", "meta"])
def test_storage_bytes_of_distinct_tensors_is_their_numel_times_element_size(device):
    tensors = [torch.empty(shape, dtype=dtype, device=device) for shape, dtype in (
        ((3, 4), torch.float32), ((7,), torch.bfloat16), ((2, 5), torch.float64),
        ((11,), torch.int8), ((0,), torch.float32), ((0,), torch.float16))]
    assert units.storage_bytes(tensors) == _numel_bytes(tensors) == 48 + 14 + 80 + 11
    assert units.storage_bytes(iter(tensors)) == units.storage_bytes(tensors)  # any iterable
    assert units.storage_bytes([]) == 0


@pytest.mark.parametrize("device", ["cpu", "meta"])
def test_views_of_one_storage_count_once_and_whole(device):
    base = torch.empty(10, 10, device=device)
    views = [base, base[2:5], base.t(), base.view(100), base[0, 3:4], base.detach()]
    assert units.storage_bytes(views) == 400
    assert units.storage_bytes([base[2:5]]) == 400  # the part a view shows is not the memory
    assert len({units.storage_key(v) for v in views}) == 1
    assert units.storage_key(base.untyped_storage()) == units.storage_key(base)


def test_meta_storages_are_told_apart_where_their_data_pointers_are_not():
    a, b = torch.empty(8, device="meta"), torch.empty(8, device="meta")
    assert a.untyped_storage().data_ptr() == b.untyped_storage().data_ptr() == 0
    assert units.storage_key(a) != units.storage_key(b)
    assert units.storage_bytes([a, b, a[4:]]) == 64


def test_storage_bytes_mixes_devices_and_parameters():
    weight = torch.nn.Parameter(torch.zeros(6))
    tensors = [weight, weight.t(), torch.zeros(6), torch.zeros(6, device="meta")]
    assert units.storage_bytes(tensors) == 3 * 24


@pytest.mark.parametrize("sizes,block,expected", [([1], 512, 512), ([512], 512, 512),
                                                   ([513, 40], 512, 1024 + 512), ([3], 1, 3),
                                                   ([0], 512, 0)])
def test_storage_bytes_rounds_each_storage_to_the_block(sizes, block, expected):
    tensors = [torch.empty(n, dtype=torch.int8) for n in sizes]
    assert units.storage_bytes(tensors + [t[1:] for t in tensors if t.numel() > 1],
                               block=block) == expected


@pytest.mark.gpu
def test_storage_bytes_on_cuda_and_the_cpu_together():
    gpu, cpu = torch.zeros(100, device="cuda"), torch.zeros(100)
    assert units.storage_bytes([gpu, gpu[10:], cpu, cpu.view(10, 10)]) == 800
    assert units.storage_key(gpu) != units.storage_key(cpu)


@pytest.mark.parametrize("bad,match", [
    (torch.zeros(3), "tensors must be an iterable"), (3, "tensors must be an iterable"),
    ([torch.zeros(3), "x"], "tensors must hold torch.Tensors"),
    ([torch.zeros(2, 2).to_sparse()], "tensors must have storages"),
])
def test_storage_bytes_rejects_what_it_cannot_count(bad, match):
    with pytest.raises(ValueError, match=match):
        units.storage_bytes(bad)


def test_storage_key_and_block_name_the_parameter():
    with pytest.raises(ValueError, match="tensor must be a torch.Tensor"):
        units.storage_key([1])
    with pytest.raises(ValueError, match="tensor must have a storage"):
        units.storage_key(torch.zeros(2, 2).to_sparse())
    for block in (0, 1.5, True):
        with pytest.raises(ValueError, match="block"):
            units.storage_bytes([torch.zeros(1)], block=block)


@pytest.mark.parametrize("n,text", [(0, "0 B"), (1023, "1023 B"), (1536, "1.50 KiB"),
                                    (3 * 2**20, "3.00 MiB"), (80 * 10**9, "74.51 GiB"),
                                    (-2048, "-2.00 KiB")])
def test_format_bytes_uses_binary_units(n, text):
    assert units.format_bytes(n) == text


def test_pick_device_prefers_available_and_rejects_unknown():
    expected = "cuda" if torch.cuda.is_available() else (
        "mps" if device._mps_available() else "cpu")
    assert device.pick_device().type == expected
    assert device.pick_device("cpu").type == "cpu"
    with pytest.raises(ValueError, match="prefer must be one of"):
        device.pick_device("tpu")
    if not torch.cuda.is_available():
        with pytest.raises(ValueError, match="no cuda device"):
            device.pick_device("cuda")


def test_pick_dtype_rules(monkeypatch):
    assert device.pick_dtype("cpu") == torch.float32
    monkeypatch.setattr(device, "_cuda_has_native_bf16", lambda d="cuda": True)
    assert device.pick_dtype("cuda") == torch.bfloat16
    monkeypatch.setattr(device, "_cuda_has_native_bf16", lambda d="cuda": False)
    assert device.pick_dtype("cuda") == torch.float16  # a T4
    assert device.needs_grad_scaler(torch.float16)
    assert not device.needs_grad_scaler(torch.bfloat16)
    with pytest.raises(ValueError, match="device must be"):
        device.pick_dtype("meta")


def test_t4_capability_has_no_native_bf16(monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda d=None: (7, 5))
    assert not device._cuda_has_native_bf16()
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda d=None: (9, 0))
    assert device._cuda_has_native_bf16()


# --------------------------------------------------------------------------- GPU presets

def test_gpu_presets_hold_the_memory_pytorch_reports():
    """PyTorch's total_memory (MiB), the lowest figure published for each card, and nvidia-smi's
    "Total" beside it; not the decimal GB on the box."""
    torch_mib = {"T4": 14930, "L4": 22563, "A100 40GB": 40536, "A100 80GB": 81050,
                 "H100 80GB": 80998, "H200": 143156}
    smi_mib = {"T4": 15360, "L4": 23034, "A100 40GB": 40960, "A100 80GB": 81920,
               "H100 80GB": 81559, "H200": 143771}
    assert {name: gpu.total_memory for name, gpu in device.GPUS.items()} == {
        name: mib * 2**20 for name, mib in torch_mib.items()}
    assert {name: gpu.smi_memory for name, gpu in device.GPUS.items()} == {
        name: mib * 2**20 for name, mib in smi_mib.items()}
    # DESIGN.md's ranges of what PyTorch reports: a Colab T4 14.56-14.75 GiB, an A100 80GB
    # 79.15-79.25 GiB, an H100 80GB about 79.1 GiB; each a few hundred MiB under nvidia-smi
    gib = {name: gpu.total_memory / 2**30 for name, gpu in device.GPUS.items()}
    assert 14.56 <= gib["T4"] <= 14.75 and 79.15 <= gib["A100 80GB"] <= 79.25
    # out-of-memory messages on H100 80GB cards report 79.10-79.11 GiB: the lowest, to 2 places
    assert f"{gib['H100 80GB']:.2f}" == "79.10"
    assert all(100 * 2**20 < g.smi_memory - g.total_memory < 1024 * 2**20
               for g in device.GPUS.values())
    assert {name: gpu.capability for name, gpu in device.GPUS.items()} == {
        "T4": (7, 5), "L4": (8, 9), "A100 40GB": (8, 0), "A100 80GB": (8, 0),
        "H100 80GB": (9, 0), "H200": (9, 0)}


def test_smi_memory_is_at_least_what_pytorch_reports():
    with pytest.raises(ValueError, match="smi_memory"):
        device.GPU("x", 2 * 2**30, (8, 0), smi_memory=2**30)


def test_presets_carry_their_datasheet_speeds():
    for name, gpu in device.GPUS.items():
        assert gpu.fp32_flops < gpu.tensor_flops, name
        assert 1e11 < gpu.memory_bandwidth < 1e13, name
    # the dense tensor figure is the datasheet's sparse one halved where it quotes only that
    assert device.GPUS["H100 80GB"].tensor_flops == pytest.approx(1979e12 / 2, rel=1e-3)
    assert device.GPUS["A100 80GB"].tensor_flops == 312e12  # quoted dense
    assert device.GPU("x", 2**30, (8, 0)).tensor_flops is None  # optional: old calls still work


def test_presets_carry_their_links():
    gpus = device.GPUS
    for name, gpu in gpus.items():
        # the host link is the board's PCIe x16; the peer link at least that (NVLink on SXM)
        assert gpu.host_link in device.PCIE_BYTES_PER_S.values(), name
        assert gpu.peer_link >= gpu.host_link, name
    assert gpus["T4"].host_link == 15.75e9  # PCIe 3.0 x16: 8 GT/s x 16 lanes x 128/130 / 8
    assert gpus["A100 80GB"].peer_link == 300e9  # NVLink 3: 600 GB/s both ways


def test_pick_dtype_of_a_preset():
    assert device.pick_dtype(device.GPUS["T4"]) == torch.float16
    for name in ("L4", "A100 40GB", "A100 80GB", "H100 80GB", "H200"):
        assert device.pick_dtype(device.GPUS[name]) == torch.bfloat16, name


def test_resolve_gpu():
    assert device.resolve_gpu(None) is None and device.resolve_gpu("cpu") is None
    assert device.resolve_gpu("T4") is device.GPUS["T4"]
    custom = device.GPU("my card", 8 * 2**30, (8, 6))
    assert device.resolve_gpu(custom) is custom
    for bad in ("V100", "t4", 16, ("T4",)):
        with pytest.raises(ValueError, match="gpu must be"):
            device.resolve_gpu(bad)
    if not torch.cuda.is_available():
        with pytest.raises(ValueError, match="no CUDA device"):
            device.resolve_gpu("cuda")


@pytest.mark.parametrize("kwargs,match", [
    (dict(total_memory=0), "total_memory"), (dict(total_memory=1.5e9), "total_memory"),
    (dict(capability=8), "capability"), (dict(capability=(8, "0")), "capability"),
    (dict(fp32_flops=0), "fp32_flops"), (dict(tensor_flops="fast"), "tensor_flops"),
    (dict(memory_bandwidth=-1.0), "memory_bandwidth"), (dict(host_link=0), "host_link"),
    (dict(peer_link=float("inf")), "peer_link")])
def test_gpu_validation(kwargs, match):
    args = dict(name="x", total_memory=2**30, capability=(8, 0)) | kwargs
    with pytest.raises(ValueError, match=match):
        device.GPU(**args)


@pytest.mark.gpu
def test_live_gpu_reads_the_device():
    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA device")
    gpu = device.live_gpu()
    props = torch.cuda.get_device_properties(0)
    assert gpu.live and gpu.total_memory == props.total_memory
    assert gpu.capability == (props.major, props.minor)
    assert 0 < gpu.free_memory <= gpu.total_memory
    assert device.pick_dtype(gpu) == device.pick_dtype("cuda")


def test_positive_int_takes_integers_as_integer_does():
    import numpy as np

    from course_lib.validation import integer, positive_int

    for value in (3, np.int64(3), np.int32(3), torch.tensor(3)):
        assert positive_int("n", value) == integer("n", value) == 3
        assert type(positive_int("n", value)) is int
    for bad in (0, -1, True, 3.0, np.float64(3), torch.tensor(3.0), torch.tensor([3]), "3", None):
        with pytest.raises(ValueError, match="n must be a positive int"):
            positive_int("n", bad)
    with pytest.raises(ValueError, match="at most 4"):
        positive_int("n", np.int64(5), maximum=4)


def test_tolerances_are_exact_on_the_cpu_and_loose_on_gpus():
    cpu, cuda = device.tolerance("cpu"), device.tolerance(torch.device("cuda:0"))
    assert (cpu.memory, cpu.deterministic) == (0.0, True)
    assert cuda.memory == 0.05 and not cuda.deterministic and cuda.flat > cpu.flat
    assert device.tolerance("mps").memory >= cuda.memory
    for bad in ("gpu", 3, None, "meta"):
        with pytest.raises(ValueError, match="device"):
            device.tolerance(bad)
