"""The guide's Sphinx configuration (``conf.py``): what it changes in how docstrings render."""

from __future__ import annotations

import importlib.util
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


def _conf():
    spec = importlib.util.spec_from_file_location("mfsdp_docs_conf", ROOT / "conf.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_an_attribute_docstring_with_a_colon_is_not_read_as_a_type():
    """napoleon reads ``word: text`` on an attribute docstring's first line as a type; ours are
    prose (the annotation gives the type), so the configuration keeps every word."""
    napoleon = pytest.importorskip("sphinx.ext.napoleon")
    from sphinx.ext.napoleon.docstring import GoogleDocstring

    config = napoleon.Config(napoleon_use_ivar=False)
    lines = ["MLA: rank of the query's low-rank projection"]
    plain = GoogleDocstring(list(lines), config, what="attribute", name="q_lora_rank").lines()
    assert ":type: MLA" in plain  # what napoleon alone makes of it
    _conf()._no_type_in_attribute_docstrings(None, "attribute", "q_lora_rank", None, {}, lines)
    ours = GoogleDocstring(lines, config, what="attribute", name="q_lora_rank").lines()
    assert not any(line.startswith(":type:") for line in ours)
    assert " ".join(ours).split() == "MLA: rank of the query's low-rank projection".split()
