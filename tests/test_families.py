"""Every MoE family of the pinned mlx-lm, and every expert quantization it writes, streamed
exactly (scripts/family_table.py does the checks); docs/families.md's tables are what they find."""

import multiprocessing
import os
from concurrent.futures import ProcessPoolExecutor
from pathlib import Path

import pytest
from mlx_lm.utils import _get_classes

import edgemoe
import family_table
from edgemoe.convert import convert
from edgemoe.format.families import UNSUPPORTED, UnsupportedModelError
from make_family_checkpoints import family_config, family_names, make_family
from conftest import ROOT

FAMILIES = family_table.supported_families()


QUANT_NAMES = [name for name, _ in family_table.QUANT_SPECS]


@pytest.fixture(scope="module")
def pool():
    """One process per core (two at most), for both tables' checks: they are independent
    and each is mostly Python-bound decode. Spawned, each worker imports mlx-lm,
    transformers and torch once for both tables."""
    context = multiprocessing.get_context("spawn")
    with ProcessPoolExecutor(min(2, os.cpu_count() or 1), mp_context=context) as executor:
        yield executor


def in_parallel(pool, fn, items, *args) -> dict:
    """{item: fn(item, *args), or the exception it raised}, on the pool."""
    futures = {item: pool.submit(fn, item, *args) for item in items}
    found = {}
    for item, future in futures.items():
        try:
            found[item] = future.result()
        except Exception as e:  # reported by the item's own test
            found[item] = e
    return found


@pytest.fixture(scope="module")
def rows(pool, tmp_path_factory):
    """family -> its row (family_table.check_family), or the error it raised."""
    return in_parallel(pool, family_table.check_family, FAMILIES,
                       tmp_path_factory.mktemp("families"))


@pytest.mark.parametrize("family", FAMILIES)
def test_family_streams_exactly_in_every_mode(rows, family):
    row = rows[family]
    if isinstance(row, Exception):
        raise row
    assert not [k for k, same in row["exact"].items() if not same], row
    assert row["speculative"] is not False, "speculative decode differs from mlx-lm's"
    assert row["routing"], "the block, routed by its native logits as a prediction, differs"
    assert row["prerouted"], "prerouted decode loaded on demand in a predicted layer"
    assert row["hf"] is not False, "its Hugging Face layout, converted, differs from mlx-lm"


def test_the_documented_family_table_is_what_the_tests_found(rows):
    if any(isinstance(r, Exception) for r in rows.values()):
        pytest.skip("a family failed: see its own test")
    table = family_table.render_table([rows[f] for f in FAMILIES])
    assert family_table.readme_table(family_table.TABLES_DOC, "family") == table, \
        "run `python scripts/family_table.py --write`"


def test_every_moe_model_file_of_mlx_lm_has_a_test_config():
    """A family added to mlx-lm (a model file calling its switch layers) needs a config
    here, or a line in UNSUPPORTED saying why not."""
    import mlx_lm

    models = Path(mlx_lm.__file__).parent / "models"
    moe = {p.stem for p in models.glob("*.py")
           if "SwitchGLU" in p.read_text() or "SwitchMLP" in p.read_text()}
    moe -= {"switch_layers"}
    configs = {_get_classes(family_config(f))[0].__module__.rsplit(".", 1)[-1]
               for f in family_names()}  # the file mlx-lm runs for the config
    assert not sorted(moe - configs - set(UNSUPPORTED))


@pytest.mark.parametrize("family", sorted(UNSUPPORTED))
def test_an_unsupported_family_is_refused_with_its_reason(family, tmp_path):
    checkpoint = make_family(family, tmp_path / family)
    reason = UNSUPPORTED[family][:40]
    with pytest.raises(UnsupportedModelError, match="cannot be streamed") as e:
        convert(checkpoint, tmp_path / "pack")
    assert reason in str(e.value) and not (tmp_path / "pack").exists()
    with pytest.raises(UnsupportedModelError, match="cannot be streamed") as e:
        edgemoe.load(checkpoint)
    assert reason in str(e.value)


@pytest.fixture(scope="module")
def quant_rows(pool, tmp_path_factory):
    rows = in_parallel(pool, family_table.check_quantization, QUANT_NAMES,
                       tmp_path_factory.mktemp("quantization"))
    for row in rows.values():
        if isinstance(row, Exception):
            raise row
    return rows


@pytest.mark.parametrize("name", QUANT_NAMES)
def test_every_expert_quantization_streams_exactly(quant_rows, name):
    row = quant_rows[name]
    assert all(row["exact"].values()), row
    if "unquantized" not in name:
        assert row["manifest"] != "none", row  # the experts really are quantized that way


def test_the_documented_quantization_table_is_what_the_tests_found(quant_rows):
    table = family_table.render_quant_table(list(quant_rows.values()))
    assert family_table.readme_table(family_table.TABLES_DOC, "quantization") == table, \
        "run `python scripts/family_table.py --write`"
