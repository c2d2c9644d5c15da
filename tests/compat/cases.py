"""The compatibility cases: what trainers do with a loaded state, run on ``torch.load``'s and ours.

A case takes a loaded state and returns an observation (plain JSON values):
the tensors' layout, the random numbers drawn after ``set_rng_state``, the
weights after ``load_state_dict`` and an optimizer step, and so on. The same
case runs on the state ``torch.load`` gives and on the one slurm-ckpt gives;
the two observations must be equal. Each run happens in a child process of its
own (``runner.py``), so a crash is a result, not the end of the suite.

The state (:func:`make_state`) is what trainers save: a model's
``state_dict`` with tied weights, an optimizer's, an LR scheduler's and a
GradScaler's, an L-BFGS optimizer's, RNG states, and tensors as people leave
them in a state: views of one buffer, transposed and expanded tensors,
parameters, tensors that need grad, one tensor object at two places, many
small tensors side by side, and one over 1 MiB (the reader's large-tensor path).
"""

from __future__ import annotations

import hashlib
import io
import pickle
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import torch
from torch import nn

__all__ = ["CASES", "GPU_CASES", "LOADERS", "RUNNER_CHECKS", "child", "make_state", "save_both"]

SEED = 20240613
TORCH_FILE = "state.pt"
OURS_DIR = "ckpt"


class Net(nn.Module):
    """A small language model: tied embedding and decoder, layer norm, dropout, a buffer,
    and one layer over 1 MiB."""

    def __init__(self) -> None:
        super().__init__()
        self.emb = nn.Embedding(64, 32)
        self.ln = nn.LayerNorm(32)
        self.drop = nn.Dropout(0.1)
        self.up = nn.Linear(32, 8192)  # 1 MiB of weight: read into a storage of its own
        self.down = nn.Linear(8192, 32)
        self.dec = nn.Linear(32, 64, bias=False)
        self.dec.weight = self.emb.weight  # tied, as GPT-2 and word-LM examples do
        self.register_buffer("pos", torch.randn(16, 32))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.drop(self.ln(self.emb(x) + self.pos[: x.shape[-1]]))
        return self.dec(h + self.down(torch.relu(self.up(h))))  # type: ignore[no-any-return]


def build(seed: int, model: Net | None = None) -> tuple[Net, torch.optim.Optimizer, Any, Any]:
    """Model (or the one given), AdamW with two param groups as nanoGPT makes them,
    a warmup scheduler and a GradScaler."""
    torch.manual_seed(seed)
    model = model or Net()
    decay = [p for n, p in model.named_parameters() if p.dim() >= 2]
    rest = [p for n, p in model.named_parameters() if p.dim() < 2]
    opt = torch.optim.AdamW([{"params": decay, "weight_decay": 0.1}, {"params": rest, "weight_decay": 0.0}], lr=1e-3)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: min(1.0, (s + 1) / 10))
    scaler = torch.amp.GradScaler("cpu", init_scale=2.0**10, growth_interval=2)
    return model, opt, sched, scaler


def train_step(model: Net, opt: torch.optim.Optimizer, sched: Any, scaler: Any, step: int) -> None:
    g = torch.Generator().manual_seed(step)
    x = torch.randint(0, 64, (4, 16), generator=g)
    loss = nn.functional.cross_entropy(model(x).flatten(0, 1), x.flatten())
    opt.zero_grad()
    scaler.scale(loss).backward()
    scaler.step(opt)
    scaler.update()
    sched.step()


def make_state() -> dict[str, Any]:
    model, opt, sched, scaler = build(SEED)
    model.train()
    for step in range(3):
        train_step(model, opt, sched, scaler, step)
    gen = torch.Generator().manual_seed(SEED + 1)
    torch.randn(7, generator=gen)
    buf = torch.arange(40, dtype=torch.float32)
    mat = torch.randn(6, 5)
    img = torch.randn(2, 3, 4, 5)
    only_part = torch.arange(100, dtype=torch.int16)  # only a slice of it is in the state
    shared = torch.randn(4)
    small = [torch.randn(k) for k in range(1, 40)]
    state: dict[str, Any] = {
        "model": model.state_dict(),
        "optim": opt.state_dict(),
        "sched": sched.state_dict(),
        "scaler": scaler.state_dict(),
        "rng": torch.get_rng_state(),
        "gen": gen.get_state(),
        "step": 3,
        "views": {
            "buf": buf,
            "every_third": buf[3:30:3],
            "tail": buf[30:],
            "row": mat[2],
            "col": mat[:, 1],
            "t": mat.t(),
            "expanded": torch.randn(4).expand(3, 4),
            "channels_last": img.contiguous(memory_format=torch.channels_last),
            "part": only_part[10:20],
            "as_bytes_of_nothing_else": torch.randn(3).view(torch.int32),
        },
        "kinds": {
            "param": nn.Parameter(torch.randn(3)),
            "frozen_param": nn.Parameter(torch.randn(2), requires_grad=False),
            "needs_grad": torch.randn(3).requires_grad_(),
            "empty": torch.empty(0, 3),
            "scalar": torch.tensor(1.5),
            "bool": torch.tensor([True, False, True]),
            "bf16": torch.randn(5).bfloat16(),
            "f16": torch.randn(5).half(),
            "i8": torch.arange(-3, 3, dtype=torch.int8),
            "i64": torch.arange(6, dtype=torch.int64).reshape(2, 3),
            "f64": torch.randn(2, 2, dtype=torch.float64),
            "c64": torch.randn(3, dtype=torch.complex64),
        },
        "same_object": [shared, shared, {"again": shared}],
        "small": small,
        "lbfgs": lbfgs_state(),
    }
    if torch.cuda.is_available():
        torch.cuda.manual_seed(SEED)
        torch.randn(3, device="cuda")
        cuda = torch.randn(8, 4, device="cuda")
        state["cuda"] = {"rng": torch.cuda.get_rng_state(), "w": cuda, "row": cuda[3], "t": cuda.t()}
    return state


def lbfgs_state() -> dict[str, Any]:
    torch.manual_seed(SEED + 3)
    model = nn.Sequential(nn.Linear(5, 7), nn.Tanh(), nn.Linear(7, 1))  # sizes no row of 16 floats fills
    opt = torch.optim.LBFGS(model.parameters(), lr=0.5, history_size=3, max_iter=4)
    lbfgs_steps(model, opt, range(3))
    return {"model": model.state_dict(), "optim": opt.state_dict()}


def save_both(state: Any, root: Path) -> None:
    """The state as ``torch.save`` writes it and as slurm-ckpt does (``save``, synchronous)."""
    from slurm_ckpt import Checkpointer

    root.mkdir(parents=True, exist_ok=True)
    torch.save(state, root / TORCH_FILE)
    with Checkpointer(root / OURS_DIR, keep=1, distributed=False, scratch=False) as ck:
        ck.save(state, step=1)


def _ours(root: Path, **kw: Any) -> Any:
    from slurm_ckpt import Checkpointer

    with Checkpointer(root / OURS_DIR, distributed=False, scratch=False) as ck:
        return ck.load_latest(**kw)


LOADERS: dict[str, Callable[[Path], Any]] = {
    "torch.load": lambda root: torch.load(root / TORCH_FILE, weights_only=True),
    "ours": _ours,
    "torch.load(mmap=True)": lambda root: torch.load(root / TORCH_FILE, weights_only=True, mmap=True),
    "ours (mmap=True)": lambda root: _ours(root, mmap=True),
}
"""Each default loader is compared with ``torch.load``, each mmap one with ``torch.load(mmap=True)``."""


def tensors(obj: Any, path: str = "") -> Iterator[tuple[str, torch.Tensor]]:
    """Every tensor of a state with its path, in the state's order."""
    if isinstance(obj, torch.Tensor):
        yield path or "/", obj
    elif isinstance(obj, dict):
        for k, v in obj.items():
            yield from tensors(v, f"{path}/{k}")
    elif isinstance(obj, (list, tuple)):
        for i, v in enumerate(obj):
            yield from tensors(v, f"{path}/{i}")


def digest(t: torch.Tensor) -> str:
    flat = torch.empty(t.shape, dtype=t.dtype, device="cpu").copy_(t.detach())
    return hashlib.sha256(flat.reshape(-1).view(torch.uint8).numpy().tobytes()).hexdigest()[:16]


def state_digest(obj: Any) -> str:
    h = hashlib.sha256()
    for path, t in tensors(obj):
        h.update(f"{path}:{digest(t)};".encode())
    return h.hexdigest()[:16]


# ---------------------------------------------------------------------------- cases


def layout(state: Any) -> list[dict[str, Any]]:
    """Per tensor: dtype, shape, stride, storage_offset, storage size and
    alignment, device, requires_grad, lazy bits, type; which tensors share a storage and at
    which byte; which places hold the same tensor object; and the values."""
    groups: dict[int, int] = {}
    objects: dict[int, str] = {}
    out = []
    for path, t in tensors(state):
        storage = t.untyped_storage()
        group = groups.setdefault(storage._cdata, len(groups))
        out.append({
            "path": path,
            "type": type(t).__name__,
            "dtype": str(t.dtype),
            "shape": list(t.shape),
            "stride": list(t.stride()),
            "storage_offset": t.storage_offset(),
            "storage_nbytes": storage.nbytes(),
            "storage starts at a multiple of 64 bytes": storage.data_ptr() % 64 == 0 if storage.nbytes() else None,
            "device": str(t.device),
            "requires_grad": t.requires_grad,
            "lazy conjugate, negative bits": [t.is_conj(), t.is_neg()],
            "is a view (has a _base)": t._base is not None,
            "storage": group,
            "at_byte": t.data_ptr() - storage.data_ptr() if storage.nbytes() else 0,
            "same_object_as": objects.setdefault(id(t), path),
            "values": digest(t),
        })  # fmt: skip
    return out


def set_rng_state(state: Any) -> list[float]:
    torch.set_rng_state(state["rng"])
    return torch.rand(5).tolist()


def generator_set_state(state: Any) -> list[float]:
    g = torch.Generator()
    g.set_state(state["gen"])
    return torch.rand(5, generator=g).tolist()


def cuda_set_rng_state(state: Any) -> list[float]:
    torch.cuda.set_rng_state(state["cuda"]["rng"])
    return torch.rand(5, device="cuda").tolist()


def _resume(state: Any, *, assign: bool) -> dict[str, Any]:
    """What a trainer does: rebuild, load every state_dict, then train a step.

    With ``assign=True`` the loaded tensors become the parameters, so the
    optimizer is built after the load, on them (as meta-device inits do), and
    the tie is made again."""
    torch.manual_seed(SEED + 99)  # different weights: the load must replace them
    model = Net()
    missing = model.load_state_dict(state["model"], strict=True, assign=assign)
    tied_after_load = model.dec.weight is model.emb.weight
    model.dec.weight = model.emb.weight  # assign= makes each its own Parameter: re-tie, as tie_weights() does
    model, opt, sched, scaler = build(SEED + 99, model)
    opt.load_state_dict(state["optim"])
    sched.load_state_dict(state["sched"])
    scaler.load_state_dict(state["scaler"])
    model.train()
    torch.manual_seed(SEED + 5)
    train_step(model, opt, sched, scaler, 100)
    return {
        "load_state_dict": str(missing),
        "tied after load": tied_after_load,
        "weights": state_digest(model.state_dict()),
        "optimizer": state_digest(opt.state_dict()),
        "lr": sched.get_last_lr(),
        "scale": scaler.get_scale(),
    }


def load_state_dict_then_step(state: Any) -> dict[str, Any]:
    return _resume(state, assign=False)


def load_state_dict_assign_then_step(state: Any) -> dict[str, Any]:
    return _resume(state, assign=True)


def scheduler_load_state_dict(state: Any) -> list[list[float]]:
    _, opt, sched, _ = build(SEED + 99)
    sched.load_state_dict(state["sched"])
    lrs = []
    for _ in range(3):
        opt.step()
        sched.step()
        lrs.append(sched.get_last_lr())
    return lrs


def grad_scaler_load_state_dict(state: Any) -> dict[str, Any]:
    *_, scaler = build(SEED + 99)
    scaler.load_state_dict(state["scaler"])
    return {"scale": scaler.get_scale(), "state": scaler.state_dict()}


def reductions(state: Any) -> list[Any]:
    """Sums and dot products of every floating-point tensor, to the last bit: a
    vectorized reduction adds in an order that depends on where the data starts."""
    out: list[Any] = []
    for path, t in tensors(state):
        if t.is_floating_point() and t.numel() and t.is_contiguous():
            t = t.detach()
            out.append([path, float(t.double().sum() if t.dtype in (torch.float16, torch.bfloat16) else t.sum()).hex(),
                        float(torch.dot(t.reshape(-1), t.reshape(-1))).hex() if t.dtype in (torch.float32, torch.float64)
                        else None])  # fmt: skip
    return out


def lbfgs_load_state_dict_then_step(state: Any) -> str:
    """L-BFGS, as PyTorch's time-sequence-prediction example trains: its state is
    small tensors (a direction, its history) that every step takes dot products of."""
    torch.manual_seed(SEED + 99)
    model = nn.Sequential(nn.Linear(5, 7), nn.Tanh(), nn.Linear(7, 1))
    opt = torch.optim.LBFGS(model.parameters(), lr=0.5, history_size=3, max_iter=4)
    model.load_state_dict(state["lbfgs"]["model"])
    opt.load_state_dict(state["lbfgs"]["optim"])
    lbfgs_steps(model, opt, range(3, 6))
    return state_digest(model.state_dict())


def lbfgs_steps(model: nn.Module, opt: torch.optim.Optimizer, steps: range) -> None:
    for step in steps:
        g = torch.Generator().manual_seed(step)
        x, y = torch.randn(8, 5, generator=g), torch.randn(8, 1, generator=g)

        def closure(x: torch.Tensor = x, y: torch.Tensor = y) -> torch.Tensor:
            opt.zero_grad()
            loss = nn.functional.mse_loss(model(x), y)
            loss.backward()
            return loss

        opt.step(closure)  # type: ignore[arg-type]


def numpy_views(state: Any) -> list[Any]:
    """``.numpy()`` of every tensor numpy can hold: same bytes, writable, no copy."""
    out: list[Any] = []
    for path, t in tensors(state):
        if t.dtype is torch.bfloat16 or t.requires_grad:
            continue
        a = t.numpy()
        same_memory = a.size == 0 or a.__array_interface__["data"][0] == t.data_ptr()
        out.append([path, a.dtype.str, list(a.strides), a.flags.writeable, same_memory,
                    hashlib.sha256(a.tobytes()).hexdigest()[:16]])  # fmt: skip
    return out


def resize_of_a_small_tensor(state: Any) -> dict[str, Any]:
    """``resize_`` a small bias to 4x and fill what it grew. ``torch.load``'s storages
    are not resizable, so it raises; whatever happens, no other tensor may change."""
    bias = state["model"]["ln.bias"]
    others = [t for _, t in tensors(state) if t is not bias]
    before = [digest(t) for t in others]
    n = bias.numel()
    try:
        bias.resize_(4 * n)
        bias[n:].fill_(7.0)
        raised = ""
    except RuntimeError as e:
        raised = str(e)
    return {"raised": raised, "storage_nbytes": bias.untyped_storage().nbytes(),
            "others unchanged": [digest(t) for t in others] == before}  # fmt: skip


def torch_save_size(state: Any) -> dict[str, int]:
    """How many bytes ``torch.save`` of a loaded tensor writes (its storage's, whole)."""
    picks = {"rng": state["rng"], "ln.bias": state["model"]["ln.bias"], "small/3": state["small"][3],
             "every_third": state["views"]["every_third"], "step": state["optim"]["state"][0]["step"]}  # fmt: skip
    out = {}
    for name, t in picks.items():
        buf = io.BytesIO()
        torch.save(t, buf)
        out[name] = len(buf.getvalue())
    buf = io.BytesIO()
    torch.save(state, buf)
    out["whole state"] = len(buf.getvalue())
    return out


def tied_write_shows_in_its_tie(state: Any) -> dict[str, Any]:
    """An in-place change through one tied weight is seen through the other (and only there)."""
    emb, dec = state["model"]["emb.weight"], state["model"]["dec.weight"]
    buf, third = state["views"]["buf"], state["views"]["every_third"]
    emb.add_(1.0)
    third.mul_(-1.0)
    return {"tie": bool(torch.equal(emb, dec)), "buffer": buf[:9].tolist(),
            "untied_neighbour": digest(state["model"]["ln.weight"])}  # fmt: skip


def pickled_for_a_worker(state: Any) -> str:
    """What ``multiprocessing`` does to hand a state to a DataLoader worker: it
    moves the storages to shared memory and pickles them."""
    from multiprocessing.reduction import ForkingPickler

    import torch.multiprocessing  # noqa: F401  (registers torch's reducers: storages go to shared memory)

    blob = io.BytesIO()
    ForkingPickler(blob, pickle.HIGHEST_PROTOCOL).dump(state["views"])
    back = pickle.loads(blob.getvalue())
    return state_digest(back) + " " + str([t.is_shared() for _, t in tensors(state["views"])])


CASES: dict[str, Callable[[Any], Any]] = {
    "layout of every tensor (dtype, shape, stride, offset, storage size and alignment, sharing, device, grad, lazy bits)": layout,
    "torch.set_rng_state": set_rng_state,
    "torch.Generator().set_state": generator_set_state,
    "model.load_state_dict (strict), optimizer.load_state_dict, step()": load_state_dict_then_step,
    "model.load_state_dict(assign=True), optimizer.load_state_dict, step()": load_state_dict_assign_then_step,
    "LR scheduler load_state_dict": scheduler_load_state_dict,
    "sums and dot products of every float tensor": reductions,
    "torch.optim.LBFGS load_state_dict, step()": lbfgs_load_state_dict_then_step,
    "GradScaler load_state_dict": grad_scaler_load_state_dict,
    ".numpy()": numpy_views,
    "resize_ of a small tensor": resize_of_a_small_tensor,
    "size of torch.save of a loaded tensor": torch_save_size,
    "in-place write through a tied weight / a view": tied_write_shows_in_its_tie,
    "tensors pickled to a worker process (share_memory_)": pickled_for_a_worker,
}
GPU_CASES: dict[str, Callable[[Any], Any]] = {
    "torch.cuda.set_rng_state": cuda_set_rng_state,
}


def _segfault(state: Any) -> None:
    import ctypes

    ctypes.string_at(0)  # reads address 0


RUNNER_CHECKS: dict[str, Callable[[Any], Any]] = {
    "(runner check) a case that segfaults": _segfault,
}
"""Not compatibility cases: they show that the runner survives a case that crashes."""


def child(case: str, loader: str, root: str, conn: Any) -> None:
    """Run one case on one loader's state; send ``{"ok": observation}`` or ``{"error": ...}``."""
    try:
        state = LOADERS[loader](Path(root))
        result: dict[str, Any] = {"ok": {**CASES, **GPU_CASES, **RUNNER_CHECKS}[case](state)}
    except Exception as e:  # the observation: both loaders must fail alike
        result = {"error": type(e).__name__, "message": str(e).splitlines()[0][:200]}
    conn.send(result)
    conn.close()
