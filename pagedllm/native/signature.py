"""C function signatures, named: each kernel's arguments are declared once, by name and C type, beside the typed
wrapper that calls it; tests/test_native_build.py holds every declaration against the prototype in the C source."""

from __future__ import annotations

import ctypes

POINTER, INT, INT64, FLOAT, STRING = ctypes.c_void_p, ctypes.c_int, ctypes.c_int64, ctypes.c_float, ctypes.c_char_p


class CFunction:
    """A C function: its name, its return type (None for void) and its arguments as (name, ctypes type) pairs, in
    order. ``declare`` sets them on a loaded library, so ctypes converts (and refuses) arguments accordingly."""

    def __init__(self, name: str, restype, *args: tuple[str, type]):
        self.name, self.restype, self.args = name, restype, args

    def declare(self, lib: ctypes.CDLL) -> None:
        function = getattr(lib, self.name)
        function.argtypes = [ctype for _, ctype in self.args]
        function.restype = self.restype


def arguments(*names_and_types: str | type) -> list[tuple[str, type]]:
    """``arguments("q", "k", POINTER, "n", INT)``: each name takes the next type after it."""
    out, pending = [], []
    for item in names_and_types:
        if isinstance(item, str):
            pending.append(item)
        else:
            out.extend((name, item) for name in pending)
            pending = []
    if pending:
        raise ValueError(f"arguments without a type: {pending}")
    return out
