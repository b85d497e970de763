"""Facts about the ops that move elements without arithmetic, one entry per op, by op name (the
op table's names: ATen's where it has one). Four places ask about them and each used to keep its
own list: the op table (their class: exact in any dtype), aliasing (``ir.graph.is_view``:
writing into a view writes its base), calibration (an output holding exactly its input's
elements has its input's statistics) and the underflow rule (a 0 moved is still a 0).
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Callable


@dataclass(frozen=True)
class Move:
    view: bool = False           # the output may share its first input's storage (a view)
    same_elements: bool = False  # the output holds exactly its first input's elements, each once
    passes_zero: bool = False    # an element of the first input that is 0 is 0 where it lands


def _moves(names: str, **flags) -> dict[str, Move]:
    entry = Move(**flags)
    return {name: entry for name in names.split()}


MOVES: dict[str, Move] = {
    # views holding every element once (reshape, contiguous and flatten may copy instead: for
    # aliasing a possible view counts as one)
    **_moves("""view _unsafe_view view_as reshape reshape_as permute transpose t unsqueeze squeeze
             flatten unflatten movedim contiguous detach alias numpy_T mT mH matrix_H adjoint
             swapaxes swapdims moveaxis ravel atleast_1d atleast_2d atleast_3d""",
             view=True, same_elements=True, passes_zero=True),
    # views onto some of the elements, or onto elements repeated
    **_moves("""expand expand_as broadcast_to narrow select slice diagonal split split_with_sizes
             chunk unbind getitem as_strided unfold tensor_split hsplit vsplit dsplit real imag
             view_as_real view_as_complex""", view=True, passes_zero=True),
    # copies of every element, or of chosen elements
    **_moves("clone lift_fresh_copy", same_elements=True, passes_zero=True),
    **_moves("index_select gather flip roll repeat", passes_zero=True),
    # moves that also bring in elements from elsewhere (another tensor, a fill value), or return
    # sizes, not elements
    **_moves("""index take_along_dim masked_select masked_scatter index_put index_fill index_copy
             scatter slice_scatter select_scatter tile repeat_interleave tril triu pixel_shuffle
             pixel_unshuffle channel_shuffle embedding pad constant_pad_nd reflection_pad1d
             reflection_pad2d reflection_pad3d replication_pad1d replication_pad2d
             replication_pad3d copy fill zero type_as size dim numel sym_size
             sym_numel sym_stride _assert_tensor_metadata getattr identity"""),
}
# names under which a call of these ops reaches the passes besides its op name
ALSO_SPELLED = {"getitem": ("__getitem__",)}


def move_names(fact: Callable[[Move], bool]) -> frozenset[str]:
    """The names (and other spellings) of the moves of which ``fact`` holds."""
    names = [n for n, move in MOVES.items() if fact(move)]
    return frozenset(names + [s for n in names for s in ALSO_SPELLED.get(n, ())])
