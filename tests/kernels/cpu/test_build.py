"""Building the CPU backend's C kernels (kvbench/kernels/cpu/build.py): cached by source, headers and CPU, and a kernel that
cannot be built or loaded — no compiler, broken source, unwritable cache, KVBENCH_NO_CPU_EXT=1 — is None (torch)."""

import pytest

from kvbench.kernels.cpu import build

needs_cc = pytest.mark.skipif(build.load("softmax_column_sums") is None, reason="no C compiler")


def test_disabled_or_unbuildable_kernels_fall_back(monkeypatch, tmp_path, capsys):
    monkeypatch.setenv("KVBENCH_NO_CPU_EXT", "1")
    assert build.load("softmax_column_sums") is None
    monkeypatch.delenv("KVBENCH_NO_CPU_EXT")
    monkeypatch.setenv("KVBENCH_CACHE", str(tmp_path))
    (tmp_path / "broken.c").write_text("this is not C\n")
    monkeypatch.setattr(build, "SOURCES", tmp_path)
    if build.shutil.which("cc") or build.shutil.which("gcc"):
        assert build._build("broken") is None
        assert "C kernel broken did not build; using torch" in capsys.readouterr().err
    monkeypatch.setattr(build.shutil, "which", lambda name: None)
    assert build._build("broken") is None
    assert "no C compiler" in capsys.readouterr().err
    assert not list(tmp_path.glob("cpu_ext/*.so"))  # nothing half-written


def test_an_unwritable_cache_falls_back_to_torch(monkeypatch, tmp_path, capsys):
    blocker = tmp_path / "file"
    blocker.write_text("")
    monkeypatch.setenv("KVBENCH_CACHE", str(blocker))  # a file where the cache folder should be
    monkeypatch.delenv("KVBENCH_NO_CPU_EXT", raising=False)
    build._load.cache_clear()
    try:
        assert build.load("softmax_column_sums") is None
        assert "using torch" in capsys.readouterr().err
    finally:
        build._load.cache_clear()


@needs_cc
def test_editing_a_header_rebuilds_the_kernels(monkeypatch, tmp_path):
    for source in build.SOURCES.iterdir():
        (tmp_path / source.name).write_bytes(source.read_bytes())
    monkeypatch.setattr(build, "SOURCES", tmp_path)
    monkeypatch.setenv("KVBENCH_CACHE", str(tmp_path / "cache"))
    before = build._build("softmax_column_sums")
    header = tmp_path / "kvbench_math.h"
    header.write_text(header.read_text() + "\n/* edited */\n")
    after = build._build("softmax_column_sums")
    assert before is not None and after is not None and before != after


@needs_cc
def test_a_built_kernel_is_cached_under_kvbench_cache(monkeypatch, tmp_path):
    monkeypatch.setenv("KVBENCH_CACHE", str(tmp_path))
    first = build._build("softmax_column_sums")
    assert first is not None and first.parent == tmp_path / "cpu_ext" and first.exists()
    mtime = first.stat().st_mtime_ns
    assert build._build("softmax_column_sums") == first and first.stat().st_mtime_ns == mtime  # not rebuilt


@needs_cc
def test_the_engine_builds_every_kernel_before_anything_is_timed(monkeypatch, tmp_path, tiny):
    from kvbench.native.engine import Engine

    monkeypatch.setenv("KVBENCH_CACHE", str(tmp_path))
    build._load.cache_clear()  # as a new process on a machine without them
    try:
        Engine(tiny)
        built = sorted(path.name.split("-")[0] for path in (tmp_path / "cpu_ext").glob("*.so"))
        assert built == sorted(path.stem for path in build.SOURCES.glob("*.c"))
    finally:
        build._load.cache_clear()  # the other tests load from the default cache again
