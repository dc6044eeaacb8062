"""What a user gets from ``pip wheel .`` and a non-editable install: the wheel holds every file of the package (the
kernels' C sources and headers included), and in a fresh virtualenv every kernel library builds from what was
installed (``python -m pagedllm.native`` under ``PAGEDLLM_NATIVE_KERNELS=require``, on an empty kernel cache)."""
from __future__ import annotations

import os
import shutil
import subprocess
import sys
import sysconfig
import zipfile
from pathlib import Path

import pytest

from pagedllm.native import build

ROOT = Path(__file__).resolve().parent.parent
pytestmark = pytest.mark.skipif(shutil.which("cc") is None, reason="no C compiler to build the kernels with")


@pytest.fixture(scope="module")
def wheel(tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("wheel")
    subprocess.run([sys.executable, "-m", "pip", "wheel", "--no-deps", "-q", "-w", str(out), str(ROOT)], check=True,
                   timeout=600, capture_output=True)
    (path,) = out.glob("pagedllm-*.whl")
    return path


def test_the_wheel_holds_every_file_of_the_package(wheel):
    with zipfile.ZipFile(wheel) as z:
        names = set(z.namelist())
    package = {str(p.relative_to(ROOT)) for p in (ROOT / "pagedllm").rglob("*")
               if p.is_file() and "__pycache__" not in p.parts and p.suffix != ".pyc"}
    assert package - names == set()
    assert any(n.endswith("native/simd.h") for n in names)


def test_every_kernel_builds_in_a_fresh_virtualenv(wheel, tmp_path):
    venv = tmp_path / "venv"
    subprocess.run([sys.executable, "-m", "venv", "--without-pip", str(venv)], check=True, timeout=120)
    python = venv / "bin" / "python"
    subprocess.run([sys.executable, "-m", "pip", "--python", str(python), "install", "--no-deps", "-q", str(wheel)],
                   check=True, timeout=300, capture_output=True)
    # pagedllm's dependencies (torch, ...) come from this environment; pagedllm itself only from the wheel.
    site = subprocess.run([str(python), "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"],
                          check=True, capture_output=True, text=True).stdout.strip()
    Path(site, "dependencies.pth").write_text(sysconfig.get_paths()["purelib"] + "\n")
    env = {**os.environ, "PAGEDLLM_CACHE_DIR": str(tmp_path / "cache"), "PAGEDLLM_NATIVE_KERNELS": "require"}
    env.pop("PYTHONPATH", None)
    where = subprocess.run([str(python), "-c", "import pagedllm; print(pagedllm.__file__)"], cwd=tmp_path, env=env,
                           check=True, capture_output=True, text=True).stdout
    assert where.startswith(site), where
    result = subprocess.run([str(python), "-m", "pagedllm.native"], cwd=tmp_path, env=env, capture_output=True,
                            text=True, timeout=600)
    assert result.returncode == 0, result.stdout + result.stderr
    for library in build.LIBRARIES:
        assert f"  {library} " in result.stdout and "failed" not in result.stdout, result.stdout
    assert result.stdout.count(" built (") >= len(build.LIBRARIES), result.stdout
