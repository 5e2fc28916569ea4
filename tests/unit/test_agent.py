"""The NVML agent (inferlb.ops.agent) against a fake at the pynvml boundary, and the real pynvml on this
GPU-less machine: readings, optional values, older bindings, the no-GPU exit, the DCGM-named metrics."""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from typing import Any

import pynvml
import pytest

from inferlb.adapters import nvml as nv
from inferlb.ops import agent as ag
from inferlb.ops import cli
from inferlb.policy.telemetry import (
    MIB,
    REASON_HW_SLOWDOWN,
    REASON_SW_POWER_CAP,
    REASON_SW_THERMAL,
    parse_dcgm_metrics,
    parse_gpu_report,
)


def nvml_error(code: int) -> Exception:
    # pynvml.NVMLError(code) builds the code's subclass (NVMLError_NotSupported...), as pynvml raises
    err: Exception = pynvml.NVMLError(code)
    return err


@dataclass
class FakeGpu:
    name: str = "NVIDIA H100 80GB HBM3"
    uuid: str = "GPU-11111111-2222-3333-4444-555555555555"
    util: int = 87
    used: int = 60 * 2**30
    total: int = 80 * 2**30
    temperature: int = 66
    reasons: int = 0
    power_mw: int | None = 512_345
    sm_mhz: int | None = 1980
    sm_max_mhz: int | None = 1980
    broken: set[str] = field(default_factory=set)


@dataclass
class _Util:
    gpu: int
    memory: int = 0


@dataclass
class _Mem:
    used: int
    total: int
    free: int = 0


class FakePynvml:
    """The pynvml functions the agent calls, over a list of fake GPUs; errors are pynvml's own."""

    NVMLError = pynvml.NVMLError

    def __init__(
        self, gpus: list[FakeGpu], *, init_error: int | None = None, event_reasons: bool = True
    ) -> None:
        self.gpus = gpus
        self.init_error = init_error
        self.initialised = False
        self.shutdowns = 0
        self.calls: list[str] = []
        self.event_reasons = event_reasons

    def __getattribute__(self, name: str) -> Any:
        # an nvidia-ml-py older than the CUDA 12.2 rename has no nvmlDeviceGetCurrentClocksEventReasons
        if name == "nvmlDeviceGetCurrentClocksEventReasons" and not object.__getattribute__(
            self, "event_reasons"
        ):
            raise AttributeError(name)
        return object.__getattribute__(self, name)

    def _gpu(self, handle: int, call: str) -> FakeGpu:
        self.calls.append(call)
        if not self.initialised:
            raise nvml_error(pynvml.NVML_ERROR_UNINITIALIZED)
        g = self.gpus[handle]
        if call in g.broken:
            raise nvml_error(pynvml.NVML_ERROR_GPU_IS_LOST)
        return g

    def nvmlInit(self) -> None:
        if self.init_error is not None:
            raise nvml_error(self.init_error)
        self.initialised = True

    def nvmlShutdown(self) -> None:
        self.shutdowns += 1
        self.initialised = False

    def nvmlDeviceGetCount(self) -> int:
        return len(self.gpus)

    def nvmlDeviceGetHandleByIndex(self, index: int) -> int:
        if index >= len(self.gpus):
            raise nvml_error(pynvml.NVML_ERROR_INVALID_ARGUMENT)
        return index

    def nvmlDeviceGetName(self, handle: int) -> str:
        return self._gpu(handle, "name").name

    def nvmlDeviceGetUUID(self, handle: int) -> bytes:
        return self._gpu(handle, "uuid").uuid.encode()  # old bindings return bytes

    def nvmlDeviceGetUtilizationRates(self, handle: int) -> _Util:
        return _Util(gpu=self._gpu(handle, "util").util)

    def nvmlDeviceGetMemoryInfo(self, handle: int) -> _Mem:
        g = self._gpu(handle, "memory")
        return _Mem(used=g.used, total=g.total, free=g.total - g.used)

    def nvmlDeviceGetTemperature(self, handle: int, sensor: int) -> int:
        assert sensor == pynvml.NVML_TEMPERATURE_GPU
        return self._gpu(handle, "temperature").temperature

    def nvmlDeviceGetCurrentClocksEventReasons(self, handle: int) -> int:
        return self._gpu(handle, "event_reasons").reasons

    def nvmlDeviceGetCurrentClocksThrottleReasons(self, handle: int) -> int:
        return self._gpu(handle, "throttle_reasons").reasons

    def nvmlDeviceGetPowerUsage(self, handle: int) -> int:
        g = self._gpu(handle, "power")
        if g.power_mw is None:
            raise nvml_error(pynvml.NVML_ERROR_NOT_SUPPORTED)
        return g.power_mw

    def nvmlDeviceGetClockInfo(self, handle: int, clock_type: int) -> int:
        assert clock_type == pynvml.NVML_CLOCK_SM
        g = self._gpu(handle, "clock")
        if g.sm_mhz is None:
            raise nvml_error(pynvml.NVML_ERROR_NOT_SUPPORTED)
        return g.sm_mhz

    def nvmlDeviceGetMaxClockInfo(self, handle: int, clock_type: int) -> int:
        assert clock_type == pynvml.NVML_CLOCK_SM
        g = self._gpu(handle, "max_clock")
        if g.sm_max_mhz is None:
            raise nvml_error(pynvml.NVML_ERROR_NOT_SUPPORTED)
        return g.sm_max_mhz


def opened(fake: FakePynvml) -> FakePynvml:
    assert nv.open_nvml(fake) == len(fake.gpus)
    return fake


def test_the_agent_constants_are_pynvmls() -> None:
    assert nv.NVML_TEMPERATURE_GPU == pynvml.NVML_TEMPERATURE_GPU
    assert nv.NVML_CLOCK_SM == pynvml.NVML_CLOCK_SM
    assert nv.NVML_ERROR_NOT_SUPPORTED == pynvml.NVML_ERROR_NOT_SUPPORTED
    assert nv.NVML_ERROR_FUNCTION_NOT_FOUND == pynvml.NVML_ERROR_FUNCTION_NOT_FOUND
    assert pynvml.nvmlClocksEventReasonSwThermalSlowdown == REASON_SW_THERMAL
    assert pynvml.nvmlClocksThrottleReasonSwPowerCap == REASON_SW_POWER_CAP
    assert pynvml.nvmlClocksThrottleReasonHwSlowdown == REASON_HW_SLOWDOWN


def test_read_gpu_maps_every_nvml_value() -> None:
    nvml = opened(FakePynvml([FakeGpu(reasons=REASON_SW_THERMAL, sm_mhz=990)]))
    g = nv.read_gpu(nvml, 0)
    assert g.index == 0 and g.uuid == "GPU-11111111-2222-3333-4444-555555555555"
    assert g.name == "NVIDIA H100 80GB HBM3"
    assert g.utilization_percent == 87.0
    assert (g.memory_used_bytes, g.memory_total_bytes) == (60 * 2**30, 80 * 2**30)
    assert g.temperature_c == 66.0
    assert g.throttle_reasons == REASON_SW_THERMAL and g.thermal_throttled and not g.power_throttled
    assert g.power_w == pytest.approx(512.345)
    assert g.clock_ratio == pytest.approx(0.5)
    assert "event_reasons" in nvml.calls and "throttle_reasons" not in nvml.calls


def test_unsupported_optional_values_are_none() -> None:
    nvml = opened(FakePynvml([FakeGpu(power_mw=None, sm_mhz=None, sm_max_mhz=None)]))
    g = nv.read_gpu(nvml, 0)
    assert g.power_w is None and g.sm_clock_mhz is None and g.clock_ratio is None
    assert g.utilization_percent == 87.0


def test_older_bindings_fall_back_to_throttle_reasons() -> None:
    nvml = opened(FakePynvml([FakeGpu(reasons=REASON_SW_POWER_CAP)], event_reasons=False))
    g = nv.read_gpu(nvml, 0)
    assert g.power_throttled and "throttle_reasons" in nvml.calls


def test_a_driver_without_the_event_reasons_function_falls_back() -> None:
    class OldDriver(FakePynvml):
        def nvmlDeviceGetCurrentClocksEventReasons(self, handle: int) -> int:
            raise nvml_error(pynvml.NVML_ERROR_FUNCTION_NOT_FOUND)

    nvml = opened(OldDriver([FakeGpu(reasons=REASON_SW_THERMAL)]))
    assert nv.read_gpu(nvml, 0).thermal_throttled


def test_a_gpu_whose_required_read_fails_is_left_out_and_named() -> None:
    nvml = opened(FakePynvml([FakeGpu(), FakeGpu(uuid="GPU-lost", broken={"memory"}), FakeGpu(uuid="GPU-3")]))
    gpus, failed = nv.read_all(nvml, 3)
    assert [g.uuid for g in gpus] == ["GPU-11111111-2222-3333-4444-555555555555", "GPU-3"]
    assert [f.index for f in failed] == [1] and "lost" in failed[0].reason


@pytest.mark.parametrize(
    ("code", "words"),
    [
        (pynvml.NVML_ERROR_LIBRARY_NOT_FOUND, "Library Not Found"),
        (pynvml.NVML_ERROR_DRIVER_NOT_LOADED, "Driver Not Loaded"),
    ],
)
def test_no_driver_is_a_clear_no_gpu_error(code: int, words: str) -> None:
    with pytest.raises(nv.NoGpuError, match=f"no NVIDIA GPU: NVML cannot be initialised.*{words}"):
        nv.open_nvml(FakePynvml([], init_error=code))


def test_no_device_is_a_no_gpu_error_and_nvml_is_shut_down() -> None:
    fake = FakePynvml([])
    with pytest.raises(nv.NoGpuError, match="0 devices"):
        nv.open_nvml(fake)
    assert fake.shutdowns == 1


def test_the_real_pynvml_on_this_machine_reports_no_gpu() -> None:
    nvml = nv.load_pynvml()
    assert nvml is pynvml
    try:
        pynvml.nvmlInit()
    except pynvml.NVMLError:
        pass
    else:
        pynvml.nvmlShutdown()
        pytest.skip("this machine has an NVIDIA driver: the no-GPU path cannot be shown here")
    with pytest.raises(nv.NoGpuError, match=r"^no NVIDIA GPU: NVML cannot be initialised"):
        nv.open_nvml(nvml)


def test_the_agent_cli_exits_1_with_the_reason_when_there_is_no_gpu(
    capsys: pytest.CaptureFixture[str],
) -> None:
    code = cli.main(["agent", "--once", "--no-metrics"])
    err = capsys.readouterr().err
    if code == cli.EXIT_OK:
        pytest.skip("this machine has a GPU")
    assert code == cli.EXIT_FAIL
    assert err.startswith("inferlb agent: no NVIDIA GPU")


def test_the_agent_cli_without_pynvml_installed_says_so(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    import builtins  # noqa: PLC0415

    real_import = builtins.__import__

    def no_pynvml(name: str, *args: Any, **kwargs: Any) -> Any:
        if name == "pynvml":
            raise ImportError("No module named 'pynvml'")
        return real_import(name, *args, **kwargs)

    monkeypatch.setattr(builtins, "__import__", no_pynvml)
    assert cli.main(["agent", "--once", "--no-metrics"]) == cli.EXIT_FAIL
    assert "nvidia-ml-py (pynvml) is not installed" in capsys.readouterr().err


def test_the_agent_cli_once_prints_the_report_from_nvml(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    fake = FakePynvml([FakeGpu(), FakeGpu(uuid="GPU-2", util=12, reasons=REASON_SW_THERMAL)])
    monkeypatch.setattr(nv, "load_pynvml", lambda: fake)
    assert cli.main(["agent", "--once", "--node", "node-7"]) == cli.EXIT_OK
    report = parse_gpu_report(json.loads(capsys.readouterr().out))
    assert report.node == "node-7"
    assert [(g.uuid, g.utilization_percent, g.thermal_throttled) for g in report.gpus] == [
        ("GPU-11111111-2222-3333-4444-555555555555", 87.0, False),
        ("GPU-2", 12.0, True),
    ]
    assert fake.shutdowns == 1


def test_metrics_use_dcgm_names_and_read_back_as_the_same_gpus() -> None:
    nvml = opened(FakePynvml([FakeGpu(), FakeGpu(uuid="GPU-2", reasons=REASON_SW_THERMAL, power_mw=None)]))
    agent = ag.Agent(nvml, 2, ag.AgentSettings(node="n1", url=None, metrics_host=None))
    report = agent.read()
    back = parse_dcgm_metrics(agent.metrics.exposition().decode())
    assert len(back) == 2
    for sent, got in zip(report.gpus, back, strict=True):
        assert got.uuid == sent.uuid and got.name == sent.name and got.index == sent.index
        assert got.utilization_percent == sent.utilization_percent
        assert abs(got.memory_used_bytes - sent.memory_used_bytes) < MIB
        assert abs(got.memory_total_bytes - sent.memory_total_bytes) < MIB
        assert got.throttle_reasons == sent.throttle_reasons
        assert got.clock_ratio == sent.clock_ratio
        assert got.power_w == sent.power_w
    text = agent.metrics.exposition().decode()
    assert 'Hostname="n1"' in text
    assert "inferlb_agent_reports_total" in text
