"""Shared fixtures; the local Spark session starts only when a `spark`-marked test asks for it."""

from __future__ import annotations

import contextlib
import faulthandler
import importlib.util
import os
import shutil
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from hypothesis import HealthCheck, settings

import shardkit

EXAMPLES = Path(__file__).resolve().parents[1] / "examples"

# Executors are Python processes started by the JVM: without these they run the system Python,
# which has neither shardkit nor this venv's pyarrow. SPARK_LOCAL_IP keeps Spark on loopback.
_SPARK_ENV = {
    "PYSPARK_PYTHON": sys.executable,
    "PYSPARK_DRIVER_PYTHON": sys.executable,
    "SPARK_LOCAL_IP": "127.0.0.1",
}

# No clock in the properties: an example is not failed for taking longer than 200 ms (Hypothesis's default
# deadline), nor a test for drawing its data slowly, on a machine shared with other tests.
settings.register_profile("shardkit", deadline=None, suppress_health_check=[HealthCheck.too_slow])
settings.load_profile("shardkit")

#: seconds after a fork when the child (a DataLoader worker, a multiprocessing child) prints its threads'
#: stacks to the test's captured stderr: one that hangs shows where, before pytest-timeout (300 s, which
#: shows only this process's) fails the test; one that lives longer prints them once and goes on
CHILD_STACKS_AFTER = 200


def _child_stacks_later() -> None:
    with contextlib.suppress(OSError, ValueError):  # no stderr to print to
        faulthandler.dump_traceback_later(CHILD_STACKS_AFTER, exit=False, file=2)


os.register_at_fork(after_in_child=_child_stacks_later)


def pytest_itemcollected(item: pytest.Item) -> None:
    """The JAX tests are one xdist group: one process runs them, after the others it was given (see
    `pytest_collection_modifyitems`)."""
    if item.path.name == "test_jax.py":
        item.add_marker(pytest.mark.xdist_group("jax"))


@pytest.hookimpl(trylast=True)
def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    """The JAX tests run last, whatever was asked for. Once jax has started its backend (threads), a
    ``fork`` in this process (DataLoader workers, multiprocessing, a ``preexec_fn``) may deadlock the
    child, and jax says so with a warning at every fork, which the suite turns into an error: run before
    the torch tests, they failed them all (a DataLoader worker hung and was killed)."""
    items.sort(key=lambda item: item.path.name == "test_jax.py")  # stable: the rest keep their order
    # the `full` tests (every kill point of a checkpoint interval; the multi-host engines' rarer network
    # failures, a minute or two each) run only when asked for, SHARDKIT_FULL=1: left out of the run, not
    # skipped (a skip in this suite means hardware it lacks, a GPU)
    if os.environ.get("SHARDKIT_FULL") != "1":
        left_out = [item for item in items if item.get_closest_marker("full")]
        if left_out:
            config.hook.pytest_deselected(items=left_out)
            items[:] = [item for item in items if not item.get_closest_marker("full")]

@pytest.fixture(scope="session")
def _spark_session() -> Iterator[Any]:
    pyspark_sql = pytest.importorskip("pyspark.sql")
    if shutil.which("java") is None and not os.environ.get("JAVA_HOME"):
        pytest.skip("Spark needs Java 17: no `java` on PATH and no JAVA_HOME")
    saved = {key: os.environ.get(key) for key in _SPARK_ENV}
    os.environ.update(_SPARK_ENV)
    session = (
        pyspark_sql.SparkSession.builder.master("local[2]")
        .appName("shardkit-tests")
        .config("spark.driver.host", "127.0.0.1")
        .config("spark.driver.bindAddress", "127.0.0.1")
        .config("spark.ui.enabled", "false")
        .config("spark.ui.showConsoleProgress", "false")
        .config("spark.sql.shuffle.partitions", "2")
        .config("spark.default.parallelism", "2")
        .config("spark.sql.session.timeZone", "UTC")
        # JIT at C1 only: the session's work is small, and the C2 compiler's threads would take the
        # CPUs of a 2-core machine from the tests (the JVM starts in about half the time)
        .config("spark.driver.extraJavaOptions", "-XX:TieredStopAtLevel=1")
        .getOrCreate()
    )
    session.sparkContext.setLogLevel("ERROR")
    try:
        yield session
    finally:
        session.stop()
        for key, value in saved.items():
            if value is None:
                os.environ.pop(key, None)
            else:
                os.environ[key] = value


@pytest.fixture
def spark(request: pytest.FixtureRequest) -> Any:
    """The shared local[2] SparkSession (started on first use, stopped at the end of the run)."""
    if request.node.get_closest_marker("spark") is None:
        pytest.fail(
            f"{request.node.nodeid} uses the `spark` fixture but is not marked @pytest.mark.spark; "
            "mark it, so that `-m 'not spark'` deselects every test that starts Spark"
        )
    return request.getfixturevalue("_spark_session")


@pytest.fixture(scope="session")
def digits(tmp_path_factory: pytest.TempPathFactory) -> str:
    """The README's digits dataset, written by ``examples/make_digits.py``'s frame and schema."""
    spec = importlib.util.spec_from_file_location("make_digits", EXAMPLES / "make_digits.py")
    assert spec is not None
    assert spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    url = str(tmp_path_factory.mktemp("data") / "digits")
    shardkit.write_dataset(module.digits_frame(), url, schema=module.SCHEMA, row_group_size=128)
    return url
