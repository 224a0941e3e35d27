"""Auto-registration: the installed coat_fp8_autoregister.pth registers CoatFP8AdamW whenever deepspeed is imported,
imports nothing at start-up, never breaks start-up, and ships in regular wheels too (editable installs are what CI
has: launch/setup.sh runs `pip install -e .`)."""
import os
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest

pytest.importorskip("deepspeed")
ROOT = Path(__file__).resolve().parents[1]
PTH = ROOT / "coat_ds" / "coat_fp8_autoregister.pth"


def python(code, **env):
    """Run `code` in a fresh interpreter, outside the repository (so nothing is importable from the cwd)."""
    proc = subprocess.run([sys.executable, "-c", code], cwd="/", capture_output=True, text=True, timeout=120,
                          env={**os.environ, "DS_ACCELERATOR": "cpu", **env})
    assert proc.returncode == 0, proc.stdout + proc.stderr
    return proc.stdout.strip().splitlines()[-1] if proc.stdout.strip() else ""


def test_pth_installed_and_free_at_startup():
    out = python("import sys, site, os\n"
                 "paths = [os.path.join(p, 'coat_fp8_autoregister.pth') for p in site.getsitepackages()]\n"
                 "found = [p for p in paths if os.path.exists(p)]\n"
                 "hooks = [f for f in sys.meta_path if getattr(f, 'coat_fp8_hook', False)]\n"
                 "heavy = [m for m in ('torch', 'deepspeed', 'coat_ds') if m in sys.modules]\n"
                 "print(len(found), open(found[0]).read() == open(%r).read() if found else None, len(hooks), heavy)"
                 % str(PTH))
    assert out == "1 True 1 []", out


def test_import_deepspeed_registers_without_importing_coat_ds():
    out = python("import torch, deepspeed\n"
                 "from deepspeed.runtime.zero.utils import ZERO_SUPPORTED_OPTIMIZERS as zero\n"
                 "import coat_ds\n"
                 "print(torch.optim.CoatFP8AdamW is coat_ds.CoatFP8AdamW, coat_ds.CoatFP8AdamW in zero)")
    assert out == "True True", out


def test_switch_off_and_import_coat_ds_first():
    off = python("import torch, deepspeed; print(hasattr(torch.optim, 'CoatFP8AdamW'))",
                 COAT_FP8_NO_AUTOREGISTER="1")
    assert off == "False"
    # without the start-up hook, `import coat_ds` before deepspeed still registers once deepspeed is imported
    first = python("import coat_ds, torch, sys; assert 'deepspeed' not in sys.modules\n"
                   "import deepspeed\n"
                   "from deepspeed.runtime.zero.utils import ZERO_SUPPORTED_OPTIMIZERS as zero\n"
                   "print(torch.optim.CoatFP8AdamW is coat_ds.CoatFP8AdamW, coat_ds.CoatFP8AdamW in zero)",
                   COAT_FP8_NO_AUTOREGISTER="1")
    assert first == "True True"


def test_failed_registration_never_breaks_deepspeed_import():
    out = python("import warnings, torch\n"
                 "torch.optim.CoatFP8AdamW = object  # someone else's class under our name\n"
                 "with warnings.catch_warnings(record=True) as w:\n"
                 "    warnings.simplefilter('always')\n"
                 "    import deepspeed\n"
                 "print(torch.optim.CoatFP8AdamW is object, any('could not register' in str(x.message) for x in w))")
    assert out == "True True", out


def test_regular_wheel_ships_the_pth(tmp_path):
    subprocess.run([sys.executable, "-m", "pip", "wheel", "-q", "--no-build-isolation", "--no-deps", "-w",
                    str(tmp_path), str(ROOT)], check=True, capture_output=True, timeout=300)
    wheel, = tmp_path.glob("coat_fp8-*.whl")
    names = zipfile.ZipFile(wheel).namelist()
    assert "coat_fp8_autoregister.pth" in names and "coat_ds/_autoregister.py" in names
