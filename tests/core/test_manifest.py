"""State capture and rebuild: a manifest over the live tensors plus a pickled skeleton."""

from __future__ import annotations

from collections import OrderedDict

import pytest
import torch

from torchpass.core.manifest import Captured, capture, fingerprint, rebuild, state_digest, tensor_bytes


def nested_state() -> dict:
    torch.manual_seed(0)
    model = OrderedDict(
        [
            ("layer.weight", torch.randn(4, 3)),
            ("layer.bias", torch.randn(3)),
            ("emb", torch.randn(5, 2, dtype=torch.bfloat16)),
            ("scale", torch.tensor(2.5)),  # 0-dim
            ("empty", torch.empty(0, 7)),
            ("mask", torch.tensor([True, False, True])),
        ]
    )
    optimizer = {
        "state": {0: {"step": torch.tensor(3.0), "exp_avg": torch.randn(4, 3), "exp_avg_sq": torch.rand(4, 3)}},
        "param_groups": [{"lr": 1e-3, "betas": (0.9, 0.999), "params": [0, 1], "name": None}],
    }
    extra = {"pair": (torch.arange(3), 7), "list": [torch.ones(2, dtype=torch.int64), "text", 1.5], "counter": 42}
    return {"model": model, "optimizer": optimizer, "extra": extra}


def assert_same(a, b) -> None:
    """Recursive equality: container types, non-tensor leaves, and tensors bitwise (dtype and shape too)."""
    assert type(a) is type(b), (type(a), type(b))
    if isinstance(a, torch.Tensor):
        assert a.dtype == b.dtype and a.shape == b.shape
        assert bytes(tensor_bytes(a.contiguous())) == bytes(tensor_bytes(b.contiguous()))
    elif isinstance(a, dict):
        assert list(a) == list(b)
        for k in a:
            assert_same(a[k], b[k])
    elif isinstance(a, (list, tuple)):
        assert len(a) == len(b)
        for x, y in zip(a, b):
            assert_same(x, y)
    else:
        assert a == b


def copies(captured) -> list[torch.Tensor]:
    """What a receiver holds after the transfer: equal bytes in separate memory."""
    return [t.clone() for t in captured.tensors]


# ---- capture / rebuild -----------------------------------------------------------


def test_round_trip_of_nested_state():
    state = nested_state()
    captured = capture(state, {"model": "params", "optimizer": "optimizer"}, version=5)
    rebuilt = rebuild(captured.manifest, copies(captured))
    assert_same(rebuilt, state)
    assert type(rebuilt["model"]) is OrderedDict
    assert type(rebuilt["optimizer"]["param_groups"][0]["betas"]) is tuple
    assert type(rebuilt["extra"]["pair"]) is tuple


def test_manifest_describes_every_tensor():
    state = nested_state()
    captured = capture(state, {"model": "params", "optimizer": "optimizer"}, version=5, meta={"rank": 3})
    manifest = captured.manifest
    assert manifest.version == 5
    assert manifest.meta == {"rank": 3}
    by_name = {e.name: e for e in manifest.entries}
    assert len(by_name) == len(manifest.entries) == len(captured.tensors) == 11
    assert by_name["model/layer.weight"].shape == (4, 3)
    assert by_name["model/layer.weight"].dtype == "float32"
    assert by_name["model/layer.weight"].nbytes == 48
    assert by_name["model/emb"].dtype == "bfloat16"
    assert by_name["model/emb"].nbytes == 20
    assert by_name["model/scale"].shape == ()
    assert by_name["model/empty"].nbytes == 0
    assert by_name["optimizer/state/0/exp_avg"].state_class == "optimizer"
    assert by_name["model/mask"].state_class == "params"
    assert by_name["extra/pair/0"].state_class == "small"  # components without a class
    assert by_name["extra/list/0"].dtype == "int64"
    assert manifest.nbytes == sum(t.numel() * t.element_size() for t in captured.tensors)


def test_capture_references_live_storage():
    weight = torch.randn(64, 64)
    state = {"model": {"w": weight}}
    captured = capture(state, {"model": "params"}, version=0)
    assert captured.tensors[0].data_ptr() == weight.data_ptr()
    weight.add_(1.0)  # later writes show through: nothing was copied
    assert torch.equal(captured.tensors[0], weight)


def test_capture_of_a_parameter_and_a_contiguous_view():
    param = torch.nn.Parameter(torch.randn(3, 3))
    base = torch.arange(20.0)
    view = base[5:9]  # contiguous, with a storage offset
    captured = capture({"model": {"p": param, "v": view}}, {}, version=0)
    assert captured.tensors[0].data_ptr() == param.data_ptr()
    assert not captured.tensors[0].requires_grad
    assert captured.tensors[1].data_ptr() == view.data_ptr()
    assert bytes(tensor_bytes(captured.tensors[1])) == bytes(tensor_bytes(torch.tensor([5.0, 6.0, 7.0, 8.0])))


def test_non_contiguous_tensors_are_copied_and_rebuilt_equal():
    base = torch.randn(6, 4)
    transposed = base.t()
    strided = base[:, ::2]
    captured = capture({"m": {"t": transposed, "s": strided, "c": base}}, {}, version=0)
    assert all(t.is_contiguous() for t in captured.tensors)
    assert captured.private == {0, 1}  # the copies; the contiguous tensor is referenced
    assert captured.tensors[2] is not base and captured.tensors[2].data_ptr() == base.data_ptr()
    assert captured.tensors[0].data_ptr() != base.data_ptr()
    rebuilt = rebuild(captured.manifest, copies(captured))
    assert torch.equal(rebuilt["m"]["t"], transposed)
    assert torch.equal(rebuilt["m"]["s"], strided)


def test_rebuild_puts_the_given_tensors_in_place():
    state = {"m": {"a": torch.ones(2), "b": [torch.zeros(3)]}}
    captured = capture(state, {}, version=0)
    received = copies(captured)
    rebuilt = rebuild(captured.manifest, received)
    assert rebuilt["m"]["a"] is received[0]
    assert rebuilt["m"]["b"][0] is received[1]


def test_rebuild_rejects_a_wrong_tensor_count():
    captured = capture({"m": {"a": torch.ones(2), "b": torch.ones(3)}}, {}, version=0)
    with pytest.raises(ValueError, match="manifest lists 2 tensors, got 1"):
        rebuild(captured.manifest, captured.tensors[:1])


def test_state_without_tensors_round_trips():
    state = {"scheduler": {"last_epoch": 7, "base_lrs": [0.1]}, "extra": {}}
    captured = capture(state, {}, version=2)
    assert captured.manifest.entries == [] and captured.tensors == []
    assert rebuild(captured.manifest, []) == state


# ---- errors ------------------------------------------------------------------------


class FakeDTensor(torch.Tensor):
    """A tensor subclass standing in for DTensor (and other wrapper subclasses)."""


def test_tensor_subclass_is_rejected():
    sub = torch.ones(2).as_subclass(FakeDTensor)
    with pytest.raises(TypeError, match=r"'model/w' is a FakeDTensor.*DTensors to their local shards"):
        capture({"model": {"w": sub}}, {}, version=0)


def test_non_cpu_tensor_is_rejected():
    with pytest.raises(TypeError, match=r"'model/w' is on meta"):
        capture({"model": {"w": torch.empty(2, device="meta")}}, {}, version=0)


def test_tensor_bytes_needs_a_contiguous_tensor():
    with pytest.raises(ValueError, match="contiguous"):
        tensor_bytes(torch.randn(3, 4).t())


def test_tensor_bytes_is_a_view_of_the_tensor():
    t = torch.zeros(4, dtype=torch.bfloat16)
    view = tensor_bytes(t)
    assert len(view) == 8
    view[0:2] = bytes(tensor_bytes(torch.tensor([1.0], dtype=torch.bfloat16)))
    assert t[0].item() == 1.0
    assert len(tensor_bytes(torch.empty(0))) == 0


# ---- fingerprints and digests ---------------------------------------------------------


def flip_one_bit(t: torch.Tensor, byte: int = 0, bit: int = 0) -> None:
    tensor_bytes(t)[byte] ^= 1 << bit


def test_fingerprint_is_equal_for_equal_state():
    a = capture(nested_state(), {"model": "params", "optimizer": "optimizer"}, version=1)
    b = capture(nested_state(), {"model": "params", "optimizer": "optimizer"}, version=1)
    assert a.tensors[0].data_ptr() != b.tensors[0].data_ptr()
    assert fingerprint(a) == fingerprint(b)


@pytest.mark.parametrize(("name", "byte", "bit"), [("model/layer.weight", 0, 0), ("model/emb", 19, 7), ("optimizer/state/0/exp_avg_sq", 33, 3)])
def test_fingerprint_changes_after_a_one_bit_flip(name, byte, bit):
    classes = {"model": "params", "optimizer": "optimizer"}
    a = capture(nested_state(), classes, version=1)
    b = capture(nested_state(), classes, version=1)
    index = [e.name for e in b.manifest.entries].index(name)
    flip_one_bit(b.tensors[index], byte, bit)
    assert fingerprint(a) != fingerprint(b)


def test_fingerprint_restricted_to_state_classes():
    classes = {"model": "params", "optimizer": "optimizer"}
    a = capture(nested_state(), classes, version=1)
    b = capture(nested_state(), classes, version=1)
    index = [e.name for e in b.manifest.entries].index("optimizer/state/0/exp_avg")
    flip_one_bit(b.tensors[index])
    assert fingerprint(a, {"params"}) == fingerprint(b, {"params"})
    assert fingerprint(a, {"optimizer"}) != fingerprint(b, {"optimizer"})
    assert fingerprint(a, {"params", "optimizer"}) != fingerprint(b, {"params", "optimizer"})
    assert fingerprint(a, {"params"}) != fingerprint(a, {"optimizer"})
    assert fingerprint(a, set()) == fingerprint(b, set())


def test_fingerprint_reads_a_copy_once_through_its_crc_table():
    captured = capture({"m": {"w": torch.randn(1000, 300), "b": torch.randn(7)}}, {"m": "params"}, version=0)
    kept = Captured(captured.manifest, captured.tensors, captured.checksums())
    chunk = 64 << 10
    assert fingerprint(kept, chunk_bytes=chunk) == fingerprint(kept, chunk_bytes=chunk) == fingerprint(captured, chunk_bytes=chunk)
    assert kept.crcs is not None and kept.crcs.checksummed == captured.manifest.nbytes
    assert fingerprint(kept, set()) == fingerprint(captured, set())  # nothing selected, nothing read


def test_fingerprint_covers_names_dtypes_and_shapes():
    base = capture({"m": {"w": torch.zeros(4)}}, {}, version=0)
    renamed = capture({"m": {"v": torch.zeros(4)}}, {}, version=0)
    reshaped = capture({"m": {"w": torch.zeros(2, 2)}}, {}, version=0)
    retyped = capture({"m": {"w": torch.zeros(4, dtype=torch.int32)}}, {}, version=0)
    prints = {fingerprint(c) for c in (base, renamed, reshaped, retyped)}
    assert len(prints) == 4


def test_state_digest_is_stable_and_sensitive():
    digest = state_digest(nested_state())
    assert digest == state_digest(nested_state())
    assert len(digest) == 64
    changed = nested_state()
    flip_one_bit(changed["model"]["layer.bias"], 11, 6)
    assert state_digest(changed) != digest
    counter = nested_state()
    counter["extra"]["counter"] = 43  # small state lives in the skeleton
    assert state_digest(counter) != digest


def test_state_digest_ignores_memory_layout():
    base = torch.randn(3, 5)
    assert state_digest({"m": {"w": base.t().contiguous()}}) == state_digest({"m": {"w": base.t()}})
