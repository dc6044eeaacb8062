"""Running a test on a native kernel and again on the path that stands in for it."""
import pytest

from pagedllm import native


def native_or_fallback(path: str, patcher: pytest.MonkeyPatch, kernel: str) -> str:
    """For a fixture parametrized over "native" and a fallback: skip "native" where ``native.<kernel>()`` is not
    built here, and for the fallback patch that loader to None so its callers take their other path."""
    if path == "native" and getattr(native, kernel)() is None:
        pytest.skip(f"no native {kernel} here (needs a C compiler and AVX-512)")
    if path != "native":
        patcher.setattr(native, kernel, lambda: None)
    return path
