"""README.md: at most 12 KB, nothing outside the repository, and every command in it run.

Each fenced block of the README is one of the kinds below, and a test runs it: the main
command (the generate part; the install before it is what CI does), the test command (the
suite itself, as .ci/run takes it from the README), the hub commands (against the hub
stand-in, tests/hub_standin.py, serving a tiny model under the README's repository name),
and the agents' base URLs (asked of the server the hub commands start)."""

import os
import re
import shlex
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest

from hub_standin import HubStandin

ROOT = Path(__file__).resolve().parents[1]
OUTSIDE = "../" + "shared"  # the folder beside the checkout that tests once reached
README = ROOT / "README.md"
TEXT = README.read_text()
BLOCKS = re.findall(r"```[a-z]*\n(.*?)\n```", TEXT, re.DOTALL)


def block(marker: str) -> str:
    """The block whose first line contains `marker`."""
    found = [b for b in BLOCKS if marker in b.splitlines()[0]]
    assert len(found) == 1, (marker, found)
    return found[0]


MAIN = block("edgemoe.generate --prompt")
TESTS = block("pytest")
HUB = block("edgemoe.doctor --model")
MAC = block("edgemoe.doctor --machine")
AGENTS = block("OPENAI_BASE_URL")
# Qwen3-30B-A3B's config.json, the fields a forecast reads (its shape: edgemoe.whatif.twin.shapes)
A3B_CONFIG = {"model_type": "qwen3_moe", "hidden_size": 2048, "moe_intermediate_size": 768,
              "num_experts": 128, "num_experts_per_tok": 8, "num_hidden_layers": 48,
              "num_attention_heads": 32, "num_key_value_heads": 4, "head_dim": 128,
              "vocab_size": 151936}


def test_every_block_is_one_a_test_runs():
    assert sorted(BLOCKS) == sorted([MAIN, TESTS, HUB, MAC, AGENTS])


def test_the_mac_forecast_command(tiny_mlx_checkpoint, tmp_path):
    """doctor --machine on the README's repository id, served by the hub stand-in with
    Qwen3-30B-A3B's config: a forecast, labelled so, for the A3B shape."""
    import json
    import shutil

    repo_dir = tmp_path / "repo"
    shutil.copytree(tiny_mlx_checkpoint, repo_dir)
    config = json.loads((repo_dir / "config.json").read_text())
    (repo_dir / "config.json").write_text(json.dumps({**config, **A3B_CONFIG}))
    command = shlex.split(MAC)
    repo = command[command.index("--model") + 1]
    hub = HubStandin()
    hub.add_repo(repo, repo_dir)
    hub.start()
    env = {k: v for k, v in os.environ.items() if not k.startswith(("HF_", "HUGGINGFACE"))}
    env.update(HF_ENDPOINT=hub.url, HF_HOME=str(tmp_path / "hf"),
               HF_HUB_DISABLE_PROGRESS_BARS="1")
    try:
        r = subprocess.run([sys.executable, *command[1:]], env=env, capture_output=True,
                           text=True, timeout=300)
    finally:
        hub.stop()
    assert r.returncode == 0, r.stderr
    assert "FORECAST" in r.stdout and "48 MoE layers x 128 experts of 2.7 MB" in r.stdout
    assert re.search(r"^\s+25%\s+32\s", r.stdout, re.MULTILINE), r.stdout  # a budget's row


def test_readme_is_at_most_12_kb():
    assert len(TEXT.encode()) <= 12 * 1024


def test_no_text_refers_outside_the_repository():
    """No document points above the repository (a shared folder beside it), and every
    relative link of the README and docs/ names a file that is there."""
    for doc in [README, *sorted((ROOT / "docs").glob("*.md"))]:
        text = doc.read_text()
        assert "../" not in text and "shared/" not in text, doc
        for target in re.findall(r"\]\(([^)#:]+)(?:#[^)]*)?\)", text):
            assert (doc.parent / target).exists(), (doc.name, target)
    tracked = subprocess.run(["git", "ls-files"], cwd=ROOT, capture_output=True, text=True)
    if tracked.returncode != 0:
        pytest.skip("not a git checkout")
    for name in tracked.stdout.split():
        path = ROOT / name
        if path.suffix in (".py", ".md", ".sh", ".toml") and path.exists():
            assert OUTSIDE not in path.read_text(errors="replace"), name


def test_the_main_command_generates(capsys):
    """The main command after its install: `.venv/bin/python -m edgemoe.generate ...`."""
    *install, run = [part.strip() for part in MAIN.split("&&")]
    assert install == ["python3 -m venv .venv", ".venv/bin/pip install -q -e ."]
    argv = shlex.split(run)
    assert argv[:3] == [".venv/bin/python", "-m", "edgemoe.generate"]
    from conftest import tool_module

    tool_module("generate").main(argv[3:])
    out = capsys.readouterr().out
    text, stats = out.split("==========", 1)
    assert text.strip()  # the continuation
    assert "Generation:" in stats and "decode hit rate" in stats


def test_the_test_command_is_what_ci_runs():
    """This suite is the test command: .ci/run takes it from the line two after the marker."""
    lines = TEXT.splitlines()
    command = lines[lines.index("<!-- test-command -->") + 2]
    assert command == TESTS
    assert command.endswith("&& .venv/bin/python -m pytest -q")
    ci = (ROOT / ".ci" / "run").read_text()
    assert "<!-- test-command -->" in ci


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_the_hub_commands_and_the_agents_base_urls(tiny_mlx_checkpoint, tmp_path):
    """doctor, generate and server on the README's repository id, from the hub stand-in;
    then each base URL of the agents' block answers its API (the port made free)."""
    import httpx

    lines = HUB.splitlines()
    repo = re.search(r"--model (\S+)", lines[0])[1]
    hub = HubStandin()
    hub.add_repo(repo, tiny_mlx_checkpoint)
    hub.start()
    env = {k: v for k, v in os.environ.items() if not k.startswith(("HF_", "HUGGINGFACE"))}
    env.update(HF_ENDPOINT=hub.url, HF_HOME=str(tmp_path), HF_HUB_DISABLE_PROGRESS_BARS="1")
    port = free_port()
    server = None
    try:
        doctor, generate, serve = [shlex.split(line) for line in lines]
        assert [c[:3] for c in (doctor, generate, serve)] == [
            ["python", "-m", "edgemoe.doctor"], ["python", "-m", "edgemoe.generate"],
            ["python", "-m", "edgemoe.server"]]
        r = subprocess.run([sys.executable, *doctor[1:]], env=env, capture_output=True,
                           text=True, timeout=300)
        assert r.returncode == 0, r.stderr
        assert "fits: --expert-budget auto gives" in r.stdout  # 24GB holds the tiny one
        r = subprocess.run([sys.executable, *generate[1:]], env=env, capture_output=True,
                           text=True, timeout=300)
        assert r.returncode == 0, r.stderr
        assert "Generation:" in r.stdout

        serve = [sys.executable, *serve[1:]]
        serve[serve.index("--port") + 1] = str(port)
        server = subprocess.Popen(serve, env=env, stdout=subprocess.DEVNULL,
                                  stderr=subprocess.PIPE, text=True)
        urls = dict(line.split("=", 1) for line in AGENTS.splitlines())
        urls = {k: v.replace(":8080", f":{port}") for k, v in urls.items()}
        deadline = time.time() + 180
        while True:
            assert server.poll() is None, server.stderr.read()
            try:
                if httpx.get(urls["OPENAI_BASE_URL"] + "/models", timeout=5).status_code == 200:
                    break
            except httpx.HTTPError:
                pass
            assert time.time() < deadline, "the server did not start"
            time.sleep(0.5)
        models = httpx.get(urls["OPENAI_BASE_URL"] + "/models", timeout=30).json()
        assert repo in [m["id"] for m in models["data"]]
        reply = httpx.post(urls["ANTHROPIC_BASE_URL"] + "/v1/messages", timeout=120, json={
            "model": repo, "max_tokens": 4, "messages": [{"role": "user", "content": "hi"}]})
        assert reply.status_code == 200 and reply.json()["type"] == "message", reply.text
        tags = httpx.get(urls["OLLAMA_HOST"] + "/api/tags", timeout=30)
        assert tags.status_code == 200 and tags.json()["models"], tags.text
    finally:
        if server is not None:
            server.terminate()
            try:
                server.wait(timeout=30)
            except subprocess.TimeoutExpired:
                server.kill()
        hub.stop()
