"""The GPUs, through NVML (the nvidia-ml-py package, `import pynvml`).

Each visible device must answer, and show none of the faults that only a GPU reset clears:
uncorrectable ECC errors since the driver loaded (the volatile counter), memory pages pending
retirement (before Ampere), rows pending remapping or a failed remapping (Ampere and later).
A query the device does not support is no fault. Visible means the indices listed in
CUDA_VISIBLE_DEVICES, as NVML numbers them (CUDA numbers them the same way under
CUDA_DEVICE_ORDER=PCI_BUS_ID); every device when it is unset or names devices by UUID.

Without NVML (no NVIDIA driver or library: a CPU machine) the check is skipped. NVML is shut
down again after every check.
"""

from __future__ import annotations

import contextlib
import os
import time
from typing import Any

from resilient.health.report import CheckResult, failed_check, ok_check, skipped_check

__all__ = ["check_gpus", "visible_indices"]

NAME = "gpu"
THRESHOLD = (
    "every visible GPU answers NVML, with no uncorrectable volatile ECC errors and no pages or "
    "rows pending retirement"
)
FIX = (
    "drain this node and reset the GPU (nvidia-smi -r, or reboot): uncorrectable ECC errors and "
    "pending retirements clear only with a reset; replace the GPU if they come back"
)
FIX_DRIVER = (
    "fix the NVIDIA driver on this node (a driver and library version mismatch needs a reboot "
    "after an upgrade; permissions on /dev/nvidia*)"
)


def check_gpus() -> CheckResult:
    t0 = time.perf_counter()
    try:
        import pynvml
    except ImportError:
        return skipped_check(NAME, t0, "nvidia-ml-py is not installed")
    try:
        pynvml.nvmlInit()
    except pynvml.NVMLError as e:
        absent = (pynvml.NVML_ERROR_LIBRARY_NOT_FOUND, pynvml.NVML_ERROR_DRIVER_NOT_LOADED)
        if getattr(e, "value", None) in absent:
            return skipped_check(NAME, t0, f"no NVIDIA driver here (NVML: {e})")
        return failed_check(NAME, t0, f"NVML does not start: {e}", THRESHOLD, FIX_DRIVER)
    try:
        return _check_devices(pynvml, t0)
    finally:
        with contextlib.suppress(pynvml.NVMLError):
            pynvml.nvmlShutdown()


def visible_indices(count: int, listed: str | None) -> tuple[list[int], str]:
    """The NVML indices to check among `count` devices, given CUDA_VISIBLE_DEVICES (`listed`),
    and how they were chosen. CUDA stops reading the list at the first negative index."""
    every = list(range(count))
    if listed is None:
        return every, "all devices"
    entries = [s.strip() for s in listed.split(",") if s.strip()]
    if not all(s.lstrip("-").isdigit() for s in entries):
        return every, "all devices (CUDA_VISIBLE_DEVICES names devices by UUID)"
    indices: list[int] = []
    for s in entries:
        if int(s) < 0:
            break
        indices.append(int(s))
    return indices, f"CUDA_VISIBLE_DEVICES={listed}"


def _check_devices(nvml: Any, t0: float) -> CheckResult:
    try:
        count = int(nvml.nvmlDeviceGetCount())
    except nvml.NVMLError as e:
        return failed_check(NAME, t0, f"NVML cannot count the devices: {e}", THRESHOLD, FIX)
    indices, chosen = visible_indices(count, os.environ.get("CUDA_VISIBLE_DEVICES"))
    if not indices:
        return skipped_check(NAME, t0, f"no GPU visible ({chosen})")
    problems: list[str] = []
    for i in indices:
        if i >= count:
            problems.append(f"device {i} ({chosen}) is missing: NVML sees {count}")
            continue
        problems += [f"device {i}: {p}" for p in _device_problems(nvml, i)]
    if problems:
        return failed_check(NAME, t0, "; ".join(problems), THRESHOLD, FIX)
    names = ", ".join(str(i) for i in indices)
    return ok_check(NAME, t0, f"{len(indices)} device(s) healthy: {names} ({chosen})", THRESHOLD)


def _device_problems(nvml: Any, index: int) -> list[str]:
    try:
        handle = nvml.nvmlDeviceGetHandleByIndex(index)
    except nvml.NVMLError as e:
        return [f"does not answer ({e})"]
    found: list[str] = []
    ecc = _query(
        nvml,
        found,
        "uncorrectable ECC count",
        lambda: nvml.nvmlDeviceGetTotalEccErrors(
            handle, nvml.NVML_MEMORY_ERROR_TYPE_UNCORRECTED, nvml.NVML_VOLATILE_ECC
        ),
    )
    if ecc:
        found.append(f"{int(ecc)} uncorrectable ECC error(s) since the driver loaded")
    pending = _query(
        nvml,
        found,
        "retired pages",
        lambda: nvml.nvmlDeviceGetRetiredPagesPendingStatus(handle),
    )
    if pending == nvml.NVML_FEATURE_ENABLED:
        found.append("memory pages pending retirement")
    remapped = getattr(nvml, "nvmlDeviceGetRemappedRows", None)
    rows = _query(nvml, found, "remapped rows", lambda: remapped(handle)) if remapped else None
    if rows is not None:
        _corrected, _uncorrected, rows_pending, rows_failed = rows
        if rows_pending:
            found.append("memory rows pending remapping")
        if rows_failed:
            found.append("a memory row remapping failed")
    return found


def _query(nvml: Any, found: list[str], what: str, call: Any) -> Any:
    """`call()`; None when the device does not support it, and a problem noted in `found`
    when it fails otherwise."""
    unsupported = {
        nvml.NVML_ERROR_NOT_SUPPORTED,
        getattr(nvml, "NVML_ERROR_FUNCTION_NOT_FOUND", nvml.NVML_ERROR_NOT_SUPPORTED),
    }
    try:
        return call()
    except nvml.NVMLError as e:
        if getattr(e, "value", None) not in unsupported:
            found.append(f"{what} query failed ({e})")
        return None
