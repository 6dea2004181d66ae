"""match_varying: the one varying-axes helper, inside and outside shard_map."""

import jax
import jax.numpy as jnp
from jax.sharding import PartitionSpec as P

from ringattn import match_varying
from ringattn._varying import varying_axes
from tests._util import make_test_mesh


def test_outside_shard_map_is_identity():
    a, b = jnp.ones(3), jnp.zeros(3)
    x, y = match_varying(a, b)
    assert x is a and y is b
    assert match_varying(None, a)[0] is None


def test_replicated_meets_sharded_and_gradient_sums():
    """The replicated operand is cast to vary; its gradient is the psum over the axis."""
    mesh = make_test_mesh((4,), ("x",))

    def body(shard, replicated):
        assert varying_axes(shard) == {"x"} and varying_axes(replicated) == frozenset()
        shard, replicated = match_varying(shard, replicated)
        assert varying_axes(replicated) == {"x"}
        return shard * replicated

    f = jax.shard_map(body, mesh=mesh, in_specs=(P("x"), P()), out_specs=P("x"), check_vma=True)
    shard, replicated = jnp.arange(8.0), jnp.full((2,), 3.0)
    out = jax.jit(f)(shard, replicated)
    assert out.tolist() == (3.0 * jnp.arange(8.0)).tolist()
    grad = jax.jit(jax.grad(lambda r: jnp.sum(f(shard, r))))(replicated)
    assert grad.tolist() == [0.0 + 2 + 4 + 6, 1.0 + 3 + 5 + 7]


def test_public_varying_axes_and_struct_inside_and_outside_shard_map():
    import ringattn

    assert ringattn.varying_axes(jnp.ones(2), None) == frozenset()
    outside = ringattn.varying_struct((3, 2), jnp.bfloat16, jnp.ones(2))
    assert (outside.shape, outside.dtype) == ((3, 2), jnp.bfloat16)
    assert not outside.manual_axis_type.varying
    mesh = make_test_mesh((2, 2), ("a", "b"))
    seen = []

    def body(x, y):
        seen.append(
            (ringattn.varying_axes(x), ringattn.varying_axes(y), ringattn.varying_axes(x, y))
        )
        seen.append(ringattn.varying_struct((1,), jnp.float32, y, x).manual_axis_type.varying)
        return x

    f = jax.shard_map(body, mesh=mesh, in_specs=(P("a"), P()), out_specs=P("a"), check_vma=True)
    jax.jit(f)(jnp.ones(4), jnp.ones(4))
    assert seen == [({"a"}, set(), {"a"}), {"a"}]
