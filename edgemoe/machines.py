"""The streaming defaults per machine, as the twin decided them (docs/mac.md, "Defaults per
machine": the figures behind each choice; tests/test_twin.py pins every row to its profile
and to that table).

A machine is named as the twin's profiles are (edgemoe/whatif/twin/profiles.json: `m4-pro-24gb`):
`EDGEMOE_MACHINE` names one, else a Mac takes the profile of its chip and memory (an M4
Air and an M4 mini report the same chip: `m4-24gb` takes `m4-air-24gb`). A Mac no profile
describes gets `apple-silicon`, with a warning that says how to measure its profile; off
macOS (these Linux VMs, a GPU box) the `generic` row holds, the values the project
measured on its own machines. StreamOptions and the tools' prefill step take
their defaults from here; a flag or keyword still overrides each.
"""

import logging
import os
import platform
import subprocess
from dataclasses import dataclass
from typing import Optional

GENERIC = "generic"


@dataclass(frozen=True)
class MachineDefaults:
    io: str  # "direct" (O_DIRECT, F_NOCACHE on macOS) or "buffered" (the page cache)
    readers: int  # reader threads, reads in flight
    cache_policy: str
    routing: str  # the exact mode that pays there: "native" or "advisory"
    prefill_step_size: int  # prompt tokens per forward call (each reads its experts once)


APPLE = MachineDefaults(io="direct", readers=2, cache_policy="lfu", routing="native",
                        prefill_step_size=4096)
DEFAULTS = {
    GENERIC: MachineDefaults(io="buffered", readers=2, cache_policy="lfu", routing="native",
                             prefill_step_size=2048),
    "apple-silicon": APPLE,  # a Mac that no profile names
    "m4-air-24gb": APPLE,
    "m4-pro-24gb": APPLE,
    "m3-max-48gb": APPLE,
    "m4-max-128gb": APPLE,
    "m5-max-128gb": APPLE,
    "m4-mini-16gb": APPLE,  # the back-test's profiles (docs/mac.md, "Back-test"): not
    "m4-air-32gb": APPLE,  # re-decided by the twin's rows; Apple's defaults
    "m5-pro-48gb": APPLE,
}


def mac_name() -> Optional[str]:
    """This Mac's chip and memory as `sysctl` gives them: `m4-pro-24gb` for an Apple M4 Pro
    with 24 GB, `m4-24gb` for a plain M4 (an Air and a mini say the same); None off macOS."""
    if platform.system() != "Darwin":
        return None
    try:
        chip = subprocess.run(["sysctl", "-n", "machdep.cpu.brand_string"], text=True,
                              capture_output=True, timeout=5).stdout.strip()
        memory = int(subprocess.run(["sysctl", "-n", "hw.memsize"], text=True,
                                    capture_output=True, timeout=5).stdout)
    except (OSError, ValueError, subprocess.SubprocessError):
        return "apple-silicon"
    words = chip.lower().removeprefix("apple ").split()  # "m4 pro"
    return "-".join(words + [f"{round(memory / 2**30)}gb"])


# words of a profile's name that say the case, not the chip: the brand string does not
# carry them, and the figures a profile holds are the chip's and its memory's
FORM_FACTORS = ("air", "mini")


def profile_for(name: str) -> Optional[str]:
    """The shipped machine whose chip and memory are `name`'s (`m4-24gb` -> `m4-air-24gb`),
    or None."""
    if name in DEFAULTS:
        return name
    same = [key for key in DEFAULTS
            if "-".join(w for w in key.split("-") if w not in FORM_FACTORS) == name]
    return same[0] if len(same) == 1 else None


def no_profile_note(name: str) -> str:
    return (f"this Mac ({name}) matches no shipped machine profile, so Apple's defaults "
            f"hold; measure one with `python -m edgemoe.doctor --measure-machine my-mac.json` "
            f"(docs/mac.md, \"Your Mac's profile\"), or name the closest with "
            f"EDGEMOE_MACHINE (one of {', '.join(k for k in DEFAULTS if k != GENERIC)})")


def this_machine() -> str:
    """The name of the machine this runs on, as DEFAULTS keys it."""
    named = os.environ.get("EDGEMOE_MACHINE")
    if named:
        if named not in DEFAULTS:
            raise ValueError(f"EDGEMOE_MACHINE={named}: choose one of {', '.join(DEFAULTS)}")
        return named
    named = mac_name()
    if named is None:
        return GENERIC
    found = profile_for(named)
    if found is None:
        _say_once(no_profile_note(named))
        return "apple-silicon"
    return found


_said = set()


def _say_once(line: str):
    if line not in _said:
        _said.add(line)
        logging.getLogger("edgemoe").warning(line)


def machine_defaults(name: Optional[str] = None) -> MachineDefaults:
    """The defaults of machine `name` (default: this one)."""
    name = name or this_machine()
    if name not in DEFAULTS:
        raise ValueError(f"machine {name!r}: choose one of {', '.join(DEFAULTS)}")
    return DEFAULTS[name]
