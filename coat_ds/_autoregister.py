"""Register CoatFP8AdamW with DeepSpeed right after `deepspeed` is imported, in any Python process.

Run at interpreter start-up by `coat_fp8_autoregister.pth` (installed into site-packages by setup.py), which loads
this file by path: nothing else of coat_ds, torch or deepspeed is imported at start-up. `install()` puts a finder on
`sys.meta_path` that answers only for `deepspeed`: each time the import system (or a probe such as
`importlib.util.find_spec("deepspeed")`, which transformers and accelerate run before they import it) asks for
deepspeed's spec, the finder returns the real spec with its loader's `exec_module` wrapped, so that the import which
actually executes deepspeed then runs `import coat_ds` (which registers the optimizer). Probes change nothing: the
finder stays until deepspeed has really been executed, then removes itself. Any failure is a warning, never an
error. Set COAT_FP8_NO_AUTOREGISTER=1 to switch the start-up hook off (`import coat_ds` still registers).

Standalone on purpose: no imports from coat_ds (this file is executed outside the package at start-up).
"""
import os
import sys
import threading

WATCHED = "deepspeed"


class DeepSpeedImportHook:
    """A meta-path finder that only answers for `deepspeed`, until deepspeed has been executed once."""

    coat_fp8_hook = True

    def __init__(self):
        self._local = threading.local()  # re-entrancy guard while the other finders are asked

    def find_spec(self, name, path=None, target=None):
        if name != WATCHED or getattr(self._local, "busy", False):
            return None
        self._local.busy = True
        try:
            spec = _find_with_other_finders(name, path, target)
        finally:
            self._local.busy = False
        loader = getattr(spec, "loader", None)
        if loader is None or not hasattr(loader, "exec_module"):
            return spec
        exec_module = loader.exec_module
        if getattr(exec_module, "coat_fp8_wrapped", False):
            return spec

        def exec_then_register(module):
            exec_module(module)
            _remove_hooks()
            register_now()

        exec_then_register.coat_fp8_wrapped = True
        loader.exec_module = exec_then_register  # this spec's own loader instance (a new one per lookup)
        return spec


def _find_with_other_finders(name, path, target):
    for finder in list(sys.meta_path):
        if getattr(finder, "coat_fp8_hook", False):
            continue
        find = getattr(finder, "find_spec", None)
        spec = find(name, path, target) if find else None
        if spec is not None:
            return spec
    return None


def register_now():
    try:
        import coat_ds  # noqa: F401  (registers with deepspeed, now importable)
        from coat_ds.deepspeed_plugin import register_with_deepspeed
        register_with_deepspeed()
    except Exception as exc:  # never break the user's import of deepspeed
        import warnings
        warnings.warn(f"coat-fp8: could not register CoatFP8AdamW with DeepSpeed: {exc!r}", RuntimeWarning)


def _remove_hooks():
    sys.meta_path[:] = [f for f in sys.meta_path if not getattr(f, "coat_fp8_hook", False)]


def install_at_startup():
    """What the .pth file runs; COAT_FP8_NO_AUTOREGISTER=1 switches it off (`import coat_ds` still registers)."""
    if not os.environ.get("COAT_FP8_NO_AUTOREGISTER"):
        install()


def install():
    """Idempotent. If deepspeed is already imported, the caller should register directly instead."""
    if WATCHED in sys.modules:
        return
    if not any(getattr(f, "coat_fp8_hook", False) for f in sys.meta_path):
        sys.meta_path.insert(0, DeepSpeedImportHook())
