"""Ring attention over two processes: one 8-device mesh from 2 processes x 4 CPU devices.

Run both processes on one machine (CPU collectives over gloo, loopback only), with the
library installed (``pip install -e .`` in the repository root)::

    python examples/multihost/ring_two_process.py 0 & python examples/multihost/ring_two_process.py 1; wait

An optional second argument is the coordinator port (default 12355; give both processes the
same one). Each process prints the shards of the output it holds and their largest error
against the dense single-process reference (about 1e-6).

On a real cluster, the user supplies three things to ``jax.distributed.initialize``: the
coordinator address ``"HOST:PORT"`` (process 0's host, a port open between the hosts), the
number of processes and this process's id (0 .. n-1). On TPU pods, SLURM and GKE,
``jax.distributed.initialize()`` with no arguments detects all three. On GPUs/TPUs drop the two
``jax.config`` lines (they emulate devices on CPU). The mesh is then ``(processes, devices per
process)``: the batch across hosts, the ring's sequence axis inside a host (the fast links).
The global inputs are built in every process here for brevity; a real loader supplies only the
slices ``index`` that the callback asks for.
"""

# --- core (docs/concepts/multihost.md shows this part verbatim) ---
import sys
from functools import partial

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import AxisType, Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

import ringattn

process_id = int(sys.argv[1])  # 0 or 1
port = int(sys.argv[2]) if len(sys.argv) > 2 else 12355
jax.config.update("jax_num_cpu_devices", 4)  # 4 CPU devices per process
jax.config.update("jax_cpu_collectives_implementation", "gloo")  # collectives across processes
jax.distributed.initialize(f"127.0.0.1:{port}", num_processes=2, process_id=process_id)

# 8 devices: the batch across the 2 processes, the sequence over each one's 4 devices.
devices = np.array(jax.devices()).reshape(jax.process_count(), jax.local_device_count())
mesh = Mesh(devices, ("data", "seq"), axis_types=(AxisType.Auto,) * 2)

B, S, N, K, H = 2, 1024, 8, 2, 64  # [B, S, N, H] queries, [B, S, K, H] keys/values
rng = np.random.default_rng(0)  # the same global inputs in every process (your loader here)
q = rng.standard_normal((B, S, N, H), np.float32)
k, v = (rng.standard_normal((B, S, K, H), np.float32) for _ in range(2))
zig = lambda x: np.asarray(ringattn.to_layout(jnp.asarray(x), "zigzag", num_shards=4))
sharding = NamedSharding(mesh, P("data", "seq"))


def global_array(x):  # each process supplies only the shards its own devices hold
    x = zig(x)
    return jax.make_array_from_callback(x.shape, sharding, lambda index: x[index])


# The positions travel with the data (permuted alike): they say where each token truly is.
positions = zig(np.broadcast_to(np.arange(S, dtype=np.int32), (B, S)))
attend = jax.jit(
    partial(
        ringattn.sharded_attention,
        mesh=mesh,
        seq_axis="seq",
        batch_axis="data",
        strategy="ring",
        layout="zigzag",
        causal=True,
        positions=ringattn.Positions(positions, positions),
    )
)
out = attend(global_array(q), global_array(k), global_array(v)).out  # global, zigzag order

want = zig(
    ringattn.attention_reference(jnp.asarray(q), jnp.asarray(k), jnp.asarray(v), causal=True).out
)
err = max(float(np.abs(np.asarray(s.data) - want[s.index]).max()) for s in out.addressable_shards)
print(
    f"process {process_id}: holds {len(out.addressable_shards)} of {len(devices.flat)} shards "
    f"of out {out.shape}; max |err| vs dense reference {err:.1e}"
)
jax.distributed.shutdown()
# --- end core ---
