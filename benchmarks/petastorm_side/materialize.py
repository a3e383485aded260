"""Runs in the Petastorm venv: write the benchmark rows with Petastorm's ``materialize_dataset``.

Usage: python benchmarks/petastorm_side/materialize.py RAW_PARQUET OUT_DIR ROWS [--image png|npy]

The rows come from the raw Parquet copy (read with this venv's pyarrow 14) as a list of row dicts, as
a Petastorm user holds them; the clock covers ``parallelize`` -> ``dict_to_spark_row`` (encoding) ->
Spark's Parquet write -> Petastorm's metadata. Prints one JSON line.
"""

import argparse
import gc
import json
import os
import sys
import time
from pathlib import Path

import _proc
import numpy as np
import pyarrow.parquet as pq
from petastorm.codecs import CompressedImageCodec, NdarrayCodec, ScalarCodec
from petastorm.etl.dataset_metadata import materialize_dataset
from petastorm.unischema import Unischema, UnischemaField, dict_to_spark_row
from pyspark.sql import SparkSession
from pyspark.sql.types import IntegerType, LongType, StringType


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("raw")
    parser.add_argument("out")
    parser.add_argument("rows", type=int)
    parser.add_argument("--image", choices=["png", "npy"], default="png")
    args = parser.parse_args()

    os.environ["PYSPARK_PYTHON"] = sys.executable
    image_codec = CompressedImageCodec("png") if args.image == "png" else NdarrayCodec()
    schema = Unischema("BenchSchema", [
        UnischemaField("id", np.int64, (), ScalarCodec(LongType()), False),
        UnischemaField("label", np.int32, (), ScalarCodec(IntegerType()), False),
        UnischemaField("features", np.float32, (128,), NdarrayCodec(), False),
        UnischemaField("image", np.uint8, (32, 32, 3), image_codec, False),
        UnischemaField("text", np.str_, (), ScalarCodec(StringType()), False),
    ])
    spark = (SparkSession.builder.master("local[2]").appName("petastorm-bench")
             .config("spark.ui.enabled", "false").config("spark.driver.host", "127.0.0.1")
             .config("spark.driver.bindAddress", "127.0.0.1").config("spark.driver.memory", "4g")
             .getOrCreate())
    spark.range(1).collect()  # JVM warm-up outside the clock

    table = pq.read_table(args.raw).slice(0, args.rows)
    features = table.column("features").combine_chunks().values.to_numpy().reshape(-1, 128)
    image = table.column("image").combine_chunks().values.to_numpy().reshape(-1, 32, 32, 3)
    ids, labels = table.column("id").to_numpy(), table.column("label").to_numpy()
    text = table.column("text").to_pylist()
    rows = [{"id": ids[i], "label": labels[i], "features": features[i], "image": image[i], "text": text[i]}
            for i in range(len(ids))]
    del table
    gc.collect()
    _proc.reset_peak_rss()
    rss_input = _proc.current_rss()
    cpu0 = _proc.tree_cpu_seconds()

    url = Path(args.out).resolve().as_uri()
    start = time.perf_counter()
    with materialize_dataset(spark, url, schema, row_group_size_mb=32):
        rdd = spark.sparkContext.parallelize(rows, max(2, len(rows) // 20000))
        rdd = rdd.map(lambda r: dict_to_spark_row(schema, r))
        spark.createDataFrame(rdd, schema.as_spark_schema()).write.mode("overwrite").parquet(url)
    seconds = time.perf_counter() - start
    cpu = _proc.tree_cpu_seconds() - cpu0
    write_peak = _proc.phase_peak_rss()
    jvm = _proc.descendants_peak_rss()
    spark.stop()
    print(json.dumps({"rows": len(rows), "seconds": seconds, "cpu_seconds": cpu, "rss_input": rss_input,
                      "write_peak_rss": write_peak, "peak_rss": _proc.peak_rss(),
                      "descendants_peak_rss": jvm}))


if __name__ == "__main__":
    main()
