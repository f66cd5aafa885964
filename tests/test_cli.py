"""Every tool's --help shows its essential flags first and sets the experimental apart;
`edgemoe COMMAND` runs `python -m edgemoe.COMMAND`; cache_sim has real subcommands."""

import importlib
import re
import subprocess
import sys

import pytest

from edgemoe import cli


def help_of(name, capsys, *argv):
    with pytest.raises(SystemExit) as e:
        importlib.import_module(f"edgemoe.{name}").main([*argv, "--help"])
    assert e.value.code == 0
    return capsys.readouterr().out


def flags_of(section: str):
    return re.findall(r"^  (--[a-z-]+)", section, re.MULTILINE)


@pytest.mark.parametrize("name", sorted(cli.ESSENTIAL))
def test_help_shows_the_essential_flags_first(name, capsys):
    out = help_of(name, capsys)
    sections = re.split(r"\n(?=\S[^\n]*:\n)", out.split("\n\n", 2)[-1])
    titles = [s.split(":\n")[0] for s in sections]
    assert titles[0] == "essential", titles  # the first group of flags
    assert flags_of(sections[0]) == cli.ESSENTIAL[name]
    usage = out.split("\n\n")[0]  # and the usage line names them first
    first = [f for f in re.findall(r"\[?(--[a-z-]+)", usage) if f != "--help"]
    assert first[:len(cli.ESSENTIAL[name])] == cli.ESSENTIAL[name], usage


def test_the_experimental_variant_is_in_a_group_named_so_and_removed_ones_are_refused(
        capsys):
    """The learned cache policy, the one experimental variant left, is named in each
    tool's "experimental" group, the last; the variants removed in #44 are refused."""
    import argparse

    from edgemoe.options import StreamOptions

    for name in ("generate", "server", "eval"):
        out = " ".join(help_of(name, capsys).split())
        assert "--routing {native,advisory,prerouted}" in out
        assert "--cache-policy {lfu}" in out
        tail = out.split(" experimental: Research variants")[1]
        assert "--cache-policy learned" in tail
    parser = StreamOptions.add_arguments(argparse.ArgumentParser())
    assert parser.parse_args(["--cache-policy", "learned"]).cache_policy == "learned"
    for removed in (["--routing", "prerouted-set"], ["--cache-policy", "lru"]):
        with pytest.raises(SystemExit):
            parser.parse_args(removed)
    assert "invalid choice" in capsys.readouterr().err
    out = help_of("train_prerouter", capsys)
    assert not {"--first-layer", "--history", "--inputs", "--depth", "--hidden"} & set(
        re.findall(r"--[a-z-]+", out))


def test_cache_sim_has_subcommands_with_their_own_help(capsys):
    out = help_of("cache_sim", capsys)
    for command in ("replay", "split", "windows", "train-learned"):
        assert f"    {command}" in out
    assert "--window" in help_of("cache_sim", capsys, "windows")
    assert "--prefetch" in help_of("cache_sim", capsys, "replay")
    assert "--out" in help_of("cache_sim", capsys, "train-learned")


def test_the_edgemoe_command_runs_each_tool(capsys):
    assert cli.main(["--help"]) == 0
    out = capsys.readouterr().out
    for name in cli.COMMANDS:
        assert name.replace("_", "-") in out
    with pytest.raises(SystemExit) as e:
        cli.main(["doctor", "--help"])
    assert e.value.code == 0
    assert "--memory" in capsys.readouterr().out
    with pytest.raises(SystemExit) as e:
        cli.main(["nonsense"])
    assert "unknown command 'nonsense'" in str(e.value.code)
    # as installed: the console script is edgemoe.cli:main
    r = subprocess.run([sys.executable, "-c", "import sys; from edgemoe.cli import main; "
                        "sys.exit(main())", "cache-sim", "--help"],
                       capture_output=True, text=True)
    assert r.returncode == 0 and "usage: edgemoe cache-sim" in r.stdout, r.stderr
