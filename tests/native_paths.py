"""Running a test on a native kernel and again on the path that stands in for it."""
import pytest

from pagedllm import native
from pagedllm.platforms.cpu import cpu_flags

# Lesser builds of a kernel than the best this CPU has, by turning instruction sets off.
LESSER_BUILDS = {"no_amx": ("-mno-amx-tile",), "no_vbmi": ("-mno-avx512vbmi",), "avx2": ("-mno-avx512f",),
                 "avx2_no_vnni": ("-mno-avx512f", "-mno-avxvnni"), "portable": ("-mno-avx2",)}
# The CPU flag each of those compiler flags turns off.
_TURNED_OFF = {"-mno-amx-tile": "amx_tile", "-mno-avx512vbmi": "avx512vbmi", "-mno-avx512f": "avx512f",
               "-mno-avxvnni": "avx_vnni", "-mno-avx2": "avx2"}


def skip_lesser_build_that_is_native(path: str) -> None:
    """Skip a lesser build where the CPU lacks every instruction set it turns off: there it is the native build,
    which the "native" case already runs (on an AVX2-only CPU, "avx2" would repeat "native")."""
    if path in LESSER_BUILDS and not any(_TURNED_OFF[flag] in cpu_flags() for flag in LESSER_BUILDS[path]):
        pytest.skip(f"the {path} build is the native one on this CPU")


def native_build(path: str, kernel: str):
    """``native.<kernel>()`` for "native", its lesser build for a LESSER_BUILDS name; a skip where it is not built
    here, or where the lesser build is the native one."""
    skip_lesser_build_that_is_native(path)
    built = getattr(native, kernel)(*([LESSER_BUILDS[path]] if path in LESSER_BUILDS else []))
    if built is None:
        pytest.skip(f"no {path} {kernel} here (needs a C compiler and the instruction sets of its body)")
    return built


def native_or_fallback(path: str, patcher: pytest.MonkeyPatch, kernel: str) -> str:
    """For a fixture parametrized over "native" (optionally a lesser build, e.g. "avx2") and a fallback: skip a
    native path where ``native.<kernel>()`` is not built here, have the kernel's loader give the lesser build,
    and for the fallback patch that loader to None so its callers take their other path."""
    if path == "native" or path in LESSER_BUILDS:
        built = native_build(path, kernel)
        patcher.setattr(native, kernel, lambda: built)
    else:
        patcher.setattr(native, kernel, lambda: None)
    return path
