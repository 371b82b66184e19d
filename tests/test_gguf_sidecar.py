"""A GGUF's config and tokenizer through the sidecar directory (engine/model/gguf_sidecar.py), and its tensors
through our own header walk (gguf_header.py) instead of gguf-py's reader: both must give what transformers and
gguf-py give."""

from __future__ import annotations

import os
import threading
from pathlib import Path

import numpy as np
import pytest

from radixserve.engine.model import gguf_sidecar
from radixserve.engine.model.quant.gguf_file import GGUFFile

from conftest import demo_gguf, requires_demo_gguf, write_gguf


@pytest.fixture
def cache(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    monkeypatch.setenv(gguf_sidecar.CACHE_DIR_ENV, str(tmp_path / "cache"))
    return tmp_path / "cache"


@requires_demo_gguf
def test_the_demo_sidecar_gives_transformers_own_config_and_tokenizer(cache: Path) -> None:
    from transformers import AutoConfig, AutoTokenizer

    path = str(demo_gguf())
    d, f = os.path.split(path)
    results: list[Path] = []
    threads = [threading.Thread(target=lambda: results.append(gguf_sidecar.ensure_sidecar(path))) for _ in range(2)]
    for t in threads:  # two engines of `up --engines 2` starting at once: both get one complete directory
        t.start()
    for t in threads:
        t.join()
    assert len(results) == 2 and results[0] == results[1] and results[0].parent == cache
    assert sorted(os.listdir(cache)) == [results[0].name]  # no temporary directory left behind

    got_config, want_config = (
        gguf_sidecar.load_gguf_config(path).to_dict(),
        AutoConfig.from_pretrained(d, gguf_file=f).to_dict(),
    )
    got_config.pop("_name_or_path"), want_config.pop("_name_or_path")
    assert got_config == want_config
    got, want = gguf_sidecar.load_gguf_tokenizer(path), AutoTokenizer.from_pretrained(d, gguf_file=f)
    messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "2+2? ünïcödé 漢字"}]
    assert got.apply_chat_template(messages, tokenize=False) == want.apply_chat_template(messages, tokenize=False)
    text = want.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    assert got(text).input_ids == want(text).input_ids and len(got) == len(want)
    assert (got.eos_token_id, got.bos_token_id) == (want.eos_token_id, want.bos_token_id)


def test_a_gguf_without_a_vocabulary_has_a_config_but_a_clear_tokenizer_error(
    cache: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    import gguf

    monkeypatch.setattr(gguf_sidecar, "IN_PROCESS_MAX_BYTES", 0)  # the child-process path, on a small file
    path = tmp_path / "novocab.gguf"
    writer = gguf.GGUFWriter(str(path), "llama")
    for add, value in [("add_block_count", 1), ("add_context_length", 64), ("add_embedding_length", 8)]:
        getattr(writer, add)(value)
    writer.add_feed_forward_length(16)
    writer.add_head_count(2)
    writer.add_head_count_kv(1)
    writer.add_layer_norm_rms_eps(1e-5)
    writer.add_tensor("output_norm.weight", np.ones(8, dtype=np.float32))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    assert gguf_sidecar.load_gguf_config(str(path)).hidden_size == 8
    with pytest.raises(ValueError, match="novocab.gguf: transformers cannot build its tokenizer: ") as e:
        gguf_sidecar.load_gguf_tokenizer(str(path))
    assert "\n" not in str(e.value)


def test_a_replaced_file_gets_a_new_sidecar(cache: Path, tmp_path: Path) -> None:
    path = write_gguf(tmp_path / "m.gguf")
    before = gguf_sidecar.sidecar_dir(str(path))
    os.utime(path, ns=(1, 1))
    assert gguf_sidecar.sidecar_dir(str(path)) != before and before.parent == cache


def test_a_config_error_is_one_line_from_the_child(cache: Path, tmp_path: Path) -> None:
    import gguf

    path = tmp_path / "m.gguf"
    writer = gguf.GGUFWriter(str(path), "no-such-architecture")
    writer.add_tensor("output_norm.weight", np.ones(8, dtype=np.float32))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    with pytest.raises(ValueError, match="m.gguf: transformers cannot read its config: ") as e:
        gguf_sidecar.ensure_sidecar(str(path))
    assert "\n" not in str(e.value)


@requires_demo_gguf
def test_our_gguf_file_maps_every_tensor_as_gguf_py_does() -> None:
    # GGUFFile walks the header itself (gguf-py's reader took ~2.8 s and ~100 MiB of heap for the demo file's
    # metadata); every tensor must come out with gguf-py's type, dtype, shape and bytes.
    from gguf import GGUFReader

    ours, theirs = GGUFFile(str(demo_gguf())), GGUFReader(str(demo_gguf()))
    assert ours.architecture == str(theirs.fields["general.architecture"].contents())
    assert ours.names() == [t.name for t in theirs.tensors]
    for t in theirs.tensors:
        mine = ours.tensor(t.name)
        assert (mine.type_name, mine.shape) == (t.tensor_type.name, tuple(int(x) for x in reversed(t.shape)))
        assert mine.data.dtype == t.data.dtype and mine.data.shape == t.data.shape
        assert np.array_equal(mine.data, t.data), t.name
