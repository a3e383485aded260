"""Train a small Keras MLP on scikit-learn's digits with TensorFlow allreduce; run by `digits_tf.yaml`.

    shardkit train examples/digits_tf.yaml

Each worker reads its own shard (`ctx.reader()`) and hands its local batch to ``strategy.run`` (one
replica per process); MultiWorkerMirroredStrategy sums the gradients across the workers. The loop
iterates the shardkit reader itself rather than a ``tf.data`` pipeline, so the reader position saved
with a checkpoint is exactly the batches trained on (tf.data would read ahead). Every worker takes
part in a checkpoint; the chief (worker 0) writes it. Worker 0 then evaluates on the test split.
"""

from __future__ import annotations

import json
import os
import time
from pathlib import Path

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")

import keras
import tensorflow as tf

import shardkit.trainer
from shardkit.trainer.strategies import tf as shardkit_tf


def make_model(hidden: int) -> keras.Model:
    return keras.Sequential([keras.Input((8, 8)), keras.layers.Flatten(),
                             keras.layers.Dense(hidden, activation="relu"), keras.layers.Dense(10)])


def evaluate(ctx: shardkit.trainer.TrainContext, model: keras.Model) -> float:
    """Accuracy on the test split (the whole of it, read by this process alone)."""
    correct = total = 0
    for batch in ctx.reader(filter=[("split", "=", "test")], shard=0, num_shards=1, shuffle=False,
                            num_epochs=1, batch_size=512):
        predicted = tf.argmax(model(batch["pixels"]), axis=1)
        correct += int(tf.reduce_sum(tf.cast(predicted == batch["label"], tf.int32)))
        total += len(batch["label"])
    return correct / total


def main() -> None:
    ctx = shardkit.trainer.init(config=os.environ.get("SHARDKIT_CONFIG", Path(__file__).with_name(
        "digits_tf.yaml")))
    strategy = shardkit_tf.strategy(ctx)  # before any other TensorFlow work
    params = ctx.params
    keras.utils.set_random_seed(params.get("seed", 0))  # the same initial weights on every worker
    with strategy.scope():
        model = make_model(params.get("hidden", 128))
        optimizer = keras.optimizers.Adam(params.get("lr", 0.003))
        optimizer.build(model.trainable_variables)  # slots exist before a restore
    reader = ctx.reader()
    start = ctx.checkpoint.restore(tf_checkpoint=tf.train.Checkpoint(model=model, optimizer=optimizer),
                                   reader=reader)
    print(f"worker {ctx.role_index} attempt {ctx.attempt}: "
          + (f"resuming at step {start}" if start else "starting"), flush=True)

    @tf.function(input_signature=[tf.TensorSpec([None, 8, 8], tf.float32), tf.TensorSpec([None], tf.int64)])
    def train_step(x: tf.Tensor, y: tf.Tensor) -> tf.Tensor:
        def replica_step(x: tf.Tensor, y: tf.Tensor) -> tf.Tensor:
            with tf.GradientTape() as tape:
                per_example = keras.losses.sparse_categorical_crossentropy(y, model(x, training=True),
                                                                           from_logits=True)
                loss = tf.nn.compute_average_loss(per_example)  # over the global batch
            grads = tape.gradient(loss, model.trainable_variables)
            optimizer.apply_gradients(zip(grads, model.trainable_variables, strict=True))
            return loss

        return strategy.reduce("SUM", strategy.run(replica_step, args=(x, y)), axis=None)

    began, samples = time.perf_counter(), 0
    with ctx:
        for batch in reader:
            loss = train_step(batch["pixels"], batch["label"])
            samples += len(batch["label"])
            ctx.step({"loss": loss}, samples=len(batch["label"]))
        if ctx.is_chief:
            # Every worker trained as many samples: each step is collective, and every shard holds as
            # many samples (the reader's default remainder="drop"); the steps end together.
            seconds = time.perf_counter() - began
            accuracy = evaluate(ctx, model)
            ctx.metrics = {"loss": float(loss), "test_accuracy": accuracy}
            print("TRAIN_STATS " + json.dumps({"steps": ctx.step_count, "test_accuracy": accuracy,
                                               "samples_per_s": samples * ctx.num_data_shards / seconds}),
                  flush=True)
            print(f"test accuracy: {accuracy:.4f} ({ctx.step_count} steps)", flush=True)


if __name__ == "__main__":
    main()
