"""The NVML seam: every GPU reading inferlb takes goes through here (nvidia-ml-py, ``import pynvml``).

For each GPU, :func:`read_gpu` calls:

=====================================  =================================================================
NVML call (pynvml)                     value
=====================================  =================================================================
``nvmlDeviceGetUtilizationRates``      ``.gpu``: percent of the last sample period a kernel ran
``nvmlDeviceGetMemoryInfo``            ``.used`` / ``.total`` (bytes)
``nvmlDeviceGetTemperature``           GPU core temperature (C), sensor ``NVML_TEMPERATURE_GPU``
``nvmlDeviceGetCurrentClocksEvent``    clock throttle reason bit mask (thermal, power; see
``Reasons``                            :mod:`inferlb.policy.telemetry`); older drivers:
                                       ``nvmlDeviceGetCurrentClocksThrottleReasons``
``nvmlDeviceGetPowerUsage``            board power (mW, reported in W)
``nvmlDeviceGetClockInfo`` /           current and maximum SM clock (MHz), ``NVML_CLOCK_SM``
``nvmlDeviceGetMaxClockInfo``
=====================================  =================================================================

Utilization, memory and temperature are required (:func:`read_all` returns a GPU whose required read fails
as a :class:`GpuReadFailed`); power, clocks and throttle reasons are optional (None when the GPU does not
support them, as NVML answers ``NVML_ERROR_NOT_SUPPORTED`` on some boards).

**No GPU.** When pynvml is missing, NVML cannot be initialised (no driver, no library) or there is no device,
:func:`open_nvml` raises :class:`NoGpuError` with the reason; the CLI prints it and exits 1.

**The seam.** Everything here calls NVML through :class:`Pynvml`, a :class:`typing.Protocol` of exactly the
pynvml functions used; :func:`load_pynvml` returns the real module, tests pass a fake implementing the same
functions (raising ``pynvml.NVMLError``).
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Protocol

from inferlb.errors import InferlbError
from inferlb.policy.telemetry import GpuTelemetry, ThrottleReasons

#: pynvml constants, repeated so that this module imports without pynvml (values from nvml.h).
NVML_TEMPERATURE_GPU = 0
NVML_CLOCK_SM = 1
NVML_ERROR_NOT_SUPPORTED = 3
NVML_ERROR_FUNCTION_NOT_FOUND = 13


class NoGpuError(InferlbError):
    """There is no GPU to read: pynvml is not installed, NVML cannot be initialised, or it sees no device."""


class _Utilization(Protocol):
    gpu: int


class _Memory(Protocol):
    used: int
    total: int


class Pynvml(Protocol):
    """The pynvml functions the agent calls (nvidia-ml-py's signatures), and its error class.

    ``NVMLError`` instances carry the NVML return code in ``.value``.
    """

    NVMLError: type[Exception]

    # pynvml's camelCase names, kept so that the real module satisfies this protocol as it is
    def nvmlInit(self) -> None: ...
    def nvmlShutdown(self) -> None: ...
    def nvmlDeviceGetCount(self) -> int: ...
    def nvmlDeviceGetHandleByIndex(self, index: int) -> Any: ...
    def nvmlDeviceGetName(self, handle: Any) -> str | bytes: ...
    def nvmlDeviceGetUUID(self, handle: Any) -> str | bytes: ...
    def nvmlDeviceGetUtilizationRates(self, handle: Any) -> _Utilization: ...
    def nvmlDeviceGetMemoryInfo(self, handle: Any) -> _Memory: ...
    def nvmlDeviceGetTemperature(self, handle: Any, sensor: int) -> int: ...
    def nvmlDeviceGetCurrentClocksEventReasons(self, handle: Any) -> int: ...
    def nvmlDeviceGetCurrentClocksThrottleReasons(self, handle: Any) -> int: ...
    def nvmlDeviceGetPowerUsage(self, handle: Any) -> int: ...
    def nvmlDeviceGetClockInfo(self, handle: Any, clock_type: int) -> int: ...
    def nvmlDeviceGetMaxClockInfo(self, handle: Any, clock_type: int) -> int: ...


def load_pynvml() -> Pynvml:
    """The real ``pynvml`` module (nvidia-ml-py).

    Raises:
        NoGpuError: nvidia-ml-py is not installed.
    """
    try:
        import pynvml  # noqa: PLC0415 - NVML is touched only by the agent, only when it runs
    except ImportError as exc:
        raise NoGpuError(f"nvidia-ml-py (pynvml) is not installed: {exc}") from None
    nvml: Pynvml = pynvml
    return nvml


def open_nvml(nvml: Pynvml) -> int:
    """Initialise NVML and return the number of GPUs (>= 1).

    Raises:
        NoGpuError: ``nvmlInit`` failed (no NVIDIA driver or library: the message gives NVML's reason) or no
            device is visible; NVML is shut down again in the latter case.
    """
    try:
        nvml.nvmlInit()
    except nvml.NVMLError as exc:
        raise NoGpuError(f"no NVIDIA GPU: NVML cannot be initialised ({exc})") from None
    try:
        count = nvml.nvmlDeviceGetCount()
    except nvml.NVMLError as exc:
        close_nvml(nvml)
        raise NoGpuError(f"no NVIDIA GPU: NVML cannot count devices ({exc})") from None
    if count < 1:
        close_nvml(nvml)
        raise NoGpuError("no NVIDIA GPU: NVML sees 0 devices")
    return count


def close_nvml(nvml: Pynvml) -> None:
    """Shut NVML down, ignoring its errors (the agent is stopping either way)."""
    with contextlib.suppress(Exception):
        nvml.nvmlShutdown()


def _text(value: str | bytes) -> str:
    # pynvml returned bytes before nvidia-ml-py 11.515; str since
    return value.decode(errors="replace") if isinstance(value, bytes) else value


@dataclass(frozen=True, kw_only=True)
class GpuReadFailed:
    """Reading GPU ``index`` failed at ``call`` with NVML's message ``reason``."""

    index: int
    call: str
    reason: str


def read_gpu(nvml: Pynvml, index: int) -> GpuTelemetry:
    """Read one GPU (NVML must be initialised).

    Raises:
        Exception: ``nvml.NVMLError`` from a required call (handle, name, UUID, utilization, memory,
            temperature); optional values become None instead.
    """
    h = nvml.nvmlDeviceGetHandleByIndex(index)
    util = nvml.nvmlDeviceGetUtilizationRates(h)
    mem = nvml.nvmlDeviceGetMemoryInfo(h)
    temperature = nvml.nvmlDeviceGetTemperature(h, NVML_TEMPERATURE_GPU)
    reasons_mask = _optional(nvml, lambda: _reasons(nvml, h))
    reasons = ThrottleReasons.from_mask(reasons_mask or 0)
    power_mw = _optional(nvml, lambda: nvml.nvmlDeviceGetPowerUsage(h))
    sm = _optional(nvml, lambda: nvml.nvmlDeviceGetClockInfo(h, NVML_CLOCK_SM))
    sm_max = _optional(nvml, lambda: nvml.nvmlDeviceGetMaxClockInfo(h, NVML_CLOCK_SM))
    return GpuTelemetry(
        index=index,
        uuid=_text(nvml.nvmlDeviceGetUUID(h)),
        name=_text(nvml.nvmlDeviceGetName(h)),
        utilization_percent=float(util.gpu),
        memory_used_bytes=int(mem.used),
        memory_total_bytes=int(mem.total),
        temperature_c=float(temperature),
        throttle_reasons=reasons.mask,
        thermal_throttled=reasons.thermal,
        power_throttled=reasons.power,
        sm_clock_mhz=float(sm) if sm is not None else None,
        max_sm_clock_mhz=float(sm_max) if sm_max is not None else None,
        power_w=power_mw / 1000.0 if power_mw is not None else None,
    )


def _reasons(nvml: Pynvml, handle: Any) -> int:
    """Clock event reasons; the older name on drivers/bindings without the new one (renamed in CUDA 12.2)."""
    try:
        return nvml.nvmlDeviceGetCurrentClocksEventReasons(handle)
    except AttributeError:
        return nvml.nvmlDeviceGetCurrentClocksThrottleReasons(handle)
    except nvml.NVMLError as exc:
        if getattr(exc, "value", None) != NVML_ERROR_FUNCTION_NOT_FOUND:
            raise
        return nvml.nvmlDeviceGetCurrentClocksThrottleReasons(handle)


def _optional(nvml: Pynvml, call: Callable[[], int]) -> int | None:
    """The value of an NVML call a board may not support, or None when NVML refuses it."""
    try:
        return call()
    except nvml.NVMLError:
        return None


def read_all(nvml: Pynvml, count: int) -> tuple[list[GpuTelemetry], list[GpuReadFailed]]:
    """Read GPUs ``0..count-1``; a GPU whose required read fails is returned as a :class:`GpuReadFailed`."""
    gpus: list[GpuTelemetry] = []
    failed: list[GpuReadFailed] = []
    for i in range(count):
        try:
            gpus.append(read_gpu(nvml, i))
        except nvml.NVMLError as exc:
            failed.append(GpuReadFailed(index=i, call="read_gpu", reason=str(exc)))
    return gpus, failed
