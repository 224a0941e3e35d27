"""Building and caching the C++ CPU step (coat_kernels.optim.cpu_step): the cache file is keyed by the target CPU
as the compiler resolves -march=native (gcc and clang dry runs; tuning aside), so two hosts with different CPUs
sharing a cache folder never load each other's library (a simulated older host builds its own, which steps
bit-exactly); a compiler that does not say what it targets is refused; the cache folder: COAT_FP8_CACHE_DIR (read
once), the home cache, a private per-user temporary folder when home cannot be written (a shared or linked one is
refused); each reason the library is unavailable gives one warning naming it and the torch reference fallback."""
import functools
import os
import platform
import re
import stat
import tempfile
import warnings
from pathlib import Path

import pytest
import torch

from coat_kernels.optim import cpu_step
from coat_kernels.optim import dre_reference as ref
from coat_kernels.optim.grouping import build_layout

GCC_DRY_RUN = """Using built-in specs.
COLLECT_GCC=g++
Target: x86_64-linux-gnu
gcc version 12.2.0 (Debian 12.2.0-14+deb12u1)
COLLECT_GCC_OPTIONS='-O3' '-march=native' '-ffp-contract=off' '-fopenmp' '-std=c++17' '-shared' '-fPIC' '-E'
 /usr/lib/gcc/x86_64-linux-gnu/12/cc1plus -E -quiet -imultiarch x86_64-linux-gnu -D_GNU_SOURCE /dev/null \
"-march={cpu}" -mmmx -msse4.2 -mavx2 -mfma -mavx512f -mavx512bw -mavx512dq {vbmi} -mno-sgx --param \
"l1-cache-size={l1}" --param "l2-cache-size=1024" "-mtune={tune}" "-std=c++17" -fopenmp -fPIC -O3 -dumpbase null
COMPILER_PATH=/usr/lib/gcc/x86_64-linux-gnu/12/
"""
CLANG_DRY_RUN = """Debian clang version 16.0.6 (15~deb12u1)
Target: x86_64-pc-linux-gnu
 "/usr/lib/llvm-16/bin/clang" "-cc1" "-triple" "x86_64-pc-linux-gnu" "-E" "-mrelocation-model" "pic" \
"-target-cpu" "{cpu}" "-target-feature" "+avx2" "-target-feature" "{vbmi}" "-tune-cpu" "{tune}" "-O3" "-x" "c++" \
"/dev/null"
"""


def gcc_target(cpu="rocketlake", vbmi="-mavx512vbmi", l1=48, tune="rocketlake"):
    return cpu_step.parse_target(GCC_DRY_RUN.format(cpu=cpu, vbmi=vbmi, l1=l1, tune=tune))


def clang_target(cpu="rocketlake", vbmi="+avx512vbmi", tune="rocketlake"):
    return cpu_step.parse_target(CLANG_DRY_RUN.format(cpu=cpu, vbmi=vbmi, tune=tune))


def name(target):
    return cpu_step.library_name(b"source", cpu_step.FLAGS, "g++ 12.2.0", target)


def test_gcc_dry_run_gives_the_resolved_cpu_and_features_without_tuning():
    assert gcc_target() == ("-march=rocketlake", "-mmmx", "-msse4.2", "-mavx2", "-mfma", "-mavx512f", "-mavx512bw",
                            "-mavx512dq", "-mavx512vbmi", "-mno-sgx")
    assert name(gcc_target()) == name(gcc_target(l1=32, tune="generic"))  # tuning never decides where code runs
    assert name(gcc_target()) != name(gcc_target(vbmi="-mno-avx512vbmi"))  # a VM hiding a feature of the same CPU
    assert name(gcc_target()) != name(gcc_target(cpu="icelake-server"))
    assert name(gcc_target()).startswith("coat_cpu_adamw-rocketlake-")


def test_clang_dry_run_gives_the_target_cpu_and_features_without_tuning():
    assert clang_target() == ("-target-cpu rocketlake", "-target-feature +avx2", "-target-feature +avx512vbmi")
    assert name(clang_target()) == name(clang_target(tune="generic"))
    assert name(clang_target()) != name(clang_target(vbmi="-avx512vbmi"))
    assert name(clang_target()).startswith("coat_cpu_adamw-rocketlake-")


def test_this_hosts_march_native_is_resolved():
    compiler = cpu_step.find_compiler()
    target = cpu_step.native_target(compiler)
    assert target and not [t for t in target if "native" in t], target
    cpu = next(t.split("=")[1] if t.startswith("-march=") else t.split()[1] for t in target
               if t.startswith(("-march=", "-target-cpu ")))
    assert cpu_step.cached_path(compiler, cpu_step.FLAGS).name.startswith(f"coat_cpu_adamw-{cpu}-")


def wrapper(path: Path, body: str) -> str:
    """A compiler script: body (bash), then the real compiler."""
    path.write_text(f"#!/usr/bin/env bash\n{body}\n")
    path.chmod(0o755)
    return str(path)


BASELINES = {"x86_64": "x86-64", "aarch64": "armv8-a"}


def test_hosts_with_different_cpus_sharing_a_cache_never_share_a_library(tmp_path, monkeypatch):
    """The other host: this machine's compiler, told to target the architecture's baseline where it reads
    -march=native (the same compiler version, another CPU)."""
    baseline = BASELINES.get(platform.machine())
    if baseline is None:
        pytest.skip(f"no baseline -march known for {platform.machine()}")
    compiler = cpu_step.find_compiler()
    older = wrapper(tmp_path / "older-host-g++", f'exec {compiler} "${{@/#-march=native/-march={baseline}}}"')
    shared = tmp_path / "shared-home-cache"
    older_lib = cpu_step.build(compiler=older, cache_dir=shared)
    this_host = cpu_step.cached_path(compiler, cpu_step.FLAGS, cache_dir=shared)
    assert older_lib.name.startswith(f"coat_cpu_adamw-{baseline}-") and this_host != older_lib
    assert sorted(shared.iterdir()) == [older_lib]  # this host would build its own, not load the older host's
    before = older_lib.stat().st_mtime_ns
    assert cpu_step.build(compiler=older, cache_dir=shared) == older_lib  # cached: not built again
    assert older_lib.stat().st_mtime_ns == before and sorted(shared.iterdir()) == [older_lib]

    layout = build_layout(None, 8192, 128)
    m_cfg, v_cfg = ref.DREConfig("e4m3"), ref.DREConfig("e4m3", keep_nonzero=True)
    h = ref.AdamWScalars.make(1e-3, 0.9, 0.95, 1e-8, 0.1, 2)
    g = torch.Generator().manual_seed(0)
    p, grad = torch.randn(8192, generator=g) * 0.02, torch.randn(8192, generator=g) * 1e-3
    mq, mm = ref.quantize(grad, layout, m_cfg)
    vq, vm = ref.quantize(grad * grad, layout, v_cfg)
    a, b = [[t.clone() for t in (p, mq, mm, vq, vm)] for _ in range(2)]
    ref.fused_adamw_step(a[0], grad, *a[1:], layout, h, m_cfg, v_cfg)
    lib = cpu_step.load(older_lib)
    monkeypatch.setattr(cpu_step, "library", lambda: lib)
    cpu_step.fused_adamw_step(b[0], grad, *b[1:], layout, h, m_cfg, v_cfg)
    assert all(torch.equal(x.view(torch.uint8), y.view(torch.uint8)) for x, y in zip(a, b))
    assert not torch.equal(a[0], p)


def test_a_compiler_that_does_not_say_its_target_is_refused(tmp_path):
    compiler = cpu_step.find_compiler()
    silent = wrapper(tmp_path / "silent-g++", f'for a; do [ "$a" = "-###" ] && exit 0; done; exec {compiler} "$@"')
    with pytest.raises(RuntimeError, match="did not say which CPU"):
        cpu_step.build(compiler=silent, cache_dir=tmp_path / "cache")
    assert not (tmp_path / "cache").exists() or not list((tmp_path / "cache").iterdir())


@pytest.fixture
def fresh_resolution():
    """The cache folder and the library resolved again in the test, and again after it."""
    cpu_step.default_cache_dir.cache_clear()
    cpu_step.library.cache_clear()
    yield
    cpu_step.default_cache_dir.cache_clear()
    cpu_step.library.cache_clear()


def test_cache_dir_variable_is_read_once(tmp_path, monkeypatch, fresh_resolution):
    monkeypatch.setenv(cpu_step.CACHE_DIR_VARIABLE, str(tmp_path / "a" / "b"))
    assert cpu_step.default_cache_dir() == tmp_path / "a" / "b" and (tmp_path / "a" / "b").is_dir()
    monkeypatch.setenv(cpu_step.CACHE_DIR_VARIABLE, str(tmp_path / "c"))
    assert cpu_step.default_cache_dir() == tmp_path / "a" / "b"


def test_home_cache_follows_xdg_cache_home(tmp_path, monkeypatch, fresh_resolution):
    monkeypatch.delenv(cpu_step.CACHE_DIR_VARIABLE, raising=False)
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "xdg"))
    assert cpu_step.default_cache_dir() == tmp_path / "xdg" / "coat_fp8"


def not_a_folder(tmp_path):
    """A path that no one (root included) can create a folder at: its parent is a file."""
    (tmp_path / "file").write_text("")
    return tmp_path / "file" / "cache"


def test_unusable_cache_dir_variable_is_an_error(tmp_path, monkeypatch, fresh_resolution):
    monkeypatch.setenv(cpu_step.CACHE_DIR_VARIABLE, str(not_a_folder(tmp_path)))
    with pytest.raises(RuntimeError, match="COAT_FP8_CACHE_DIR=.* cannot hold the compiled library"):
        cpu_step.default_cache_dir()


@pytest.fixture
def unwritable_home(tmp_path, monkeypatch, fresh_resolution):
    """No COAT_FP8_CACHE_DIR, a home cache that cannot be created, and a temporary directory of the test's own."""
    monkeypatch.delenv(cpu_step.CACHE_DIR_VARIABLE, raising=False)
    monkeypatch.setenv("XDG_CACHE_HOME", str(not_a_folder(tmp_path)))
    (tmp_path / "tmp").mkdir()
    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path / "tmp"))
    return tmp_path / "tmp" / f"coat_fp8-{os.getuid()}"


def test_unwritable_home_falls_back_to_a_private_temporary_folder(unwritable_home):
    assert cpu_step.default_cache_dir() == unwritable_home
    assert stat.S_IMODE(unwritable_home.stat().st_mode) == 0o700


@pytest.mark.parametrize("shared", ["writable by others", "a link"])
def test_a_shared_temporary_folder_is_refused(unwritable_home, tmp_path, shared):
    if shared == "a link":
        (tmp_path / "elsewhere").mkdir(mode=0o700)
        unwritable_home.symlink_to(tmp_path / "elsewhere")
    else:
        unwritable_home.mkdir()
        unwritable_home.chmod(0o777)
    with pytest.raises(RuntimeError, match="not a private folder.*set COAT_FP8_CACHE_DIR"):
        cpu_step.default_cache_dir()


@pytest.mark.parametrize("reason", ["no compiler", "compile error", "unwritable cache", "missing source"])
def test_unavailable_library_warns_once_naming_the_reason(reason, tmp_path, monkeypatch, fresh_resolution):
    if reason == "no compiler":
        monkeypatch.setenv("PATH", str(tmp_path))
        expected = r"no C\+\+ compiler"
    elif reason == "compile error":
        (tmp_path / "broken.cpp").write_text("this is not C++;\n")
        monkeypatch.setattr(cpu_step, "build", functools.partial(cpu_step.build, source=tmp_path / "broken.cpp",
                                                                  cache_dir=tmp_path / "cache"))
        expected = r"building broken.cpp with .* failed:.*error"
    elif reason == "unwritable cache":
        monkeypatch.setenv(cpu_step.CACHE_DIR_VARIABLE, str(not_a_folder(tmp_path)))
        expected = "COAT_FP8_CACHE_DIR=.* cannot hold the compiled library"
    else:
        monkeypatch.setattr(cpu_step, "build", functools.partial(cpu_step.build, source=tmp_path / "gone.cpp"))
        expected = r"gone.cpp is missing \(coat-fp8 installed without its package data\? reinstall it\)"
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        assert cpu_step.library() is None and cpu_step.library() is None
    assert len(caught) == 1 and caught[0].category is RuntimeWarning, [str(w.message) for w in caught]
    message = str(caught[0].message)
    assert "the fast CPU optimizer step is unavailable" in message, message
    assert "CPU tensors use the torch reference step (same results, much slower)" in message, message
    assert re.search(expected, message, re.DOTALL), message
