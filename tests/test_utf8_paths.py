"""A checkpoint or store under a folder whose name is not UTF-8 (Python holds it with
surrogate escapes): the tokenizers and safetensors libraries open UTF-8 paths only, and get
a link to the same files instead (dlm/engine/utf8_paths.py). Compared in float32."""

from __future__ import annotations

import os
import shutil
from pathlib import Path

from dlm.cli.store.fetch import fetch
from dlm.cli.store.store import Store
from dlm.engine import default_model
from dlm.engine.llm import LLM


def not_utf8(parent: Path) -> Path:
    """`parent`/st<0xff>: a folder name in Latin-1, not UTF-8."""
    return Path(os.fsdecode(os.fsencode(parent) + b"/st\xff"))


def test_the_default_model_under_a_non_utf8_folder_loads_and_answers_the_same(tmp_path: Path) -> None:
    """Before: the tokenizer failed to load (UnicodeEncodeError from the tokenizers library,
    a UsageError 'could not load the tokenizer'), and the weights would have failed next
    (SafetensorError 'is not valid UTF-8')."""
    original = default_model.ensure_default_model()
    copy = not_utf8(tmp_path) / "model"
    shutil.copytree(original, copy)
    prompt = "What is 27 + 58?"
    expected = LLM(original, dtype="float32", device="cpu").generate(prompt, gen_length=32, chat=True)[0]
    got = LLM(copy, dtype="float32", device="cpu").generate(prompt, gen_length=32, chat=True)[0]
    assert got.output_ids == expected.output_ids and got.text == expected.text


def test_a_store_under_a_non_utf8_folder_verifies_what_it_fetches(tmp_path: Path) -> None:
    """Before: `dlm fetch` stored the sound default model as `failed` (tokenizer: 'utf-8'
    codec can't encode character '\\udcff'), so no command would load it."""
    store = Store(not_utf8(tmp_path) / "store")
    result = fetch(str(default_model.default_model_dir()), store, name="tiny", workers=1)
    assert result.manifest.state == "verified", result.manifest.verification


def test_a_utf8_path_is_given_as_it_is_and_another_through_a_link_removed_after(tmp_path: Path) -> None:
    from dlm.engine.utf8_paths import utf8_path

    with utf8_path(tmp_path) as same:
        assert same == str(tmp_path)
    folder = not_utf8(tmp_path)
    folder.mkdir()
    (folder / "f").write_text("x")
    with utf8_path(folder) as alias:
        alias.encode("utf-8")  # the libraries' requirement
        assert Path(alias).name == "st\ufffd" and os.path.samefile(alias, folder)
        assert (Path(alias) / "f").read_text() == "x"
    assert not os.path.lexists(alias)
