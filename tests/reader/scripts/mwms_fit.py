"""One worker of a 2-process ``MultiWorkerMirroredStrategy`` on 127.0.0.1: ``shardkit.tf.make_dataset(shard=
index, num_shards=2)`` distributed by the strategy (``experimental_distribute_dataset``, as a custom
training loop and TensorFlow's own ``fit`` do), a training step on every batch (``strategy.run``, an
allreduce of the gradients), and the ids that worker's replicas got.

(Keras 3's ``model.fit`` itself fails under ``MultiWorkerMirroredStrategy`` on any dataset here, a
plain ``from_tensor_slices`` one included: "Attempt to convert a value (PerReplica...)".)

Usage: mwms_fit.py INDEX PORT0 PORT1 DATASET OUT.json
"""

import json
import os
import sys

index, port0, port1, url, out = int(sys.argv[1]), sys.argv[2], sys.argv[3], sys.argv[4], sys.argv[5]
os.environ["TF_CONFIG"] = json.dumps({"cluster": {"worker": [f"127.0.0.1:{port0}", f"127.0.0.1:{port1}"]},
                                      "task": {"type": "worker", "index": index}})
import tensorflow as tf  # noqa: E402

import shardkit.tf  # noqa: E402

strategy = tf.distribute.MultiWorkerMirroredStrategy()
with strategy.scope():
    weight = tf.Variable(0.0)
    optimizer = tf.keras.optimizers.SGD(0.01)


@tf.function
def step(batch: dict) -> tf.Tensor:
    def replica(batch: dict) -> tf.Tensor:
        with tf.GradientTape() as tape:
            loss = tf.reduce_mean(tf.square(weight * batch["x"] - tf.cast(batch["label"], tf.float32)))
        optimizer.apply_gradients([(tape.gradient(loss, weight), weight)])
        return batch["id"]

    return strategy.run(replica, args=(batch,))


dist = strategy.experimental_distribute_dataset(
    shardkit.tf.make_dataset(url, shard=index, num_shards=2, batch_size=16, seed=0))
ids = [int(i) for batch in dist for part in strategy.experimental_local_results(step(batch))
       for i in part.numpy()]
with open(out, "w") as f:
    json.dump({"ids": ids, "weight": float(weight.numpy())}, f)
