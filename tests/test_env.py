"""Where a measurement ran: the AMX state is asked of the kernel, and every record carries it."""

import ctypes
import platform
from pathlib import Path

import pytest

from specgraft import costs, env


def test_amx_state_agrees_with_the_kernel_and_cpu_flags():
    state = env.amx_state()
    assert state in ("usable", "refused", "absent")
    if platform.system() == "Linux" and platform.machine() == "x86_64":
        libc = ctypes.CDLL(None, use_errno=True)
        mask = ctypes.c_uint64(0)
        assert libc.syscall(env.SYS_ARCH_PRCTL, env.ARCH_GET_XCOMP_SUPP, ctypes.byref(mask)) == 0
        kernel_has_tiles = bool(mask.value >> env.XFEATURE_XTILEDATA & 1)
        assert (state != "absent") == kernel_has_tiles
        if "amx_tile" in env.cpu_flags():  # a listed flag means the kernel enabled the feature
            assert state != "absent"


def test_no_amx_off_linux_x86(monkeypatch):
    monkeypatch.setattr(env.platform, "machine", lambda: "aarch64")
    env.amx_state.cache_clear()
    try:
        assert env.amx_state() == "absent"
    finally:
        env.amx_state.cache_clear()


def test_every_record_names_the_matrix_engine():
    e = env.environment()
    assert e["amx"] == env.amx_state()
    assert e["isa"] in ("avx512_bf16", "avx512", "avx2", platform.machine())
    if "avx512f" in env.cpu_flags():
        assert e["isa"].startswith("avx512")


def test_cost_curves_with_usable_amx_are_kept_apart(monkeypatch):
    monkeypatch.setattr(costs, "amx_state", lambda: "absent")
    plain = costs.machine_key("smollm2-135m", "bfloat16", runtime="threads=2|torch=x")
    assert "amx" not in plain  # machines without AMX keep the keys their caches already use
    monkeypatch.setattr(costs, "amx_state", lambda: "usable")
    assert costs.machine_key("smollm2-135m", "bfloat16", runtime="threads=2|torch=x") == plain + "_amx"


def test_cost_curves_of_cpus_sharing_a_name_are_kept_apart(monkeypatch):
    monkeypatch.setattr(costs, "amx_state", lambda: "absent")
    monkeypatch.setattr(costs, "cpu_name", lambda: "AMD EPYC")
    keys = set()
    for family_model in ("25-1", "26-2"):  # an AVX2-only Milan and an AVX-512 Zen 5, both "AMD EPYC" under KVM
        monkeypatch.setattr(costs, "cpu_id", lambda: family_model)
        keys.add(costs.machine_key("smollm2-135m", "gguf", runtime="threads=2|llama_cpp=x"))
    assert len(keys) == 2


def test_cpu_id_reads_family_and_model():
    cpuinfo = Path("/proc/cpuinfo")
    if not cpuinfo.exists() or "cpu family" not in cpuinfo.read_text():
        pytest.skip("no x86 /proc/cpuinfo here")
    family, model = env.cpu_id().split("-")
    assert family.isdigit() and model.isdigit() and env.environment()["cpu_id"] == env.cpu_id()


def test_usable_amx_means_this_process_holds_the_tile_permission():
    """``usable`` is a grant, not a guess: after it the kernel lists tile data among this process's permitted
    features (ARCH_GET_XCOMP_PERM), which is what a tile instruction needs."""
    if env.amx_state() != "usable":
        pytest.skip(f"AMX is {env.amx_state()} on this machine ({env.cpu_name()})")
    libc = ctypes.CDLL(None, use_errno=True)
    permitted = ctypes.c_uint64(0)
    assert libc.syscall(env.SYS_ARCH_PRCTL, env.ARCH_GET_XCOMP_PERM, ctypes.byref(permitted)) == 0
    assert permitted.value >> env.XFEATURE_XTILEDATA & 1
