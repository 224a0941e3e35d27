"""Everything is in pyproject.toml, except the start-up hook that registers CoatFP8AdamW with DeepSpeed.

`coat_ds/coat_fp8_autoregister.pth` must land in site-packages itself (a .pth file only runs from there):
- regular wheels: build_py copies it to the root of build_lib, which is the wheel's root;
- editable (PEP 660) wheels keep nothing from build_lib but the package finder, so it is written next to the
  finder's own .pth, into the folder setuptools zips as the wheel (`_install_namespaces` is setuptools' hook that
  writes the namespace-package .pth files there; present since setuptools 64).
tests/deepspeed/test_deepspeed_registration.py checks the installed result.
"""
import shutil
from pathlib import Path

from setuptools import setup
from setuptools.command.build_py import build_py
from setuptools.command.editable_wheel import editable_wheel

PTH = Path(__file__).parent / "coat_ds" / "coat_fp8_autoregister.pth"


class BuildPyWithPth(build_py):
    def run(self):
        super().run()
        if not self.editable_mode:
            self.copy_file(str(PTH), str(Path(self.build_lib, PTH.name)))


class EditableWheelWithPth(editable_wheel):
    def _install_namespaces(self, installation_dir, pth_prefix):
        super()._install_namespaces(installation_dir, pth_prefix)
        shutil.copy(PTH, Path(installation_dir, PTH.name))


setup(cmdclass={"build_py": BuildPyWithPth, "editable_wheel": EditableWheelWithPth})
