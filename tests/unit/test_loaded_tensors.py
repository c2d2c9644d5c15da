"""Storages and views in the format: what each reader gives back, ``into=``, devices, format 1.

``tests/compat/`` holds loaded states to ``torch.load``'s through the torch calls
trainers make; these tests pin the parts underneath: every reader (the engine's,
its mmap, the reference one) lays tensors out as ``torch.load`` does, the data
files stay plain safetensors, ``into=`` fills views and tied weights in place,
a tensor saved on a device goes back there, and format-1 checkpoints still load.
"""

from __future__ import annotations

import json
import math
import shutil
import tempfile
import zlib
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from slurm_ckpt import Checkpointer
from slurm_ckpt.engine import Engine
from slurm_ckpt.errors import CheckpointCorrupt
from slurm_ckpt.store.codec import encode_state
from slurm_ckpt.store.commit import commit
from slurm_ckpt.store.load import load_state
from slurm_ckpt.store.manifest import MANIFEST, Manifest
from slurm_ckpt.store.verify import verify_checkpoint
from slurm_ckpt.store.writer import write_state
from tests.compat.cases import layout, state_digest, tensors
from tests.unit.old_formats import format1_state, format2_state

torch = pytest.importorskip("torch")

DATA = Path(__file__).parent / "data"


def views_state() -> dict[str, Any]:
    """Storages shared and not, views at offsets, strides, a large tensor and its view."""
    g = torch.Generator().manual_seed(3)
    buf = torch.randn(64, generator=g)
    big = torch.randn(1 << 19, generator=g)  # 2 MiB: the reader's large-tensor path
    mat = torch.randn(5, 6, generator=g)
    w = torch.randn(8, 4, generator=g)
    return {
        "buf": buf, "head": buf[:10], "odd": buf[1::2],
        "big": big, "big_rows": big.view(512, 1024)[100:200],
        "t": mat.t(), "row": mat[2],  # mat itself is not in the state: stored whole anyway
        "tied": {"a": w, "b": w.detach()},  # two tensor objects on one storage
        "rng": torch.get_rng_state(), "small": [torch.full((k,), float(k)) for k in range(1, 20)],
        "param": torch.nn.Parameter(torch.randn(3, generator=g)),
    }  # fmt: skip


def torch_loaded(state: Any, tmp_path: Path) -> Any:
    torch.save(state, tmp_path / "ref.pt")
    return torch.load(tmp_path / "ref.pt", weights_only=True)


def saved(state: Any, tmp_path: Path) -> tuple[Path, Manifest]:
    with Checkpointer(tmp_path / "run", distributed=False, scratch=False) as ck:
        path = ck.save(state, step=1)
    return path, verify_checkpoint(path)


@pytest.mark.parametrize("reader", ["engine", "engine mmap", "reference"])
def test_every_reader_lays_tensors_out_as_torch_load_does(tmp_path: Path, reader: str) -> None:
    state = views_state()
    path, man = saved(state, tmp_path)
    if reader == "reference":
        got = load_state(path, man)
    else:
        got = Engine().load(path, man, mmap=reader == "engine mmap")
    assert layout(got) == layout(torch_loaded(state, tmp_path))
    if reader != "reference":  # whose storages are torch's own allocations, resizable
        assert not got["small"][3].untyped_storage().resizable()  # as torch.load's


def bits_state() -> dict[str, Any]:
    """Tensors with torch's lazy conjugate or negative bit, whose bytes are not their values."""
    g = torch.Generator().manual_seed(5)
    z = torch.randn(6, dtype=torch.complex64, generator=g)
    big = torch.randn(1 << 18, dtype=torch.complex64, generator=g)  # 2 MiB: the reader's large-tensor path
    w = torch.randn(4, dtype=torch.complex64, generator=g)
    return {
        "conj": z.conj(), "plain": z,  # one storage, with and without the bit
        "conj_rows": z[1:4].conj(), "big_conj": big.conj(),
        "neg": w.conj().imag,  # the negative bit: the imaginary parts of w's storage, as floats
    }  # fmt: skip


@pytest.mark.parametrize("how", ["save", "save_async", "save, mmap", "save, reference reader"])
def test_conjugate_and_negative_bits_load_as_torch_load_gives_them(tmp_path: Path, how: str) -> None:
    state = bits_state()
    with Checkpointer(tmp_path / "run", distributed=False, scratch=False) as ck:
        if how == "save_async":
            ck.save_async(state, step=1).wait()  # the default snapshot copies the state
        else:
            ck.save(state, step=1)
        if how == "save, reference reader":
            path = ck.dir / "step-000000001"
            got = load_state(path, verify_checkpoint(path))
        else:
            got = ck.load_latest(mmap=how == "save, mmap")
    assert layout(got) == layout(torch_loaded(state, tmp_path))  # values, bits, sharing


@pytest.mark.parametrize("n", [6, 1 << 18])  # small: copied in; large: read straight into a plain target
def test_into_a_conjugate_tensor_gets_the_saved_values_not_their_bytes(tmp_path: Path, n: int) -> None:
    w = torch.randn(n, dtype=torch.complex64)
    path, man = saved({"w": w, "wc": w.conj(), "re": w.real}, tmp_path)  # views of w's storage
    target = torch.zeros_like(w).conj()
    into = {"w": target, "wc": torch.zeros_like(w), "re": torch.zeros(n)}
    got = Engine().load(path, man, into=into)
    assert got["w"] is target and target.is_conj() and torch.equal(target, w)
    assert torch.equal(got["wc"], w.conj()) and torch.equal(got["re"], w.real)  # not read off target's bytes


def starts(state: Any) -> dict[str, int]:
    """Where each tensor's storage starts within 64 bytes (torch's allocator: 0; a
    view is then where torch.load's would be)."""
    return {p: t.untyped_storage().data_ptr() % 64 for p, t in tensors(state) if t.numel()}


@pytest.mark.parametrize("mmap", [False, True], ids=["read", "mmap"])
def test_every_tensor_starts_on_64_bytes_as_torch_load_s_do(tmp_path: Path, mmap: bool) -> None:
    # Sums and dot products depend on where the data starts (test_compat's
    # reductions and L-BFGS cases show what follows). Two large tensors of odd
    # sizes: the second sits off 64 in the file (moved within its buffer); many
    # small ones of odd sizes sit off 64 in a shared buffer (copied).
    state = {"big": [torch.randn((1 << 18) + 1), torch.randn((1 << 18) + 3)], "aligned": torch.randn(1 << 18),
             "small": [torch.randn(k) for k in range(1, 30)], "step": torch.tensor(3.0), "i8": torch.arange(5).byte()}  # fmt: skip
    path, man = saved(state, tmp_path)
    got = Engine().load(path, man, mmap=mmap)
    assert set(starts(got).values()) == {0}
    assert set(starts(torch_loaded(state, tmp_path)).values()) == {0}
    assert state_digest(got) == state_digest(state)
    assert not got["big"][1].untyped_storage().resizable() and got["big"][1].untyped_storage().nbytes() == 4 * ((1 << 18) + 3)


@pytest.mark.parametrize("fixture", ["format1", "format2"])
def test_tensors_of_files_laid_out_before_start_on_64_bytes_too(tmp_path: Path, fixture: str) -> None:
    for mmap in (False, True):
        got, _ = load_fixture(fixture, tmp_path, mmap=mmap)
        assert set(starts(got).values()) == {0}, mmap


def test_views_of_one_storage_are_stored_once_in_a_plain_safetensors_file(tmp_path: Path) -> None:
    from safetensors import safe_open

    buf = torch.arange(1 << 16, dtype=torch.float32)  # 256 KiB
    state = {"buf": buf, "views": [buf[i : i + 100] for i in range(0, 1 << 16, 1000)], "t": buf.view(256, 256).t()}
    path, man = saved(state, tmp_path)
    data = path / "tensors-00000.safetensors"
    assert data.stat().st_size < (1 << 18) + 8192  # the buffer once, not once per view
    with safe_open(str(data), framework="pt") as f:
        assert list(f.keys()) == ["buf"] and torch.equal(f.get_tensor("buf"), buf)
    tree = json.loads((path / "state.json").read_bytes())
    assert tree["buf"] == {"$t": "buf"}
    assert tree["t"]["$view"] == {"key": "t", "of": "buf", "dtype": "F32", "shape": [256, 256],
                                  "stride": [1, 256], "offset": 0}  # fmt: skip
    got = Engine().load(path, man)
    assert all(v.untyped_storage().data_ptr() == got["buf"].untyped_storage().data_ptr() for v in got["views"])
    assert torch.equal(got["t"], state["t"]) and got["t"].stride() == (1, 256)


@pytest.fixture
def read_in_place(monkeypatch: pytest.MonkeyPatch) -> list[list[str]]:
    """The keys each file read wrote straight into the caller's tensors (a spy on the reader)."""
    from slurm_ckpt.engine import reader

    seen: list[list[str]] = []
    real = reader._read

    def spy(*args: Any) -> Any:
        seen.append(sorted(args[-1]))  # in_place: the targets read into
        return real(*args)

    monkeypatch.setattr(reader, "_read", spy)
    return seen


def test_into_fills_tied_weights_and_views_in_place(tmp_path: Path, read_in_place: list[list[str]]) -> None:
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Embedding(300, 1024), torch.nn.Linear(1024, 300, bias=False))
    model[1].weight = model[0].weight  # tied: 1.2 MiB, read in place
    buf = torch.randn(40)
    saved({"model": model.state_dict(), "buf": buf, "every_other": buf[::2]}, tmp_path)
    torch.manual_seed(1)
    fresh = torch.nn.Sequential(torch.nn.Embedding(300, 1024), torch.nn.Linear(1024, 300, bias=False))
    fresh[1].weight = fresh[0].weight
    mine = torch.zeros(40)
    into = {"model": fresh.state_dict(), "buf": mine, "every_other": mine[::2]}
    ptr = fresh[0].weight.data_ptr()
    with Checkpointer(tmp_path / "run", distributed=False, scratch=False) as ck:
        got = ck.load_latest(into=into)
    assert fresh[0].weight.data_ptr() == ptr and fresh[1].weight is fresh[0].weight
    assert torch.equal(fresh[0].weight, model[0].weight)
    # The head is the embedding's memory, as when saved: it keeps nothing from the read in place.
    assert read_in_place == [["model/0.weight"]]
    assert torch.equal(mine, buf) and got["buf"] is mine
    assert got["every_other"] is into["every_other"] and torch.equal(got["every_other"], buf[::2])


def test_into_refuses_a_view_of_another_shape_before_reading(tmp_path: Path) -> None:
    buf = torch.randn(40)
    saved({"buf": buf, "view": buf[:10]}, tmp_path)
    mine = torch.zeros(40)
    with Checkpointer(tmp_path / "run", distributed=False, scratch=False) as ck, \
            pytest.raises(ValueError, match=r"'view'.*holds torch.float32 \[10\].*pass a state shaped like"):  # fmt: skip
        ck.load_latest(into={"buf": mine, "view": mine[:12]})
    assert not mine.any()


def test_into_tensors_of_another_dtype_are_cast_as_load_state_dict_casts(tmp_path: Path) -> None:
    # A model cast since the save (bf16 inference, a float64 check): load_state_dict,
    # DCP and slurm_ckpt.sharded cast into it. Large ones too, which are otherwise
    # read in place, tied weights and views among them.
    buf = torch.randn(600_000)  # as bf16 too, over the size read in place
    state = {"model": {"w": buf, "tied": buf, "head": buf[:10], "b": torch.randn(5)}, "step": torch.tensor(7)}
    saved(state, tmp_path)
    big = torch.zeros(600_000, dtype=torch.bfloat16)
    into = {"model": {"w": big, "tied": big, "head": torch.zeros(10, dtype=torch.float64),
                      "b": torch.zeros(5, dtype=torch.float16)}, "step": torch.zeros((), dtype=torch.float32)}
    with Checkpointer(tmp_path / "run", distributed=False, scratch=False) as ck:
        got = ck.load_latest(into=into)
    for key in ("w", "tied", "head", "b"):
        target = into["model"][key]
        assert got["model"][key] is target
        assert torch.equal(target, state["model"][key].to(target.dtype)), key
    assert got["step"] is into["step"] and into["step"].item() == 7.0


def test_into_a_model_on_the_meta_device_is_refused_with_the_way_to_load_it(tmp_path: Path) -> None:
    # Copying into a meta tensor does nothing, so the load handed the model's meta
    # tensors back unchanged, with no error until the model was used.
    model = torch.nn.Linear(300, 400)
    saved({"model": model.state_dict()}, tmp_path)
    with torch.device("meta"):
        meta = torch.nn.Linear(300, 400)
    with Checkpointer(tmp_path / "run", distributed=False, scratch=False) as ck:
        with pytest.raises(ValueError, match=r"'model/weight'.*meta device.*assign=True.*to_empty"):
            ck.load_latest(into={"model": meta.state_dict()})
        meta.load_state_dict(ck.load_latest()["model"], assign=True)  # the way the message names
    assert torch.equal(meta.weight, model.weight) and not meta.weight.is_meta


def test_into_a_lazy_module_not_yet_run_is_refused_with_the_way_to_load_it(tmp_path: Path) -> None:
    # Its parameters have no shape and no memory until its first forward, and torch
    # raised at the first look at their storage, without saying where in the state.
    torch.manual_seed(0)
    model = torch.nn.LazyLinear(4)
    model(torch.randn(2, 3))
    saved({"model": model.state_dict()}, tmp_path)
    fresh = torch.nn.LazyLinear(4)
    with Checkpointer(tmp_path / "run", distributed=False, scratch=False) as ck:
        with pytest.raises(ValueError, match=r"lazy module.* at /model/weight.*load_state_dict"):
            ck.load_latest(into={"model": fresh.state_dict()})
        fresh.load_state_dict(ck.load_latest()["model"])  # the way the message names
    assert not torch.nn.parameter.is_lazy(fresh.weight) and torch.equal(fresh.weight, model.weight)


def test_into_the_model_s_parameters_loads_them_as_load_state_dict_does(tmp_path: Path) -> None:
    # dict(model.named_parameters()) holds leaves that need grad: copying into one
    # outside no_grad raises, as it would for a trainer's own copy_.
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(600, 600), torch.nn.Linear(600, 3))  # one read in place, others copied
    saved({"model": model.state_dict()}, tmp_path)
    fresh = torch.nn.Sequential(torch.nn.Linear(600, 600), torch.nn.Linear(600, 3))
    params = dict(fresh.named_parameters())
    with Checkpointer(tmp_path / "run", distributed=False, scratch=False) as ck:
        got = ck.load_latest(into={"model": params})
    for name, p in fresh.named_parameters():
        assert got["model"][name] is p and p.requires_grad and torch.equal(p, model.state_dict()[name])


class _LM(torch.nn.Module):
    """An embedding and an output layer of 2 MiB each, tied or not (GPT-2 ties them)."""

    def __init__(self, tie: bool) -> None:
        super().__init__()
        self.emb = torch.nn.Embedding(1024, 512)
        self.head = torch.nn.Linear(512, 1024, bias=False)
        if tie:
            self.head.weight = self.emb.weight


def test_into_targets_that_share_memory_get_what_load_state_dict_gives_them(tmp_path: Path) -> None:
    # A checkpoint of an untied model loaded into a tied one: its state_dict() gives two
    # tensors on one storage, each large enough to be read in place. Read into at once,
    # the reads raced, and a crc taken of the other read's bytes failed a sound checkpoint.
    torch.manual_seed(0)
    untied = _LM(tie=False)
    saved({"model": untied.state_dict()}, tmp_path)
    ref = _LM(tie=True)
    ref.load_state_dict(untied.state_dict())  # copies each in turn: the head's weight last
    for _ in range(3):  # one load could have been lucky
        tied, skipped = _LM(tie=True), []
        with Checkpointer(tmp_path / "run", distributed=False, scratch=False) as ck:
            got = ck.load_latest(into={"model": tied.state_dict()}, skipped=skipped)
        assert got is not None and skipped == [], skipped
        assert torch.equal(tied.emb.weight, ref.emb.weight) and tied.head.weight is tied.emb.weight
    # Two views of one buffer that overlap, into= in the other order than saved: copied
    # in into='s order, as load_state_dict would, so "a" is copied last and wins.
    a, b = torch.full((512, 1024), 1.0), torch.full((512, 1024), 2.0)
    shutil.rmtree(tmp_path / "run")
    saved({"a": a, "b": b}, tmp_path)
    base = torch.zeros(513, 1024)
    with Checkpointer(tmp_path / "run", distributed=False, scratch=False) as ck:
        got = ck.load_latest(into={"b": base[1:], "a": base[:-1]})
    assert got is not None
    assert torch.equal(base[:-1], a) and torch.equal(base[-1], b[-1])
    # The same into another dtype (cast once read), and into views of a saved tensor
    # ("q", a $view in the file) given before the tensor that overlaps them: into='s
    # order still decides, whatever the file's.
    wide = torch.zeros(513, 1024, dtype=torch.float64)
    with Checkpointer(tmp_path / "run", distributed=False, scratch=False) as ck:
        ck.load_latest(into={"b": wide[1:], "a": wide[:-1]})
    assert torch.equal(wide[:-1], a.double()) and torch.equal(wide[-1], b[-1].double())
    shutil.rmtree(tmp_path / "run")
    p, q_base = torch.randn(8), torch.randn(8)
    saved({"p": p, "q_base": q_base, "q": q_base[2:6]}, tmp_path)
    for order in (("q", "p"), ("p", "q")):
        mine = torch.zeros(8)
        targets = {"q": mine[:4], "p": mine}
        with Checkpointer(tmp_path / "run", distributed=False, scratch=False) as ck:
            ck.load_latest(into={k: targets[k] for k in order})
        want = torch.zeros(8)
        for k in order:  # what load_state_dict's copies in this order leave
            want[: len(targets[k])] = {"p": p, "q": q_base[2:6]}[k]
        assert torch.equal(mine, want), order


def test_only_targets_whose_bytes_overlap_are_kept_from_reads_in_place(tmp_path: Path,
                                                                      read_in_place: list[list[str]]) -> None:  # fmt: skip
    # What a strided target can touch is its own extent in its storage, not the whole
    # storage: a disjoint neighbour on the same buffer is still read straight into.
    from slurm_ckpt.store.codec import overlapping

    n = 512 * 1024  # 2 MiB of float32: large enough to be read in place
    buf = torch.zeros(3 * n)
    a = buf[:n]
    apart = buf[n : 2 * n].view(512, 1024).t()  # transposed, after a's last byte
    across = buf[n - 1024 : 2 * n - 1024].view(512, 1024).t()  # its first row is a's last
    assert overlapping({"a": a, "apart": apart}) == set()
    assert overlapping({"a": a, "across": across}) == {"a", "across"}
    assert overlapping({"a": a, "every_other": buf[1::2]}) == {"a", "every_other"}
    assert overlapping({"a": a, "last": buf[-4:].expand(3, 4), "empty": buf[:0]}) == set()
    assert overlapping({"a": a, "again": buf[n - 1 : n].expand(2, 2)}) == {"a", "again"}
    saved({"a": torch.randn(n), "apart": torch.randn(1024, 512)}, tmp_path)
    with Checkpointer(tmp_path / "run", distributed=False, scratch=False) as ck:
        got = ck.load_latest(into={"a": a, "apart": apart})
        want = ck.load_latest()
    assert got["a"] is a and torch.equal(a, want["a"]) and torch.equal(apart, want["apart"])
    assert not buf[2 * n :].any()
    assert read_in_place == [["a"], []]  # the second load, without into=, reads into nothing


def test_into_arrays_no_tensor_can_view_get_the_values_too(tmp_path: Path) -> None:
    # A field of a record array whose stride is no whole number of its elements, negative
    # strides: torch views neither, so they are loaded through a copy. The copy's values used to stay
    # there, and the caller's array kept its old values without a word.
    records = np.zeros(3, dtype=[("x", "<f8"), ("n", "<i4")])
    backwards = np.zeros((4, 6))[::-1, ::2]
    frozen = np.zeros(3)
    frozen.flags.writeable = False
    state = {"x": np.arange(3.0) + 0.5, "n": np.array([7, 8, 9], dtype=np.int32),
             "back": np.arange(12.0).reshape(4, 3), "frozen": np.ones(3), "fortran": np.arange(6.0).reshape(2, 3).T}  # fmt: skip
    transposed_back = np.zeros((2, 3))[::-1].T  # saved in Fortran order, into= one with negative strides
    into = {"x": records["x"], "n": records["n"], "back": backwards, "frozen": frozen, "fortran": transposed_back}
    saved(state, tmp_path)
    with Checkpointer(tmp_path / "run", distributed=False, scratch=False) as ck:
        got = ck.load_latest(into=into)
    for key in ("x", "n", "back", "fortran"):
        assert np.shares_memory(got[key], into[key]) and np.array_equal(into[key], state[key]), key
    assert records.tolist() == [(0.5, 7), (1.5, 8), (2.5, 9)]
    # A read-only array is left alone: the loaded values are in a copy of their own.
    assert not frozen.any() and got["frozen"] is not frozen and np.array_equal(got["frozen"], state["frozen"])
    # One such array given at two places saved apart: the last place's values, as for a tensor.
    shutil.rmtree(tmp_path / "run")
    saved({"a": np.array([1.0, 2.0, 3.0]), "b": np.array([4.0, 5.0, 6.0])}, tmp_path)
    both = np.zeros(6)[::-2]
    with Checkpointer(tmp_path / "run", distributed=False, scratch=False) as ck:
        got = ck.load_latest(into={"a": both, "b": both})
    assert both.tolist() == [4.0, 5.0, 6.0] and got["a"] is both and got["b"] is both


def test_arrays_with_negative_strides_on_dims_of_size_1_save_and_load(tmp_path: Path) -> None:
    # NumPy calls them C-contiguous, and torch refused to view them: the save failed.
    import pickle

    state = {"row": np.arange(3.0)[::-1][:1], "flat": np.arange(6.0).reshape(1, 6)[::-1], "n": 4}
    assert all(s < 0 for s in state["row"].strides) and state["flat"].flags.c_contiguous  # what the test is about
    saved(state, tmp_path)
    with Checkpointer(tmp_path / "run", distributed=False, scratch=False) as ck:
        got = ck.load_latest()
        into = {"row": np.zeros(3)[::-1][:1], "flat": np.zeros((1, 6))[::-1]}
        ck.load_latest(into=into)
    for key in ("row", "flat"):
        want = pickle.loads(pickle.dumps(state[key]))
        assert got[key].strides == want.strides and np.array_equal(got[key], state[key]), key
        assert np.array_equal(into[key], state[key]), key


def test_into_is_matched_by_place_not_by_how_keys_print(tmp_path: Path) -> None:
    # A dict keyed by 1 and "1" ((1,) and "(1,)") given in another order than saved:
    # matched by a path made of str(key), the two tensors got each other's values.
    a, b, c, d = (torch.full((3,), float(i)) for i in range(4))
    saved({"d": {1: a, "1": b, (1,): c, "(1,)": d}}, tmp_path)
    into = {"d": {"(1,)": torch.zeros(3), "1": torch.zeros(3), (1,): torch.zeros(3), 1: torch.zeros(3)}}
    with Checkpointer(tmp_path / "run", distributed=False, scratch=False) as ck:
        got = ck.load_latest(into=into)
    for key, want in ((1, a), ("1", b), ((1,), c), ("(1,)", d)):
        assert got["d"][key] is into["d"][key] and torch.equal(into["d"][key], want), key


def test_into_one_tensor_at_two_places_gets_what_load_state_dict_gives_it(tmp_path: Path) -> None:
    # Given twice (a tied model's weights under two names), saved apart: copied into in
    # into='s order, the last one's values stay, and the state holds it at both places.
    a, b = torch.full((4,), 1.0), torch.full((4,), 2.0)
    saved({"a": a, "b": b, "tied": a, "tied_too": a}, tmp_path)
    for order in (("a", "b"), ("b", "a")):
        t = torch.zeros(4)
        with Checkpointer(tmp_path / "run", distributed=False, scratch=False) as ck:
            got = ck.load_latest(into={k: t for k in order})
        assert got["a"] is t and got["b"] is t and torch.equal(t, {"a": a, "b": b}[order[-1]]), order
    # One tensor saved at two places, given as two: refused, naming both, before any read.
    mine, other = torch.zeros(4), torch.zeros(4)
    with Checkpointer(tmp_path / "run", distributed=False, scratch=False) as ck, \
            pytest.raises(ValueError, match=r"one tensor at both into\['tied'\] and into\['tied_too'\].*load_state_dict"):  # fmt: skip
        ck.load_latest(into={"tied": mine, "tied_too": other})
    assert not mine.any() and not other.any()
    # Unless the two are one tensor as memory: a tied model's state_dict() (two detach()es
    # of one weight), into a checkpoint of state_dict(keep_vars=True) (the weight itself).
    torch.manual_seed(0)
    tied = _LM(tie=True)
    shutil.rmtree(tmp_path / "run")
    saved({"model": tied.state_dict(keep_vars=True)}, tmp_path)
    fresh = _LM(tie=True)
    with Checkpointer(tmp_path / "run", distributed=False, scratch=False) as ck:
        ck.load_latest(into={"model": fresh.state_dict()})
    assert torch.equal(fresh.emb.weight, tied.emb.weight) and fresh.head.weight is fresh.emb.weight


def load_into(tmp_path: Path, state: Any, into: Any) -> Any:
    """``state`` saved in a run dir of its own under ``tmp_path``, loaded ``into=``."""
    run = Path(tempfile.mkdtemp(dir=tmp_path))
    with Checkpointer(run, distributed=False, scratch=False) as ck:
        ck.save(state, step=1)
        return ck.load_latest(into=into)


def test_into_tensors_that_look_alike_but_differ_are_not_taken_for_one(tmp_path: Path) -> None:
    # Given for one tensor saved at two places: one memory seen through a lazy bit, or
    # two empty tensors, are two tensors, and refused as such.
    z, w, empty = torch.randn(4, dtype=torch.complex64), torch.randn(4), torch.empty(0)
    mine, real = torch.zeros(4, dtype=torch.complex64), torch.zeros(4)
    for state, into in (({"a": z, "b": z}, {"a": mine, "b": mine.conj()}),
                        ({"a": w, "b": w}, {"a": real, "b": torch._neg_view(real)}),
                        ({"a": empty, "b": empty}, {"a": torch.empty(0), "b": torch.empty(0)})):  # fmt: skip
        with pytest.raises(ValueError, match=r"one tensor at both into\['a'\] and into\['b'\]"):
            load_into(tmp_path, state, into)
    assert not mine.any() and not real.any()


def test_into_a_head_in_an_embedding_laid_out_otherwise_is_copied_in_into_s_order(tmp_path: Path) -> None:
    # The head lies where it lay when saved, but the embedding's memory is transposed:
    # not the saved storage's bytes, so the two are copied in as load_state_dict copies.
    e = torch.randn(512, 1024)
    base = torch.zeros(1024, 512).t()
    head = torch.as_strided(base, (1024,), (1,), 1024)  # where e[1] lay in e's storage
    want_base = torch.zeros(1024, 512).t()
    want_head = torch.as_strided(want_base, (1024,), (1,), 1024)
    with torch.no_grad():  # load_state_dict, in into's order
        want_head.copy_(e[1])
        want_base.copy_(e)
    load_into(tmp_path, {"emb": e, "head": e[1]}, {"head": head, "emb": base})
    assert torch.equal(base, want_base) and torch.equal(head, want_head)


def test_into_arrays_that_cannot_get_a_saved_tensor_s_values_are_refused(tmp_path: Path) -> None:
    # One torch cannot view gets its values from a saved array only; a big-endian one is
    # pickled, and nothing can be loaded into it: both kept their old values without a word.
    backwards = np.zeros(8)[::-2]
    with pytest.raises(ValueError, match=r"at into\['a'\] a NumPy array that torch cannot view.*holds a tensor"):
        load_into(tmp_path, {"a": torch.arange(4.0)}, {"a": backwards})
    big = np.zeros(4, dtype=">f8")
    with pytest.raises(ValueError, match=r"at into\['a'\] a value that cannot be loaded into"):
        load_into(tmp_path, {"a": np.arange(4.0)}, {"a": big})
    assert not backwards.any() and not big.any()


def test_a_parameter_read_in_place_is_marked_changed_as_load_state_dict_marks_it(tmp_path: Path) -> None:
    # A graph that saved the weight for backward must not run backward through new
    # values: after load_state_dict (copy_) torch raises there, and so must it after into=.
    torch.manual_seed(0)
    model = torch.nn.Linear(1024, 512, bias=False)  # 2 MiB: read straight into its memory
    saved({"model": model.state_dict()}, tmp_path)
    for load in ("load_state_dict", "into="):
        fresh = torch.nn.Linear(1024, 512, bias=False)
        before = fresh.weight._version
        loss = (fresh(torch.randn(2, 1024, requires_grad=True)) ** 2).sum()  # saves the weight for backward
        if load == "into=":
            with Checkpointer(tmp_path / "run", distributed=False, scratch=False) as ck:
                assert ck.load_latest(into={"model": dict(fresh.named_parameters())}) is not None
        else:
            fresh.load_state_dict(model.state_dict())
        assert fresh.weight._version == before + 1, load
        with pytest.raises(RuntimeError, match="modified by an inplace operation"):
            loss.backward()
        assert torch.equal(fresh.weight, model.weight)
    with torch.inference_mode():  # an inference tensor has no version counter to move: read into, unmarked
        frozen = torch.zeros(512, 1024)
    with Checkpointer(tmp_path / "run", distributed=False, scratch=False) as ck:
        assert ck.load_latest(into={"model": {"weight": frozen}})["model"]["weight"] is frozen
    assert torch.equal(frozen, model.weight)


def gpu_made(tmp_path: Path) -> Path:
    """A checkpoint as a GPU node writes it: tensors recorded on ``cuda:0``."""
    buf = torch.arange(10.0)
    enc = encode_state({"w": buf, "v": buf[2:5]})
    for name in ("w", "v"):
        enc.tree[name] = {"$view": {"key": name, "of": "w", "dtype": "F32", "shape": list(enc.leaves[name].shape),
                                    "stride": [1], "offset": int(enc.leaves[name].storage_offset()),
                                    "device": "cuda:0"}}  # fmt: skip
    return commit(tmp_path, 1, lambda tmp: write_state(tmp, enc))


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the error a CPU-only process gives")
def test_a_tensor_saved_on_a_gpu_loads_on_a_cpu_only_node_with_map_location(tmp_path: Path) -> None:
    path = gpu_made(tmp_path)
    man = verify_checkpoint(path)
    with pytest.raises(ValueError, match=r"saved on cuda:0.*map_location='cpu'"):
        Engine().load(path, man)  # torch.load also refuses, unless told where
    got = Engine().load(path, man, map_location="cpu")
    assert got["w"].device.type == "cpu" and torch.equal(got["v"], torch.arange(2.0, 5.0))
    assert got["v"].untyped_storage().data_ptr() == got["w"].untyped_storage().data_ptr()


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the error a CPU-only process gives")
def test_map_location_takes_a_dict_from_saved_device_to_device_as_torch_load_does(tmp_path: Path) -> None:
    # As the DDP tutorial loads: map_location={"cuda:0": f"cuda:{rank}"}.
    path = gpu_made(tmp_path)
    man = verify_checkpoint(path)
    got = Engine().load(path, man, map_location={"cuda:0": "cpu"})
    assert got["w"].device.type == "cpu" and torch.equal(got["v"], torch.arange(2.0, 5.0))
    assert got["v"].untyped_storage().data_ptr() == got["w"].untyped_storage().data_ptr()
    with pytest.raises(ValueError, match=r"saved on cuda:0.*map_location"):
        Engine().load(path, man, map_location={"cuda:1": "cpu"})  # names another device: cuda:0 stays
    with pytest.raises(ValueError, match=r"map_location as a function .* not supported: pass a device"):
        Engine().load(path, man, map_location=lambda storage, loc: storage)


def test_map_location_dict_moves_what_was_saved_on_the_cpu_only_if_it_names_the_cpu(tmp_path: Path) -> None:
    state = views_state()
    path, man = saved(state, tmp_path)
    kept = Engine().load(path, man, map_location={"cuda:0": "cuda:1"})
    assert {t.device.type for _, t in tensors(kept)} == {"cpu"} and state_digest(kept) == state_digest(state)
    moved = Engine().load(path, man, map_location={"cpu": "meta"})  # a device every torch has
    assert {t.device.type for _, t in tensors(moved)} == {"meta"}
    path, man = saved({"w": torch.ones(3), "a": np.arange(4.0)}, tmp_path / "np")
    for where in ("meta", {"cpu": "meta"}):  # numpy arrays stay in host memory, as torch.load leaves them
        got = Engine().load(path, man, map_location=where)
        assert got["w"].is_meta and isinstance(got["a"], np.ndarray) and (got["a"] == np.arange(4.0)).all()
    assert moved["head"].untyped_storage()._cdata == moved["buf"].untyped_storage()._cdata  # moved once, shared


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_tensors_saved_on_a_gpu_come_back_there_sharing_as_saved(tmp_path: Path) -> None:
    w = torch.randn(64, 32, device="cuda")
    state = {"w": w, "row": w[3], "t": w.t(), "cpu": torch.randn(3)}
    path, man = saved(state, tmp_path)
    got = Engine().load(path, man)
    assert layout(got) == layout(torch_loaded(state, tmp_path))
    assert got["w"].device == w.device and got["cpu"].device.type == "cpu"
    moved = Engine().load(path, man, map_location="cpu")
    assert moved["row"].device.type == "cpu" and torch.equal(moved["row"], w[3].cpu())
    assert moved["row"].untyped_storage().data_ptr() == moved["w"].untyped_storage().data_ptr()


def load_fixture(name: str, tmp_path: Path, **load: Any) -> tuple[Any, int | None]:
    """The committed checkpoint ``data/<name>``, of an earlier format, and its step, as a trainer loads it."""
    if not (tmp_path / "run").exists():
        shutil.copytree(DATA / name, tmp_path / "run")
    with Checkpointer(tmp_path / "run", distributed=False, scratch=False) as ck:
        return ck.load_latest(**load), ck.loaded_step


def test_a_format_1_checkpoint_still_loads(tmp_path: Path) -> None:
    # Written by the release before storages were kept (tests/unit/data/format1).
    got, step = load_fixture("format1", tmp_path)
    assert step == 7
    want = format1_state()
    assert torch.equal(got["model"]["w"], want["model"]["w"]) and torch.equal(got["t"], want["t"])
    assert got["tied"][0] is got["tied"][1] and torch.equal(got["optim"]["state"][0]["exp_avg"],
                                                            want["optim"]["state"][0]["exp_avg"])  # fmt: skip
    assert got["optim"]["param_groups"] == want["optim"]["param_groups"]
    assert isinstance(got["np"], np.ndarray) and (got["np"] == want["np"]).all()
    g = torch.Generator()
    g.set_state(got["rng"])
    assert torch.equal(torch.rand(3, generator=g), torch.rand(3, generator=torch.Generator().manual_seed(5)))
    assert json.loads((tmp_path / "run" / "step-000000007" / MANIFEST).read_text())["version"] == 1


def test_a_format_2_checkpoint_still_loads_as_it_was_written(tmp_path: Path) -> None:
    # Written by 0.2.0 (tests/unit/data/format2), which stored numpy scalars as
    # JSON numbers and a torch.Size as a tuple: they load as such, as they did.
    got, step = load_fixture("format2", tmp_path)
    assert step == 9
    want = format2_state()
    assert json.loads((tmp_path / "run" / "step-000000009" / MANIFEST).read_text())["version"] == 2
    assert type(got["model"]) is type(want["model"]) and got["model"]._metadata == want["model"]._metadata
    for k, v in want["model"].items():
        assert torch.equal(got["model"][k], v), k
    assert got["tied"][0] is got["tied"][1] and torch.equal(got["tied"][0], want["tied"][0])
    assert got["t"].untyped_storage().data_ptr() == got["tied"][0].untyped_storage().data_ptr()
    assert torch.equal(got["t"], want["t"]) and torch.equal(got["row"], want["row"])
    assert type(got["np_f32"]) is float and got["np_f32"] == float(want["np_f32"])
    assert type(got["np_i64"]) is int and got["np_i64"] == -5
    assert type(got["size"]) is tuple and got["size"] == (2, 3)
    assert math.isnan(got["nan"]) and got["step"] == 9


def test_a_newer_format_is_refused_with_what_to_do(tmp_path: Path) -> None:
    path, _ = saved({"x": torch.ones(2)}, tmp_path)
    raw = (path / MANIFEST).read_bytes().replace(b'"version": 3', b'"version": 4')
    body = raw[: raw.rindex(b',\n "manifest_crc32"')]
    (path / MANIFEST).write_bytes(body + b',\n "manifest_crc32": "%08x"\n}\n' % zlib.crc32(body + b"\n}"))
    with pytest.raises(CheckpointCorrupt, match=r"format version 4 is not one this slurm-ckpt reads.*upgrade"):
        Manifest.read(path)


def test_a_state_dict_keeps_its_type_and_module_versions(tmp_path: Path) -> None:
    # load_state_dict hands each module its version from _metadata; a module whose
    # format changed (BatchNorm: version 2) migrates old state_dicts by it.
    model = torch.nn.Sequential(torch.nn.Linear(2, 3), torch.nn.BatchNorm1d(3))
    sd = model.state_dict()
    path, man = saved({"model": sd, "plain": {"a": 1}}, tmp_path)
    got = Engine().load(path, man)
    assert type(got["model"]) is type(sd) and list(got["model"]) == list(sd)
    assert got["model"]._metadata == sd._metadata and got["model"]._metadata["1"]["version"] == 2
    assert type(got["plain"]) is dict


def test_views_of_other_dtypes_share_the_storage_torch_save_refuses(tmp_path: Path) -> None:
    # torch.save refuses "multiple tensors ... that view the same data as different types";
    # they are stored once, as bytes, and come back sharing it.
    f = torch.randn(6)
    state = {"f": f[1:], "bytes": f.view(torch.uint8)[4:12], "ints": f.view(torch.int32)}
    path, man = saved(state, tmp_path)
    got = Engine().load(path, man)
    for k in state:
        assert torch.equal(got[k], state[k]) and got[k].dtype == state[k].dtype
        assert got[k].storage_offset() == state[k].storage_offset()
    assert len({t.untyped_storage().data_ptr() for t in got.values()}) == 1
    got["ints"][1] = 0
    assert got["f"][0] == 0 and not got["bytes"][:4].any()  # one memory, as saved


def test_into_a_cpu_model_loads_views_saved_on_a_gpu_without_cuda(tmp_path: Path) -> None:
    path = gpu_made(tmp_path)
    mine = torch.zeros(10)
    got = Engine().load(path, verify_checkpoint(path), into={"w": mine, "v": mine[2:5]})
    assert got["w"] is mine and torch.equal(mine, torch.arange(10.0))


def test_into_a_transposed_tensor_still_gives_its_views_the_saved_values(tmp_path: Path) -> None:
    buf = torch.arange(40.0).reshape(5, 8)
    path, man = saved({"buf": buf, "row": buf[1]}, tmp_path)
    mine = torch.zeros(8, 5).t()  # not laid out as the saved storage: copied into
    row = torch.zeros(8)
    got = Engine().load(path, man, into={"buf": mine, "row": row})
    assert torch.equal(mine, buf) and torch.equal(row, buf[1]) and got["row"] is row
