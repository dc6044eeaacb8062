"""Running a test on a native kernel and again on the path that stands in for it."""
import pytest

from pagedllm import native


# Lesser builds of a kernel than the best this CPU has, by turning instruction sets off.
LESSER_BUILDS = {"avx2": ("-mno-avx512f",)}


def native_build(path: str, kernel: str):
    """``native.<kernel>()`` for "native", its lesser build for a LESSER_BUILDS name; a skip where it is not built
    here."""
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
