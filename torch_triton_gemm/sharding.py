"""DTensor sharding rules for tgemm's ops: tensor-parallel calls run tgemm on each rank's shard.

``torch.ops.tgemm.mm`` / ``grouped_mm`` / ``scaled_mm`` called with DTensor operands run the op
on every rank's local tensors, after the redistribution that DTensor's sharding propagation
picks from the rules below, and return a DTensor. The rules are those DTensor has for aten's
``mm`` / ``addmm``, ``bmm``, ``_grouped_mm`` and ``_scaled_mm``, so a tensor-parallel model makes
the same collectives with and without tgemm (``override()`` routes DTensor operands here).

Each rule gives, for one mesh dimension, the placements of the output and of the tensor
arguments in schema order. DTensor expands them over every mesh dimension and redistributes
inputs whose placements no rule takes (to Replicate at worst: correct, with more communication).

The epilogue limits the rules. An op whose output is ``Partial`` (a sum over ranks of the local
results) adds its local bias on every rank, so the bias must be ``Partial`` too (DTensor splits
a replicated bias among the ranks, as it does for ``addmm``). An activation does not distribute
over that sum, so ``tgemm::mm`` with an activation other than "none" has no ``Partial`` output:
DTensor gathers K-sharded operands first.

Importing the package registers the rules where ``torch.distributed`` is available.
"""

from __future__ import annotations

from typing import Any

import torch

from .ops import grouped_mm as _grouped_mm_module  # noqa: F401  (registers the ops)
from .ops import mm as _mm_module  # noqa: F401
from .ops import scaled_mm as _scaled_mm_module  # noqa: F401

# The DTensor type where its sharding rules can be registered: override() routes its operands.
DTENSOR_TYPES: tuple[type, ...] = ()
# Whether DTensor's cache of sharding decisions tells tgemm::mm's activations apart (register):
# without that, mm offers no Partial output, which a cached call with an activation would reuse.
_ACTIVATION_IN_CACHE_KEY = False

if torch.distributed.is_available():
    try:
        from torch.distributed.tensor import DTensor, Partial, Replicate, Shard
        from torch.distributed.tensor.experimental import register_sharding
        from torch.distributed.tensor.placement_types import _StridedShard

        DTENSOR_TYPES = (DTensor,)
    except ImportError:  # a PyTorch without these: DTensor operands stay with PyTorch
        pass

# A rule gives, for one mesh dimension, the placement of the output and then of each tensor
# argument in schema order: R replicated, P a pending sum (Partial), an int: sharded along that
# dim of the tensor. _expand turns rules into the placements register_sharding takes.
R, P = "R", "P"
Rule = tuple[Any, ...]


def _expand(rules: list[Rule], args: tuple[Any, ...]) -> list[tuple[list[Any], list[Any]]]:
    """The placements of ``rules`` for the arguments ``args`` (DTensorSpecs, None where absent).

    Every int becomes Shard(dim), and also _StridedShard(dim, sf) for each such placement that an
    argument has on the dim of its own entry (a reshape's: [B, T, K] with T sharded, folded into
    [B*T, K]). The ops keep rows, columns and groups in order, so the output takes the same
    placement, as aten's rules give it.
    """
    expanded = []
    for rule in rules:
        kinds: dict[Any, None] = {None: None}  # None: plain Shard; else a split factor
        for entry, arg in zip(rule[1:], args):
            if isinstance(entry, int) and arg is not None:
                kinds.update((p.split_factor, None) for p in arg.placements
                             if isinstance(p, _StridedShard) and p.dim == entry)
        for kind in kinds:
            def placement(entry: Any, kind: Any = kind) -> Any:
                if entry == R:
                    return Replicate()
                if entry == P:
                    return Partial()
                return Shard(entry) if kind is None else _StridedShard(entry, split_factor=kind)

            placements = [None if arg is None else placement(entry)
                          for entry, arg in zip(rule[1:], args)]
            expanded.append(([placement(rule[0])], placements))
    return expanded


# --- tgemm::mm: act(a [M, K] @ b [K, N] + bias [N]) -> [M, N]; (out, a, b, bias) --------------

MM_RULES: list[Rule] = [
    (R, R, R, R),  # everything replicated
    (0, 0, R, R),  # rows of a (data or sequence parallel)
    (1, R, 1, 0),  # columns of b and bias (column-wise tensor parallel)
]
# A Partial output sums the ranks' results after the epilogue: only without an activation.
MM_PARTIAL_RULES: list[Rule] = [
    (P, 1, 0, P),  # the contraction (row-wise tensor parallel); the bias split among the ranks
    (P, P, R, P),  # a is a pending sum, so is the product (linearity)
    (P, R, P, P),  # b is a pending sum, so is the product (linearity)
]


def _mm_rules(a: Any, b: Any, bias: Any = None, activation: str = "none",
              out_dtype: Any = None) -> list[tuple[list[Any], list[Any]]]:
    partial = activation == "none" and _ACTIVATION_IN_CACHE_KEY
    rules = MM_RULES + (MM_PARTIAL_RULES if partial else [])
    return _expand(rules, (a, b, bias))


# --- tgemm::grouped_mm: per form (a.dim(), b.dim()); (out, a, b, offs, bias) -------------------
# offs holds global indices along the grouped dimension, so it stays replicated and no rule
# shards that dimension: sharding the groups of a 2-D operand (expert parallel with offs) would
# need per-rank offs, and DTensor gathers such inputs instead.

GROUPED_MM_RULES: list[Rule] = [
    (R, R, R, R, R),  # everything replicated
    (P, P, R, R, P),  # a is a pending sum, so is the product (linearity)
    (P, R, P, R, P),  # b is a pending sum, so is the product (linearity)
]
GROUPED_MM_FORM_RULES: dict[tuple[int, int], list[Rule]] = {
    # [G, M, K] x [G, K, N] -> [G, M, N], bias [G, N]
    (3, 3): [
        (0, 0, 0, R, 0),  # the batch (experts, heads)
        (1, 1, R, R, R),  # rows of a
        (2, R, 2, R, 1),  # columns of b
        (P, 2, 1, R, P),  # the contraction
    ],
    # [T, K] x [G, K, N], offs over T -> [T, N], bias [G, N]
    (2, 3): [
        (1, R, 2, R, 1),  # columns of every expert (MoE tensor parallel)
        (P, 1, 1, R, P),  # the contraction
    ],
    # [G, M, K] x [K, N], offs over N -> [M, N], bias [N]
    (3, 2): [
        (0, 1, R, R, R),  # rows of a
        (P, 2, 0, R, P),  # the contraction
    ],
    # [M, K] x [K, N], offs over K -> [G, M, N], bias [G, N]
    (2, 2): [
        (1, 0, R, R, R),  # rows of a
        (2, R, 1, R, 1),  # columns of b
    ],
}


def _grouped_mm_rules(a: Any, b: Any, offs: Any = None, bias: Any = None, out_dtype: Any = None,
                      zero_tail: bool = False) -> list[tuple[list[Any], list[Any]]]:
    rules = GROUPED_MM_RULES + GROUPED_MM_FORM_RULES.get((a.ndim, b.ndim), [])
    return _expand(rules, (a, b, offs, bias))


# --- tgemm::scaled_mm: (a * scale_a) [M, K] @ (b * scale_b) [K, N] + bias [N]; (out, a, b, bias)
# The scales follow their operands (_scale_placement).

# mm's rules and its contraction (no activation; pending sums of fp8 operands do not exist).
SCALED_MM_RULES: list[Rule] = MM_RULES + MM_PARTIAL_RULES[:1]


def _scale_placement(scale: Any, data: Any, placement: Any) -> Any:
    """The placement of a scale whose operand ``data`` has ``placement``; None where the
    operand's shards would cut a scale block. Scales are indexed like their operand
    (scale_a [rows, K blocks], scale_b [K blocks, columns]), one scale for a whole dim where that
    dim has size 1."""
    if isinstance(placement, (Replicate, Partial)):
        return Replicate()
    dim = placement.dim
    extent = data.shape[dim]
    blocks = scale.shape[dim] if scale.ndim == 2 else 1
    if blocks == 1 and scale.tensor_meta.dtype == torch.float32:
        return Replicate()  # one float32 scale for the whole dim (tensorwise, rowwise along K)
    if blocks == extent:
        return placement  # a scale per row or column (rowwise, 1x128 blocks' rows)
    if isinstance(placement, Shard) and extent % blocks == 0 and (
            blocks % data.mesh.size() == 0):
        return placement  # whole blocks on every rank
    return None  # the shards would cut a block, or a partial last one: gathered instead


def _scaled_mm_rules(a: Any, b: Any, scale_a: Any, scale_b: Any, bias: Any = None,
                     out_dtype: Any = None,
                     use_fast_accum: bool = False) -> list[tuple[list[Any], list[Any]]]:
    rules = []
    for out, (a_p, b_p, bias_p) in _expand(SCALED_MM_RULES, (a, b, bias)):
        scales = [_scale_placement(scale_a, a, a_p), _scale_placement(scale_b, b, b_p)]
        if None not in scales:
            rules.append((out, [a_p, b_p, *scales, bias_p]))
    return rules


# --- registration -------------------------------------------------------------------------------

def register() -> bool:
    """Register the rules with DTensor; False where ``torch.distributed`` or DTensor's
    ``register_sharding`` is unavailable."""
    global _ACTIVATION_IN_CACHE_KEY
    if not DTENSOR_TYPES:
        return False
    register_sharding(torch.ops.tgemm.mm.default)(_mm_rules)
    register_sharding(torch.ops.tgemm.grouped_mm.default)(_grouped_mm_rules)
    register_sharding(torch.ops.tgemm.scaled_mm.default)(_scaled_mm_rules)
    # register_sharding keys DTensor's cache of sharding decisions on the tensors' placements and
    # the arguments from the first int on (out_dtype); mm's rules also depend on activation.
    _ACTIVATION_IN_CACHE_KEY = _key_arguments_from(torch.ops.tgemm.mm.default, "activation")
    return True


def _key_arguments_from(op: torch._ops.OpOverload, name: str) -> bool:
    """Make DTensor's sharding cache tell calls of ``op`` apart by their arguments from ``name``
    on; False where this PyTorch keeps that setting elsewhere."""
    index = [argument.name for argument in op._schema.arguments].index(name)
    try:
        infos = DTensor._op_dispatcher.sharding_propagator.op_to_schema_info
        infos[op] = type(infos[op])(static_argnum=index, needs_pytree=True)
    except (AttributeError, KeyError, TypeError):
        return False
    return True


register()
