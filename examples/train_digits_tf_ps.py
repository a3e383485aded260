"""Train a small Keras MLP on scikit-learn's digits with TensorFlow's ParameterServerStrategy; run by
`digits_tf_ps.yaml`.

    shardkit train examples/digits_tf_ps.yaml

Only the chief runs this code past `shardkit.trainer.init()` (ps and worker processes serve there).
The chief builds the model under the strategy (its variables live on the ps), reads the whole
training split with a shardkit reader, and sends each batch to a free worker as the arguments of one
training step (`shardkit.trainer.strategies.tf.Scheduler`): a shardkit reader is Python, which cannot run
inside a
remote worker's tf.data graph. Checkpoints are taken by the chief after every scheduled step has
finished, so the saved variables and reader position agree.
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
    """Accuracy on the test split, computed on the chief (the variables are read from the ps)."""
    correct = total = 0
    for batch in ctx.reader(filter=[("split", "=", "test")], shard=0, num_shards=1, shuffle=False,
                            num_epochs=1, batch_size=512):
        predicted = tf.argmax(model(batch["pixels"]), axis=1)
        correct += int(tf.reduce_sum(tf.cast(predicted == batch["label"], tf.int32)))
        total += len(batch["label"])
    return correct / total


def main() -> None:
    ctx = shardkit.trainer.init(config=os.environ.get("SHARDKIT_CONFIG", Path(__file__).with_name(
        "digits_tf_ps.yaml")))
    strategy = shardkit_tf.strategy(ctx)  # the chief's ParameterServerStrategy
    coordinator = shardkit_tf.coordinator(strategy)
    params = ctx.params
    keras.utils.set_random_seed(params.get("seed", 0))
    with strategy.scope():  # variables are created on the ps
        model = make_model(params.get("hidden", 128))
        optimizer = keras.optimizers.Adam(params.get("lr", 0.003))
        optimizer.build(model.trainable_variables)
    reader = ctx.reader()
    start = ctx.checkpoint.restore(tf_checkpoint=tf.train.Checkpoint(model=model, optimizer=optimizer),
                                   reader=reader)
    print(f"chief attempt {ctx.attempt}: " + (f"resuming at step {start}" if start else "starting"),
          flush=True)

    @tf.function(input_signature=[tf.TensorSpec([None, 8, 8], tf.float32), tf.TensorSpec([None], tf.int64)])
    def train_step(x: tf.Tensor, y: tf.Tensor) -> tf.Tensor:
        def replica_step(x: tf.Tensor, y: tf.Tensor) -> tf.Tensor:
            with tf.GradientTape() as tape:
                loss = tf.reduce_mean(keras.losses.sparse_categorical_crossentropy(
                    y, model(x, training=True), from_logits=True))
            grads = tape.gradient(loss, model.trainable_variables)
            optimizer.apply_gradients(zip(grads, model.trainable_variables, strict=True))
            return loss

        return strategy.reduce("SUM", strategy.run(replica_step, args=(x, y)), axis=None)

    run = shardkit_tf.Scheduler(ctx, coordinator, train_step)
    began, samples = time.perf_counter(), 0
    with ctx:
        for batch in reader:
            run(batch["pixels"], batch["label"], samples=len(batch["label"]))
            samples += len(batch["label"])
        metrics = run.join()  # every step done before the final checkpoint and the evaluation
        seconds = time.perf_counter() - began
        accuracy = evaluate(ctx, model)
        ctx.metrics = {**metrics, "test_accuracy": accuracy}
        print("TRAIN_STATS " + json.dumps({"steps": ctx.step_count, "test_accuracy": accuracy,
                                           "samples_per_s": samples / seconds}), flush=True)
        print(f"test accuracy: {accuracy:.4f} ({ctx.step_count} steps)", flush=True)


if __name__ == "__main__":
    main()
