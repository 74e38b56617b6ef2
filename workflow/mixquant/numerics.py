"""The CPU numerics profile: the same bits from every x86-64 CPU with AVX2, and from every aarch64 CPU.

A bf16 forward on CPU runs through three libraries whose code path depends on the host: ATen's own
kernels (chosen by its CPU capability: AVX2 vs AVX512), MKL (its conditional numerical
reproducibility mode; ``MKL_CBWR=AVX2`` is ignored on non-Intel CPUs, ``COMPATIBLE`` applies on any
vendor) and oneDNN (PyTorch sends bf16 Linear layers to it only on hosts whose oneDNN ISA is AVX512 or
more). The ``portable`` profile pins all three and the thread counts; ``native`` leaves the host's
defaults (faster, and the host's ISA then enters the keys).

The libraries read these settings lazily, so :func:`enter` sets the environment (overriding what the
shell exported) and then checks what is *effective*: ATen's capability and MKL's CBWR mode as the
libraries report them. A process where they differ from the profile stops with one line. The profile
is recorded in every manifest and in the engine info (:func:`fingerprint`) and enters the keys of the
stages whose numbers it decides (:func:`key_identity`).
"""

from __future__ import annotations

import contextlib
import ctypes
import os
import platform
import sys
from collections.abc import Iterator
from functools import cache
from pathlib import Path
from typing import Any

from mixquant.jsonio import diff_values

PROFILES = ("portable", "native")
DEFAULT_THREADS = 1

# MKL's CBWR branch codes (mkl_cbwr.h): what mkl_cbwr_get(MKL_CBWR_ALL) reports.
MKL_CBWR_ALL = 1
MKL_CBWR_NAMES = {0: "OFF", 1: "BRANCH_OFF", 2: "AUTO", 3: "COMPATIBLE", 4: "SSE2", 9: "AVX2", 10: "AVX512"}
PORTABLE_CAPABILITY = "AVX2"
PORTABLE_CBWR = "COMPATIBLE"


class NumericsError(RuntimeError):
    """The process does not compute under the profile it was asked for (one line)."""


# aarch64 (Grace, Graviton): ATen's DEFAULT capability is its NEON build on every aarch64 CPU (SVE256 only
# where SVE vectors are 256 bits wide: Graviton3, not Grace's 128), there is no MKL, and oneDNN is off under
# the profile; so one aarch64 profile gives the same bits on every aarch64 host -- others than x86-64's, so
# the keys of the stages whose numbers the CPU decides differ between the two architectures.
AARCH64 = ("aarch64", "arm64")
AARCH64_CAPABILITY = "DEFAULT"


def cpu_architecture(machine: str | None = None) -> str:
    """ "aarch64" on 64-bit ARM, else "x86_64" (the profile's two families)."""
    return "aarch64" if (machine or platform.machine()).lower() in AARCH64 else "x86_64"


def portable_capability(machine: str | None = None) -> str:
    """The ATen CPU capability the portable profile pins on this architecture."""
    return AARCH64_CAPABILITY if cpu_architecture(machine) == "aarch64" else PORTABLE_CAPABILITY


def portable_environment(threads: int = DEFAULT_THREADS, machine: str | None = None) -> dict[str, str]:
    """Environment of the portable profile: read by ATen, MKL, oneDNN and OpenMP at first use."""
    if cpu_architecture(machine) == "aarch64":
        return {
            "ATEN_CPU_CAPABILITY": "default",  # ATen's NEON build on every aarch64 host (not SVE256)
            "OMP_DYNAMIC": "FALSE",
            "OMP_NUM_THREADS": str(threads),
        }
    return {
        "ATEN_CPU_CAPABILITY": "avx2",  # ATen's own kernels: the AVX2 build on every AVX2+ host
        "ONEDNN_MAX_CPU_ISA": "AVX2",  # keeps oneDNN's AVX512/AMX bf16 paths off (and PyTorch off oneDNN)
        "MKL_CBWR": PORTABLE_CBWR,  # one MKL code path on Intel and AMD alike
        "MKL_DYNAMIC": "FALSE",
        "OMP_DYNAMIC": "FALSE",
        "OMP_NUM_THREADS": str(threads),
        "MKL_NUM_THREADS": str(threads),
    }


def profile_settings(
    profile: str = "portable", threads: int = DEFAULT_THREADS, machine: str | None = None
) -> dict[str, Any]:
    """What a profile pins (recorded in manifests and keys)."""
    if profile not in PROFILES:
        raise NumericsError(f"numerics.cpu: unknown profile {profile!r}; known: {', '.join(PROFILES)}")
    if profile == "native":
        return {"cpu": "native", "threads": threads}
    settings = {
        "cpu": "portable",
        "threads": threads,
        "environment": portable_environment(threads, machine),
        "mkldnn": False,
        "float32_matmul_precision": "highest",
        "cpu_capability": portable_capability(machine),
        "mkl_cbwr": PORTABLE_CBWR,
    }
    if cpu_architecture(machine) == "aarch64":  # no MKL on aarch64; the architecture enters the keys
        settings.update(mkl_cbwr=None, architecture="aarch64")
    return settings


def host_isa() -> str:
    """The best SIMD level of this host from /proc/cpuinfo ('avx512', 'avx2', 'default'; on aarch64
    'aarch64' or 'aarch64-sve')."""
    try:
        flags = Path("/proc/cpuinfo").read_text(errors="replace")
    except OSError:
        return platform.machine() or "unknown"
    words = set(flags.split())
    if cpu_architecture() == "aarch64":  # its SIMD levels: NEON everywhere, SVE on some
        return "aarch64-sve" if "sve" in words else "aarch64"
    if {"avx512f", "avx512bw", "avx512vl", "avx512dq"} <= words:
        return "avx512"
    if "avx2" in words and "fma" in words:
        return "avx2"
    return "default"


def key_identity(profile: str = "portable", threads: int = DEFAULT_THREADS) -> dict[str, Any]:
    """What enters the key of a stage whose numbers the CPU decides.

    portable: the pinned settings (the same on every AVX2 host); native: the host's ISA, because the
    bits then depend on it.
    """
    settings = profile_settings(profile, threads)
    if profile == "native":
        settings["host_isa"] = host_isa()
    return settings


# What a CUDA process pins: no TF32, full-precision bf16 GEMM reductions, deterministic kernels (the
# eager experts' index_add_ is an atomic scatter otherwise, so two runs could differ), cuBLAS's
# deterministic workspace. The GPU model is not known at planning: it is in the fingerprint, not the key.
CUDA_PROFILE = {
    "tf32": False,
    "bf16_reduced_precision_reduction": False,
    "deterministic_algorithms": True,
    "cublas_workspace_config": ":4096:8",
}


def device_type(device: str) -> str:
    """'cpu' or 'cuda' of a configured device ('cuda:1' -> 'cuda')."""
    return str(device).split(":", 1)[0]


def numerics_key(device: str = "cpu", profile: str = "portable", threads: int = DEFAULT_THREADS) -> dict:
    """What enters the key of a stage computing on ``device``: the device type and its profile (the
    device index does not decide numbers)."""
    if device_type(device) == "cuda":
        return {"device": "cuda", **CUDA_PROFILE}
    return {"device": "cpu", **key_identity(profile, threads)}


def apply_environment(profile: str = "portable", threads: int = DEFAULT_THREADS) -> None:
    """Set the profile's environment in this process (inherited by its children), overriding the shell's.

    Call it before torch is imported; :func:`enter` checks afterwards that it took effect.
    """
    settings = profile_settings(profile, threads)
    if profile == "portable":
        os.environ.update(settings["environment"])
    else:
        os.environ.update({"OMP_NUM_THREADS": str(threads), "MKL_NUM_THREADS": str(threads)})
    os.environ["MIXQUANT_NUMERICS"] = f"{profile}:{threads}"


def requested() -> tuple[str, int]:
    """(profile, threads) this process was started under (MIXQUANT_NUMERICS), default portable:1."""
    value = os.environ.get("MIXQUANT_NUMERICS", f"portable:{DEFAULT_THREADS}")
    profile, _, threads = value.partition(":")
    try:
        return profile, int(threads or DEFAULT_THREADS)
    except ValueError:
        raise NumericsError(f"MIXQUANT_NUMERICS={value!r}: expected PROFILE:THREADS") from None


@cache
def _mkl_cbwr_getter():
    """MKL's cbwr_get from the MKL that torch links statically (None where it is not exported)."""
    import torch

    library = Path(torch.__file__).parent / "lib" / "libtorch_cpu.so"
    try:
        lib = ctypes.CDLL(str(library))
    except OSError:
        return None
    for symbol in ("mkl_cbwr_get", "mkl_serv_cbwr_get"):
        function = getattr(lib, symbol, None)
        if function is not None:
            function.restype = ctypes.c_int
            function.argtypes = [ctypes.c_int]
            return function
    return None


def effective_mkl_cbwr() -> str | None:
    """MKL's effective CBWR mode as MKL reports it (None where it cannot be asked)."""
    getter = _mkl_cbwr_getter()
    if getter is None:
        return None
    code = int(getter(MKL_CBWR_ALL))
    return MKL_CBWR_NAMES.get(code, str(code))


def enter(profile: str | None = None, threads: int | None = None, device: str = "cpu") -> dict[str, Any]:
    """Apply the profile in this process, import torch, check it took effect; the fingerprint.

    Raises NumericsError (one line) when ATen's capability or MKL's CBWR mode is not the profile's:
    a host without AVX2, or a library that had already read other settings. With a CUDA ``device`` the
    CUDA profile is applied as well (CPU work in the same process keeps the CPU profile).
    """
    asked_profile, asked_threads = requested()
    profile = profile or asked_profile
    threads = threads or asked_threads
    apply_environment(profile, threads)
    if device_type(device) == "cuda":
        os.environ["CUBLAS_WORKSPACE_CONFIG"] = CUDA_PROFILE["cublas_workspace_config"]
    import torch

    if device_type(device) == "cuda":
        torch.backends.cuda.matmul.allow_tf32 = CUDA_PROFILE["tf32"]
        torch.backends.cudnn.allow_tf32 = CUDA_PROFILE["tf32"]
        torch.backends.cuda.matmul.allow_bf16_reduced_precision_reduction = CUDA_PROFILE[
            "bf16_reduced_precision_reduction"
        ]
        torch.use_deterministic_algorithms(CUDA_PROFILE["deterministic_algorithms"])

    torch.set_num_threads(threads)
    if profile == "portable":
        torch.backends.mkldnn.enabled = False
        torch.set_float32_matmul_precision("highest")
        capability = torch.backends.cpu.get_cpu_capability()
        if capability != portable_capability():
            raise NumericsError(
                f"numerics profile 'portable' needs ATen CPU capability {portable_capability()}, this "
                f"process runs {capability} (host ISA {host_isa()}; use numerics.cpu: native on a host "
                "without AVX2)"
            )
        cbwr = effective_mkl_cbwr()
        if cpu_architecture() == "x86_64" and cbwr not in (None, PORTABLE_CBWR):  # aarch64: no MKL
            raise NumericsError(
                f"numerics profile 'portable' needs MKL_CBWR {PORTABLE_CBWR}, MKL runs {cbwr} "
                "(MKL was initialised before the profile was applied)"
            )
    return fingerprint(device_type(device))


def _cpu_model() -> dict[str, str]:
    info = {"vendor": "unknown", "model": platform.processor() or "unknown"}
    try:
        for line in Path("/proc/cpuinfo").read_text(errors="replace").splitlines():
            name, _, value = line.partition(":")
            if name.strip() == "vendor_id":
                info["vendor"] = value.strip()
            elif name.strip() == "model name":
                info["model"] = value.strip()
                break
    except OSError:
        pass
    return info


# Every field a decisive fingerprint may hold: fingerprint()'s (host_isa under native only) and what the
# vllm engine adds (mixquant.kld.vllm_engine). Config published.numerics refuses any other, since a mistyped
# field would make two fingerprints differ and so excuse a logits mismatch (mixquant.release.verify).
DECISIVE_FIELDS = (
    "device",
    "profile",
    "threads",
    "cpu_capability",
    "mkl_cbwr",
    "mkldnn",
    "libraries",
    "python",
    "host_isa",
    "gpu",
    "cuda",
    "cuda_profile",
    "tensor_parallel_size",
)


def fingerprint(device: str = "cpu") -> dict[str, Any]:
    """What decides this process's numbers: device, profile, effective capability, library versions.

    ``decisive`` fields must be equal for two runs to promise the same bits; ``host`` is informative
    (under the portable profile another CPU model still gives the same bits).
    """
    import torch

    profile, threads = requested()
    versions = {"torch": torch.__version__, "mkl": None, "onednn": None}
    config = torch.__config__.show()
    for line in config.splitlines():
        if "Math Kernel Library Version" in line:
            versions["mkl"] = line.split("Version", 1)[1].split("Product")[0].strip(" -")
        elif "MKL-DNN v" in line:
            versions["onednn"] = line.split("MKL-DNN v", 1)[1].split()[0]
    for package in ("transformers", "nvidia-modelopt", "safetensors"):
        from importlib import metadata

        try:
            versions[package] = metadata.version(package)
        except metadata.PackageNotFoundError:
            versions[package] = None
    decisive = {
        "device": device,
        "profile": profile if device == "cpu" else "gpu",
        "threads": threads if device == "cpu" else None,
        "cpu_capability": torch.backends.cpu.get_cpu_capability() if device == "cpu" else None,
        "mkl_cbwr": effective_mkl_cbwr() if device == "cpu" else None,
        "mkldnn": bool(torch.backends.mkldnn.enabled),
        "libraries": versions,
        "python": platform.python_version(),
    }
    if profile == "native" and device == "cpu":
        decisive["host_isa"] = host_isa()
    if device == "cuda":  # the settings in effect (an hf stage pins CUDA_PROFILE; vLLM keeps its own)
        decisive["cuda_profile"] = {
            "tf32": bool(torch.backends.cuda.matmul.allow_tf32),
            "bf16_reduced_precision_reduction": bool(
                torch.backends.cuda.matmul.allow_bf16_reduced_precision_reduction
            ),
            "deterministic_algorithms": bool(torch.are_deterministic_algorithms_enabled()),
        }
        decisive["cuda"] = torch.version.cuda
        if torch.cuda.device_count():  # 0 on a CPU-only torch
            decisive["gpu"] = torch.cuda.get_device_name()
    host = {**_cpu_model(), "isa": host_isa(), "machine": platform.machine()}
    return {"decisive": decisive, "host": host}


def fingerprint_differences(ours: dict[str, Any], theirs: dict[str, Any]) -> list[str]:
    """Decisive fingerprint fields that differ, as 'field: theirs -> ours' (empty when equal)."""
    return [
        f"{where}: {left!r} -> {right!r}"
        for where, left, right in diff_values(theirs.get("decisive", {}), ours.get("decisive", {}))
    ]


def main_module_guard() -> None:
    """Apply the requested profile's environment if torch is not imported yet (library entry points)."""
    if "torch" not in sys.modules:
        apply_environment(*requested())


@contextlib.contextmanager
def torch_threads(threads: int | None) -> Iterator[None]:
    """torch's intra-op threads set to ``threads`` for the duration (None or 0: unchanged), then restored: a
    stage that runs with the job's own thread count inside a process that may hold another."""
    import torch  # lazy: planning imports this module, torch-free

    old = torch.get_num_threads()
    if threads:
        torch.set_num_threads(int(threads))
    try:
        yield
    finally:
        torch.set_num_threads(old)
