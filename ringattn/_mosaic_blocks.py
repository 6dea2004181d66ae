"""Block sizes of the Mosaic (TPU) Pallas kernels: defaults, clamping and the tiling rule.

:func:`mosaic_blocks` picks the ``(block_q, block_kv)`` pairs of :mod:`ringattn._pallas_tpu`'s
forward and backward kernels and refuses, up front, sizes the compiled kernel cannot tile
(the ``(8, 128)`` rule: ``LANES`` and ``SUBLANES``, which the kernels import from here).
:func:`ringattn._blockwise.make_pallas_config` calls it for the ``"mosaic"`` target.
"""

LANES, SUBLANES = 128, 8


def mosaic_blocks(block_sizes, G: int, T: int, S: int, interpret: bool):
    """``((bq, bk), (bq_bwd, bk_bwd))`` of the Mosaic kernels, clamped to the lengths.

    Default (``block_sizes`` None): about 512 rows (``8 * max(1, 64 // G)`` query positions,
    ``G`` rows each) by ``512`` keys forward, about 256 rows (``8 * max(1, 32 // G)``
    positions) by ``256`` keys backward: rows stay a multiple of 8 for every ``G``, and the
    float32 logits of one step (1 MiB forward) fit the default scoped VMEM of every TPU
    generation with room for their temporaries. A size at least the length becomes the
    length (one block spans the axis). Compiled (not interpreted) kernels need rows
    (``block_q * G``) that are a multiple of 8 and ``block_kv`` a multiple of 128, unless the
    block spans its axis, else NotImplementedError.
    """
    if block_sizes is None:
        fwd, bwd = (8 * max(1, 64 // G), 512), (8 * max(1, 32 // G), 256)
    else:
        fwd, bwd = block_sizes.forward, block_sizes.backward
    fwd = (min(fwd[0], T), min(fwd[1], S))
    bwd = (min(bwd[0], T), min(bwd[1], S))
    if not interpret:
        for name, (bq, bk) in (("", fwd), ("_bwd", bwd)):
            if bq < T and (bq * G) % SUBLANES:
                raise NotImplementedError(
                    f"blockwise_attention(impl='pallas'): rows block_q{name} * G = {bq * G} "
                    "must be a multiple of 8 for the compiled TPU kernel (Mosaic), or "
                    "block_q{name} at least the query length"
                )
            if bk < S and bk % LANES:
                raise NotImplementedError(
                    f"blockwise_attention(impl='pallas'): block_kv{name} = {bk} must be a "
                    "multiple of 128 for the compiled TPU kernel (Mosaic), or at least the "
                    "key length"
                )
    return fwd, bwd
