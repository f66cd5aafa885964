"""What every tool shares (the streaming flags, the bundled model as the default) and
what a new user hit: over-100% budgets, cache_sim --png without matplotlib, eval with no
--model, doctor with another model's trace, mlx-lm's --verbose values; and what a plain
(non-editable) `pip install .` brings."""

import argparse
import importlib
import json
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from edgemoe import cache_sim, doctor, eval as edgemoe_eval
from edgemoe.options import StreamOptions
from edgemoe.routing.modes import PREROUTED
from edgemoe.streaming.budget import BudgetError, parse_budget

from conftest import error_line

ROOT = Path(__file__).resolve().parents[1]


def test_every_tool_takes_the_same_streaming_flags(capsys):
    helps = {}
    for name in ("generate", "server", "eval", "doctor", "train_prerouter", "train_lora",
                 "cache_sim", "cache_prompt"):
        with pytest.raises(SystemExit) as e:
            importlib.import_module(f"edgemoe.{name}").main(["--help"])
        assert e.value.code == 0
        helps[name] = " ".join(capsys.readouterr().out.split())
    budget_help = ("a fraction (0.25), a percentage (25%), a size (2GB), or auto: what fits "
                   "in the memory available")
    for name in ("generate", "server", "eval", "doctor", "train_prerouter", "train_lora",
                 "cache_prompt"):
        assert "--expert-budget" in helps[name] and budget_help in helps[name], name
    for name in ("generate", "server", "eval"):
        for flag in ("--routing", "--prerouter", "--adapter-path", "--cache-policy", "--io",
                     "--readers"):
            assert flag in helps[name], (name, flag)


def test_options_round_trip_through_a_parser():
    p = StreamOptions.add_arguments(argparse.ArgumentParser())
    args = p.parse_args(["--expert-budget", "25%", "--routing", "prerouted",
                         "--adapter-path", "pack", "--io", "direct"])
    options = StreamOptions.from_args(args)
    assert options == StreamOptions("25%", io="direct", routing="prerouted", adapter_path="pack")
    assert options.routing is PREROUTED and not options.routing.exact
    assert StreamOptions.of(options, expert_budget=0.5) == options.replace(expert_budget=0.5)
    with pytest.raises(TypeError, match="colour"):
        StreamOptions.of(colour="blue")
    with pytest.raises(TypeError, match="expert_budget=0.25"):
        StreamOptions.of(0.25)  # load(path, 0.25): the budget must be named
    with pytest.raises(SystemExit):
        p.parse_args(["--routing", "sideways"])


def test_the_eval_model_spec_parses_into_stream_options():
    from edgemoe.eval import ModelConfig

    config = ModelConfig.parse("PACK,budget=0.25,routing=prerouted,prerouter=H,adapter=A")
    assert config.stream_options(StreamOptions(io="direct")) == StreamOptions(
        "0.25", io="direct", routing=PREROUTED, prerouter_path="H",
        adapter_path="A")
    with pytest.raises(ValueError, match="sideways"):
        ModelConfig.parse("PACK,routing=sideways")


def test_budgets_over_100_percent_hold_every_expert(capsys):
    assert parse_budget("150%", 1000) == 1000
    assert "holding all of them" in capsys.readouterr().err
    for bad in ("1.5", 1.5):
        with pytest.raises(BudgetError, match="a fraction is at most 1"):
            parse_budget(bad, 1000)


def test_generate_cli_refuses_a_fractional_budget_over_1_in_one_line(capsys):
    generate_tool = importlib.import_module("edgemoe.generate")  # (edgemoe.generate: the function)
    assert error_line(generate_tool.main, "--expert-budget", "1.5", "--max-tokens", "2") == (
        "edgemoe.generate: error: expert budget '1.5': a fraction is at most 1 (1.0 holds "
        "every expert); for more write a size like 1.5GB, or 100%")
    assert capsys.readouterr().err == ""  # the exit's line alone


@pytest.mark.parametrize("value,streams", [("F", False), ("false", False), ("True", True),
                                           ("T", True)])
def test_generate_verbose_takes_what_mlx_lm_takes(value, streams, capsys):
    generate_tool = importlib.import_module("edgemoe.generate")  # (edgemoe.generate: the function)

    generate_tool.main(["--prompt", "def ", "--ignore-chat-template", "--max-tokens", "4",
                        "--verbose", value])
    assert ("Generation: " in capsys.readouterr().out) == streams


def test_generate_takes_mlx_lm_generates_flags_and_gives_its_text(checkpoints, capsys):
    """The sampling, KV-cache and prefill flags of mlx_lm.generate, passed the same way:
    greedy text equal to mlx_lm.generate's on the same int4 checkpoint (in place at a
    partial budget), with a quantized rotating KV cache and small prefill steps."""
    model = str(checkpoints["qwen3_moe_large"][1])  # heads of 64: KV quantization groups
    common = ["--model", model, "--prompt", "import json", "--max-tokens", "24",
              "--verbose", "F", "--top-k", "1", "--min-p", "0.05", "--extra-eos-token",
              "<|endoftext|>", "--chat-template-config", '{"unused_flag": true}',
              "--system-prompt", "be brief"]

    def run(*argv):
        return subprocess.run([sys.executable, "-m", *argv], capture_output=True, text=True,
                              check=True).stdout

    generate_tool = importlib.import_module("edgemoe.generate")  # (edgemoe.generate: the function)
    # mlx-lm cannot quantize a rotating cache: the two KV-cache options apart
    for kv in (["--max-kv-size", "16", "--prefill-step-size", "3"],
               ["--kv-bits", "4", "--kv-group-size", "32", "--quantized-kv-start", "4"]):
        generate_tool.main([*common, *kv, "--expert-budget", "50%"])  # in this process
        ours = capsys.readouterr().out
        theirs = run("mlx_lm.generate", *common, *kv).split("\n", 1)[1]  # after its notice
        assert ours.strip() and ours == theirs, kv


def test_a_saved_prompt_cache_continues_as_mlx_lm_continues_it(checkpoints, tmp_path, capsys,
                                                               monkeypatch):
    """edgemoe.cache_prompt writes mlx_lm.cache_prompt's file; edgemoe.generate continues
    from either tool's file with mlx_lm.generate's text on the same checkpoint."""
    model = str(checkpoints["qwen3_moe"][1])
    context = "You read Python. Here is a module: import os, sys, json"
    ask = ["--prompt", " What does it import?", "--max-tokens", "16", "--verbose", "F"]

    def mlx_lm_tool(name, *argv):  # mlx-lm's own CLI, in this process: what it prints
        monkeypatch.setattr(sys, "argv", [name, *argv])
        importlib.import_module(name).main()
        return capsys.readouterr().out

    generate_tool = importlib.import_module("edgemoe.generate")  # (edgemoe.generate: the function)
    theirs_file, ours_file = tmp_path / "mlx_lm.safetensors", tmp_path / "edgemoe.safetensors"
    mlx_lm_tool("mlx_lm.cache_prompt", "--model", model, "--prompt", context,
                "--prompt-cache-file", str(theirs_file))
    importlib.import_module("edgemoe.cache_prompt").main(
        ["--model", model, "--prompt", context, "--prompt-cache-file", str(ours_file),
         "--expert-budget", "50%"])
    capsys.readouterr()
    theirs = mlx_lm_tool("mlx_lm.generate", "--prompt-cache-file", str(theirs_file), *ask)
    for saved in (ours_file, theirs_file):  # in this process: the text it prints
        generate_tool.main(["--prompt-cache-file", str(saved), *ask, "--expert-budget", "50%"])
        ours = capsys.readouterr().out
        assert ours.strip() and ours == theirs, saved

    with pytest.raises(SystemExit) as e:  # the tool's one-line error
        generate_tool.main(["--prompt-cache-file", str(ours_file), "--model", str(tmp_path)])
    assert e.value.code == (f"edgemoe.generate: error: --prompt-cache-file {ours_file} was "
                            f"made for the model {model}, not {tmp_path}")


@pytest.mark.parametrize("argv,message", [
    (["--chat-template-config", "[1, 2]"],
     "--chat-template-config: expected a JSON object, found '[1, 2]'"),
    (["--kv-bits", "4", "--max-kv-size", "64"],
     "--kv-bits with --max-kv-size: mlx-lm cannot quantize a rotating KV cache"),
])
def test_generate_refuses_what_it_cannot_do_in_one_usage_line(argv, message, capsys):
    generate_tool = importlib.import_module("edgemoe.generate")  # (edgemoe.generate: the function)

    with pytest.raises(SystemExit) as e:
        generate_tool.main(argv)
    assert e.value.code == 2
    assert capsys.readouterr().err.strip().splitlines()[-1].endswith(message)


def test_the_plain_install_has_every_package_the_server_imports():
    """`python -m edgemoe.server` after the README's plain `pip install`: the third-party
    packages the server imports are base dependencies, not an extra."""
    import ast
    import re
    import tomllib

    deps = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["dependencies"]
    base = {re.split(r"[\[<>=!~; ]", d, maxsplit=1)[0].lower() for d in deps}
    imported = set()
    for source in [ROOT / "edgemoe" / "server.py", *(ROOT / "edgemoe" / "serving").glob("*.py")]:
        for node in ast.walk(ast.parse(source.read_text())):
            if isinstance(node, ast.Import):
                imported |= {a.name.split(".")[0] for a in node.names}
            elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
                imported.add(node.module.split(".")[0])
    packages = {m.replace("_", "-") for m in imported - set(sys.stdlib_module_names)}
    assert packages and packages <= base, packages - base


def test_generate_runs_prerouted_with_the_packs_own_heads_adapter_and_learned_policy(capsys):
    generate_tool = importlib.import_module("edgemoe.generate")  # (edgemoe.generate: the function)
    generate_tool.main(["--prompt", "import os", "--ignore-chat-template", "--max-tokens", "6",
                        "--routing", "prerouted", "--adapter-path", "pack", "--cache-policy",
                        "learned", "--expert-budget", "25%"])
    out, err = capsys.readouterr()
    assert "Generation: 6 tokens" in out and "the heads" in err


def a_trace(layers, experts, nbytes, model=None):
    trace = dict(layers=np.array(layers, np.int32),
                 routed=np.zeros((3, len(layers), 2), np.int32),
                 decode=np.array([False, True, True]),
                 num_experts=np.array([experts] * len(layers), np.int32),
                 expert_bytes=np.array(nbytes, np.int64))
    if model is not None:
        trace["model"] = np.array(model)
    return trace


def test_doctor_refuses_a_trace_of_another_model(packs, tmp_path):
    from edgemoe.format.pack import Pack

    pack = Pack.open(packs["qwen3_moe"]["hf"])
    layers = [l.index for l in pack.layers]
    sizes = [l.expert_bytes for l in pack.layers]
    cases = {"fingerprint": a_trace(layers, 16, sizes, model="0123456789abcdef"),
             "MoE layers": a_trace(layers[:-1], 16, sizes[:-1]),
             "num_experts": a_trace(layers, 64, sizes),
             "expert_bytes": a_trace(layers, 16, [s + 1 for s in sizes])}
    for what, trace in cases.items():
        path = tmp_path / f"{what}.npz"
        with open(path, "wb") as f:
            np.savez(f, **trace)
        with pytest.raises(SystemExit, match=f"edgemoe.doctor: error: {path}: recorded on "
                                             f"another model \\({what}"):
            doctor.main(["--model", str(pack.path), "--trace", str(path)])


def test_cache_sim_writes_its_json_before_a_png_it_cannot_draw(tmp_path, monkeypatch,
                                                               capsys):
    trace = a_trace([0, 1], 8, [100, 100])
    trace["routed"] = np.random.default_rng(0).integers(0, 8, (40, 2, 2)).astype(np.int32)
    trace["decode"] = np.arange(40) >= 8
    path = tmp_path / "t.npz"
    with open(path, "wb") as f:
        np.savez(f, **trace)
    monkeypatch.setitem(sys.modules, "matplotlib", None)  # as if it were not installed
    out = tmp_path / "r.json"
    with pytest.raises(SystemExit, match=r"--png needs matplotlib: pip install 'edgemoe\[bench\]'"):
        cache_sim.main([str(path), "--budget", "0.5", "--policies", "lfu",
                        "--json", str(out), "--png", str(tmp_path / "r.png")])
    assert json.loads(out.read_text())[0]["policy"] == "lfu"
    assert not (tmp_path / "r.png").exists()


def test_eval_without_a_model_scores_the_bundled_one(tmp_path, capsys):
    text = tmp_path / "t.txt"
    text.write_text("import os\nimport sys\n\ndef main():\n    print(os.getcwd())\n" * 4)
    edgemoe_eval.main(["--text", str(text), "--context", "16", "--max-tokens", "32",
                       "--expert-budget", "50%"])
    out = capsys.readouterr().out
    assert "fine: perplexity" in out


def test_a_plain_pip_install_runs_prerouted_with_the_bundled_assets(tmp_path):
    """`pip install .` (not editable) ships the bundled pack with its heads, adapter and
    learned cache policy, and its draft. Installed into a folder of its own, without dependencies
    (this environment has them), and run from outside the repository."""
    target = tmp_path / "site"
    subprocess.run([sys.executable, "-m", "pip", "install", "-q", "--no-deps",
                    "--no-build-isolation", "--target", str(target), str(ROOT)], check=True)
    env = dict(os.environ, PYTHONPATH=str(target))
    code = ("import edgemoe, sys; print(edgemoe.__file__); "
            "from edgemoe.generate import main; main(sys.argv[1:])")
    r = subprocess.run([sys.executable, "-c", code, "--prompt", "def f(x):",
                        "--ignore-chat-template", "--max-tokens", "5", "--routing",
                        "prerouted", "--adapter-path", "pack", "--cache-policy", "learned",
                        "--expert-budget", "25%"], cwd=tmp_path, env=env, capture_output=True,
                       text=True)
    assert r.returncode == 0, r.stderr
    assert r.stdout.splitlines()[0].startswith(str(target))  # the installed copy ran
    assert "Generation: 5 tokens" in r.stdout
    installed = target / "edgemoe" / "models"
    for asset in ("fine/prerouter/prerouter.safetensors", "fine/adapter/adapters.safetensors",
                  "fine/prerouter/adapter/adapters.safetensors",
                  "fine/cache_policy.npz", "fine-draft/model.safetensors",
                  "fine/traces/stdlib.npz"):
        assert (installed / asset).exists(), asset
    assert not (installed / "reference").exists()
    # every package of the tree, the what-if room's included (this environment's editable
    # install of the project would otherwise stand in for a package pyproject.toml forgot)
    packages = {f.parent.relative_to(ROOT) for f in (ROOT / "edgemoe").rglob("__init__.py")}
    missing = {p for p in packages if not (target / p / "__init__.py").exists()}
    assert not missing, f"pyproject.toml's packages lack {sorted(map(str, missing))}"
    assert (target / "edgemoe" / "whatif" / "twin" / "profiles.json").exists()
    # doctor --machine forecasts from the shipped traces (README, "On a Mac")
    code = "import sys; from edgemoe.doctor import main; main(sys.argv[1:])"
    r = subprocess.run([sys.executable, "-c", code, "--machine", "m4-pro-24gb", "--model",
                        "qwen3-30b-a3b"], cwd=tmp_path, env=env, capture_output=True, text=True)
    assert r.returncode == 0, r.stderr
    assert "FORECAST" in r.stdout and str(installed / "fine" / "traces") in r.stdout


@pytest.mark.parametrize("flag,value", [("--temp", "-1"), ("--temp", "nan"), ("--temp", "inf"),
                                        ("--top-p", "1.5"), ("--max-tokens", "0")])
def test_generate_refuses_bad_sampling_flags_in_one_line(flag, value):
    from edgemoe.generate import setup_arg_parser

    with pytest.raises(SystemExit) as e:
        setup_arg_parser().parse_args([flag, value])
    assert e.value.code == 2  # argparse's usage error: one line, no traceback


def test_importing_the_generate_cli_keeps_the_package_generate_the_function():
    """`python -m edgemoe.generate`'s module shares the name of mlx-lm's `generate`: the
    package's attribute stays the function, as in mlx_lm, whatever was imported first."""
    code = ("import edgemoe, edgemoe.generate\nfrom edgemoe.generate import main\n"
            "import importlib; importlib.import_module('edgemoe.server')\n"
            "from edgemoe.mlx_backend.generation import generate, stream_generate\n"
            "assert edgemoe.generate is generate, edgemoe.generate\n"
            "assert edgemoe.stream_generate is stream_generate\n"
            "assert callable(main) and edgemoe.load.__name__ == 'load'\n")
    subprocess.run([sys.executable, "-c", code], check=True, timeout=120)


def test_the_benchmark_runs_the_adapter_only_beside_rows_it_runs_without_it():
    # its decode cost is a ratio to the same row without the adapter: a budget list without
    # 100% has no resident native row to pair
    import bench_stream

    assert bench_stream.lora_pairs(["0.25:native", "0.25:prerouted", "0.25:advisory"]) == \
        ["0.25:prerouted"]
    assert bench_stream.lora_pairs(["1.0:native", "0.1:native", "0.1:prerouted"]) == \
        ["1.0:native", "0.1:prerouted"]


def test_the_benchmarks_forced_decode_feeds_the_texts_own_tokens():
    import bench_stream
    import mlx.core as mx
    from mlx_lm.generate import generate_step

    import edgemoe

    model, _ = edgemoe.load(expert_budget=0.25)  # the bundled model
    following = [int(t) for t in np.random.default_rng(4).integers(3, 500, 12)]
    steps = generate_step(mx.array([5, 6, 7]), model, max_tokens=10,
                          sampler=bench_stream.forced_sampler(following, 10, "T"))
    assert [int(token) for token, _ in steps] == following[:10]
    with pytest.raises(SystemExit, match="T: --forced needs 11 tokens after the prompt, "
                                         "found 10"):
        bench_stream.forced_sampler(following[:10], 10, "T")


def test_a_picture_without_matplotlib_is_one_line_that_names_the_extra(monkeypatch):
    """The scripts draw through scripts/plotting.py: without matplotlib (the `bench` extra)
    a script says in one line what to install, with no traceback, and draws nothing."""
    import plotting

    monkeypatch.setitem(sys.modules, "matplotlib", None)  # (its import raises ImportError)
    monkeypatch.setattr(sys, "argv", ["scripts/bench_hotpath.py"])
    with pytest.raises(SystemExit) as exit_:
        plotting.pyplot()
    assert str(exit_.value) == ("bench_hotpath.py: no picture drawn: it needs matplotlib "
                                "(pip install -e '.[bench]')")
    drawing = [f.name for f in sorted((ROOT / "scripts").glob("*.py"))
               if f.name != "plotting.py" and "import matplotlib" in f.read_text()]
    assert drawing == [], "these scripts import matplotlib themselves: use plotting.pyplot"
