"""Where a measurement ran: CPU, threads, library versions, commit and whether the tree was dirty."""

from __future__ import annotations

import ctypes
import functools
import importlib.metadata as md
import os
import platform
import subprocess
from pathlib import Path

import torch
import transformers


def cpu_fields() -> dict[str, str]:
    """The first CPU's block of /proc/cpuinfo (``model name``, ``cpu family``, ``model``, ``flags``, ...);
    empty where there is none."""
    fields: dict[str, str] = {}
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            key, _, value = line.partition(":")
            if not key.strip():  # the end of the first CPU's block
                break
            fields.setdefault(key.strip(), value.strip())
    except OSError:
        pass
    return fields


def cpu_name() -> str:
    return cpu_fields().get("model name") or platform.processor() or platform.machine()


def cpu_id() -> str:
    """``family-model`` of the first CPU (``25-1``), empty where /proc/cpuinfo does not say: one model name
    ("AMD EPYC" under KVM) covers CPUs with and without AVX-512, whose cost curves differ."""
    fields = cpu_fields()
    return f"{fields['cpu family']}-{fields['model']}" if "cpu family" in fields and "model" in fields else ""


# Linux x86-64 arch_prctl: which extended-state features the kernel supports, and the per-process permission a
# process must request before its first AMX tile instruction (without it, that instruction faults).
# (asm/prctl.h: 0x1021 asks what the kernel supports, 0x1022 what this process is already permitted, which is no
# dynamic feature before the request: an earlier version read 0x1022 as "supported" and called AMX absent.)
SYS_ARCH_PRCTL = 158
ARCH_GET_XCOMP_SUPP, ARCH_GET_XCOMP_PERM, ARCH_REQ_XCOMP_PERM = 0x1021, 0x1022, 0x1023
XFEATURE_XTILEDATA = 18


@functools.cache
def amx_state() -> str:
    """``usable`` (the kernel supports AMX tile data and granted this process permission), ``refused`` (supported,
    permission denied), ``absent`` (no AMX, or not Linux x86-64). Asked of the kernel, not read from
    /proc/cpuinfo: a hypervisor may hide the flag on a CPU whose tiles work, and the permission is what a process
    needs anyway (oneDNN requests the same)."""
    if platform.system() != "Linux" or platform.machine() != "x86_64":
        return "absent"
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        supported = ctypes.c_uint64(0)
        if libc.syscall(SYS_ARCH_PRCTL, ARCH_GET_XCOMP_SUPP, ctypes.byref(supported)) != 0:
            return "absent"  # a kernel without the extended-state interface
        if not supported.value >> XFEATURE_XTILEDATA & 1:
            return "absent"
        return "usable" if libc.syscall(SYS_ARCH_PRCTL, ARCH_REQ_XCOMP_PERM, XFEATURE_XTILEDATA) == 0 else "refused"
    except (OSError, AttributeError):
        return "absent"


def cpu_flags() -> set[str]:
    """The first CPU's feature flags from /proc/cpuinfo (empty elsewhere)."""
    return set(cpu_fields().get("flags", "").split())


def vector_isa() -> str:
    """The widest vector extension the CPU reports: what a matmul falls back to without AMX."""
    flags = cpu_flags()
    for isa, flag in (("avx512_bf16", "avx512_bf16"), ("avx512", "avx512f"), ("avx2", "avx2")):
        if flag in flags:
            return isa
    return platform.machine()


@functools.cache
def packed_path(dtype: torch.dtype) -> bool:
    """Whether oneDNN reorders a ``dtype`` weight into its packed layout on this CPU, asked of PyTorch on a tiny
    weight (what it decides by, rather than the CPU flags): bf16 needs AVX-512 (BW, VL, DQ), AMX or
    AVX-NE-CONVERT, and on an AVX2-only CPU the reorder raises. False on a PyTorch without the oneDNN ops."""
    mkldnn = torch.ops.mkldnn
    if not torch.backends.mkldnn.is_available() or not hasattr(mkldnn, "_reorder_linear_weight"):
        return False
    try:
        mkldnn._reorder_linear_weight(torch.zeros(16, 16, dtype=dtype), 1)
    except (RuntimeError, AttributeError):
        return False
    return True


def bf16_path() -> bool:
    """oneDNN's packed bf16 path exists on this CPU (:func:`packed_path`); without it bf16 arithmetic is
    emulated, and callers choosing a dtype for speed pick fp32 (``models.resolve_dtype``)."""
    return packed_path(torch.bfloat16)


def git(*args: str) -> str | None:
    try:
        return subprocess.run(["git", *args], capture_output=True, text=True, timeout=5,
                              cwd=Path(__file__).resolve().parent).stdout.strip()
    except (OSError, subprocess.SubprocessError):
        return None


def environment() -> dict:
    status = git("status", "--porcelain", "--untracked-files=no")
    return {"cpu": cpu_name(), "cpu_id": cpu_id(), "amx": amx_state(), "isa": vector_isa(), "cores": os.cpu_count(),
            "threads": torch.get_num_threads(),
            "python": platform.python_version(), "torch": torch.__version__,
            "transformers": transformers.__version__, "specgraft": md.version("specgraft"),
            "commit": git("rev-parse", "--short", "HEAD") or None, "dirty": None if status is None else bool(status)}
