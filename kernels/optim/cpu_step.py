"""The fused COAT optimizer steps for CPU tensors: `cpu_adamw.cpp` (AdamW) and `cpu_lion.cpp` (Lion), each built on
first use into its own library, bit-exact with the torch references; both include `dre_cpu.h` (the shared encodings).

`fused_adamw_step` has `dre_reference.fused_adamw_step`'s signature and results (the same bits: parameters, codes,
metadata, skipped groups), `fused_lion_step` those of `lion_reference.fused_lion_step`. Each library is built with
the system C++ compiler (`-O3 -march=native -ffp-contract=off -fopenmp`: vectorized for this CPU, no fused
multiply-add but the explicit ones; on CPUs with AVX-512 VBMI the AdamW source selects its intrinsics path, elsewhere
its portable one) and loaded through ctypes; a build takes a few seconds, once per cache folder and CPU. The sources
ship inside the package (package data), so installed wheels build them too.

Cache: one file per source (with the header), flags, compiler version and target CPU (what `-march=native` resolves
to on this host, as the compiler reports it), so hosts with different CPUs that share a home directory never load
each other's library. Its folder is resolved once per process: `$COAT_FP8_CACHE_DIR` when set (it must be writable),
else `$XDG_CACHE_HOME/coat_fp8` or `~/.cache/coat_fp8`, else, when that cannot be written, a private per-user folder
in the system temporary directory (`coat_fp8-<uid>`, mode 700). Without a compiler, with a failed build or without a
writable cache folder, the step falls back to the torch reference, with one warning that names the reason.
Threads: torch.get_num_threads().
"""
from __future__ import annotations

import ctypes
import hashlib
import os
import re
import shlex
import shutil
import stat
import subprocess
import tempfile
import warnings
import weakref
from functools import lru_cache
from pathlib import Path

import torch

from . import dre_reference as reference
from .dre_reference import AdamWScalars, DREConfig
from .grouping import GroupLayout

SOURCE = Path(__file__).with_name("cpu_adamw.cpp")
LION_SOURCE = Path(__file__).with_name("cpu_lion.cpp")
HEADER = Path(__file__).with_name("dre_cpu.h")  # included by both sources: part of each library's cache key
FLAGS = ("-O3", "-march=native", "-ffp-contract=off", "-fno-math-errno", "-fopenmp", "-shared", "-fPIC", "-std=c++17")
CACHE_DIR_VARIABLE = "COAT_FP8_CACHE_DIR"
_PARAM_KINDS = {torch.float32: 0, torch.bfloat16: 1}
_BF16_WITH_REMAINDERS = 2
_GRAD_KINDS = {torch.float32: 0, torch.bfloat16: 1}


def _writable_dir(path: Path) -> Path:
    """path, created if needed; raises OSError when it cannot be written."""
    path.mkdir(parents=True, exist_ok=True)
    if not os.access(path, os.W_OK | os.X_OK):
        raise PermissionError(f"{path} is not writable")
    return path


def _private_temp_dir() -> Path:
    """`coat_fp8-<uid>` in the system temporary directory: created with mode 700; refused unless it is a real folder
    of this user that nobody else can write (a shared /tmp must not hand us someone else's library)."""
    if not hasattr(os, "getuid"):
        raise OSError("no per-user temporary folder on this platform")
    path = Path(tempfile.gettempdir()) / f"coat_fp8-{os.getuid()}"
    try:
        path.mkdir(mode=0o700)
    except FileExistsError:
        pass
    info = path.lstat()
    if not stat.S_ISDIR(info.st_mode) or info.st_uid != os.getuid() or info.st_mode & 0o022:
        raise PermissionError(f"{path} is not a private folder of this user (a link, another owner, or writable by "
                              "others)")
    return _writable_dir(path)


@lru_cache(maxsize=1)
def default_cache_dir() -> Path:
    """The folder for built libraries (see the module docstring); resolved once per process. Raises RuntimeError,
    naming the folders tried, when none can be written."""
    chosen = os.environ.get(CACHE_DIR_VARIABLE)
    if chosen:
        try:
            return _writable_dir(Path(chosen).expanduser())
        except OSError as exc:
            raise RuntimeError(f"{CACHE_DIR_VARIABLE}={chosen} cannot hold the compiled library ({exc}); point it "
                               "to a writable folder") from None
    xdg = os.environ.get("XDG_CACHE_HOME")
    home = (Path(xdg) if xdg else Path.home() / ".cache") / "coat_fp8"
    try:
        return _writable_dir(home)
    except OSError as home_error:
        try:
            return _private_temp_dir()
        except OSError as temp_error:
            raise RuntimeError(f"no writable cache folder for the compiled library ({home_error}; {temp_error}); "
                               f"set {CACHE_DIR_VARIABLE} to a writable folder") from None


def find_compiler() -> str:
    """The system C++ compiler (g++, else c++); raises RuntimeError when there is none."""
    compiler = shutil.which("g++") or shutil.which("c++")
    if compiler is None:
        raise RuntimeError("no C++ compiler (g++ or c++) on PATH")
    return compiler


def parse_target(dry_run: str) -> tuple[str, ...]:
    """The target CPU options in a compiler's `-###` output, as they reach the compiler proper: gcc's -march=<cpu>
    and -m<feature>/-mno-<feature> options (-march=native expanded), clang's -target-cpu and -target-feature
    pairs. Tuning (-mtune, cache-size parameters) is left out: it changes speed, never which instructions run."""
    for line in dry_run.splitlines():
        try:
            tokens = shlex.split(line)
        except ValueError:
            continue
        if "-cc1" in tokens:  # clang
            target = [f"{t} {v}" for t, v in zip(tokens, tokens[1:]) if t in ("-target-cpu", "-target-feature")]
        elif tokens and Path(tokens[0]).name.startswith("cc1"):  # gcc: cc1, cc1plus
            target = [t for t in tokens if t.startswith("-m") and not t.startswith("-mtune=")]
        else:
            continue
        if target:
            return tuple(target)
    return ()


def native_target(compiler: str, flags: tuple[str, ...] = FLAGS) -> tuple[str, ...]:
    """What the target options in flags (-march=native) resolve to on this host, as the compiler reports it (a
    `-###` dry run: nothing is compiled). Raises RuntimeError when the compiler does not say."""
    proc = subprocess.run([compiler, *flags, "-###", "-E", "-x", "c++", os.devnull], capture_output=True, text=True,
                          timeout=60)
    target = parse_target(proc.stderr)
    if proc.returncode != 0 or not target:
        raise RuntimeError(f"{compiler} did not say which CPU {' '.join(flags)} targets on this host, so the library "
                           f"cannot be cached safely:\n{proc.stderr[-2000:]}")
    return target


def library_name(source_text: bytes, flags: tuple[str, ...], compiler_version: str, target: tuple[str, ...],
                 stem: str = "coat_cpu_adamw") -> str:
    """The cache file name: the target CPU's name (for people reading the folder) and a hash of everything that
    decides the library's bytes and where it may run."""
    key = hashlib.sha256(b"\0".join([source_text, " ".join(flags).encode(), compiler_version.encode(),
                                     "\n".join(target).encode()])).hexdigest()[:16]
    cpu = next((t.split("=", 1)[1] for t in target if t.startswith("-march=")), None)
    cpu = cpu or next((t.split(" ", 1)[1] for t in target if t.startswith("-target-cpu ")), "cpu")
    return f"{stem}-{re.sub(r'[^A-Za-z0-9_.-]', '_', cpu)}-{key}.so"


def cached_path(compiler: str, flags: tuple[str, ...], source: Path = SOURCE, cache_dir: Path | None = None) -> Path:
    """Where the library that compiler builds from source with flags for this host's CPU is cached (nothing is
    compiled); cache_dir: default default_cache_dir()."""
    source = Path(source)
    if not source.is_file():
        raise RuntimeError(f"{source} is missing (coat-fp8 installed without its package data? reinstall it)")
    version = subprocess.run([compiler, "--version"], capture_output=True, text=True, timeout=30).stdout
    header = HEADER.read_bytes() if HEADER.is_file() else b""
    name = library_name(source.read_bytes() + header, flags, version, native_target(compiler, flags),
                        stem=f"coat_{source.stem}")
    return (_writable_dir(Path(cache_dir)) if cache_dir is not None else default_cache_dir()) / name


def build(compiler: str | None = None, extra_flags: tuple[str, ...] = (), source: Path = SOURCE,
          cache_dir: Path | None = None) -> Path:
    """Compile the library (if not cached) and return its path; raises on failure. extra_flags: appended to FLAGS
    (the tests build the portable implementation alone with "-DCOAT_PORTABLE"); source: another version of the
    file (benchmarks compare versions); cache_dir: where the library is kept (default: default_cache_dir())."""
    compiler = compiler or find_compiler()
    flags = (*FLAGS, *extra_flags)
    path = cached_path(compiler, flags, source, cache_dir)
    if not path.exists():
        scratch = tempfile.mkdtemp(prefix=".build-", dir=path.parent)  # private to this build: no clash between
        try:                                                            # processes or hosts building one file
            built = Path(scratch, path.name)
            proc = subprocess.run([compiler, *flags, str(source), "-o", str(built)], capture_output=True, text=True,
                                  timeout=300)
            if proc.returncode != 0:
                raise RuntimeError(f"building {Path(source).name} with {compiler} failed:\n{proc.stderr[-2000:]}")
            os.replace(built, path)  # atomic: concurrent builds of one file each produce the same bytes
        finally:
            shutil.rmtree(scratch, ignore_errors=True)
    return path


def load(path: Path):
    """The library built at path, loaded (either step's: its int64 entry points declared)."""
    lib = ctypes.CDLL(str(path))
    for entry in ("coat_fused_adamw_step", "coat_fused_lion_step"):
        if hasattr(lib, entry):
            getattr(lib, entry).restype = ctypes.c_int64
    return lib


@lru_cache(maxsize=1)
def library():
    """The loaded AdamW library, or None (it cannot be built or loaded: one warning naming why, and the reference is
    used)."""
    return _loaded(build, "optimizer step")


@lru_cache(maxsize=1)
def lion_library():
    """The loaded Lion library, or None (as `library`)."""
    return _loaded(lambda: build(source=LION_SOURCE), "Lion step")


def _loaded(make, what: str):
    try:
        return load(make())
    except Exception as exc:  # no compiler, no source, no cache folder, a failed build or load: the reference works
        warnings.warn(f"coat-fp8: the fast CPU {what} is unavailable ({exc}); CPU tensors use the torch "
                      "reference step (same results, much slower)", RuntimeWarning, stacklevel=3)
        return None


_BOUNDS: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()  # layout -> (starts, lengths): made once each


def _bounds(layout: GroupLayout):
    """(starts, lengths) of the layout's groups, checked once per layout to lie inside its numel elements."""
    bounds = _BOUNDS.get(layout)
    if bounds is None:
        starts, lengths = layout.group_bounds()
        if len(starts) != layout.num_groups or len(starts) and (
                int(starts.min()) < 0 or int(lengths.min()) < 1 or int((starts + lengths).max()) > layout.numel):
            raise ValueError(f"a GroupLayout whose groups do not lie inside its {layout.numel} elements (or are not "
                             f"{layout.num_groups}): build it with coat_kernels.optim.grouping.build_layout")
        bounds = _BOUNDS[layout] = (starts.contiguous(), lengths.contiguous())
    return bounds


def _check_step_arguments(param, grad, m_codes, m_meta, v_codes, v_meta, layout: GroupLayout) -> None:
    """O(1) checks before the library touches memory: every tensor on the CPU and as large as the layout says (FP8
    codes [numel], fp32 metadata [3, n_groups]); ValueError naming the argument otherwise."""
    n, groups = layout.numel, layout.num_groups
    meta_shape = (3, groups)
    try:  # the common case in one expression (this runs on every step of every tensor)
        if (param.is_cpu and grad.is_cpu and m_codes.is_cpu and m_meta.is_cpu and v_codes.is_cpu and v_meta.is_cpu
                and param.numel() == n and grad.numel() == n and m_codes.numel() == n and v_codes.numel() == n
                and m_codes.element_size() == 1 and v_codes.element_size() == 1 and m_codes.is_floating_point()
                and v_codes.is_floating_point() and m_meta.dtype == torch.float32 and v_meta.dtype == torch.float32
                and m_meta.shape == meta_shape and v_meta.shape == meta_shape):
            return
    except AttributeError:
        pass
    for name, t in (("param", param), ("grad", grad), ("m_codes", m_codes), ("m_meta", m_meta),
                    ("v_codes", v_codes), ("v_meta", v_meta)):
        if not isinstance(t, torch.Tensor) or t.device.type != "cpu":
            raise ValueError(f"the CPU step needs CPU tensors; {name} is "
                             f"{t.device if isinstance(t, torch.Tensor) else type(t).__name__}")
    for name, t in (("param", param), ("grad", grad)):
        if t.numel() != n:
            raise ValueError(f"the CPU step: {name} has {t.numel()} elements, the layout {n}")
    for name, t in (("m_codes", m_codes), ("v_codes", v_codes)):
        if t.element_size() != 1 or not t.is_floating_point() or t.numel() != n:
            raise ValueError(f"the CPU step: {name} must be {n} FP8 codes, got {t.dtype} {tuple(t.shape)}")
    for name, t in (("m_meta", m_meta), ("v_meta", v_meta)):
        if t.dtype != torch.float32 or tuple(t.shape) != (3, groups):
            raise ValueError(f"the CPU step: {name} must be torch.float32 (3, {groups}) for the layout's {groups} "
                             f"groups, got {t.dtype} {tuple(t.shape)}")


def _moment_args(cfg: DREConfig):
    fmt = cfg.fmt
    consts = torch.tensor([cfg.log2_max, cfg.expand_numerator, cfg.inv_expand_min, reference.f32(cfg.k_max),
                           fmt.max, fmt.min_subnormal], dtype=torch.float32)
    ints = torch.tensor([int(cfg.expand), int(cfg.keep_nonzero), fmt.mantissa_bits, fmt.min_normal_exp,
                         1 - fmt.min_normal_exp], dtype=torch.int32)
    return consts, ints, fmt.log2_table("cpu")


def _ptr(t: torch.Tensor):
    return ctypes.c_void_p(t.data_ptr())


def fused_adamw_step(param, grad, m_codes, m_meta, v_codes, v_meta, layout: GroupLayout, h: AdamWScalars,
                     m_cfg: DREConfig, v_cfg: DREConfig, skip_nonfinite: bool = True,
                     remainder: torch.Tensor | None = None) -> torch.Tensor:
    """dre_reference.fused_adamw_step, for CPU tensors (see the module docstring). Tensors that do not fit the
    layout raise ValueError before anything is read. The torch reference steps what the library does not take:
    parameters other than fp32 / bf16, non-contiguous tensors, groups larger than the library's limit
    (`coat_max_group`, 1024 elements) and any step when the library cannot be built; the results are the same bits.
    remainder: a bf16 param's master remainders (see the reference)."""
    _check_step_arguments(param, grad, m_codes, m_meta, v_codes, v_meta, layout)
    if remainder is not None and (param.dtype != torch.bfloat16 or remainder.dtype != torch.int16 or
                                  remainder.numel() != layout.numel or not remainder.is_cpu):
        raise ValueError(f"the CPU step: master remainders belong to a bf16 param and must be {layout.numel} int16 "
                         f"CPU elements, got {remainder.dtype} {tuple(remainder.shape)} on {remainder.device} for a "
                         f"{param.dtype} param")
    lib = library()
    if lib is None or param.dtype not in _PARAM_KINDS or layout.group_size > lib.coat_max_group() or not all(
            t.is_contiguous() for t in (param, m_codes, m_meta, v_codes, v_meta)) or (
            remainder is not None and not remainder.is_contiguous()):
        return reference.fused_adamw_step(param, grad, m_codes, m_meta, v_codes, v_meta, layout, h, m_cfg, v_cfg,
                                          skip_nonfinite, remainder=remainder)
    grad = grad.reshape(-1)
    if grad.dtype not in _GRAD_KINDS:
        grad = grad.float()
    grad = grad.contiguous()
    starts, lengths = _bounds(layout)
    scalars = torch.tensor([getattr(h, f) for f in AdamWScalars.__dataclass_fields__], dtype=torch.float32)
    (m_consts, m_ints, m_table), (v_consts, v_ints, v_table) = _moment_args(m_cfg), _moment_args(v_cfg)
    kind = _PARAM_KINDS[param.dtype] if remainder is None else _BF16_WITH_REMAINDERS
    skipped = lib.coat_fused_adamw_step(
        _ptr(param), kind, _ptr(param if remainder is None else remainder), _ptr(grad), _GRAD_KINDS[grad.dtype],
        _ptr(m_codes), _ptr(m_meta), _ptr(v_codes), _ptr(v_meta), _ptr(starts), _ptr(lengths),
        ctypes.c_int64(layout.num_groups), _ptr(scalars), _ptr(m_consts), _ptr(m_ints), _ptr(v_consts), _ptr(v_ints),
        _ptr(m_table), _ptr(v_table),
        int(skip_nonfinite), torch.get_num_threads())
    return torch.tensor(skipped, dtype=torch.int64)


def fused_lion_step(param, grad, codes, meta, layout: GroupLayout, h, cfg: DREConfig) -> torch.Tensor:
    """lion_reference.fused_lion_step, for CPU tensors: checked and dispatched as `fused_adamw_step` (the torch
    reference steps what the library does not take), with the same results."""
    from . import lion_reference

    _check_step_arguments(param, grad, codes, meta, codes, meta, layout)  # one moment: checked as both
    lib = lion_library()
    if lib is None or param.dtype not in _PARAM_KINDS or layout.group_size > lib.coat_max_group() or not all(
            t.is_contiguous() for t in (param, codes, meta)):
        return lion_reference.fused_lion_step(param, grad, codes, meta, layout, h, cfg)
    grad = grad.reshape(-1)
    if grad.dtype not in _GRAD_KINDS:
        grad = grad.float()
    grad = grad.contiguous()
    starts, lengths = _bounds(layout)
    scalars = torch.tensor([getattr(h, f) for f in type(h).__dataclass_fields__], dtype=torch.float32)
    consts, ints, table = _moment_args(cfg)
    skipped = lib.coat_fused_lion_step(
        _ptr(param), _PARAM_KINDS[param.dtype], _ptr(grad), _GRAD_KINDS[grad.dtype], _ptr(codes), _ptr(meta),
        _ptr(starts), _ptr(lengths), ctypes.c_int64(layout.num_groups), _ptr(scalars), _ptr(consts), _ptr(ints),
        _ptr(table), torch.get_num_threads())
    return torch.tensor(skipped, dtype=torch.int64)
