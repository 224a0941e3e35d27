"""Register CoatFP8AdamW with DeepSpeed right after `deepspeed` is imported, in any Python process.

Run at interpreter start-up by `coat_fp8_autoregister.pth` (installed into site-packages by setup.py), which loads
this file by path: nothing else of coat_ds, torch or deepspeed is imported at start-up. `install()` puts a one-shot
finder on `sys.meta_path`; when `import deepspeed` runs, the finder wraps deepspeed's loader so that, once the
module has executed, `import coat_ds` runs (which registers the optimizer). Any failure is a warning, never an
error. Set COAT_FP8_NO_AUTOREGISTER=1 to switch the start-up hook off.

Standalone on purpose: no imports from coat_ds (this file is executed outside the package at start-up).
"""
import os
import sys

WATCHED = "deepspeed"


class DeepSpeedImportHook:
    """A meta-path finder that only answers for `deepspeed`, and only once."""

    coat_fp8_hook = True

    def find_spec(self, name, path=None, target=None):
        if name != WATCHED:
            return None
        _remove_hooks()
        spec = None
        for finder in list(sys.meta_path):
            find = getattr(finder, "find_spec", None)
            spec = find(name, path, target) if find else None
            if spec is not None:
                break
        loader = getattr(spec, "loader", None)
        if loader is None or not hasattr(loader, "exec_module"):
            return spec
        exec_module = loader.exec_module

        def exec_then_register(module):
            exec_module(module)
            register_now()

        loader.exec_module = exec_then_register
        return spec


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
