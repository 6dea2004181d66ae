"""One process of the multi-process test (run by test_multiprocess.py, not collected by pytest).

Usage: ``python mp_worker.py PORT PROCESS_ID NUM_PROCESSES``. Each process owns 4 CPU devices;
together they form one 8-device mesh. Every process builds the same deterministic global
inputs, runs ``sharded_attention`` (ring, causal, zigzag) forward and backward over the global
mesh, and compares the shards it can address with ``attention_reference`` computed locally on
the full inputs. Exit code 0 on success, 1 on a mismatch (the max errors are printed).
"""

import os
import sys

os.environ.setdefault("JAX_PLATFORMS", "cpu")

import jax

LOCAL_DEVICES = 4
jax.config.update("jax_num_cpu_devices", LOCAL_DEVICES)
jax.config.update("jax_cpu_collectives_implementation", "gloo")

import jax.numpy as jnp
import numpy as np
from jax.sharding import AxisType, Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

from ringattn import Positions, attention_reference, sharded_attention, to_layout

B, T, N, K, H = 2, 64, 4, 2, 8
TOLERANCE = 5e-5


def main(port: int, process_id: int, num_processes: int) -> int:
    jax.distributed.initialize(
        f"127.0.0.1:{port}", num_processes=num_processes, process_id=process_id
    )
    devices = jax.devices()
    n = len(devices)
    assert n == LOCAL_DEVICES * num_processes, devices
    mesh = Mesh(np.array(devices), ("seq",), axis_types=(AxisType.Auto,))

    rng = np.random.default_rng(0)  # same global data in every process
    q, dout = (rng.standard_normal((B, T, N, H), np.float32) for _ in range(2))
    k, v = (rng.standard_normal((B, T, K, H), np.float32) for _ in range(2))
    perm = lambda x: np.asarray(to_layout(jnp.asarray(x), "zigzag", num_shards=n))

    spec = NamedSharding(mesh, P(None, "seq"))

    def global_array(x):
        x = perm(x)
        return jax.make_array_from_callback(x.shape, spec, lambda index: x[index])

    pos = perm(np.broadcast_to(np.arange(T, dtype=np.int32), (B, T)))  # permuted like the data

    def loss(q, k, v, dout):
        out = sharded_attention(
            q, k, v, mesh=mesh, seq_axis="seq", strategy="ring", layout="zigzag", causal=True,
            positions=Positions(pos, pos),
        ).out  # fmt: skip
        return jnp.sum(out * dout), out

    grad_fn = jax.jit(jax.grad(loss, argnums=(0, 1, 2), has_aux=True))
    (dq, dk, dv), out = grad_fn(*(global_array(x) for x in (q, k, v, dout)))

    def ref_loss(q, k, v):
        out = attention_reference(q, k, v, causal=True).out
        return jnp.sum(out * dout), out

    (rdq, rdk, rdv), rout = jax.jit(jax.grad(ref_loss, argnums=(0, 1, 2), has_aux=True))(q, k, v)

    failed = False
    for name, got, want in (("out", out, rout), ("dq", dq, rdq), ("dk", dk, rdk), ("dv", dv, rdv)):
        want = perm(want)
        err = max(
            float(np.max(np.abs(np.asarray(shard.data) - want[shard.index])))
            for shard in got.addressable_shards
        )
        shards = len(got.addressable_shards)
        print(f"process {process_id}: {name} max abs error {err:.3g} over {shards} shards")
        failed |= not err <= TOLERANCE
    jax.distributed.shutdown()
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main(int(sys.argv[1]), int(sys.argv[2]), int(sys.argv[3])))
