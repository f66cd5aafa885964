"""bench_twin's shape packs default to a cache folder under the user's home, as the hub
cache does, never a machine's own path."""

import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def default_packs(env):
    code = ("import importlib.util,sys; spec=importlib.util.spec_from_file_location('b', "
            f"{str(ROOT / 'scripts' / 'bench_twin.py')!r}); m=importlib.util.module_from_spec(spec);"
            " spec.loader.exec_module(m); print(m.DEFAULT_PACKS)")
    env = {k: v for k, v in os.environ.items()
           if k not in ("EDGEMOE_TWIN_PACKS", "XDG_CACHE_HOME")} | env
    return subprocess.run([sys.executable, "-c", code], env=env, capture_output=True,
                          text=True, check=True).stdout.strip()


def test_shape_packs_live_in_the_users_cache(tmp_path):
    assert default_packs({"HOME": str(tmp_path)}) == str(tmp_path / ".cache" / "edgemoe" /
                                                         "twin-packs")
    assert default_packs({"HOME": str(tmp_path), "XDG_CACHE_HOME": str(tmp_path / "c")}) == \
        str(tmp_path / "c" / "edgemoe" / "twin-packs")
    assert default_packs({"EDGEMOE_TWIN_PACKS": str(tmp_path / "p")}) == str(tmp_path / "p")
    assert "/work/" not in (ROOT / "scripts" / "bench_twin.py").read_text()
    assert "/work/" not in (ROOT / "docs" / "mac.md").read_text()
