"""State <-> (JSON tree, tensors): the safe encoding of a checkpoint's contents.

:mod:`.tags` holds the tag table (what each ``$``-tag in ``state.json`` means)
and the dtypes; :mod:`.encode` and :mod:`.decode` turn a state into a tree and
data-file entries and back; :mod:`.into` matches a load's ``into=`` to the saved
tensors by place.
"""

from __future__ import annotations

from .decode import decode_state
from .encode import encode_state
from .into import (
    IntoPlan,
    IntoTree,
    into_tree,
    match_into,
    overlapping,
    plan_into,
    refuse_meta,
    tensor_refs,
)
from .tags import (
    _DTYPES as _DTYPES,  # the table itself, not a copy: tests add a dtype for every reader
)
from .tags import (
    EncodedState,
    TensorEntry,
    array_tensor,
    contiguous_strides,
    copied_into,
    gc_paused,
    is_dtensor,
    namespace,
    path_parts,
    resolved,
    st_dtype,
    torch_dtype,
    torch_dtype_name,
    transposed,
)

__all__ = [
    "EncodedState",
    "IntoPlan",
    "IntoTree",
    "TensorEntry",
    "array_tensor",
    "contiguous_strides",
    "copied_into",
    "decode_state",
    "encode_state",
    "gc_paused",
    "into_tree",
    "is_dtensor",
    "match_into",
    "namespace",
    "overlapping",
    "path_parts",
    "plan_into",
    "refuse_meta",
    "resolved",
    "st_dtype",
    "tensor_refs",
    "torch_dtype",
    "torch_dtype_name",
    "transposed",
]
