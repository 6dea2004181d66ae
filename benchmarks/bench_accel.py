"""Attention kernels on one GPU or TPU: ringattn's Pallas kernels against the vendor's best.

Times, in bfloat16 with ``B = 1``, at ``T = S`` in 4K..128K (``--lengths``), forward and
forward+backward, interleaved per length:
  * ``pallas``: ``ringattn.blockwise_attention(impl="pallas")`` (returns ``(out, lse)``);
  * ``cudnn``: ``jax.nn.dot_product_attention(implementation="cudnn")`` (no log-sum-exp);
  * ``xla``: ``ringattn.blockwise_attention(impl="xla")`` (up to ``--max-xla-length``);
  * ``jax_mha``: ``jax.experimental.pallas.ops.gpu.attention.mha`` (JAX's Triton kernel;
    MHA only, so it runs when ``--kv-heads`` equals ``--heads``).
On a TPU (``JAX_PLATFORMS=tpu``) the Pallas kernels are the Mosaic variant, and the
baseline is ``jax_flash``: ``jax.experimental.pallas.ops.tpu.flash_attention`` (JAX's TPU
kernel, ``[B, N, T, H]``; MHA only) instead of cuDNN, and there is no ``jax_mha``.
Each result is also achieved TFLOP/s (``4 B N H T S`` matmul FLOPs forward, halved when
causal; 3.5 times that for forward+backward) and its fraction of ``--peak-tflops`` (default:
H200 dense bfloat16, 989, on GPU; on TPU the dense bfloat16 peak of the chip, from
``TPU_PEAK_TFLOPS`` by device kind).

Paged decode section (``--sections paged``): one decode token (``T = 1``) per sequence over a
heads-major bfloat16 pool with a shuffled page table, ``paged.paged_attention(impl="pallas")``
(the Pallas decode kernel) against ``impl="xla"`` (the page walk), for ``--paged-batch``
sequences at each context length of ``--paged-lengths``. Each result is also achieved HBM
GB/s (the KV pages read, plus queries and outputs) and its fraction of ``--peak-hbm-gbs``
(default: H200, 4800); the issue's target for the kernel is 80%.

Usage (from the repository root):
  JAX_PLATFORMS=cuda python -m benchmarks.bench_accel            # 4K..128K, both masks
  JAX_PLATFORMS=cuda python -m benchmarks.bench_accel --quick    # 4K and 16K, non-causal
  JAX_PLATFORMS=tpu python -m benchmarks.bench_accel --quick     # the same on one TPU
  python -m benchmarks.bench_accel --interpret-smoke             # CPU: each path once, tiny

Without a GPU or TPU it prints that it needs one and exits 0, except with ``--interpret-smoke``,
which runs every implementation that exists on CPU once at a tiny size (the Pallas kernels
in interpret mode), checks each against ``ringattn.attention_reference`` and writes nothing.
"""

import functools
import math
import os
import sys

from benchmarks import _common

PEAK_TFLOPS_H200_BF16 = 989.0
PEAK_HBM_GBS_H200 = 4800.0
DEFAULT_LENGTHS = (4096, 8192, 16384, 32768, 65536, 131072)
DEFAULT_PAGED_LENGTHS = (8192, 32768, 131072)
# Dense bfloat16 peak TFLOP/s per chip, by the start of ``device_kind`` (public specs).
TPU_PEAK_TFLOPS = {"TPU v4": 275.0, "TPU v5 lite": 197.0, "TPU v5": 459.0, "TPU v6": 918.0}
BASELINES = {"gpu": "cudnn", "tpu": "jax_flash"}


def tpu_peak_tflops(device_kind: str) -> float | None:
    """The dense bfloat16 peak of a TPU chip from its ``device_kind``, or None if unknown."""
    matches = [k for k in TPU_PEAK_TFLOPS if device_kind.startswith(k)]
    return TPU_PEAK_TFLOPS[max(matches, key=len)] if matches else None


def attention_flops(B, T, S, N, H, causal: bool, backward: bool) -> float:
    """Matmul FLOPs of attention: ``4 B N H T S`` forward (half when causal), x3.5 with bwd."""
    fwd = 4.0 * B * N * H * T * S * (0.5 if causal else 1.0)
    return fwd * (3.5 if backward else 1.0)


def make_impls(causal: bool, *, interpret: bool, mha_ok: bool, backend: str = "gpu"):
    """name -> ``attend(q, k, v) -> out`` for every implementation available here."""
    import jax

    from ringattn import blockwise_attention

    impls = {
        "pallas": lambda q, k, v: blockwise_attention(q, k, v, causal=causal, impl="pallas").out,
        "xla": lambda q, k, v: blockwise_attention(q, k, v, causal=causal, impl="xla").out,
    }
    if backend == "tpu":
        if mha_ok:
            from jax.experimental.pallas.ops.tpu import flash_attention as tpu_attention

            def jax_flash(q, k, v):
                heads_major = lambda x: x.transpose(0, 2, 1, 3)  # [B, T, N, H] -> [B, N, T, H]
                out = tpu_attention.flash_attention(
                    *map(heads_major, (q, k, v)),
                    causal=causal,
                    sm_scale=1.0 / math.sqrt(q.shape[-1]),
                )
                return heads_major(out)

            impls["jax_flash"] = jax_flash
        return impls
    if not interpret:
        impls["cudnn"] = lambda q, k, v: jax.nn.dot_product_attention(
            q, k, v, is_causal=causal, implementation="cudnn"
        )
    if mha_ok:
        try:
            from jax.experimental.pallas.ops.gpu import attention as gpu_attention
        except ImportError:  # pragma: no cover - depends on the JAX build
            gpu_attention = None
        if gpu_attention is not None:

            def jax_mha(q, k, v):
                scale = 1.0 / math.sqrt(q.shape[-1])
                blocks = gpu_attention.BlockSizes.get_default()
                if interpret:  # tiny smoke sizes: blocks no larger than the sequence
                    blocks = gpu_attention.BlockSizes(
                        block_q=16,
                        block_k=16,
                        block_q_dkv=16,
                        block_kv_dkv=16,
                        block_q_dq=16,
                        block_kv_dq=16,
                    )
                return gpu_attention.mha(
                    q,
                    k,
                    v,
                    None,
                    sm_scale=scale,
                    causal=causal,
                    block_sizes=blocks,
                    interpret=interpret,
                )

            impls["jax_mha"] = jax_mha
    return impls


def forward_and_backward(attend):
    """``(jit forward, jit forward+backward)`` of ``attend``; the loss is ``sum(out * w)``."""
    import jax
    import jax.numpy as jnp

    def loss(q, k, v, w):
        return jnp.sum(attend(q, k, v).astype(jnp.float32) * w)

    fwd = jax.jit(attend)
    bwd = jax.jit(jax.grad(loss, argnums=(0, 1, 2)))
    return fwd, bwd


def _inputs(B, T, N, K, H, dtype, seed=0):
    import jax

    kq, kk, kv, kw = jax.random.split(jax.random.key(seed), 4)
    q = jax.random.normal(kq, (B, T, N, H), dtype)
    k = jax.random.normal(kk, (B, T, K, H), dtype)
    v = jax.random.normal(kv, (B, T, K, H), dtype)
    w = jax.random.normal(kw, (B, T, N, H), "float32")
    return q, k, v, w


def paged_decode_bytes(B: int, S: int, N: int, K: int, H: int, itemsize: int) -> float:
    """HBM bytes one decode step must move: keys and values of ``B`` sequences of ``S``
    tokens (``2 B S K H``), the queries read and the outputs written (``2 B N H``)."""
    return float(itemsize) * (2.0 * B * S * K * H + 2.0 * B * N * H)


def paged_inputs(B: int, S: int, N: int, K: int, H: int, C: int, dtype, seed=0):
    """``(q [B, 1, N, H], k_pages, v_pages [K, P, C, H], table [B, M], lengths [B])``: every
    sequence ``S`` tokens long on randomly permuted pages (page 0 the null page)."""
    import jax
    import jax.numpy as jnp

    M = -(-S // C)
    P = 1 + B * M
    kq, kk, kv, kp = jax.random.split(jax.random.key(seed), 4)
    q = jax.random.normal(kq, (B, 1, N, H), dtype)
    k_pages = jax.random.normal(kk, (K, P, C, H), dtype)
    v_pages = jax.random.normal(kv, (K, P, C, H), dtype)
    table = (1 + jax.random.permutation(kp, B * M)).reshape(B, M).astype(jnp.int32)
    return q, k_pages, v_pages, table, jnp.full((B,), S, jnp.int32)


def make_paged_impls(pages_per_block: int):
    """name -> ``decode(q, k_pages, v_pages, table, lengths) -> out``, jitted."""
    import jax

    from paged import paged_attention

    def decode(impl, q, k_pages, v_pages, table, lengths):
        return paged_attention(
            q, k_pages, v_pages, table, lengths, pages_per_block=pages_per_block, impl=impl
        ).out

    return {name: jax.jit(functools.partial(decode, name)) for name in ("pallas", "xla")}


def paged_interpret_smoke() -> dict[str, float]:
    """The Pallas decode kernel once in interpret mode, tiny, against the reference."""
    import jax.numpy as jnp

    from paged import paged_attention_reference

    q, k_pages, v_pages, table, lengths = paged_inputs(2, 40, 4, 2, 16, 16, jnp.bfloat16)
    lengths = jnp.asarray([40, 7], jnp.int32)
    want = paged_attention_reference(q, k_pages, v_pages, table, lengths).out
    errors = {}
    for name, decode in make_paged_impls(pages_per_block=2).items():
        out = decode(q, k_pages, v_pages, table, lengths)
        err = float(jnp.max(jnp.abs(out.astype(jnp.float32) - want)))
        errors[f"paged_{name}/decode"] = err
        assert err <= 2e-2, (name, err)
    return errors


def paged_section(args) -> list[str]:
    """Markdown lines of the paged decode table (GPU)."""
    import jax
    import jax.numpy as jnp

    B, N, K, H, C = args.paged_batch, args.paged_heads, args.paged_kv_heads, args.head_dim, 16
    lines = [
        "",
        f"Paged decode: bfloat16, B = {B}, T = 1, N = {N}, K = {K}, H = {H}, C = {C}, "
        f"{args.pages_per_block} pages per block; peak HBM {args.peak_hbm_gbs:.0f} GB/s.",
        "",
        "| context S | impl | ms | GB/s | % peak HBM | vs xla |",
        "|---|---|---|---|---|---|",
    ]
    for S in args.paged_lengths or DEFAULT_PAGED_LENGTHS:
        inputs = paged_inputs(B, S, N, K, H, C, jnp.bfloat16)
        fns, failed = {}, {}
        for name, decode in make_paged_impls(args.pages_per_block).items():
            try:
                jax.block_until_ready(decode(*inputs))
            except Exception as e:  # report it and keep measuring the rest
                failed[name] = f"{type(e).__name__}: {str(e).splitlines()[0][:120]}"
                continue
            fns[name] = functools.partial(decode, *inputs)
        timing = _common.time_interleaved(fns, repeats=args.repeats, warmup=0)
        best = {key: t.best for key, t in timing.items()}
        moved = paged_decode_bytes(B, S, N, K, H, 2)
        for name in ("pallas", "xla"):
            if name in failed:
                lines.append(f"| {S} | {name} | failed: {failed[name]} |")
                continue
            gbs = moved / best[name] / 1e9
            ratio = f"{best['xla'] / best[name]:.2f}" if "xla" in best else "n/a"
            lines.append(
                f"| {S} | {name} | {best[name] * 1e3:.3f} | {gbs:.0f} | "
                f"{100 * gbs / args.peak_hbm_gbs:.0f} | {ratio} |"
            )
        print("\n".join(lines[-2:]), flush=True)
        del inputs
    lines += ["", "`vs xla` is the XLA page walk's time over this implementation's."]
    return lines


def interpret_smoke() -> dict[str, float]:
    """Every implementation available on CPU once, tiny, against the reference.

    Returns:
      ``"<impl>/<pass>" -> max abs error`` against :func:`ringattn.attention_reference`.

    Raises:
      AssertionError: an error above 2e-2 (bfloat16 inputs, float32 reference).
    """
    import jax
    import jax.numpy as jnp

    from ringattn import attention_reference

    B, T, N, H = 1, 32, 2, 16
    q, k, v, w = _inputs(B, T, N, N, H, jnp.bfloat16)
    errors = {}
    for causal in (False, True):
        ref = functools.partial(
            lambda causal, q, k, v: attention_reference(q, k, v, causal=causal).out, causal
        )
        f32 = [x.astype(jnp.float32) for x in (q, k, v)]
        want_fwd, want_bwd = forward_and_backward(ref)
        want_out, want_grads = want_fwd(*f32), want_bwd(*f32, w)
        for name, attend in make_impls(causal, interpret=True, mha_ok=True).items():
            fwd, bwd = forward_and_backward(attend)
            out = fwd(q, k, v)
            grads = bwd(q, k, v, w)
            err = float(jnp.max(jnp.abs(out.astype(jnp.float32) - want_out)))
            gerr = max(
                float(jnp.max(jnp.abs(g.astype(jnp.float32) - wg)) / (1 + jnp.max(jnp.abs(wg))))
                for g, wg in zip(grads, want_grads, strict=True)
            )
            tag = "causal" if causal else "full"
            errors[f"{name}/{tag}/forward"] = err
            errors[f"{name}/{tag}/backward (relative)"] = gerr
            assert err <= 2e-2 and gerr <= 2e-2, (name, tag, err, gerr)
            jax.block_until_ready(grads)
    errors.update(paged_interpret_smoke())
    return errors


def main(argv=None):
    parser = _common.make_parser(__doc__)
    parser.add_argument("--peak-tflops", type=float, default=None)
    parser.add_argument("--lengths", type=int, nargs="+", default=None)
    parser.add_argument("--heads", type=int, default=16)
    parser.add_argument("--kv-heads", type=int, default=16)
    parser.add_argument("--head-dim", type=int, default=128)
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--max-xla-length", type=int, default=32768)
    parser.add_argument("--causal", choices=("both", "no", "yes"), default="both")
    parser.add_argument("--interpret-smoke", action="store_true")
    parser.add_argument(
        "--sections", choices=("attention", "paged"), nargs="+", default=("attention", "paged")
    )
    parser.add_argument("--peak-hbm-gbs", type=float, default=PEAK_HBM_GBS_H200)
    parser.add_argument("--paged-lengths", type=int, nargs="+", default=None)
    parser.add_argument("--paged-batch", type=int, default=8)
    parser.add_argument("--paged-heads", type=int, default=32)
    parser.add_argument("--paged-kv-heads", type=int, default=8)
    parser.add_argument("--pages-per-block", type=int, default=32)
    args = parser.parse_args(argv)

    if args.interpret_smoke:
        os.environ.setdefault("JAX_PLATFORMS", "cpu")
        errors = interpret_smoke()
        for key, err in errors.items():
            print(f"{key}: max error {err:.2e}")
        print(
            "interpret smoke: pallas, xla, jax_mha and the paged decode kernel agree with "
            "the reference (cudnn is GPU only: not run)"
        )
        return 0

    import jax
    import jax.numpy as jnp

    backend = jax.default_backend()
    if backend not in BASELINES:
        print(
            "bench_accel needs a GPU (JAX_PLATFORMS=cuda) or a TPU (JAX_PLATFORMS=tpu); this "
            f"machine's backend is {backend!r}. Use --interpret-smoke for a CPU check."
        )
        return 0
    device = jax.devices()[0]
    baseline = BASELINES[backend]
    if args.peak_tflops is None:
        peak = PEAK_TFLOPS_H200_BF16 if backend == "gpu" else tpu_peak_tflops(device.device_kind)
        if peak is None:
            print(f"unknown peak for {device.device_kind!r}: pass --peak-tflops")
            return 1
        args.peak_tflops = peak

    run = _common.start_run("bench_accel", args, cpu_devices=None)
    lengths = args.lengths or ((4096, 16384) if args.quick else DEFAULT_LENGTHS)
    masks = {"both": (False, True), "no": (False,), "yes": (True,)}[args.causal]
    if args.quick:
        masks = (False,)
        args.paged_lengths = args.paged_lengths or (8192, 32768)
    if "attention" not in args.sections:
        masks = ()
    B, N, K, H = 1, args.heads, args.kv_heads, args.head_dim
    lines = [
        f"Device: {device.device_kind}, JAX {jax.__version__}; bfloat16, B = {B}, N = {N}, "
        f"K = {K}, H = {H}; peak {args.peak_tflops:.0f} TFLOP/s; best of {args.repeats} "
        "interleaved runs after a warm-up (compile).",
        "",
        "| mask | T = S | impl | fwd ms | fwd TFLOP/s | % peak | fwd+bwd ms | fwd+bwd TFLOP/s "
        f"| % peak | fwd vs {baseline} | fwd+bwd vs {baseline} |",
        "|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for causal in masks:
        for T in lengths:
            q, k, v, w = _inputs(B, T, N, K, H, jnp.bfloat16)
            impls = make_impls(causal, interpret=False, mha_ok=N == K, backend=backend)
            if T > args.max_xla_length:
                impls.pop("xla")
            fns, failed = {}, {}
            for name, attend in impls.items():
                fwd, bwd = forward_and_backward(attend)
                try:
                    jax.block_until_ready(fwd(q, k, v))
                    jax.block_until_ready(bwd(q, k, v, w))
                except Exception as e:  # report it and keep measuring the rest
                    failed[name] = f"{type(e).__name__}: {str(e).splitlines()[0][:120]}"
                    continue
                fns[f"{name}/fwd"] = functools.partial(fwd, q, k, v)
                fns[f"{name}/bwd"] = functools.partial(bwd, q, k, v, w)
            timing = _common.time_interleaved(fns, repeats=args.repeats, warmup=0)
            best = {key: t.best for key, t in timing.items()}
            tag = "causal" if causal else "full"
            for name in impls:
                if name in failed:
                    lines.append(f"| {tag} | {T} | {name} | failed: {failed[name]} |")
                    continue
                f, b = best[f"{name}/fwd"], best[f"{name}/bwd"]
                tf = attention_flops(B, T, T, N, H, causal, False) / f / 1e12
                tb = attention_flops(B, T, T, N, H, causal, True) / b / 1e12
                rf = rb = "n/a"
                if f"{baseline}/fwd" in best:
                    rf = f"{best[f'{baseline}/fwd'] / f:.2f}"
                    rb = f"{best[f'{baseline}/bwd'] / b:.2f}"
                lines.append(
                    f"| {tag} | {T} | {name} | {f * 1e3:.2f} | {tf:.0f} | "
                    f"{100 * tf / args.peak_tflops:.0f} | {b * 1e3:.2f} | {tb:.0f} | "
                    f"{100 * tb / args.peak_tflops:.0f} | {rf} | {rb} |"
                )
            print("\n".join(lines[-len(impls) :]), flush=True)
    lines += [
        "",
        f"`vs {baseline}` is {baseline}'s time over this implementation's (above 1: faster "
        f"than {baseline}).",
    ]
    if "paged" in args.sections:
        lines += paged_section(args)
    run.write(f"Attention kernels on one {backend.upper()}", lines)
    return 0


if __name__ == "__main__":
    sys.exit(main())
