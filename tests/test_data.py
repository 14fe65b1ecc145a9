"""Offline datasets, the real torchvision loading path on files in the real format, and TensorLoader."""
import struct

import numpy as np
import pytest
import torch

from course_utils.data import (ImageDataset, TensorLoader, load_cifar10, load_mnist, synthetic_cifar,
                               synthetic_digits)
from course_utils.models import SimpleCNN
from course_utils.trainer import Trainer


def test_synthetic_digits_shape_range_balance_and_determinism():
    ds = synthetic_digits(1000, seed=3)
    assert ds.images.shape == (1000, 1, 28, 28) and ds.images.dtype == torch.float32
    assert ds.images.min() >= 0 and ds.images.max() <= 1
    assert torch.bincount(ds.labels, minlength=10).tolist() == [100] * 10
    again = synthetic_digits(1000, seed=3)
    assert torch.equal(ds.images, again.images) and torch.equal(ds.labels, again.labels)
    assert not torch.equal(ds.images, synthetic_digits(1000, seed=4).images)


def test_synthetic_digits_vary_within_a_class():
    ds = synthetic_digits(200, seed=0)
    sevens = ds.images[ds.labels == 7]
    assert (sevens[0] - sevens[1]).abs().mean() > 0.02  # jittered, not copies of one glyph


def test_synthetic_cifar_shape_and_determinism():
    ds = synthetic_cifar(500, seed=1)
    assert ds.images.shape == (500, 3, 32, 32)
    assert len(ds.classes) == 10 and set(ds.labels.tolist()) == set(range(10))
    assert torch.equal(ds.images, synthetic_cifar(500, seed=1).images)


def test_simple_cnn_learns_synthetic_digits_in_one_cpu_epoch():
    torch.manual_seed(0)
    train, test = synthetic_digits(10_000, seed=0), synthetic_digits(2_000, seed=1)
    model = SimpleCNN()
    trainer = Trainer(model, torch.optim.Adam(model.parameters(), 1e-3), torch.nn.CrossEntropyLoss(),
                      TensorLoader.from_dataset(train, batch_size=64, seed=0), device="cpu")
    trainer(1)
    acc = trainer.evaluate(TensorLoader.from_dataset(test, batch_size=500, shuffle=False))["accuracy"]
    assert acc >= 0.95, acc


def _write_idx(path, array, magic):
    with open(path, "wb") as f:
        f.write(struct.pack(">I", magic))
        for dim in array.shape:
            f.write(struct.pack(">I", dim))
        f.write(array.astype(np.uint8).tobytes())


def test_load_mnist_reads_real_idx_files_through_torchvision(tmp_path):
    raw = tmp_path / "MNIST" / "raw"
    raw.mkdir(parents=True)
    rng = np.random.default_rng(0)
    images = rng.integers(0, 256, size=(12, 28, 28))
    labels = rng.integers(0, 10, size=(12,))
    _write_idx(raw / "train-images-idx3-ubyte", images, 0x00000803)
    _write_idx(raw / "train-labels-idx1-ubyte", labels, 0x00000801)
    _write_idx(raw / "t10k-images-idx3-ubyte", images[:4], 0x00000803)
    _write_idx(raw / "t10k-labels-idx1-ubyte", labels[:4], 0x00000801)
    ds = load_mnist(tmp_path, train=True, download=False)
    assert ds.source == "torchvision.MNIST" and len(ds) == 12
    assert torch.allclose(ds.images[:, 0] * 255, torch.from_numpy(images).float())
    assert ds.labels.tolist() == labels.tolist()
    assert len(load_mnist(tmp_path, train=False, download=False)) == 4


def test_load_cifar10_reads_real_pickled_batches_through_torchvision(tmp_path, monkeypatch):
    import pickle

    import torchvision.datasets.cifar

    folder = tmp_path / "cifar-10-batches-py"
    folder.mkdir()
    rng = np.random.default_rng(0)
    for name in [f"data_batch_{i}" for i in range(1, 6)] + ["test_batch"]:
        batch = {"data": rng.integers(0, 256, size=(3, 3072), dtype=np.uint8),
                 "labels": rng.integers(0, 10, size=3).tolist()}
        with open(folder / name, "wb") as f:
            pickle.dump(batch, f)
    with open(folder / "batches.meta", "wb") as f:
        pickle.dump({"label_names": [f"c{i}" for i in range(10)]}, f)
    # The only thing faked: torchvision checks each file's MD5 against the official release, which small test
    # files cannot match. Parsing, the pickle format and the HWC->CHW layout all run for real.
    monkeypatch.setattr(torchvision.datasets.cifar, "check_integrity", lambda *args, **kwargs: True)
    ds = load_cifar10(tmp_path, train=True, download=False)
    assert ds.source == "torchvision.CIFAR10" and ds.images.shape == (15, 3, 32, 32)
    assert ds.classes == [f"c{i}" for i in range(10)]
    first = pickle.load(open(folder / "data_batch_1", "rb"))["data"][0]
    assert torch.allclose(ds.images[0] * 255, torch.from_numpy(first.reshape(3, 32, 32)).float())


def test_offline_fallback_is_one_clear_sentence(tmp_path, capsys):
    ds = load_mnist(tmp_path / "nothing-here", download=False, fallback_size=50)
    out = capsys.readouterr().out.strip()
    assert ds.source == "synthetic" and len(ds) == 50
    assert out.count("\n") == 0 and "synthetic digits instead" in out
    ds = load_cifar10(tmp_path / "nothing-here", download=False, fallback_size=20)
    assert ds.source == "synthetic" and ds.images.shape[1:] == (3, 32, 32)


def test_tensor_loader_covers_every_sample_once_and_reshuffles():
    x = torch.arange(10).float()[:, None]
    y = torch.arange(10)
    loader = TensorLoader(x, y, batch_size=4, seed=0)
    assert len(loader) == 3
    epoch1 = torch.cat([b for _, b in loader])
    epoch2 = torch.cat([b for _, b in loader])
    assert sorted(epoch1.tolist()) == list(range(10)) == sorted(epoch2.tolist())
    assert not torch.equal(epoch1, epoch2)
    for xb, yb in loader:
        assert torch.equal(xb[:, 0].long(), yb)  # images and labels stay paired
    assert len(TensorLoader(x, y, batch_size=4, drop_last=True)) == 2


def test_tensor_loader_state_resumes_the_same_order():
    x, y = torch.randn(20, 1), torch.arange(20)
    loader = TensorLoader(x, y, batch_size=5, seed=1)
    list(loader)
    state = loader.state_dict()
    expected = [b.tolist() for _, b in loader]
    other = TensorLoader(x, y, batch_size=5, seed=99)
    other.load_state_dict(state)
    assert [b.tolist() for _, b in other] == expected


def test_bad_arguments_get_clear_messages():
    with pytest.raises(ValueError, match="labels"):
        TensorLoader(torch.zeros(3, 1), torch.zeros(4), batch_size=2)
    with pytest.raises(ValueError, match="batch_size"):
        TensorLoader(torch.zeros(3, 1), torch.zeros(3), batch_size=0)
    with pytest.raises(ValueError):
        synthetic_digits(0)
    with pytest.raises(ValueError):
        ImageDataset(torch.zeros(2, 1, 2, 2), torch.zeros(3), [], "x")
