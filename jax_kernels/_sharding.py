"""Partitioning of the kernel passes under sharded ``jit`` (SPMD).

A custom call is opaque to XLA's partitioner, which would gather every sharded operand onto
every device. Each pass therefore declares, per call, how its dimensions relate (a
:class:`Spec`: one factor name per dimension of each operand and of the result, einsum-like),
and which factors may stay sharded. From that one declaration this module builds both halves
of ``jax.experimental.custom_partitioning``:

- the Shardy ``sharding_rule`` (the einsum string; factors that must not be sharded are
  ``need_replication`` factors, shardable factors absent from the result are ``reduction``
  factors), and the same choice for the GSPMD partitioner (``infer_sharding_from_operands``);
- the partition: the shardable factors keep the mesh axes their operands (or, for a factor only
  the result has, the result) are sharded on; every other dimension is replicated; the
  per-shard function runs the same pass on the local shapes (``Spec.local`` adapts parameters
  and operands that encode global positions, e.g. roi_align's batch indices), then sums over
  the mesh axes of sharded reduction factors (``psum``: a weight gradient, a box gradient).

Used only where it changes something: a lowering for more than one device that is not inside a
fully manual region (``shard_map``) and not for ``jax.export`` (serialized programs cannot carry
the partitioner's Python callbacks; an exported program's ops are partitioned by XLA's default,
gathering, behaviour). This is the one module that uses ``custom_partitioning``.
"""

from __future__ import annotations

import math
from typing import Any, Callable, NamedTuple

import jax
from jax.experimental.custom_partitioning import custom_partitioning
from jax.sharding import NamedSharding, PartitionSpec


class Spec(NamedTuple):
    """The dimensions of one call.

    operands: one tuple of factor names per operand, one name per dimension.
    result: the result's factor names.
    free: the factors that may stay sharded; every other factor is replicated. A free factor
      absent from the result is summed over (its partial results are added with ``psum``).
    local: ``local(operands, params, result_shape, offsets) -> (operands, params)``: the
      per-shard call's operands and parameters, given the local result shape and, for each
      factor in ``offsets`` that is sharded, the traced index of this shard's first element
      along it. None: the same parameters, the operands as they are.
    offsets: the factors whose shard offsets ``local`` needs.
    """

    operands: tuple[tuple[str, ...], ...]
    result: tuple[str, ...]
    free: frozenset[str]
    local: Callable | None = None
    offsets: frozenset[str] = frozenset()


def unique(prefix: str, count: int) -> tuple[str, ...]:
    """``count`` factor names private to one tensor (replicated dimensions)."""
    return tuple(f"{prefix}{i}" for i in range(count))


def partitionable(ctx: Any) -> bool:
    """Whether a lowering can be partitioned by a custom rule: more than one device, no manual
    axes (inside ``shard_map`` every call is already per shard), not for ``jax.export``."""
    module = ctx.module_context
    if getattr(module.lowering_parameters, "for_export", False):
        return False
    axis_context = module.axis_context
    if getattr(axis_context, "manual_axes", None):
        return False
    if hasattr(axis_context, "num_devices"):  # jit
        devices = axis_context.device_assignment
        return devices is not None and len(devices) > 1
    mesh = getattr(axis_context, "mesh", None)
    return mesh is not None and mesh.size > 1


def requires_devices(primitive: Any) -> None:
    """Asks jit to know the devices when it lowers ``primitive`` (as for custom_partitioning's
    own primitive), so that the partitioning rule sees the mesh."""
    try:
        from jax._src import dispatch
        dispatch.prim_requires_devices_during_lowering.add(primitive)
    except (ImportError, AttributeError):  # then lowerings without devices fall back
        pass


def partitioned(emit: Callable, params: dict[str, Any], in_avals, out_aval, spec: Spec):
    """``emit(*operands, **params)`` wrapped in a ``custom_partitioning`` built from ``spec``."""
    sizes: dict[str, int] = {}
    for factors, a in zip(spec.operands + (spec.result,), tuple(in_avals) + (out_aval,)):
        assert len(factors) == len(a.shape), (factors, a.shape)
        for f, n in zip(factors, a.shape):
            assert sizes.setdefault(f, n) == n, (f, sizes[f], n)
    sums = frozenset(f for f in spec.free if f not in spec.result)

    def assign(mesh, operand_shardings, result_sharding) -> dict[str, tuple[str, ...]]:
        """factor -> the mesh axes it stays sharded on."""
        chosen: dict[str, tuple[str, ...]] = {}
        if mesh is None:
            return chosen
        used: set[str] = set()
        sources = list(zip(spec.operands, operand_shardings)) + [(spec.result, result_sharding)]
        for factors, sharding in sources:
            for f, axes in zip(factors, _axes(sharding, mesh, len(factors))):
                if f not in spec.free or f in chosen or not axes or used & set(axes):
                    continue
                if sizes[f] % math.prod(mesh.shape[a] for a in axes):
                    continue
                chosen[f] = axes
                used.update(axes)
        return chosen

    def named(mesh, factors, chosen) -> NamedSharding:
        if mesh is None:
            raise ValueError("no mesh")
        entries = []
        for f in factors:
            axes = chosen.get(f)
            entries.append(None if not axes else axes[0] if len(axes) == 1 else axes)
        return NamedSharding(mesh, PartitionSpec(*entries))

    def infer(mesh, arg_shapes, result_shape):
        # An exception in a partitioner callback aborts the process (XLA CHECK-fails): any
        # failure here falls back to a replicated result, which is always correct.
        mesh = _mesh_of(mesh, arg_shapes)
        try:
            chosen = assign(mesh, [a.sharding for a in arg_shapes], None)
            return named(mesh, spec.result, chosen)
        except Exception:  # noqa: BLE001 (see above)
            return _replicated(mesh, arg_shapes)

    def partition(mesh, arg_shapes, result_shape):
        mesh = _mesh_of(mesh, tuple(arg_shapes) + (result_shape,))
        try:
            chosen = assign(mesh, [a.sharding for a in arg_shapes], result_shape.sharding)
            result_sharding = named(mesh, spec.result, chosen)
            arg_shardings = tuple(named(mesh, f, chosen) for f in spec.operands)
            local_shape = tuple(
                n // math.prod(mesh.shape[a] for a in chosen.get(f, ()))
                for f, n in zip(spec.result, out_aval.shape))
        except Exception:  # noqa: BLE001 (see infer)
            replicated = _replicated(mesh, arg_shapes)
            return (mesh, lambda *ops: emit(*ops, **params), replicated,
                    tuple(replicated for _ in arg_shapes))
        summed = tuple(a for f in sorted(sums) if f in chosen for a in chosen[f])

        def per_shard(*operands):
            local_params = params
            if spec.local is not None:
                offsets = {}
                for f in spec.offsets:
                    if f in chosen:
                        shard = jax.lax.axis_index(chosen[f])
                        offsets[f] = shard * (sizes[f] // math.prod(mesh.shape[a]
                                                                   for a in chosen[f]))
                operands, local_params = spec.local(tuple(operands), dict(params), local_shape,
                                                    offsets)
            out = emit(*operands, **local_params)
            return jax.lax.psum(out, summed) if summed else out

        return mesh, per_shard, result_sharding, arg_shardings

    function = custom_partitioning(lambda *operands: emit(*operands, **params))
    function.def_partition(
        partition=partition,
        infer_sharding_from_operands=infer,
        sharding_rule=_rule_string(spec),
        # Shardy wants the special factors in the order the factors first appear.
        reduction_factors=tuple(f for f in sizes if f in sums),
        need_replication_factors=tuple(f for f in sizes if f not in spec.free),
    )
    return function


def _rule_string(spec: Spec) -> str:
    def tensor(factors):
        return " ".join(factors) if factors else ""
    return ", ".join(tensor(f) for f in spec.operands) + " -> " + tensor(spec.result)


def _axes(sharding: Any, mesh: Any, rank: int) -> list[tuple[str, ...]]:
    """The mesh axes of each dimension of a NamedSharding on `mesh` (empty for replicated
    dimensions, unknown shardings and shardings on another mesh)."""
    if not isinstance(sharding, NamedSharding) or sharding.mesh.shape != mesh.shape:
        return [()] * rank
    out = []
    for entry in tuple(sharding.spec) + (None,) * (rank - len(sharding.spec)):
        if entry is None or entry is PartitionSpec.UNCONSTRAINED:
            out.append(())
        elif isinstance(entry, str):
            out.append((entry,))
        else:
            out.append(tuple(entry))
    return out[:rank]


def _mesh_of(mesh: Any, shapes) -> Any:
    """The mesh the callbacks get, else the mesh of a named operand sharding, else None."""
    if mesh is not None and not getattr(mesh, "empty", True):
        return mesh
    for shape in shapes:
        sharding = getattr(shape, "sharding", None)
        if isinstance(sharding, NamedSharding):
            return sharding.mesh
    return None


def _replicated(mesh: Any, shapes) -> Any:
    """A replicated sharding: on `mesh`, else on the devices of an operand's sharding."""
    if mesh is not None:
        return NamedSharding(mesh, PartitionSpec())
    from jax._src.sharding_impls import GSPMDSharding  # no mesh: the partitioner's own kind
    for shape in shapes:
        sharding = getattr(shape, "sharding", None)
        if sharding is not None:
            return GSPMDSharding.get_replicated(sharding._device_assignment)
    raise ValueError("jax_kernels: no sharding to partition by")
