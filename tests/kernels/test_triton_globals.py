"""Every @triton.jit function in coat_kernels reads only the globals Triton's compiler accepts.

Triton compiles a kernel on the GPU only if each global it names is a module, another jit function, a Triton
builtin or dtype, or a `tl.constexpr(...)` instance; a plain `N = 5` read inside a kernel is a NameError at
compile time. The CPU tests run kernels under TRITON_INTERPRET=1, which executes them as Python and does not
apply that rule, so this test applies it to the source of every kernel.
"""
import ast
import builtins
import importlib
import inspect
import pkgutil
import textwrap
from types import ModuleType

import pytest

triton = pytest.importorskip("triton")
from triton.runtime.interpreter import InterpretedFunction  # noqa: E402
from triton.runtime.jit import JITFunction  # noqa: E402

import coat_kernels  # noqa: E402

# What @triton.jit returns: a JITFunction, or an InterpretedFunction under TRITON_INTERPRET=1.
JIT_TYPES = (JITFunction, InterpretedFunction)


def jit_functions():
    """(qualified name, jit function) for every jit function defined in a coat_kernels module."""
    found = {}
    for info in pkgutil.walk_packages(coat_kernels.__path__, coat_kernels.__name__ + "."):
        module = importlib.import_module(info.name)
        for name, value in vars(module).items():
            if isinstance(value, JIT_TYPES) and value.fn.__module__ == module.__name__:
                found[f"{module.__name__}.{name}"] = value
    return sorted(found.items())


def free_names(source: str) -> set:
    """Names a function's body reads that it does not bind itself (parameters, assignments, loop targets)."""
    tree = ast.parse(textwrap.dedent(source))
    fn = tree.body[0]
    bound = {a.arg for a in fn.args.args + fn.args.kwonlyargs + fn.args.posonlyargs}
    read = set()
    for node in ast.walk(fn):
        if isinstance(node, ast.Name):
            (read if isinstance(node.ctx, ast.Load) else bound).add(node.id)
    return read - bound


def accepted_by_triton(value) -> bool:
    """Triton's code generator's rule for a global read inside a kernel."""
    import triton.language as tl
    return (isinstance(value, (ModuleType, *JIT_TYPES, tl.constexpr, tl.dtype))
            or getattr(value, "__triton_builtin__", False)
            or getattr(value, "__module__", "").startswith("triton.language"))


def rejected_globals(fn) -> list:
    scope = fn.fn.__globals__
    return sorted(name for name in free_names(inspect.getsource(fn.fn))
                  if name in scope and not hasattr(builtins, name) and not accepted_by_triton(scope[name]))


def test_the_walk_finds_the_kernels():
    names = {name.rsplit(".", 1)[1] for name, _ in jit_functions()}
    assert {"_finite_flags_kernel", "_muon_momentum_kernel", "_apply_update_kernel"} <= names
    assert len(names) > 20


@pytest.mark.parametrize("name,fn", jit_functions(), ids=lambda v: v if isinstance(v, str) else "")
def test_kernel_reads_only_globals_triton_compiles(name, fn):
    assert rejected_globals(fn) == [], (
        f"{name} reads globals Triton cannot compile: make them tl.constexpr(...) instances")


def test_the_rule_catches_a_plain_global(tmp_path, monkeypatch):
    (tmp_path / "kernel_with_plain_global.py").write_text(textwrap.dedent('''
        import triton
        import triton.language as tl
        WIDTH = 5
        OK = tl.constexpr(5)

        @triton.jit
        def bad(x):
            y = x + WIDTH
            return tl.maximum(y, OK)
    '''))
    monkeypatch.syspath_prepend(str(tmp_path))
    module = importlib.import_module("kernel_with_plain_global")
    assert rejected_globals(module.bad) == ["WIDTH"]
