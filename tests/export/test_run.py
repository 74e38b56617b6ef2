"""Where the export takes its tokenizer from, and the refusal of an unpinned tokenizer revision."""

from pathlib import Path

import pytest
from mixquant.export.run import tokenizer_source_dir


def test_model_tokenizer_comes_from_the_model_dir(tmp_path):
    assert tokenizer_source_dir({"source": "model"}, tmp_path / "model", tmp_path) == tmp_path / "model"


def test_unpinned_hub_tokenizer_is_refused(tmp_path):
    with pytest.raises(ValueError, match="refusing an unpinned revision"):
        tokenizer_source_dir({"source": "hub", "repo": "org/model", "revision": None}, Path("m"), tmp_path)
