"""The native kernels' build and call machinery: each Python declaration of a C function matches its prototype in
the C source, a failed build is remembered and not retried, ``PAGEDLLM_NATIVE_KERNELS`` switches the fallback off
or into an error, ``python -m pagedllm.native`` reports, and the argument checks stop a bad call before it runs."""
from __future__ import annotations

import os
import re
import shutil
import stat
import subprocess
import sys

import pytest
import torch

from pagedllm import native
from pagedllm.native import attention, build, fused, gemms, graph, lora_ops
from pagedllm.native.checks import NativeCallError
from pagedllm.native.signature import FLOAT, INT, INT64, POINTER, STRING

HAS_CC = shutil.which("cc") is not None
SIGNATURES = {"paged_attention": attention.SIGNATURES, "fused_ops": fused.FUSED_SIGNATURES,
              "gemm": gemms.GEMM_SIGNATURES, "gemm_bf16": gemms.GEMM_BF16_SIGNATURES,
              "lora": lora_ops.LORA_SIGNATURES, "graph_replay": graph.GRAPH_REPLAY_SIGNATURES}


def _c_type(declaration: str):
    if "*" in declaration:
        return STRING if declaration.startswith("const char") else POINTER
    base = declaration.replace("const ", "").split()[0]
    return {"int": INT, "int64_t": INT64, "float": FLOAT, "void": None}[base]


def _prototypes(library: str) -> dict[str, list[tuple]]:
    """Every definition of an exported function in the library's sources: its (return type, [(name, type)])."""
    found: dict[str, list[tuple]] = {}
    for source in build.LIBRARIES[library]:
        with open(os.path.join(build.HERE, source)) as f:
            text = f.read()
        for m in re.finditer(r"^((?:const )?[a-z_0-9]+ \*?)([a-z_0-9]+)\(([^)]*)\)\s*\{", text, re.M):
            returns, name, params = m.groups()
            args = [] if params.strip() == "void" else [
                (re.findall(r"\w+", p)[-1], _c_type(p.strip())) for p in params.split(",")]
            found.setdefault(name, []).append((_c_type(returns.strip()), args))
    return found


@pytest.mark.parametrize("library", sorted(SIGNATURES))
def test_declarations_match_the_c_prototypes(library):
    prototypes = _prototypes(library)
    for signature in SIGNATURES[library]:
        assert signature.name in prototypes, f"{signature.name} is not defined in {build.LIBRARIES[library]}"
        for returns, args in prototypes[signature.name]:  # each #if branch's definition
            assert returns == signature.restype, signature.name
            assert args == list(signature.args), signature.name


def test_every_source_and_header_is_part_of_a_build():
    sources = {name for names in build.LIBRARIES.values() for name in names}
    on_disk = {name for name in os.listdir(build.HERE) if name.endswith(".c")}
    assert sources == on_disk
    assert build._headers()  # the headers are in every library's key


def test_the_quantized_formats_compile_in_parallel():
    """gemm's quantized kernels (gemm_quant.h) are instantiated a few formats to a file, each format once, so that
    the library's first build runs a compiler per file side by side (build._compile_and_link) instead of one
    compiler through every format."""
    with open(os.path.join(build.HERE, "gemm_quant.h")) as f:
        formats = re.findall(r"(\w+) = \d+", re.search(r"enum \{(.*?)\};", f.read(), re.S).group(1))
    per_file = []
    for source in build.LIBRARIES["gemm"]:
        with open(os.path.join(build.HERE, source)) as f:
            per_file.append(re.findall(r"^QUANT_KERNELS\((\w+)\)", f.read(), re.M))
    instantiated = sorted(name for names in per_file for name in names)
    assert instantiated == sorted(formats)
    assert sum(1 for names in per_file if names) >= 3 and max(map(len, per_file)) <= len(formats) // 2


@pytest.mark.skipif(native.gemm_q4() is None, reason="no quantized gemm kernels here")
def test_gemm_exports_only_its_api():
    """The functions its files share (gemm.h's INTERNAL) are hidden: the library's symbols are its API's."""
    lib = native._gemm_lib()
    for name in ("panel_rows", "quant_item_Q4", "quant_half_Q4"):
        with pytest.raises(AttributeError):
            getattr(lib, name)


def _fake_compiler(tmp_path, body: str) -> str:
    """An executable standing in for cc that counts its calls in tmp_path/calls, then runs ``body``."""
    path = tmp_path / "fake-cc"
    path.write_text(f"#!/bin/sh\necho x >> {tmp_path}/calls\n{body}\n")
    path.chmod(path.stat().st_mode | stat.S_IEXEC)
    return str(path)


def _calls(tmp_path) -> int:
    calls = tmp_path / "calls"
    return len(calls.read_text().splitlines()) if calls.exists() else 0


def test_a_failed_build_is_remembered_with_the_compilers_message(tmp_path, monkeypatch, caplog):
    monkeypatch.setenv("PAGEDLLM_CACHE_DIR", str(tmp_path / "cache"))
    monkeypatch.setenv("CC", _fake_compiler(tmp_path, "echo 'error: no such intrinsic' >&2; exit 1"))
    monkeypatch.setattr(build, "STATUS", {})
    assert build.build("fused_ops") is None
    sources = len(build.LIBRARIES["fused_ops"])  # one compile a source, each failing
    assert _calls(tmp_path) == sources
    assert "no such intrinsic" in caplog.text and "delete" in caplog.text
    failed = list((tmp_path / "cache").rglob("fused_ops-*.failed"))
    assert len(failed) == 1 and "no such intrinsic" in failed[0].read_text()
    caplog.clear()
    monkeypatch.setattr(build, "STATUS", {})  # as a new process: nothing built in it yet
    assert build.build("fused_ops") is None
    assert _calls(tmp_path) == sources  # not retried
    assert build.STATUS["fused_ops", ()].state == "failed" and "no such intrinsic" in caplog.text
    assert not list((tmp_path / "cache").rglob("*.so"))


def test_require_turns_a_failed_build_into_an_error(tmp_path, monkeypatch):
    monkeypatch.setenv("PAGEDLLM_CACHE_DIR", str(tmp_path / "cache"))
    monkeypatch.setenv("CC", _fake_compiler(tmp_path, "echo 'error: broken' >&2; exit 1"))
    monkeypatch.setenv("PAGEDLLM_NATIVE_KERNELS", "require")
    monkeypatch.setattr(build, "STATUS", {})
    with pytest.raises(build.NativeKernelError, match="broken"):
        build.load("gemm", gemms.GEMM_SIGNATURES)
    monkeypatch.setenv("CC", "no-such-compiler")
    with pytest.raises(build.NativeKernelError, match="no C compiler"):
        build.load("gemm", gemms.GEMM_SIGNATURES)


def test_kernels_off_builds_nothing(tmp_path, monkeypatch):
    monkeypatch.setenv("PAGEDLLM_CACHE_DIR", str(tmp_path / "cache"))
    monkeypatch.setenv("CC", _fake_compiler(tmp_path, "exit 1"))
    monkeypatch.setenv("PAGEDLLM_NATIVE_KERNELS", "0")
    assert build.load("gemm", gemms.GEMM_SIGNATURES) is None
    assert _calls(tmp_path) == 0
    monkeypatch.setenv("PAGEDLLM_NATIVE_KERNELS", "yes")
    with pytest.raises(ValueError, match="PAGEDLLM_NATIVE_KERNELS"):
        build.load("gemm", gemms.GEMM_SIGNATURES)


@pytest.mark.skipif(not HAS_CC, reason="no C compiler")
def test_doctor_reports_every_library():
    """(tests/test_wheel.py runs it on a fresh cache, from an installed wheel.)"""
    env = {**os.environ, "PAGEDLLM_NATIVE_KERNELS": "require"}
    result = subprocess.run([sys.executable, "-m", "pagedllm.native"], capture_output=True, text=True, env=env,
                            timeout=600)
    assert result.returncode == 0, result.stdout + result.stderr
    for library in build.LIBRARIES:
        assert re.search(rf"^  {library}\b.* (built \(|from cache)", result.stdout, re.M), result.stdout
    assert "dtype=auto is" in result.stdout


def test_doctor_fails_when_a_build_fails(tmp_path):
    env = {**os.environ, "PAGEDLLM_CACHE_DIR": str(tmp_path), "CC": "false"}
    result = subprocess.run([sys.executable, "-m", "pagedllm.native"], capture_output=True, text=True, env=env,
                            timeout=300)
    assert result.returncode == 1 and "failed" in result.stdout


@pytest.mark.skipif(native.paged_decode() is None, reason="no native paged attention here")
def test_checks_stop_a_decode_call_with_bad_arguments(monkeypatch):
    monkeypatch.setattr("pagedllm.native.checks.ENABLED", True)
    kernel = native.paged_decode()
    q, out, lse = torch.randn(2, 4, 64), torch.empty(2, 4, 64), torch.empty(2, 4)
    cache = torch.randn(8 * 16, 2, 64)
    table, lens = torch.tensor([[0, 1], [2, 3]], dtype=torch.int32), torch.tensor([20, 17], dtype=torch.int32)
    kernel(q, cache, cache, table, lens, out, lse, start_pos=0, block_size=16, scale=0.125)  # a good call
    bad = [((q, cache, cache, table.long(), lens, out, lse), "block_table"),
           ((q, cache.to(torch.bfloat16), cache, table, lens, out, lse), "k_cache"),
           ((q.transpose(1, 2), cache, cache, table, lens, out, lse), "q"),
           ((q, cache, cache, table, torch.tensor([20, 40], dtype=torch.int32), out, lse), "longer than"),
           ((q, cache, cache, torch.tensor([[0, 1], [2, 9]], dtype=torch.int32), lens, out, lse), "outside"),
           ((q, cache, cache, table, lens, out[:1], lse), "out and lse")]
    for args, message in bad:
        with pytest.raises(NativeCallError, match=message):
            kernel(*args, start_pos=0, block_size=16, scale=0.125)


@pytest.mark.skipif(native.gemm() is None, reason="no native GEMM here")
def test_checks_stop_a_gemm_call_with_panels_of_another_shape(monkeypatch):
    from pagedllm.layers.gemm_layout import DenseWeight

    monkeypatch.setattr("pagedllm.native.checks.ENABLED", True)
    dense = DenseWeight(torch.randn(70, 40))
    with pytest.raises(NativeCallError, match="packed"):
        native.gemm()(torch.randn(3, 40), dense.panels[:1], None, 70)
    with pytest.raises(NativeCallError, match="bias"):
        native.gemm()(torch.randn(3, 40), dense.panels, torch.randn(69), 70)
