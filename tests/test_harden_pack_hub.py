"""Issue 53, items 3, 4 and 11: every byte asked of the hub is one bounded, deadlined
fetch, sized from what the hub declares before it is read, against a hostile stand-in
(tests/hub_standin.py) that stalls, lies in its headers and serves giant files. doctor
runs in this process (its hub calls read huggingface_hub's endpoint at call time);
downloads and killed runs in subprocesses, as a user runs them."""

import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from conftest import error_line, tool_module
from hub_standin import HubStandin

ROOT = Path(__file__).resolve().parents[1]
REPO = "org/tiny-moe"
TIMEOUT = "1"  # EDGEMOE_HUB_TIMEOUT: a stall is one second without a byte


@pytest.fixture(scope="module")
def variants(tiny_mlx_checkpoint, tmp_path_factory):
    """The tiny checkpoint, and copies of it that lie: a header length of 10^12, weights
    only in a subfolder, weights beside config.json and in a subfolder too."""
    base = tmp_path_factory.mktemp("hub-lies")
    lying = base / "lying"
    shutil.copytree(tiny_mlx_checkpoint, lying)
    weights = lying / "model.safetensors"
    data = weights.read_bytes()
    weights.write_bytes((10 ** 12).to_bytes(8, "little") + data[8:])
    sub = base / "sub"
    shutil.copytree(tiny_mlx_checkpoint, sub)
    (sub / "model").mkdir()
    (sub / "model.safetensors").rename(sub / "model" / "model.safetensors")
    both = base / "both"
    shutil.copytree(tiny_mlx_checkpoint, both)
    (both / "model_extra").mkdir()
    shutil.copy(both / "model.safetensors", both / "model_extra" / "model.safetensors")
    return {"tiny": tiny_mlx_checkpoint, "lying": lying, "sub": sub, "both": both}


@pytest.fixture()
def hub(variants, monkeypatch, tmp_path):
    import huggingface_hub.constants as constants

    standin = HubStandin()
    standin.add_repo(REPO, variants["tiny"])
    standin.add_repo("org/lying-header", variants["lying"])
    standin.add_repo("org/subfolder", variants["sub"])
    standin.add_repo("org/both", variants["both"])
    standin.add_repo("org/giant-config", variants["tiny"], giant={"config.json": 300 << 20})
    standin.add_repo("org/giant-unlisted", variants["tiny"], giant={"config.json": 300 << 20},
                     claimed_sizes={"config.json": 3000})  # the listing lies, the header not
    standin.start()
    monkeypatch.setattr(constants, "ENDPOINT", standin.url)  # (HF_ENDPOINT, read at import)
    monkeypatch.setattr(constants, "HUGGINGFACE_CO_URL_TEMPLATE",
                        standin.url + "/{repo_id}/resolve/{revision}/{filename}")
    monkeypatch.setattr(constants, "HF_HUB_CACHE", str(tmp_path / "hub"))
    monkeypatch.setenv("EDGEMOE_HUB_TIMEOUT", TIMEOUT)
    monkeypatch.setenv("TMPDIR", str(tmp_path))
    monkeypatch.setattr("tempfile.tempdir", None)
    yield standin
    standin.stop()


def doctor_line(repo) -> str:
    return error_line(tool_module("doctor").main, "--model", repo, "--memory", "8GB")


def served(hub, name) -> int:
    return hub.bytes_served(lambda s: s.filename == name)


def test_a_stall_in_the_model_info_has_a_deadline(hub):
    hub.stalls["model-info"] = None  # not even a status line
    tic = time.monotonic()
    line = doctor_line(REPO)
    assert time.monotonic() - tic < 10, line
    assert "the repository's file list stalled before answering: no byte from" in line, line
    assert "cannot be reached" not in line


@pytest.mark.parametrize("sent, stage", [(0, "after 0 bytes"), (40, "after 40 bytes")])
def test_a_stall_before_or_inside_a_header_names_the_file(hub, sent, stage):
    """0: the status and headers come, then nothing (before the length field); 40: the
    stall comes mid-header (the second range request)."""
    hub.stalls["model.safetensors"] = sent
    tic = time.monotonic()
    line = doctor_line(REPO)
    assert time.monotonic() - tic < 10, line
    assert f"{REPO}: model.safetensors stalled {stage}: no byte from" in line, line


def test_a_header_length_that_lies_is_refused_before_fetching(hub):
    line = doctor_line("org/lying-header")
    assert "model.safetensors: its header claims 1000000000000 bytes in a file of" in line
    assert served(hub, "model.safetensors") == 8  # its length field, nothing more


def test_a_giant_config_is_refused_from_the_listing_before_one_byte(hub):
    line = doctor_line("org/giant-config")
    assert f"config.json: the hub lists {300 << 20} bytes, more than a config.json" in line
    assert served(hub, "config.json") == 0


def test_a_giant_config_the_listing_hides_is_refused_from_its_content_length(hub):
    line = doctor_line("org/giant-unlisted")
    assert f"config.json: the hub declares {300 << 20} bytes (Content-Length)" in line, line
    assert served(hub, "config.json") < 64 << 20  # what the socket took before the close


def test_a_404_is_not_found_not_try_again_later(hub):
    hub.unserved.add("config.json")
    line = doctor_line(REPO)
    assert f"{REPO}: config.json not found in {REPO} on {hub.url} (HTTP 404)" in line, line
    assert "try again later" not in line


def test_weights_in_a_subfolder_are_named_not_enoent(hub, tmp_path, capsys):
    line = doctor_line("org/subfolder")
    assert "no safetensors weights (model*.safetensors) beside config.json" in line, line
    assert "only in subfolders: model/model.safetensors" in line and "tmp" not in line
    tool_module("doctor").main(["--model", "org/both", "--memory", "8GB"])
    assert "fits: --expert-budget auto gives" in capsys.readouterr().out


def env_for(hub, tmp_path, **extra):
    env = {k: v for k, v in os.environ.items() if not k.startswith(("HF_", "HUGGINGFACE"))}
    env.update(HF_ENDPOINT=hub.url, HF_HOME=str(tmp_path / "home"), TMPDIR=str(tmp_path),
               HF_HUB_DISABLE_TELEMETRY="1", PYTHONPATH=str(ROOT))
    env.update({"EDGEMOE_HUB_TIMEOUT": TIMEOUT, **extra})
    return env


def test_a_download_stalled_mid_file_names_the_file(hub, monkeypatch):
    """generate's download (edgemoe.hub.resolve): huggingface_hub retries a stalled file,
    resuming, five times; then the file is named, and the hub is not said to be
    unreachable."""
    from edgemoe import hub as edgemoe_hub

    monkeypatch.setenv("EDGEMOE_HUB_TIMEOUT", "0.3")
    hub.stalls["model.safetensors"] = 100_000
    tic = time.monotonic()
    with pytest.raises(edgemoe_hub.HubError) as e:
        edgemoe_hub.resolve(REPO, progress=False)
    assert time.monotonic() - tic < 30
    line = str(e.value)
    assert f"{REPO}: model.safetensors stalled while downloading" in line, line
    assert "cannot be reached" not in line


def test_a_killed_doctor_leaves_no_temporary_folder(hub, tmp_path):
    """A doctor killed mid-fetch (SIGKILL: nothing of it runs) leaves its folder; the
    next doctor run removes it. SIGTERM removes it at once."""
    hub.stalls["model.safetensors"] = 0
    env = env_for(hub, tmp_path, EDGEMOE_HUB_TIMEOUT="60")
    for sig in (signal.SIGKILL, signal.SIGTERM):
        proc = subprocess.Popen([sys.executable, "-m", "edgemoe.doctor", "--model", REPO],
                                env=env, cwd=ROOT, stdout=subprocess.DEVNULL,
                                stderr=subprocess.PIPE, text=True)
        deadline = time.monotonic() + 60
        while not any(s.filename == "model.safetensors" for s in hub.log):
            assert time.monotonic() < deadline and proc.poll() is None, proc.stderr.read()
            time.sleep(0.1)
        assert list(tmp_path.glob("edgemoe-doctor-*"))
        proc.send_signal(sig)
        proc.wait(30)
        if sig == signal.SIGTERM:
            assert "Traceback" not in proc.stderr.read()
            assert not list(tmp_path.glob("edgemoe-doctor-*"))
        if sig == signal.SIGKILL:  # the next run (here, in this process) removes it
            left = list(tmp_path.glob("edgemoe-doctor-*"))
            assert left
            hub.stalls.clear()
            tool_module("doctor").main(["--model", REPO, "--memory", "8GB"])
            assert not list(tmp_path.glob("edgemoe-doctor-*")), left
            hub.stalls["model.safetensors"] = 0
        hub.log.clear()
