"""Auto-registration: the installed coat_fp8_autoregister.pth registers CoatFP8AdamW whenever deepspeed is imported,
also after `importlib.util.find_spec("deepspeed")` probes (transformers, accelerate), imports nothing at start-up,
never breaks start-up, and ships in regular wheels too (editable installs are what CI has: launch/setup.sh runs
`pip install -e .`). The Hugging Face Trainer with a ds_config naming CoatFP8AdamW trains, saves and resumes
exactly; a misspelled type gets the right name."""
import json
import os
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest

from coat_ds.engine_hooks import check_optimizer_type
from rank_helpers import JOBS

ROOT = Path(__file__).resolve().parents[2]
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


REGISTERED = ("from deepspeed.runtime.zero.utils import ZERO_SUPPORTED_OPTIMIZERS as zero\n"
              "import coat_ds\n"
              "print(torch.optim.CoatFP8AdamW is coat_ds.CoatFP8AdamW, coat_ds.CoatFP8AdamW in zero)")


@pytest.mark.parametrize("probe", [
    "import importlib.util; assert importlib.util.find_spec('deepspeed'); importlib.util.find_spec('deepspeed')",
    "from transformers.integrations.deepspeed import is_deepspeed_available; assert is_deepspeed_available()",
    "from accelerate.utils import is_deepspeed_available; assert is_deepspeed_available()",
])
def test_probes_before_the_import_do_not_consume_the_hook(probe):
    out = python(f"import torch, sys\n{probe}\nassert 'deepspeed' not in sys.modules\nimport deepspeed\n" + REGISTERED)
    assert out == "True True", out


def test_import_coat_ds_then_probe_then_deepspeed():
    """`import coat_ds` at any point before deepspeed is imported is enough, start-up hook or not."""
    code = ("import coat_ds, torch, sys, importlib.util\n"
            "assert importlib.util.find_spec('deepspeed') and 'deepspeed' not in sys.modules\n"
            "import deepspeed\n" + REGISTERED)
    assert python(code) == "True True"
    assert python(code, COAT_FP8_NO_AUTOREGISTER="1") == "True True"


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


@pytest.mark.parametrize("name", ["CoatFp8AdamW", "coatfp8adamw", "CoatFP8_AdamW", "CoatFP8Adam"])
def test_misspelled_optimizer_type_names_the_right_one(name):
    with pytest.raises(ValueError, match='did you mean "CoatFP8AdamW"'):
        check_optimizer_type(name)


@pytest.mark.parametrize("name", ["CoatFP8AdamW", "AdamW", "adam", "Lamb", "SGD", "OneBitAdam", None])
def test_other_optimizer_types_pass_the_check(name):
    check_optimizer_type(name)


def test_misspelled_type_fails_deepspeed_initialize_with_the_hint():
    code = ("import os, sys, importlib, torch, deepspeed\n"
            "importlib.import_module('deepspeed.comm.torch')\n"
            "sys.modules['deepspeed.comm.torch'].build_shm_op = lambda: None\n"
            "os.environ.update(MASTER_ADDR='127.0.0.1', MASTER_PORT='29613', RANK='0', LOCAL_RANK='0', "
            "WORLD_SIZE='1')\n"
            "cfg = {'train_micro_batch_size_per_gpu': 1,\n"
            "       'optimizer': {'type': 'CoatFp8AdamW', 'params': {'lr': 1e-3}}}\n"
            "try:\n"
            "    deepspeed.initialize(model=torch.nn.Linear(16, 16), config=cfg)\n"
            "except ValueError as exc:\n"
            "    print('hint' if 'did you mean \"CoatFP8AdamW\"' in str(exc) else repr(exc))\n")
    assert python(code) == "hint"


def test_hf_trainer_with_deepspeed_trains_saves_and_resumes_exactly(tmp_path):
    """Trainer + ZeRO-2 + "type": "CoatFP8AdamW" from a script that never imports coat_ds: 6 steps straight, and 3
    steps resumed from the step-3 checkpoint of that run, give the same losses."""
    job = JOBS / "hf_trainer_job.py"

    def run(*args, port):
        proc = subprocess.run([sys.executable, str(job), *map(str, args)], capture_output=True, text=True,
                              timeout=300, cwd=tmp_path, env={**os.environ, "MASTER_PORT": str(port)})
        assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
        return json.loads(proc.stdout.strip().splitlines()[-1])

    straight = run(tmp_path / "a", 6, port=29621)
    assert straight["optimizer"] == "CoatFP8AdamW" and straight["registered"]
    resumed = run(tmp_path / "a", 6, tmp_path / "a" / "checkpoint-3", port=29622)
    assert sorted(straight["losses"]) == sorted(resumed["losses"]) == ["1", "2", "3", "4", "5", "6"]
    assert resumed["losses"] == straight["losses"]  # steps 1-3 from the checkpoint's history, 4-6 trained again
