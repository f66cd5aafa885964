"""Hub ids (`--model org/name[@revision]`) against a stand-in of the Hugging Face hub's HTTP
API on loopback (tests/hub_standin.py): huggingface_hub itself talks to it, through
HF_ENDPOINT, from the tools run as a user runs them (subprocesses)."""

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from hub_standin import HubStandin

ROOT = Path(__file__).resolve().parents[1]
REPO = "org/tiny-moe"


@pytest.fixture(scope="module")
def tiny(tiny_mlx_checkpoint, tmp_path_factory):
    """The tiny Qwen3-MoE as mlx-lm writes it, and a second revision of it."""
    mlx = tiny_mlx_checkpoint
    second = tmp_path_factory.mktemp("hub-checkpoint") / "second"
    shutil.copytree(mlx, second)
    config = json.loads((second / "config.json").read_text())
    (second / "config.json").write_text(json.dumps(dict(config, revision_mark=2)))
    return mlx, second


@pytest.fixture()
def hub(tiny):
    first, second = tiny
    standin = HubStandin()
    standin.first = standin.add_repo(REPO, first)
    standin.second = standin.add_repo(REPO, second)  # main moves on
    standin.add_repo("org/gated-moe", first, gated=True)
    standin.add_repo("org/huge-moe", first, claimed_sizes={"model.safetensors": 1 << 50})
    standin.start()
    yield standin
    standin.stop()


def env_for(hub, home, **extra):
    env = {k: v for k, v in os.environ.items() if not k.startswith(("HF_", "HUGGINGFACE"))}
    env.update(HF_ENDPOINT=hub.url if hub is not None else "http://127.0.0.1:9",
               HF_HOME=str(home), HF_HUB_DISABLE_TELEMETRY="1", **extra)
    return env


def run(args, env, timeout=180):
    return subprocess.run([sys.executable, *args], env=env, capture_output=True, text=True,
                          cwd=ROOT, timeout=timeout)


def resolve(name, env, chunk=None):
    """`edgemoe.hub.resolve(name)` in a fresh process: (return code, folder or error);
    `chunk`: huggingface_hub's download chunk size there."""
    patch = (f"import huggingface_hub.constants as c; c.DOWNLOAD_CHUNK_SIZE = {chunk}\n"
             if chunk else "")
    r = run(["-c", patch + "import sys; from edgemoe import hub, cli\n"
                   "try: print(hub.resolve(sys.argv[1], progress=False))\n"
                   "except ValueError as e: sys.exit(cli.message(e))", name], env)
    return r.returncode, (r.stdout.strip() or r.stderr.strip().splitlines()[-1])


def test_generate_runs_a_hub_id_then_offline_from_the_cache(hub, tmp_path):
    env = env_for(hub, tmp_path)
    r = run(["-m", "edgemoe.generate", "--model", REPO, "--prompt", "hello",
             "--max-tokens", "4", "--verbose", "False"], env)
    assert r.returncode == 0, r.stderr
    assert r.stdout.strip(), "no text generated"
    assert "downloading" in r.stderr  # the size, then huggingface_hub's progress bar
    snapshot = tmp_path / "hub" / "models--org--tiny-moe" / "snapshots" / hub.second
    assert (snapshot / "config.json").exists() and (snapshot / "model.safetensors").exists()
    assert not (snapshot / "README.md").exists()  # only the files a model needs
    assert not any(s.filename == "README.md" for s in hub.log)

    served = len(hub.log)
    offline = env_for(hub, tmp_path, HF_HUB_OFFLINE="1")
    r = run(["-m", "edgemoe.generate", "--model", REPO, "--prompt", "hello",
             "--max-tokens", "4", "--verbose", "False"], offline)
    assert r.returncode == 0, r.stderr
    assert r.stdout.strip()
    # once downloaded, doctor on the id calibrates this machine on the cached files
    r = run(["-m", "edgemoe.doctor", "--model", REPO, "--memory", "24GB"], offline)
    assert r.returncode == 0, r.stderr
    assert f"pack: {snapshot}" in r.stdout and "calibration (this machine)" in r.stdout
    assert len(hub.log) == served  # not one request: the cache alone


def test_doctor_fits_a_hub_model_from_its_headers_alone(hub, tiny, tmp_path):
    r = run(["-m", "edgemoe.doctor", "--model", REPO, "--memory", "24GB"], env_for(hub, tmp_path))
    assert r.returncode == 0, r.stderr
    out = r.stdout
    assert f"hub: {REPO} at {hub.second[:12]}" in out
    assert "memory 24.0 GB (--memory 24GB): fits: --expert-budget auto gives" in out
    assert "resident" in out and "routed experts" in out and "download" in out
    weights = (tiny[1] / "model.safetensors").read_bytes()
    header = 8 + int.from_bytes(weights[:8], "little")
    served = {}
    for s in hub.log:
        if s.filename:
            served[s.filename] = served.get(s.filename, 0) + s.body_bytes
    assert served.pop("model.safetensors") == header  # its header, not one byte of weights
    assert set(served) <= {"config.json", "model.safetensors.index.json"}
    assert not (tmp_path / "hub" / "models--org--tiny-moe").exists()  # nothing downloaded
    # (what doctor says where a model does not fit: tests/test_doctor.py, the same code)


def test_download_resumes_after_a_cut_connection(hub, tiny, tmp_path):
    """The connection drops 100 kB into the weights: the download continues where the
    file's part ends (a Range request answered 206), not from its start. (A real shard's
    10 MB chunks reach the disk as they come; the tiny file's would not, so the chunks are
    made 64 kB here.)"""
    weights = (tiny[1] / "model.safetensors").read_bytes()
    hub.cuts["model.safetensors"] = 100_000
    code, folder = resolve(REPO, env_for(hub, tmp_path), chunk=65536)
    assert code == 0, folder
    gets = [s for s in hub.log if s.filename == "model.safetensors" and s.method == "GET"]
    assert [(s.status, s.range, s.body_bytes) for s in gets] == [
        (200, None, 100_000), (206, "bytes=65536-", len(weights) - 65536)]
    assert (Path(folder) / "model.safetensors").read_bytes() == weights


def test_an_interrupted_download_keeps_its_finished_files(hub, tiny, tmp_path):
    """The hub fails on the weights: one line, and the files already fetched stay in the
    cache; run again, only the weights are fetched. (huggingface_hub deletes a file's
    partial part when its process fails, so a file restarts from its beginning.)"""
    hub.refused.add("model.safetensors")
    code, line = resolve(REPO, env_for(hub, tmp_path))
    assert code == 1 and line.startswith(f"{REPO}: ") and "503" in line, line
    before = {s.filename for s in hub.log if s.method == "GET" and s.status == 200}
    assert before  # files fetched before the failure (in parallel with the weights)

    hub.refused.clear()
    served = len(hub.log)
    code, folder = resolve(REPO, env_for(hub, tmp_path))
    assert code == 0, folder
    again = {s.filename for s in hub.log[served:] if s.method == "GET" and s.filename}
    assert "model.safetensors" in again and not again & before  # none fetched twice
    assert (Path(folder) / "model.safetensors").read_bytes() == \
        (tiny[1] / "model.safetensors").read_bytes()


def test_a_pinned_revision(hub, tmp_path):
    env = env_for(hub, tmp_path)
    code, folder = resolve(f"{REPO}@{hub.first}", env)
    assert code == 0, folder
    assert Path(folder).name == hub.first
    assert "revision_mark" not in json.loads((Path(folder) / "config.json").read_text())
    code, folder = resolve(REPO, env)
    assert code == 0 and Path(folder).name == hub.second
    assert json.loads((Path(folder) / "config.json").read_text())["revision_mark"] == 2


@pytest.mark.parametrize("name, expected", [
    ("org/no-such-moe", "org/no-such-moe: no such model folder here, nor a repository on"),
    ("org/gated-moe", "org/gated-moe: a gated repository on"),
    (f"{REPO}@v9", f"{REPO}@v9: no revision 'v9'"),
    ("org/huge-moe", "of disk for its files"),
])
def test_hub_errors_are_one_line(hub, tmp_path, name, expected):
    code, line = resolve(name, env_for(hub, tmp_path))
    assert code == 1 and expected in line, line
    assert not (tmp_path / "hub" / "models--org--huge-moe" / "blobs").exists() or not any(
        (tmp_path / "hub" / "models--org--huge-moe" / "blobs").iterdir())


def test_no_network_and_offline_errors_are_one_line(tmp_path):
    code, line = resolve(REPO, env_for(None, tmp_path))
    assert code == 1 and "cannot be reached" in line, line
    code, line = resolve(REPO, env_for(None, tmp_path, HF_HUB_OFFLINE="1"))
    assert code == 1 and "HF_HUB_OFFLINE is set" in line, line
    r = run(["-m", "edgemoe.generate", "--model", REPO], env_for(None, tmp_path))
    assert r.returncode == 1
    assert r.stderr.strip().splitlines()[-1].startswith("edgemoe.generate: error: " + REPO)
    assert "Traceback" not in r.stderr


def test_local_paths_are_not_hub_ids(tmp_path):
    from edgemoe.hub import HubId, parse_hub_id

    assert parse_hub_id("org/name") == HubId("org/name")
    assert parse_hub_id("org/name@v1.0") == HubId("org/name", "v1.0")
    assert parse_hub_id(str(tmp_path)) is None  # exists
    assert parse_hub_id("./org/name") is None and parse_hub_id("a/b/c") is None
    (tmp_path / "org").mkdir()
    assert parse_hub_id(tmp_path / "org") is None


def test_hf_token_opens_a_gated_repository(hub, tmp_path):
    code, folder = resolve("org/gated-moe", env_for(hub, tmp_path, HF_TOKEN="hf_standin"))
    assert code == 0 and (Path(folder) / "config.json").exists(), folder


def test_convert_and_eval_take_a_hub_id(hub, tmp_path):
    env = env_for(hub, tmp_path / "home")
    r = run(["-m", "edgemoe.convert", "--hf-path", REPO, "--mlx-path", str(tmp_path / "pack")],
            env)
    assert r.returncode == 0, r.stderr
    assert (tmp_path / "pack" / "experts.bin").exists()
    text = tmp_path / "text.txt"
    text.write_text("def read_lines(path):\n    with open(path) as f:\n        return f.read()\n" * 4)
    r = run(["-m", "edgemoe.eval", "--text", str(text), "--model", f"{REPO},budget=0.5",
             "--context", "16", "--max-tokens", "32"], env)
    assert r.returncode == 0, r.stderr
    assert r.stdout.startswith(f"{REPO},budget=0.5: perplexity ")
