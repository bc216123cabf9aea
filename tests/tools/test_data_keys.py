"""`tools/data_keys.py`: the data-key tables of docs/library.md are the ones generated from the
loss contracts, every key a loss declares has a glossary entry, and the glossary agrees with the
batch checks (`compiled_loss.inputs.validate`) on every key both describe."""

from __future__ import annotations

import importlib.util
from pathlib import Path

from compiled_loss.inputs import validate
from compiled_loss.interfaces import DATA_KEYS

ROOT = Path(__file__).resolve().parents[2]
_spec = importlib.util.spec_from_file_location("data_keys", ROOT / "tools" / "data_keys.py")
data_keys = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(data_keys)

STEP_KEYS = {"input_ids", "input_lengths"}  # what the training step reads of every batch


def test_the_docs_tables_are_the_generated_ones():
    assert data_keys.PAGE == ROOT / "docs" / "library.md"
    assert data_keys.page_tables(data_keys.PAGE.read_text()) == data_keys.tables(), (
        "docs/library.md's data-key tables are stale: python tools/data_keys.py --write"
    )


def test_every_loss_declares_its_keys_and_every_key_has_a_glossary_entry():
    read = set()
    for loss in data_keys.losses():
        required, optional = data_keys.data_keys(loss)
        assert required, f"{type(loss).__name__} declares no data keys (InputSpec.data)"
        read |= set(required) | set(optional)
    assert read <= set(DATA_KEYS), f"no glossary entry: {sorted(read - set(DATA_KEYS))}"
    assert set(DATA_KEYS) <= read | STEP_KEYS, f"glossary entries no loss reads: {sorted(set(DATA_KEYS) - read)}"


def test_the_glossary_agrees_with_the_batch_checks():
    expected = {k: "[B, S]" for k in validate.TOKEN_KEYS} | {k: "[B]" for k in validate.ROW_KEYS}
    expected |= validate.POSITION_KEYS
    for key, shape in expected.items():
        assert DATA_KEYS[key].shape == shape, key
    for key in validate.INTEGER_KEYS:
        assert DATA_KEYS[key].dtype == ("integer or bool" if key in validate.FLAG_KEYS else "integer"), key
    for key in validate.FLOAT_KEYS:
        assert DATA_KEYS[key].dtype == "float", key
    assert {e.dtype for e in DATA_KEYS.values()} == {"integer", "integer or bool", "float"}
