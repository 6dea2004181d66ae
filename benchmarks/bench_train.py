"""One training step of the example model: ring / all-gather / Ulysses on 8 devices vs one device.

Rerun from the repository root:
        python -m benchmarks.bench_train            (contexts 2K and 8K, several minutes idle)
        python -m benchmarks.bench_train --quick    (context 1K, about a minute idle)
        python -m benchmarks.bench_train --contexts 2048,8192,16384 --batch 2 --repeats 5

The step is the example's own ``train.make_train_step`` (forward, backward, global-norm
clipping and the AdamW update of ``train.make_optimizer``) on the shipped model shape
(``ModelConfig()`` defaults, the same as ``examples/longctx_lm/checkpoint/config.json``),
random initial weights (``train.init_model``; the time of a step does not depend on the
weights) and a batch of ``--batch`` rows of the training tasks (``train.mixed_batch``).
Methods, the same weights and batch:

* ``blockwise (1 device)``: ``attention.blockwise()``, natural order: the baseline;
* ``ring zigzag``: ``attention.sharded(mesh, strategy="ring", layout="zigzag")``;
* ``allgather zigzag``: ``strategy="allgather"``;
* ``ulysses contiguous``: ``strategy="ulysses"`` (the all-to-all gives each device the whole
  sequence, so the layout only matters for the ring's load balance);

the sharded ones on a ``("data", "seq") = (1, 8)`` mesh of 8 emulated CPU devices, the example
permuted into the layout once at the data boundary (``train.to_layout_example``) and placed
with ``P("data", "seq")``. Reported: the median step time over ``--repeats`` steps after a
compile and a warm-up step (best next to it), tokens/s, the ratio to the one-device step, and
the compiled memory of the step per device (``compiled.memory_analysis()``: arguments +
outputs + temporaries; the parameters and AdamW state are replicated on every device).

Before timing, the script checks once at a small context that every strategy's step gives the
one-device step's loss and gradient norm to 1e-4 (relative), so no broken path is timed.

On CPU the 8 "devices" are emulated on the host's cores (2 here): a sharded step does the
one-device step's work plus the collectives on the same cores, so sequence parallelism buys
no compute here and ring attention cannot really be faster than one device. A ratio below 1x
can still appear, because XLA:CPU runs each emulated device's program on its own thread (8
programs keep both cores busy) while one device's program does not always use both cores:
that is core utilisation, not a sequence-parallel speed-up. What the CPU table is good for
is the overhead of one strategy against another and the per-device memory; speed-ups need
real devices.
"""

import contextlib
import os
import time

import jax
import numpy as np
from flax import nnx
from jax.sharding import AxisType, NamedSharding
from jax.sharding import PartitionSpec as P

from benchmarks import _common

DEVICES = 8
SHARDED = {
    "ring zigzag": ("ring", "zigzag"),
    "allgather zigzag": ("allgather", "zigzag"),
    "ulysses contiguous": ("ulysses", "contiguous"),
}
BASELINE = "blockwise (1 device)"
METHODS = (BASELINE, *SHARDED)


def make_mesh():
    return jax.make_mesh((1, DEVICES), ("data", "seq"), axis_types=(AxisType.Auto, AxisType.Auto))


def setup(context: int, batch: int, *, seed: int = 0, model_cfg=None):
    """(graphdef, params, rest, opt_state, tx, natural-order example) of one step."""
    from examples.longctx_lm import train
    from examples.longctx_lm.model import ModelConfig

    model_cfg = model_cfg or ModelConfig()
    cfg = train.TrainConfig(batch_size=batch)
    model = train.init_model(model_cfg, seed)
    graphdef, params, rest = nnx.split(model, nnx.Param, ...)
    tx = train.make_optimizer(cfg)
    opt_state = tx.init(params)
    rng = np.random.default_rng([seed, context])
    ex = train.model_inputs(train.mixed_batch(cfg.tasks, context, batch, rng))
    return graphdef, params, rest, opt_state, tx, ex


def make_step(method: str, mesh, tx, ex, block_sizes=None):
    """(jitted step, the example it takes: in layout order and sharded for a sharded method)."""
    from examples.longctx_lm import attention, train

    if method == BASELINE:
        return train.make_train_step(attention.blockwise(block_sizes), tx), ex
    strategy, layout = SHARDED[method]
    attend = attention.sharded(mesh, strategy=strategy, layout=layout, block_sizes=block_sizes)
    ex = train.to_layout_example(ex, layout=layout, num_shards=DEVICES)
    ex = jax.device_put(ex, NamedSharding(mesh, P("data", "seq")))
    return train.make_train_step(attend, tx), ex


def mesh_context(method: str, mesh):
    """``jax.set_mesh(mesh)`` for a sharded method; nothing for the one-device baseline.

    The baseline must be compiled outside the mesh: under ``set_mesh`` an Auto mesh makes
    ``jit`` replicate the unsharded step on all 8 devices (8 copies of the work on the same
    cores, measured 15x slower here), which is not a one-device step.
    """
    return contextlib.nullcontext() if method == BASELINE else jax.set_mesh(mesh)


def check_agreement(context: int = 256, batch: int = 2, *, block_sizes=None, model_cfg=None,
                    tol: float = 1e-4) -> dict[str, tuple[float, float]]:  # fmt: skip
    """Every method's step loss and gradient norm vs the one-device step, at a small size.

    Returns ``method -> (relative loss error, relative grad-norm error)``; raises
    ``AssertionError`` if any exceeds ``tol``. Needs 8 devices.
    """
    mesh = make_mesh()
    graphdef, params, rest, opt_state, tx, ex = setup(context, batch, model_cfg=model_cfg)
    got = {}
    for method in METHODS:
        step, ex_m = make_step(method, mesh, tx, ex, block_sizes)
        with mesh_context(method, mesh):
            _, _, loss, _, gnorm = step(graphdef, params, rest, opt_state, ex_m)
        got[method] = (float(loss), float(gnorm))
    want_loss, want_gnorm = got[BASELINE]
    errors = {
        m: (abs(loss - want_loss) / abs(want_loss), abs(g - want_gnorm) / abs(want_gnorm))
        for m, (loss, g) in got.items()
    }
    bad = {m: e for m, e in errors.items() if max(e) > tol}
    assert not bad, f"bench_train: steps disagree with the one-device step (> {tol}): {bad}"
    return errors


def memory_bytes(compiled) -> int | None:
    """Arguments + outputs + temporaries of a compiled program (per device), or None."""
    try:
        m = compiled.memory_analysis()
    except Exception:  # some backends do not implement it
        return None
    if m is None:
        return None
    try:
        return int(m.temp_size_in_bytes + m.argument_size_in_bytes + m.output_size_in_bytes)
    except (AttributeError, TypeError):
        return None


def bench_context(context: int, batch: int, repeats: int):
    mesh = make_mesh()
    graphdef, params, rest, opt_state, tx, ex = setup(context, batch)
    fns, memory = {}, {}
    for method in METHODS:
        step, ex_m = make_step(method, mesh, tx, ex)
        args = (graphdef, params, rest, opt_state, ex_m)
        with mesh_context(method, mesh):
            t0 = time.perf_counter()
            compiled = step.lower(*args).compile()
            seconds = time.perf_counter() - t0
            print(f"  {context}: {method}: compiled in {seconds:.1f} s", flush=True)
        memory[method] = memory_bytes(compiled)
        # The compiled step without its static graphdef argument.
        fns[method] = lambda compiled=compiled, args=args: compiled(*args[1:])
    timing = _common.time_interleaved(fns, repeats=repeats)
    return timing, memory


def fmt_mib(nbytes: int | None) -> str:
    return "n/a" if nbytes is None else f"{nbytes / _common.MiB:.1f}"


def main(argv=None):
    parser = _common.make_parser(__doc__)
    parser.add_argument("--contexts", type=str, default=None, help="e.g. 2048,8192")
    parser.add_argument("--batch", type=int, default=None, help="rows per step (default 2)")
    parser.add_argument("--repeats", type=int, default=None, help="timed steps per method")
    args = parser.parse_args(argv)
    run = _common.start_run("bench_train", args, cpu_devices=DEVICES, argv=argv)
    from examples.longctx_lm import train
    from examples.longctx_lm.model import ModelConfig, num_params

    if args.contexts:
        contexts = [int(x) for x in args.contexts.split(",")]
    else:
        contexts = [1024] if args.quick else [2048, 8192]
    batch = args.batch or (1 if args.quick else 2)
    repeats = args.repeats or (2 if args.quick else 3)

    t0 = time.perf_counter()
    errors = check_agreement()
    check = ", ".join(f"{m}: {max(e):.1e}" for m, e in errors.items() if m != BASELINE)
    print(f"agreement at context 256, batch 2 (max relative error): {check}", flush=True)

    cfg = ModelConfig()
    params = num_params(train.init_model(cfg, 0))
    lines = [
        f"Model: `ModelConfig()` defaults (the shipped model: width {cfg.width}, "
        f"{cfg.num_layers} layers, N={cfg.num_heads}, K={cfg.num_kv_heads}, H={cfg.head_dim}, "
        f"MLP {cfg.mlp_width}, {params:,} parameters), float32, random initial weights "
        "(timing does not depend on them). One step = `train.make_train_step`: forward, "
        "backward, clipping and AdamW. "
        f"Batch {batch} row(s) of the training tasks (`train.mixed_batch`). Sharded methods: a "
        f'`("data", "seq") = (1, {DEVICES})` mesh of {DEVICES} emulated CPU devices '
        "(`jax_num_cpu_devices`), Auto axes, inputs permuted by `train.to_layout_example`. "
        f"Median (best) of {repeats} interleaved steps after a compile and a warm-up step.",
        "",
        f"**On CPU the {DEVICES} devices are emulated on the host's cores "
        f"({os.cpu_count()} here): a sharded step does the one-device step's work plus the "
        "collectives on the same cores, so ring attention cannot really be faster than one "
        "device here.** A ratio below 1x can still appear because XLA:CPU runs each emulated "
        "device's program on its own thread (8 programs keep both cores busy) while one "
        "device's program does not always use both: core utilisation, not a sequence-parallel "
        "speed-up. Compare strategies with each other, and read the memory column (the "
        "per-device footprint that lets a longer context fit); speed-ups need real devices.",
        "",
        f"Correctness, checked first (context 256, batch 2): the step's loss and gradient "
        f"norm agree with the one-device step to a relative {check} (tolerance 1e-4).",
        "",
        "| context | method | step (median) | step (best) | tokens/s | vs 1-device blockwise "
        "| compiled MiB / device |",
        "|---:|---|---:|---:|---:|---:|---:|",
    ]
    for context in contexts:
        timing, memory = bench_context(context, batch, repeats)
        base = timing[BASELINE].median
        for method in METHODS:
            t = timing[method]
            row = (
                f"| {context} | {method} | {_common.ms(t.median, 0)} | {_common.ms(t.best, 0)} "
                f"| {batch * context / t.median:,.0f} | {t.median / base:.2f}x "
                f"| {fmt_mib(memory[method])} |"
            )
            lines.append(row)
            print(row, flush=True)
    lines += [
        "",
        "vs 1-device blockwise = step time / the one-device step's (median, same run; above "
        "1 is slower). Compiled memory = arguments + outputs + temporaries of the compiled "
        "step per device (`memory_analysis()`; n/a where the backend gives none); the "
        "arguments include the replicated parameters and AdamW state.",
        "",
        f"Total benchmark time: {time.perf_counter() - t0:.0f} s.",
    ]
    run.write("Training step of the example model: sequence parallel vs one device", lines)


if __name__ == "__main__":
    main()
