"""Train the example model on the retrieval tasks (optax AdamW, orbax checkpoints).

Run ``python -m examples.longctx_lm.train --help``. The shipped checkpoint was made with the
command recorded in ``examples/longctx_lm/checkpoint/README.md``.

The step is a pure function of ``(graphdef, state, batch)`` under ``jax.jit``; the same step
runs on one device with :func:`attention.blockwise` or sharded over a ``("data", "seq")``
mesh with :func:`attention.sharded` (ring attention, zigzag layout): the batch is permuted
into the layout once, at the data boundary, and positions travel with it.
"""

import argparse
import dataclasses
import functools
import json
import os
import time
from typing import NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
import optax
import orbax.checkpoint as ocp
from flax import nnx

import ringattn
from examples.longctx_lm import attention
from examples.longctx_lm.data import Batch, TaskConfig, make_batch
from examples.longctx_lm.model import ModelConfig, Transformer, previous_tokens


@dataclasses.dataclass(frozen=True)
class TrainConfig:
    """Optimisation and schedule (frozen; saved beside the checkpoint).

    Attributes:
      tasks: tasks mixed in every batch (half the rows each when both).
      stages: the curriculum, ``((steps, context), ...)``: ``context`` is the model's input
        length (samples have ``context + 1`` tokens).
      batch_size: rows per step.
      peak_lr, warmup_steps, end_lr: AdamW learning rate, linear warm-up then cosine decay
        over all stages to ``end_lr``.
      weight_decay, clip_norm: AdamW decoupled weight decay; global-norm gradient clipping.
      seed: parameters and data.
    """

    tasks: tuple[str, ...] = ("passkey", "recall")
    stages: tuple[tuple[int, int], ...] = ((500, 128), (300, 512), (400, 1024), (300, 2048))
    batch_size: int = 16
    peak_lr: float = 6e-3
    warmup_steps: int = 50
    end_lr: float = 6e-4
    weight_decay: float = 0.01
    clip_norm: float = 1.0
    seed: int = 0

    @property
    def total_steps(self) -> int:
        return sum(s for s, _ in self.stages)


def task_config(task: str, context: int, **kw) -> TaskConfig:
    """The task's samples for a model input of ``context`` tokens."""
    return TaskConfig(task=task, length=context + 1, **kw)


def make_optimizer(cfg: TrainConfig) -> optax.GradientTransformation:
    schedule = optax.warmup_cosine_decay_schedule(
        0.0, cfg.peak_lr, cfg.warmup_steps, max(cfg.total_steps, cfg.warmup_steps + 1), cfg.end_lr
    )
    return optax.chain(
        optax.clip_by_global_norm(cfg.clip_norm),
        optax.adamw(schedule, b1=0.9, b2=0.98, weight_decay=cfg.weight_decay),
    )


def mixed_batch(tasks, context: int, batch_size: int, rng: np.random.Generator) -> Batch:
    """Rows of each task in turn (``batch_size`` rows in all)."""
    parts = []
    for i, task in enumerate(tasks):
        rows = batch_size // len(tasks) + (i < batch_size % len(tasks))
        if rows:
            parts.append(make_batch(task_config(task, context), rows, rng))
    return Batch(*(np.concatenate(x) for x in zip(*parts, strict=True)))


class Example(NamedTuple):
    """One step's arrays, each ``[B, T]`` with ``T = length - 1`` (natural or layout order).

    Attributes:
      inputs: token ids fed to the model.
      prev_tokens: the token before each input in natural order (see ``model.previous_tokens``).
      positions: true positions of the inputs.
      targets: the next token of each input.
      mask: float32, 1 on answer targets.
    """

    inputs: jax.Array
    prev_tokens: jax.Array
    positions: jax.Array
    targets: jax.Array
    mask: jax.Array


def model_inputs(batch: Batch) -> Example:
    """The model's view of a batch, in natural order."""
    tokens = jnp.asarray(batch.tokens)
    B, L = tokens.shape
    positions = jnp.broadcast_to(jnp.arange(L - 1, dtype=jnp.int32), (B, L - 1))
    inputs = tokens[:, :-1]
    return Example(
        inputs,
        previous_tokens(inputs),
        positions,
        tokens[:, 1:],
        jnp.asarray(batch.loss_mask[:, 1:]),
    )


def to_layout_example(ex: Example, *, layout: str, num_shards: int) -> Example:
    """Permute every field into a sequence layout once (the loss is a sum: unchanged)."""
    f = functools.partial(ringattn.to_layout, layout=layout, num_shards=num_shards)
    return Example(*(f(x) for x in ex))


def loss_and_accuracy(model, ex: Example, attend):
    """Mean cross-entropy over answer tokens, and the fraction of answer tokens right."""
    inputs, prev_tokens, positions, targets, mask = ex
    logits = model(inputs, positions, attend, prev_tokens).astype(jnp.float32)
    ce = optax.softmax_cross_entropy_with_integer_labels(logits, targets)
    denom = jnp.maximum(mask.sum(), 1.0)
    loss = jnp.sum(ce * mask) / denom
    correct = (jnp.argmax(logits, -1) == targets).astype(jnp.float32)
    return loss, jnp.sum(correct * mask) / denom


def make_train_step(attend, tx: optax.GradientTransformation):
    """A jitted ``step(graphdef, params, rest, opt_state, example)``; returns
    ``(params, opt_state, loss, accuracy, grad_norm)``."""

    @functools.partial(jax.jit, static_argnums=0)
    def step(graphdef, params, rest, opt_state, ex: Example):
        def loss_fn(params):
            return loss_and_accuracy(nnx.merge(graphdef, params, rest), ex, attend)

        (loss, acc), grads = jax.value_and_grad(loss_fn, has_aux=True)(params)
        updates, opt_state = tx.update(grads, opt_state, params)
        params = optax.apply_updates(params, updates)
        return params, opt_state, loss, acc, optax.tree.norm(grads)

    return step


def init_model(model_cfg: ModelConfig, seed: int) -> Transformer:
    return Transformer(model_cfg, rngs=nnx.Rngs(seed))


def _abstract_state(model_cfg: ModelConfig, cfg: TrainConfig):
    model = init_model(model_cfg, cfg.seed)
    graphdef, params, rest = nnx.split(model, nnx.Param, ...)
    state = {"params": params, "opt_state": make_optimizer(cfg).init(params), "step": 0}
    return graphdef, rest, state


def save_checkpoint(path: str, state: dict, model_cfg: ModelConfig, cfg: TrainConfig, history):
    """Saves ``{"params", "opt_state", "step"}`` with orbax, and the configs and history as
    JSON beside them (``config.json``), so training can resume and evaluation can rebuild the
    model."""
    path = os.path.abspath(path)
    os.makedirs(path, exist_ok=True)
    ckptr = ocp.StandardCheckpointer()
    ckptr.save(os.path.join(path, "state"), state, force=True)
    ckptr.wait_until_finished()
    # Orbax's completion marker records the absolute path it wrote to; keep the committed
    # checkpoint free of machine paths (only the marker's presence is read on restore).
    marker = os.path.join(path, "state", "commit_success.txt")
    if os.path.exists(marker):
        with open(marker, "w") as f:
            f.write("Checkpoint commit was successful to state\n")
    meta = {"model": dataclasses.asdict(model_cfg), "train": dataclasses.asdict(cfg), "history": history}  # fmt: skip
    with open(os.path.join(path, "config.json.tmp"), "w") as f:
        json.dump(meta, f, indent=1)
    os.replace(os.path.join(path, "config.json.tmp"), os.path.join(path, "config.json"))


def _configs(meta: dict) -> tuple[ModelConfig, TrainConfig]:
    train_meta = dict(meta["train"])
    train_meta["tasks"] = tuple(train_meta["tasks"])
    train_meta["stages"] = tuple(tuple(s) for s in train_meta["stages"])
    return ModelConfig(**meta["model"]), TrainConfig(**train_meta)


def restore_state(path: str):
    """``(graphdef, rest, state, meta)`` of a checkpoint saved by :func:`save_checkpoint`."""
    path = os.path.abspath(path)
    with open(os.path.join(path, "config.json")) as f:
        meta = json.load(f)
    graphdef, rest, abstract = _abstract_state(*_configs(meta))
    state = ocp.StandardCheckpointer().restore(os.path.join(path, "state"), abstract)
    return graphdef, rest, state, meta


def load_checkpoint(path: str) -> tuple[Transformer, dict]:
    """The trained model of a checkpoint, and its metadata (configs, training history)."""
    graphdef, rest, state, meta = restore_state(path)
    return nnx.merge(graphdef, state["params"], rest), meta


@functools.partial(jax.jit, static_argnums=(0, 1))
def _predict(graphdef, attend, state, ex: Example):
    """Greedy next tokens ``[B, T]``; one compile per model, attention and shape (module
    level, so periodic evaluations during training reuse it)."""
    model = nnx.merge(graphdef, state)
    return jnp.argmax(model(ex.inputs, ex.positions, attend, ex.prev_tokens), -1)


def evaluate(model, task: str, context: int, samples: int, seed: int, attend, batch_size=16):
    """Exact-match accuracy: a passkey sample counts if all its digits are right, a recall
    query if its value is right."""
    graphdef, state = nnx.split(model)
    rng = np.random.default_rng(seed)
    right = total = 0
    for start in range(0, samples, batch_size):
        n = min(batch_size, samples - start)
        batch = make_batch(task_config(task, context), n, rng)
        ex = model_inputs(batch)
        pred = np.asarray(_predict(graphdef, attend, state, ex))
        mask = np.asarray(ex.mask)
        ok = (pred == np.asarray(ex.targets)) | (mask == 0)
        if task == "passkey":
            right += int(ok.all(axis=1).sum())
            total += n
        else:
            m = mask == 1
            right += int((ok & m).sum())
            total += int(m.sum())
    return right / max(total, 1)


def train(model_cfg: ModelConfig, cfg: TrainConfig, *, out: str | None, eval_every: int = 200,
          eval_samples: int = 64, resume: bool = True, log=print, mesh=None,
          block_sizes: ringattn.BlockSizes | None = None):  # fmt: skip
    """Trains with blockwise attention on one device, or ring attention over ``mesh``.

    With ``mesh`` (axes ``("data", "seq")``, of either axis type) every step runs under
    ``jax.set_mesh(mesh)`` with :func:`attention.sharded` (ring, zigzag layout): the batch is
    permuted into the layout once per step and split over both axes; the periodic evaluation
    runs on one device with blockwise attention (the same math). Returns the model and its
    history.

    Every ``eval_every`` steps (and at the end) both tasks are evaluated at the current
    context and, with ``out``, a checkpoint is written. With ``resume`` and a checkpoint of the
    same configuration in ``out``, training continues from its step: the data of step ``i`` is
    drawn from ``seed`` and ``i`` alone, so a resumed run sees the batches an uninterrupted one
    would.
    """
    kw = dict(out=out, eval_every=eval_every, eval_samples=eval_samples, resume=resume, log=log, block_sizes=block_sizes)  # fmt: skip
    if mesh is None:
        return _train(model_cfg, cfg, mesh=None, **kw)
    with jax.set_mesh(mesh):
        return _train(model_cfg, cfg, mesh=mesh, **kw)


def _train(model_cfg, cfg, *, out, eval_every, eval_samples, resume, log, mesh, block_sizes):
    from tqdm.auto import tqdm

    graphdef, rest, state = _abstract_state(model_cfg, cfg)
    history = []
    if out and resume and os.path.exists(os.path.join(out, "config.json")):
        graphdef, rest, state, meta = restore_state(out)
        if _configs(meta) != (model_cfg, cfg):
            raise ValueError(f"train: out: {out} holds a checkpoint of another configuration")
        history = meta["history"]
        log(f"resuming at step {int(state['step'])}")
    params, opt_state, done = state["params"], state["opt_state"], int(state["step"])
    log(f"parameters: {sum(x.size for x in jax.tree.leaves(params)):,}")
    attend = attention.blockwise(block_sizes)
    step_attend, to_step = attend, lambda ex: ex
    if mesh is not None:
        if tuple(mesh.axis_names) != ("data", "seq"):
            raise ValueError(f"train: mesh: expected axes ('data', 'seq'), got {mesh.axis_names}")
        if cfg.batch_size % mesh.shape["data"]:
            raise ValueError(
                f"train: mesh: batch_size {cfg.batch_size} is not divisible by the data axis "
                f"({mesh.shape['data']})"
            )
        step_attend = attention.sharded(mesh, block_sizes=block_sizes)
        shards = mesh.shape["seq"]
        spec = jax.sharding.NamedSharding(mesh, jax.P("data", "seq"))

        def to_step(ex):
            ex = to_layout_example(ex, layout="zigzag", num_shards=shards)
            return Example(*(jax.device_put(x, spec) for x in ex))

    step_fn = make_train_step(step_attend, make_optimizer(cfg))
    t0, step, first = time.time(), 0, 0
    for steps, context in cfg.stages:
        first, step = step, step + steps
        if step <= done:
            continue
        bar = tqdm(range(max(first, done), step), desc=f"context {context}", mininterval=5.0)
        for i in bar:
            batch = mixed_batch(cfg.tasks, context, cfg.batch_size, np.random.default_rng([cfg.seed, i]))  # fmt: skip
            t = time.time()
            params, opt_state, loss, acc, _ = step_fn(
                graphdef, params, rest, opt_state, to_step(model_inputs(batch))
            )
            loss = float(loss)
            tok_s = cfg.batch_size * context / (time.time() - t)
            bar.set_postfix(loss=f"{loss:.3f}", acc=f"{float(acc):.2f}", tok_s=f"{tok_s:.0f}")
            if (i + 1) % eval_every == 0 or i + 1 == cfg.total_steps:
                model = nnx.merge(graphdef, params, rest)
                scores = {
                    task: evaluate(model, task, context, eval_samples, 10_000 + i, attend)
                    for task in cfg.tasks
                }
                row = {"step": i + 1, "context": context, "loss": round(loss, 5), "minutes": round((time.time() - t0) / 60, 2), **scores}  # fmt: skip
                history.append(row)
                log(json.dumps(row))
                if out:
                    state = {"params": params, "opt_state": opt_state, "step": i + 1}
                    save_checkpoint(out, state, model_cfg, cfg, history)
    return nnx.merge(graphdef, params, rest), history


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--out", default="examples/longctx_lm/checkpoint")
    p.add_argument("--stages", default=None, help="steps:context,... (default: TrainConfig's)")
    p.add_argument("--batch-size", type=int, default=16)
    p.add_argument("--peak-lr", type=float, default=6e-3)
    p.add_argument("--warmup", type=int, default=50)
    p.add_argument("--width", type=int, default=128)
    p.add_argument("--layers", type=int, default=2)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--eval-every", type=int, default=100)
    p.add_argument("--eval-samples", type=int, default=32)
    p.add_argument("--no-resume", action="store_true", help="start afresh even if --out has one")
    p.add_argument(
        "--mesh", default=None, metavar="DxS",
        help="ring attention over a (data, seq) mesh of D x S devices, e.g. 2x4 (on CPU, D*S "
        "devices are emulated)",
    )  # fmt: skip
    args = p.parse_args(argv)
    mesh = None
    if args.mesh:
        d, s = (int(x) for x in args.mesh.lower().split("x"))
        if jax.config.jax_platforms in (None, "", "cpu"):
            try:
                jax.config.update("jax_num_cpu_devices", d * s)  # before any JAX array
            except RuntimeError:  # the backend already exists (e.g. under pytest): keep it
                pass
        mesh = jax.make_mesh(
            (d, s), ("data", "seq"), axis_types=(jax.sharding.AxisType.Explicit,) * 2
        )
    stages = TrainConfig().stages
    if args.stages:
        stages = tuple(tuple(int(x) for x in s.split(":")) for s in args.stages.split(","))
    model_cfg = ModelConfig(width=args.width, num_layers=args.layers, mlp_width=3 * args.width)
    cfg = TrainConfig(
        stages=stages, batch_size=args.batch_size, peak_lr=args.peak_lr,
        warmup_steps=args.warmup, end_lr=args.peak_lr / 10, seed=args.seed,
    )  # fmt: skip
    train(
        model_cfg, cfg, out=args.out, eval_every=args.eval_every,
        eval_samples=args.eval_samples, resume=not args.no_resume, mesh=mesh,
    )  # fmt: skip


if __name__ == "__main__":
    main()
