"""The index builders: the compiled C path, the numpy/Python fallback and megatron-core agree.

blending_indices.npz was recorded from megatron-core 0.16.1's compiled helpers_cpp by
tests/fixtures/data_megatron/make_blending_indices.py, on inputs full of float64 ties.
"""
import json
import logging
import os

import numpy as np
import pytest

from megatron_smp import native
from megatron_smp.data import compiled, indices

FIXTURES = os.path.join(os.path.dirname(__file__), "..", "..", "fixtures", "data_megatron")
REFERENCE = np.load(os.path.join(FIXTURES, "blending_indices.npz"))
CASES = json.loads(str(REFERENCE["cases"]))


@pytest.fixture(params=["compiled", "fallback"])
def path(request, monkeypatch):
    """Run the test once with the C helpers and once with the numpy/Python path."""
    if request.param == "compiled":
        if native._compiler() is None:
            pytest.skip("no C compiler here: the fallback is what runs")
        assert compiled.library() is not None, "a C compiler is here: the helpers must build"
    else:
        monkeypatch.setenv("MEGATRON_SMP_NO_COMPILED_HELPERS", "1")
    return request.param


def _sample_index_inputs(seed, num_documents):
    rng = np.random.RandomState(seed)
    sizes = rng.randint(1, 200, size=num_documents).astype(np.int32)
    document_index = np.tile(np.arange(num_documents, dtype=np.int32), 2)
    rng.shuffle(document_index)
    return sizes, document_index


def test_equal_megatron_core(path):
    for name, (weights, size) in CASES["blend"].items():
        dataset_index, dataset_sample_index = indices.build_blending_indices(weights, size)
        assert dataset_index.dtype == np.int16 and dataset_sample_index.dtype == np.int64
        np.testing.assert_array_equal(dataset_index, REFERENCE[f"blend/{name}/dataset_index"])
        np.testing.assert_array_equal(
            dataset_sample_index, REFERENCE[f"blend/{name}/dataset_sample_index"]
        )
    for name, sizes in CASES["exhaustive"].items():
        dataset_index, dataset_sample_index = indices.build_exhaustive_blending_indices(sizes)
        np.testing.assert_array_equal(
            dataset_index, REFERENCE[f"exhaustive/{name}/dataset_index"], err_msg=name
        )
        np.testing.assert_array_equal(
            dataset_sample_index, REFERENCE[f"exhaustive/{name}/dataset_sample_index"]
        )
    for name, (seed, num_documents, seq_length, extra) in CASES["sample_index"].items():
        sizes, document_index = _sample_index_inputs(seed, num_documents)
        ours = indices.build_sample_index(sizes, document_index, seq_length, extra)
        np.testing.assert_array_equal(ours, REFERENCE[f"sample_index/{name}"], err_msg=name)


def test_compiled_equals_fallback_on_random_inputs(monkeypatch):
    """Ties, empty documents, int64 document indices and zero-sample edge cases."""
    if native._compiler() is None:
        pytest.skip("no C compiler here: the fallback is what runs")
    assert compiled.library() is not None
    rng = np.random.RandomState(0)

    def both(build, *args):
        monkeypatch.delenv("MEGATRON_SMP_NO_COMPILED_HELPERS", raising=False)
        fast = build(*args)
        monkeypatch.setenv("MEGATRON_SMP_NO_COMPILED_HELPERS", "1")
        slow = build(*args)
        monkeypatch.delenv("MEGATRON_SMP_NO_COMPILED_HELPERS")
        fast, slow = (fast, slow) if isinstance(fast, tuple) else ((fast,), (slow,))
        for a, b in zip(fast, slow):
            assert a.dtype == b.dtype and a.shape == b.shape
            np.testing.assert_array_equal(a, b)

    for trial in range(60):
        n = rng.randint(1, 9)
        weights = [np.ones(n), rng.rand(n), np.array([1.0, 2, 3, 1, 2, 3, 1, 2])[:n]][trial % 3]
        both(indices.build_blending_indices, (weights / weights.sum()).tolist(),
             rng.randint(0, 2000))
        both(indices.build_exhaustive_blending_indices, rng.randint(1, 300, size=n).tolist())
        sizes = rng.randint(0, 20, size=rng.randint(1, 40)).astype(np.int32)  # empty documents
        dtype = (np.int32, np.int64)[trial % 2]
        document_index = rng.randint(0, sizes.size, size=rng.randint(1, 80)).astype(dtype)
        for extra in (0, 1):
            both(indices.build_sample_index, sizes, document_index, 1 + trial % 7, extra)


def test_document_and_shuffle_index_draws():
    """The in-place shuffles of views draw what Megatron's shuffles of separate arrays do."""
    documents = np.arange(5, 40, dtype=np.int32)
    ours = indices.build_document_index(documents, 3, np.random.RandomState(7), True)
    rng = np.random.RandomState(7)
    head, tail = np.tile(documents, 2), documents.copy()
    rng.shuffle(head)
    rng.shuffle(tail)
    np.testing.assert_array_equal(ours, np.concatenate((head, tail)))
    assert ours.dtype == np.int32

    ours = indices.build_shuffle_index(100, 130, np.random.RandomState(8))
    rng = np.random.RandomState(8)
    head, tail = np.arange(100, dtype=np.uint32), np.arange(100, 130, dtype=np.uint32)
    rng.shuffle(head)
    rng.shuffle(tail)
    np.testing.assert_array_equal(ours, np.concatenate((head, tail)))
    assert ours.dtype == np.uint32


def test_missing_compiler_falls_back_with_a_warning(tmp_path, monkeypatch, caplog):
    monkeypatch.setattr(native, "_loaded", {})
    monkeypatch.setenv("MEGATRON_SMP_HELPERS_DIR", str(tmp_path))
    monkeypatch.setenv("CC", str(tmp_path / "no-such-cc"))
    with caplog.at_level(logging.WARNING, logger="megatron_smp.native"):
        assert compiled.library() is None
    assert "cannot build helpers.c" in caplog.text
    assert "numpy/Python path" in caplog.text
    weights, size = CASES["blend"]["equal_10"]
    dataset_index, _ = indices.build_blending_indices(weights, size)
    np.testing.assert_array_equal(dataset_index, REFERENCE["blend/equal_10/dataset_index"])

    # No compiler on the PATH at all: the same fallback, its own line.
    monkeypatch.setattr(native, "_loaded", {})
    monkeypatch.delenv("CC")
    monkeypatch.setattr(native.shutil, "which", lambda name: None)
    caplog.clear()
    with caplog.at_level(logging.WARNING, logger="megatron_smp.native"):
        assert compiled.library() is None
    assert "no C compiler found" in caplog.text


def test_compiles_into_the_cache_dir_once(tmp_path, monkeypatch):
    if native._compiler() is None:
        pytest.skip("no C compiler here")
    monkeypatch.setattr(native, "_loaded", {})
    monkeypatch.setenv("MEGATRON_SMP_HELPERS_DIR", str(tmp_path))
    assert compiled.library() is not None
    (built,) = [p for p in os.listdir(tmp_path) if p.endswith(".so")]
    stamp = os.path.getmtime(tmp_path / built)
    monkeypatch.setattr(native, "_loaded", {})
    assert compiled.library() is not None  # a second process: loads, does not rebuild
    assert os.path.getmtime(tmp_path / built) == stamp
    assert os.listdir(tmp_path) == [built]
