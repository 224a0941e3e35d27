"""coat-fp8 as users install it: a source distribution built from the checkout, a wheel built from that (as
`python -m build` does), installed (not editable) into a fresh virtual environment that sees this environment's
dependencies but not the checkout. From outside the checkout: the wheel holds the C++ CPU step's source and the
DeepSpeed start-up hook (at its root); the installed C++ step builds (into a temporary cache folder given through
COAT_FP8_CACHE_DIR, never the real ~/.cache) and steps bit-exactly with the reference; the installed start-up hook
registers CoatFP8AdamW when deepspeed is imported; `import coat_hf` leaves deepspeed unimported. Nothing is
downloaded (--no-build-isolation --no-deps)."""
import email
import json
import os
import shutil
import site
import subprocess
import sys
import tarfile
import zipfile
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
PTH = "coat_fp8_autoregister.pth"


def run(*args, **kwargs):
    proc = subprocess.run([str(a) for a in args], capture_output=True, text=True, timeout=300, **kwargs)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    return proc.stdout


class Install:
    """The built sdist and wheel, and a fresh virtual environment with the wheel installed."""

    def __init__(self, base: Path):
        source = base / "source"  # the checkout without its build state (egg-info, build/, .venv), as CI clones it
        shutil.copytree(ROOT, source, ignore=shutil.ignore_patterns(".*", "build", "dist", "*.egg-info",
                                                                     "__pycache__", "out", "runs"))
        dist = base / "dist"
        run(sys.executable, "-c", "import sys; from setuptools import build_meta; build_meta.build_sdist(sys.argv[1])",
            dist, cwd=source)
        self.sdist, = dist.glob("coat_fp8-*.tar.gz")
        run(sys.executable, "-m", "pip", "wheel", "-q", "--no-build-isolation", "--no-deps", "-w", dist, self.sdist,
            cwd=base)
        self.wheel, = dist.glob("coat_fp8-*.whl")
        self.env = base / "venv"
        run(sys.executable, "-m", "venv", "--without-pip", self.env)
        self.python = self.env / "bin" / "python"
        self.site = Path(run(self.python, "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])").strip())
        run(sys.executable, "-m", "pip", "--python", self.python, "install", "-q", "--no-deps", "--no-build-isolation",
            self.wheel, cwd=base)
        # this environment's packages (torch, deepspeed, ...) as plain path entries: its own .pth files (the
        # editable install of the checkout among them) do not run
        (self.site / "zz_test_dependencies.pth").write_text("\n".join(site.getsitepackages()) + "\n")
        self.home, self.cache, self.work = base / "home", base / "cache", base / "work"
        for folder in (self.home, self.work):
            folder.mkdir()

    def python_run(self, code: str) -> dict:
        """Run code in the installed environment, from a folder outside the checkout; it prints one JSON line."""
        env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "XDG_CACHE_HOME", "TRITON_INTERPRET")}
        env.update(HOME=str(self.home), COAT_FP8_CACHE_DIR=str(self.cache), DS_ACCELERATOR="cpu")
        out = run(self.python, "-c", code, cwd=self.work, env=env)
        return json.loads(out.strip().splitlines()[-1])


@pytest.fixture(scope="module")
def installed(tmp_path_factory):
    return Install(tmp_path_factory.mktemp("wheel"))


def test_sdist_and_wheel_hold_the_cpp_source_and_the_startup_hook(installed):
    sdist = tarfile.open(installed.sdist).getnames()
    prefix = installed.sdist.name[:-len(".tar.gz")]
    assert f"{prefix}/kernels/optim/cpu_adamw.cpp" in sdist and f"{prefix}/coat_ds/{PTH}" in sdist
    wheel = zipfile.ZipFile(installed.wheel)
    names = wheel.namelist()
    assert wheel.read("coat_kernels/optim/cpu_adamw.cpp") == (ROOT / "kernels/optim/cpu_adamw.cpp").read_bytes()
    assert wheel.read(PTH) == (ROOT / "coat_ds" / PTH).read_bytes()  # at the root: site-packages runs it
    packages = {"coat_kernels", "coat_kernels/optim", "coat_kernels/act", "coat_ds", "coat_megatron"}
    if (ROOT / "coat_hf").is_dir():
        packages |= {"coat_hf", "coat_hf/families"}
    assert {f"{p}/__init__.py" for p in packages} <= set(names)
    assert not [n for n in names if n.startswith(("tests/", "benchmarks/", "launch/", "kernels/"))]


def test_wheel_metadata_bounds_every_dependency_and_offers_the_documented_extras(installed):
    info = next(n for n in zipfile.ZipFile(installed.wheel).namelist() if n.endswith(".dist-info/METADATA"))
    metadata = email.message_from_bytes(zipfile.ZipFile(installed.wheel).read(info))
    assert {"deepspeed", "megatron", "hf", "all"} <= set(metadata.get_all("Provides-Extra"))
    unbounded = [r for r in metadata.get_all("Requires-Dist")
                 if not r.startswith("coat-fp8") and "<" not in r and "==" not in r and 'extra == "tests"' not in r]
    assert not unbounded, unbounded


def test_installed_package_builds_and_runs_the_cpp_step(installed):
    out = installed.python_run(
        "import json, sys, warnings, torch\n"
        "warnings.simplefilter('error')\n"
        "import coat_kernels\n"
        "from coat_kernels.optim import cpu_step, dre_reference as ref\n"
        "from coat_kernels.optim.grouping import build_layout\n"
        "lib = cpu_step.library()\n"
        "layout = build_layout(None, 4096, 128)\n"
        "m_cfg, v_cfg = ref.DREConfig('e4m3'), ref.DREConfig('e4m3', keep_nonzero=True)\n"
        "h = ref.AdamWScalars.make(1e-3, 0.9, 0.95, 1e-8, 0.1, 2)\n"
        "g = torch.Generator().manual_seed(0)\n"
        "p, grad = torch.randn(4096, generator=g), torch.randn(4096, generator=g) * 1e-3\n"
        "mq, mm = ref.quantize(grad, layout, m_cfg)\n"
        "vq, vm = ref.quantize(grad * grad, layout, v_cfg)\n"
        "a, b = [[t.clone() for t in (p, mq, mm, vq, vm)] for _ in range(2)]\n"
        "ref.fused_adamw_step(a[0], grad, *a[1:], layout, h, m_cfg, v_cfg)\n"
        "cpu_step.fused_adamw_step(b[0], grad, *b[1:], layout, h, m_cfg, v_cfg)\n"
        "same = all(torch.equal(x.view(torch.uint8), y.view(torch.uint8)) for x, y in zip(a, b))\n"
        "print(json.dumps({'package': coat_kernels.__file__, 'source': str(cpu_step.SOURCE), 'built': lib is not None,"
        " 'cache': [str(f) for f in cpu_step.default_cache_dir().iterdir()], 'same': same,"
        " 'changed': not torch.equal(a[0], p)}))")
    assert Path(out["package"]).is_relative_to(installed.site), out  # the wheel's copy, not the checkout
    assert Path(out["source"]).is_relative_to(installed.site) and out["built"], out
    assert [Path(f).parent for f in out["cache"]] == [installed.cache], out
    assert out["same"] and out["changed"], out
    assert not (installed.home / ".cache" / "coat_fp8").exists()


def test_installed_startup_hook_registers_with_deepspeed(installed):
    assert (installed.site / PTH).is_file()
    out = installed.python_run(
        "import json, sys, torch\n"
        "hooks = [f for f in sys.meta_path if getattr(f, 'coat_fp8_hook', False)]\n"
        "idle = not any(m in sys.modules for m in ('deepspeed', 'coat_ds'))\n"
        "import deepspeed\n"
        "import coat_ds\n"
        "print(json.dumps({'hooks': len(hooks), 'idle': idle, 'coat_ds': coat_ds.__file__,"
        " 'registered': getattr(torch.optim, 'CoatFP8AdamW', None) is coat_ds.CoatFP8AdamW}))")
    assert out["hooks"] == 1 and out["idle"] and out["registered"], out
    assert Path(out["coat_ds"]).is_relative_to(installed.site), out


def test_installed_coat_hf_leaves_deepspeed_unimported(installed):
    if not (ROOT / "coat_hf").is_dir():
        pytest.skip("this source tree has no coat_hf/ (the package list names it: checked once it is merged)")
    out = installed.python_run("import json, sys\nimport coat_hf\nprint(json.dumps("
                               "{'coat_hf': coat_hf.__file__, 'deepspeed': 'deepspeed' in sys.modules}))")
    assert Path(out["coat_hf"]).is_relative_to(installed.site) and not out["deepspeed"], out
