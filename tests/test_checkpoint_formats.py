"""The registry of checkpoint formats (``mfsdp/checkpoint/formats.py``) is the one list of formats:
the guide's table and ``--ckpt-format`` agree with it, and a format registered here, in this file
only, is recognised, converted to and from the others by ``mfsdp convert`` and loaded."""

from __future__ import annotations

import re
from pathlib import Path

import pytest
import torch

from mfsdp.checkpoint import formats
from mfsdp.checkpoint.convert import main as convert_main
from mfsdp.checkpoint.dcp import read_full, write_full

DOCS = Path(__file__).resolve().parent.parent / "docs"


def test_the_guide_table_is_the_registry():
    text = (DOCS / "conversion-reference.md").read_text()
    start = text.index("| format | what it holds | who writes it |")
    table = text[start:text.index("\n\n", start)]
    assert table == formats.guide_table(), (
        "docs/conversion-reference.md's format table differs from the registry; paste "
        "mfsdp.checkpoint.formats.guide_table() there")


def test_ckpt_format_choices_are_the_registry():
    from mfsdp.trainer.arguments import build_parser

    action = next(a for a in build_parser()._actions if "--ckpt-format" in a.option_strings)
    assert tuple(action.choices) == formats.train_formats()


def test_every_name_resolves_and_none_is_taken_twice():
    for name in formats.names():
        assert name in (formats.get(name).name, *formats.get(name).aliases)
    with pytest.raises(ValueError, match="'torch_dist' is already registered"):
        formats.register(formats.CheckpointFormat(name="torch_dist", holds="", written_by="",
                                                  recognise=lambda p: False))


# -- a format defined here only ------------------------------------------------------------------
def _tiny_to_common(src: Path, out: Path, options) -> None:
    weights = torch.load(Path(src) / "tiny.pt")
    write_full(out, {f"model.{k}": v.float() for k, v in weights.items()},
               {"extra": {"iteration": 0}}, "fsdp_dtensor", None)


def _common_to_tiny(src: Path, out: Path, options) -> str:
    tensors, _, _ = read_full(src)
    out.mkdir(parents=True)
    torch.save({k[len("model."):]: v for k, v in tensors.items() if k.startswith("model.")},
               out / "tiny.pt")
    return f"wrote a tiny checkpoint {out}"


@pytest.fixture
def tiny():
    fmt = formats.register(formats.CheckpointFormat(
        name="tiny", holds="one `tiny.pt` of weights by name", written_by="this test",
        recognise=lambda path: (path / "tiny.pt").is_file(),
        to_common=_tiny_to_common, from_common=_common_to_tiny,
        load=formats.loader_via_common("tiny")))
    yield fmt
    formats.unregister("tiny")


def test_a_registered_format_is_detected_and_converted_both_ways(tiny, tmp_path, capsys):
    torch.manual_seed(0)
    weights = {"fc.weight": torch.randn(4, 3), "fc.bias": torch.randn(4)}
    src = tmp_path / "in"
    src.mkdir()
    torch.save(weights, src / "tiny.pt")
    assert formats.detect(src) == "tiny"
    assert "| `tiny` | one `tiny.pt` of weights by name | this test |" in formats.guide_table()
    # tiny -> mfsdp_full: through the common form, by the two formats' converters
    assert convert_main(["--from", "tiny", "--to", "mfsdp_full", str(src),
                         str(tmp_path / "full")]) == 0
    assert formats.detect(tmp_path / "full") == "mfsdp_full"
    full, _, _ = read_full(tmp_path / "full")
    for k, v in weights.items():
        assert torch.equal(full[f"model.{k}"], v)
    assert not list(tmp_path.glob(".tmp-*"))  # the common form in between is gone
    # mfsdp_full -> tiny, and the other way round through safetensors
    assert convert_main(["--from", "mfsdp_full", "--to", "tiny", str(tmp_path / "full"),
                         str(tmp_path / "back")]) == 0
    assert re.search(r"wrote a tiny checkpoint .*back", capsys.readouterr().out)
    assert formats.detect(tmp_path / "back") == "tiny"
    back = torch.load(tmp_path / "back" / "tiny.pt")
    assert back.keys() == weights.keys() and all(torch.equal(back[k], weights[k]) for k in back)
    assert convert_main(["--from", "tiny", "--to", "safetensors", str(src),
                         str(tmp_path / "st")]) == 0
    assert formats.detect(tmp_path / "st") == "safetensors"
    # two built-in formats, neither of them the common form
    assert convert_main(["--from", "mfsdp_full", "--to", "safetensors", str(tmp_path / "full"),
                         str(tmp_path / "st2")]) == 0
    from mfsdp.checkpoint.safetensors import load_file

    st2, _ = load_file(tmp_path / "st2" / "model.safetensors")
    assert st2.keys() == weights.keys() and all(torch.equal(st2[k], weights[k]) for k in st2)
    with pytest.raises(SystemExit, match="is a tiny checkpoint .* not safetensors"):
        convert_main(["--from", "safetensors", "--to", "fsdp_dtensor", str(src),
                      str(tmp_path / "x")])


def _load_tiny(path: str) -> dict:
    import torch.distributed as dist

    import mfsdp
    from mfsdp.checkpoint import load_checkpoint

    formats.register(formats.CheckpointFormat(
        name="tiny", holds="", written_by="", recognise=lambda p: (p / "tiny.pt").is_file(),
        to_common=_tiny_to_common, load=formats.loader_via_common("tiny")))
    model = mfsdp.fully_shard_model(torch.nn.Linear(3, 4))
    load_checkpoint(path, model)
    full = model.full_parameters()
    return {k: v.clone() for k, v in full.items()} if dist.get_rank() == 0 else {}


def test_a_registered_format_loads_into_a_sharded_model(tiny, tmp_path):
    from mfsdp.launch import launch

    weights = {"weight": torch.randn(4, 3), "bias": torch.randn(4)}
    torch.save(weights, tmp_path / "tiny.pt")
    loaded = launch(_load_tiny, 2, args=(str(tmp_path),))[0]
    assert loaded.keys() == weights.keys()
    assert all(torch.equal(loaded[k], weights[k]) for k in weights)


def test_fixture_checkpoints_name_no_machine_path():
    """Every committed DCP fixture names its directory relative to ``tests/fixtures`` (DCP
    records the writer's absolute path; ``tests/fixtures/relative_metadata.py`` rewrites it), and
    the rewritten fixtures still read (the other tests read them in full)."""
    import pickle

    root = Path(__file__).parent / "fixtures"
    found = sorted(root.rglob(".metadata"))
    assert len(found) >= 20
    for path in found:
        storage = pickle.loads(path.read_bytes()).storage_meta
        assert str(storage.checkpoint_id) == str(path.parent.relative_to(root)), path
    from torch.distributed.checkpoint import FileSystemReader

    metadata = FileSystemReader(root / "megatron_lm" / "optim" / "adam" / "iter_0000002"
                                ).read_metadata()
    assert len(metadata.state_dict_metadata) > 10
