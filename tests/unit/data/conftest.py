import numpy as np
import pytest

from megatron_smp.data.indexed_dataset import IndexedDatasetBuilder


def write_documents(prefix, documents, dtype=np.uint16):
    """Write `documents` (lists of ids) as one indexed dataset; returns the prefix."""
    builder = IndexedDatasetBuilder(prefix + ".bin", dtype)
    for document in documents:
        builder.add_document(np.asarray(document))
    builder.finalize(prefix + ".idx")
    return prefix


def random_documents(num_documents, seed, eod, vocab=1000, max_length=60):
    """Documents of random ids below `vocab`, each ending with `eod`."""
    rng = np.random.RandomState(seed)
    return [
        list(rng.randint(0, vocab, size=rng.randint(1, max_length))) + [eod]
        for _ in range(num_documents)
    ]


@pytest.fixture
def make_dataset(tmp_path):
    def make(name, documents, dtype=np.uint16):
        return write_documents(str(tmp_path / name), documents, dtype)

    return make
