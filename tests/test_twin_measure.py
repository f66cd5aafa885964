"""A profile measured on this machine (edgemoe.whatif.twin.measure, doctor --measure-machine), small
sizes, and the forecast doctor --machine makes from it."""

import json
from pathlib import Path

from edgemoe import doctor
from edgemoe.whatif.twin.measure import measure_machine
from edgemoe.whatif.twin.profiles import FIGURES, all_profiles, load_profile

FINE = Path(__file__).resolve().parents[1] / "edgemoe" / "models" / "fine"
TRACE = FINE / "traces" / "stdlib.npz"


def test_this_machine_measured_and_forecast_from(tmp_path, capsys):
    out = tmp_path / "mine.json"
    measure_machine(out, megabytes=16, sizes=(64 * 1024, 256 * 1024), depths=(1, 2),
                    reads=8, name="mine", repeats=1)
    saved = json.loads(out.read_text())
    assert len(saved["ssd_table"]) == 4
    assert {(r["record_bytes"], r["threads"]) for r in saved["ssd_table"]} == \
        {(65536, 1), (65536, 2), (262144, 1), (262144, 2)}
    assert not (tmp_path / ".edgemoe-measure.bin").exists()  # the scratch file is gone
    profile = load_profile(str(out))
    # contributed as edgemoe/whatif/twin/profiles/NAME.json, it is a named profile
    folder = tmp_path / "profiles"
    folder.mkdir()
    (folder / "mine-measured.json").write_text(out.read_text())
    assert "mine-measured" in all_profiles(contributed=folder)
    for fig in FIGURES:
        f = profile.figures[fig]
        assert f["kind"] == "measured" and "--measure-machine" in f["source"], fig
        assert f["value"] >= 0
    assert profile.value("ssd_read_gbps") > 0 and profile.value("int4_gbps") > 0
    assert profile.value("cpu_vs_here") > 0
    capsys.readouterr()
    rows = doctor.main(["--machine", str(out), "--model", str(FINE), "--memory", "0.5",
                        "--expert-budget", "25%", "--trace", str(TRACE)])
    text = capsys.readouterr().out
    assert "machine: mine" in text and "FORECAST" in text
    assert rows[0]["budget"] == "25%" and rows[0]["native_tok_s"] > 0
    # this disk and CPU, not a Mac's: the forecast's read time is its bytes over the
    # measured rate
    assert rows[0]["read_ms"] > 1e3 * rows[0]["bytes_per_token"] / (
        profile.value("ssd_read_gbps") * 1e9) * 0.99
