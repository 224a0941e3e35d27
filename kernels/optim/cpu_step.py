"""The fused COAT AdamW step for CPU tensors: `cpu_adamw.cpp`, built on first use, bit-exact with the torch reference.

`fused_adamw_step` has `dre_reference.fused_adamw_step`'s signature and results (the same bits: parameters, codes,
metadata, skipped groups). The library is built with the system C++ compiler (`-O3 -march=native -ffp-contract=off
-fopenmp`: vectorized for this CPU, no fused multiply-add but the explicit ones; on CPUs with AVX-512 VBMI the source
selects its intrinsics path, elsewhere its portable one) into ~/.cache/coat_fp8 (a temporary directory when that is
not writable), keyed by the source, the flags and the compiler, and loaded through ctypes; a build takes a few seconds
once per machine. Without a working compiler the step falls back to the torch reference, with one warning. Threads:
torch.get_num_threads().
"""
from __future__ import annotations

import ctypes
import hashlib
import os
import shutil
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
FLAGS = ("-O3", "-march=native", "-ffp-contract=off", "-fno-math-errno", "-fopenmp", "-shared", "-fPIC", "-std=c++17")
_PARAM_KINDS = {torch.float32: 0, torch.bfloat16: 1}
_BF16_WITH_REMAINDERS = 2
_GRAD_KINDS = {torch.float32: 0, torch.bfloat16: 1}


def _cache_dir() -> Path:
    home = Path.home() / ".cache" / "coat_fp8"
    try:
        home.mkdir(parents=True, exist_ok=True)
        if os.access(home, os.W_OK):
            return home
    except OSError:
        pass
    return Path(tempfile.gettempdir())


def build(compiler: str | None = None, extra_flags: tuple[str, ...] = (), source: Path = SOURCE) -> Path:
    """Compile the library (if not cached) and return its path; raises on failure. extra_flags: appended to FLAGS
    (the tests build the portable implementation alone with "-DCOAT_PORTABLE"); source: another version of the
    file (benchmarks compare versions)."""
    compiler = compiler or shutil.which("g++") or shutil.which("c++")
    if compiler is None:
        raise RuntimeError("no C++ compiler (g++ or c++) on PATH")
    flags = (*FLAGS, *extra_flags)
    version = subprocess.run([compiler, "--version"], capture_output=True, text=True, timeout=30).stdout
    key = hashlib.sha256(Path(source).read_bytes() + " ".join(flags).encode() + version.encode()).hexdigest()[:16]
    path = _cache_dir() / f"coat_cpu_adamw-{key}.so"
    if not path.exists():
        tmp = path.with_suffix(f".{os.getpid()}.tmp")
        proc = subprocess.run([compiler, *flags, str(source), "-o", str(tmp)], capture_output=True, text=True,
                              timeout=300)
        if proc.returncode != 0:
            raise RuntimeError(f"building {Path(source).name} failed:\n{proc.stderr[-2000:]}")
        os.replace(tmp, path)  # atomic: concurrent builds (several ranks) each produce the same file
    return path


def load(path: Path):
    """The library built at path, loaded."""
    lib = ctypes.CDLL(str(path))
    lib.coat_fused_adamw_step.restype = ctypes.c_int64
    return lib


@lru_cache(maxsize=1)
def library():
    """The loaded library, or None (the build failed: one warning, and the reference is used)."""
    try:
        return load(build())
    except Exception as exc:  # no compiler, a failed build or load: the reference still works
        warnings.warn(f"coat-fp8: the fast CPU optimizer step is unavailable ({exc}); CPU tensors use the torch "
                      "reference step (same results, much slower)", RuntimeWarning, stacklevel=2)
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
        _ptr(param), kind, _ptr(param if remainder is None else remainder), _ptr(grad), _GRAD_KINDS[grad.dtype], _ptr(m_codes), _ptr(m_meta),
        _ptr(v_codes), _ptr(v_meta), _ptr(starts), _ptr(lengths), ctypes.c_int64(layout.num_groups), _ptr(scalars),
        _ptr(m_consts), _ptr(m_ints), _ptr(v_consts), _ptr(v_ints), _ptr(m_table), _ptr(v_table),
        int(skip_nonfinite), torch.get_num_threads())
    return torch.tensor(skipped, dtype=torch.int64)
