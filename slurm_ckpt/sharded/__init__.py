"""Sharded states: DTensors, plain tensors and plain values in one checkpoint, loadable at any world size.

A state here is what ``Checkpointer.save`` takes (nested dicts, lists and
tuples of tensors and plain values) where tensors may be ``DTensor`` s, as
``get_state_dict`` returns them for an FSDP2 model and its optimizer::

    from slurm_ckpt import sharded
    msd, osd = get_state_dict(model, opt)
    sharded.save({"model": msd, "optim": osd, "step": step}, run_dir, step)     # every rank

    msd, osd = get_state_dict(model, opt)           # at the new world size
    got = sharded.load(run_dir, into={"model": msd, "optim": osd})
    set_state_dict(model, opt, model_state_dict=got.state["model"], optim_state_dict=got.state["optim"])

Every rank calls both (they are collective). The tensors go through DCP with
:class:`slurm_ckpt.dcp.StorageWriter`: each rank writes only its own shards,
and one checkpoint is committed for all. What is saved, and what comes back:

* a **DTensor** is one global tensor; a load reshards it to whatever the
  ``into=`` tensor at the same place is (any mesh, any placement), each rank
  reading only the blocks that hold its part;
* a **plain tensor** that is the same on every rank (a replicated buffer, an
  optimizer's ``step``) is stored once; one that differs between ranks (an
  RNG state) is stored per rank, and each rank gets its own back;
* **everything else** goes to ``state.json`` through the codec (never pickle,
  unless ``allow_pickle``), once if it is the same on every rank, else per rank.

A load at another world size gives a rank that did not exist at save time
rank 0's per-rank values, and says so in a warning: there is no right answer
for them (an RNG state of a rank that did not exist), and most trainers
reseed or recompute them.

Without ``into=``, a load returns every tensor whole (a plain CPU tensor of
the global shape), on every rank: the state as one process would have it,
for evaluation, export, or a world of one. With ``into=``, tensors found at
the same place in ``into`` are filled in place (what ``set_state_dict``
expects), others come back whole, and values come from the checkpoint.

The public names are the four in ``__all__``, imported from
``slurm_ckpt.sharded``; its modules (``api``, ``job``, ``loader``,
``parts``) are internal and may change between releases.
"""

from __future__ import annotations

from .api import load, save, save_async
from .loader import Loaded

__all__ = ["Loaded", "load", "save", "save_async"]
