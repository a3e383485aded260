"""`shardkit render`: Kubeflow PyTorchJob/TFJob and Skein specs, validated against the real schemas."""

from __future__ import annotations

import copy
import json
import os
import re
import signal
import subprocess
import sys
import threading
from pathlib import Path
from typing import Any

import jsonschema
import pytest
import referencing
import skein
import yaml
from hypothesis import given, settings
from hypothesis import strategies as st
from referencing.jsonschema import DRAFT202012

from shardkit.cluster.render import render
from shardkit.cluster.render.entry import place, role_env, yarn_addresses, yarn_master, yarn_secrets
from shardkit.errors import ConfigError
from shardkit.job import protocol as p
from shardkit.job.config import JobConfig, load_config
from shardkit.job.layout import layout

ROOT = Path(__file__).resolve().parents[2]
SCHEMAS = ROOT / "tests" / "fixtures" / "schemas"
EXAMPLES = sorted((ROOT / "examples").glob("*.yaml"))
IMAGE = "registry.example.com/shardkit/digits:1"
SECRET = "s3cr3t-Do-Not-Leak-7f3a9c"  # a distinctive value: must never appear in a rendered file
K8S_DEFS = "https://kubernetes.io/api/_definitions.json"
# The CRD's own quantity schema (spec.runPolicy.schedulingPolicy.minResources in the vendored CRDs).
QUANTITY = re.compile(r"^(\+|-)?(([0-9]+(\.[0-9]*)?)|(\.[0-9]+))(([KMGTPE]i)|[numkMGTPE]|([eE](\+|-)?"
                      r"(([0-9]+(\.[0-9]*)?)|(\.[0-9]+))))?$")
DNS_1035 = re.compile(r"^[a-z]([-a-z0-9]*[a-z0-9])?$")


# -- schemas ---------------------------------------------------------------------------------------


def _strict(node: Any) -> Any:
    """What ``kubeconform -strict`` does: an object schema listing properties forbids the others."""
    if isinstance(node, dict):
        node = {k: _strict(v) for k, v in node.items()}
        if ("properties" in node and "additionalProperties" not in node
                and not node.get("x-kubernetes-preserve-unknown-fields")):
            node["additionalProperties"] = False
        return node
    if isinstance(node, list):
        return [_strict(v) for v in node]
    return node


def _format_checker() -> jsonschema.FormatChecker:
    checker = jsonschema.FormatChecker()
    checker.checks("int32")(lambda v: not isinstance(v, int) or -(2**31) <= v < 2**31)
    checker.checks("int64")(lambda v: not isinstance(v, int) or -(2**63) <= v < 2**63)
    return checker


class Schemas:
    def __init__(self) -> None:
        defs = json.loads((SCHEMAS / "k8s-v1.37.0-definitions.json").read_text())
        quantity = {"anyOf": [{"type": "integer"}, {"type": "string"}], "pattern": QUANTITY.pattern}
        defs["$defs"]["io.k8s.apimachinery.pkg.api.resource.Quantity"] = quantity
        self.registry: referencing.Registry[Any] = referencing.Registry().with_resource(
            K8S_DEFS, referencing.Resource.from_contents(defs, default_specification=DRAFT202012))
        self.crds = {}
        crd_files = {"PyTorchJob": "kubeflow.org_pytorchjobs.yaml", "TFJob": "kubeflow.org_tfjobs.yaml"}
        for kind, file in crd_files.items():
            crd = yaml.safe_load((SCHEMAS / file).read_text())
            version = crd["spec"]["versions"][0]
            assert crd["spec"]["group"] == "kubeflow.org"
            assert (version["name"], crd["spec"]["names"]["kind"]) == ("v1", kind)
            self.crds[kind] = self.validator(_strict(version["schema"]["openAPIV3Schema"]))

    def validator(self, schema: dict[str, Any]) -> jsonschema.Draft202012Validator:
        return jsonschema.Draft202012Validator(schema, registry=self.registry,
                                               format_checker=_format_checker())

    def k8s(self, definition: str) -> jsonschema.Draft202012Validator:
        return self.validator({"$ref": f"{K8S_DEFS}#/$defs/{definition}"})


@pytest.fixture(scope="module")
def schemas() -> Schemas:
    return Schemas()


def webhook_problems(job: dict[str, Any]) -> list[str]:
    """The training operator's admission checks (kubeflow/training-operator pkg/webhooks/...), and the
    value sets its API documents for restartPolicy and cleanPodPolicy."""
    problems = []
    if not DNS_1035.match(job["metadata"]["name"]) or len(job["metadata"]["name"]) > 63:
        problems.append("metadata.name is not a DNS-1035 label")
    kind = job["kind"]
    specs = job["spec"]["pytorchReplicaSpecs" if kind == "PyTorchJob" else "tfReplicaSpecs"]
    container_name = "pytorch" if kind == "PyTorchJob" else "tensorflow"
    allowed = ({"Master", "Worker"} if kind == "PyTorchJob"
               else {"Chief", "Master", "Worker", "PS", "Evaluator"})
    for rtype, spec in specs.items():
        if rtype not in allowed:
            problems.append(f"replica type {rtype}")
        containers = spec["template"]["spec"].get("containers") or []
        if not any(c["name"] == container_name and c.get("image") for c in containers):
            problems.append(f"{rtype}: no container {container_name} with an image")
        if spec.get("restartPolicy") not in (None, "Always", "OnFailure", "Never", "ExitCode"):
            problems.append(f"{rtype}: restartPolicy {spec['restartPolicy']}")
        if kind == "PyTorchJob" and rtype == "Master" and spec.get("replicas") != 1:
            problems.append("Master replicas must be 1")
        if spec.get("replicas", 1) < 1:
            problems.append(f"{rtype}: replicas < 1")
    if sum(r in ("Chief", "Master") for r in specs) > 1:
        problems.append("more than one Chief or Master")
    if job["spec"].get("runPolicy", {}).get("cleanPodPolicy") not in (None, "All", "Running", "None"):
        problems.append("cleanPodPolicy")
    return problems


def check_kubernetes(schemas: Schemas, files: dict[str, str]) -> list[dict[str, Any]]:
    """Validate every document of the rendered files; returns them."""
    docs = [doc for text in files.values() for doc in yaml.safe_load_all(text)]
    assert sorted(d["kind"] for d in docs)[0] == "ConfigMap"
    assert len(docs) == 2
    for doc in docs:
        schemas.k8s("io.k8s.apimachinery.pkg.apis.meta.v1.ObjectMeta").validate(doc["metadata"])
        if doc["kind"] == "ConfigMap":
            schemas.k8s("io.k8s.api.core.v1.ConfigMap").validate(doc)
        else:
            assert doc["apiVersion"] == "kubeflow.org/v1"
            schemas.crds[doc["kind"]].validate(doc)
            assert webhook_problems(doc) == []
    return docs


def check_skein(files: dict[str, str]) -> skein.ApplicationSpec:
    (name,) = [f for f in files if f.endswith("-skein.yaml")]
    spec = skein.ApplicationSpec.from_yaml(files[name])
    again = skein.ApplicationSpec.from_yaml(spec.to_yaml())
    assert again == spec
    assert skein.ApplicationSpec.from_protobuf(spec.to_protobuf()) == spec
    return spec


# -- configs ---------------------------------------------------------------------------------------

COMBOS = [("torch", "allreduce"), ("torch", "parameter_server"), ("tensorflow", "allreduce"),
          ("tensorflow", "parameter_server")]


def job_yaml(folder: Path, framework: str, strategy: str, **extra: Any) -> Path:
    (folder / "train.py").write_text("import shardkit.trainer\nshardkit.trainer.init()\n")
    (folder / "token.txt").write_text(SECRET + "\n")
    roles: dict[str, Any] = {"worker": {"count": 3, "resources": {"cpus": 0.5, "gpus": 1, "memory": "1.5G"}}}
    if strategy == "parameter_server":
        roles["ps"] = {"count": 2, "resources": {"cpus": 2, "memory": "4G"}}
    if framework == "tensorflow":
        roles["evaluator"] = {"count": 1}
    doc = {"name": f"job-{framework}-{strategy.replace('_', '-')}", "entrypoint": "train.py",
           "framework": framework, "strategy": strategy, "roles": roles,
           "data": {"url": "s3://bucket/digits", "batch_size": 32},
           "checkpoint": {"dir": "s3://bucket/ckpt", "every_steps": 10},
           "fault_tolerance": {"max_restarts": 4},
           "env": {"OMP_NUM_THREADS": 1},
           "secrets": {"AWS_SECRET_ACCESS_KEY": {"env": "SHARDKIT_TEST_SECRET"},
                       "TOKEN": {"file": "token.txt"}},
           **extra}
    path = folder / f"{framework}-{strategy}.yaml"
    path.write_text(yaml.safe_dump(doc))
    return path


@pytest.fixture
def secret_env(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("SHARDKIT_TEST_SECRET", SECRET)


# -- rendering the examples and the four framework x strategy jobs ---------------------------------


@pytest.mark.parametrize("engine", ["kubernetes", "yarn"])
@pytest.mark.parametrize("example", EXAMPLES, ids=[e.stem for e in EXAMPLES])
def test_examples_render_valid(example: Path, engine: str, schemas: Schemas) -> None:
    overrides = [f"engine.image={IMAGE}"] if engine == "kubernetes" else ["engine.queue=ml"]
    config = load_config(example, overrides)
    files = render(config, engine=engine)
    if engine == "kubernetes":
        docs = check_kubernetes(schemas, files)
        job = next(d for d in docs if d["kind"] != "ConfigMap")
        assert job["kind"] == ("PyTorchJob" if config.framework == "torch" else "TFJob")
    else:
        spec = check_skein(files)
        assert spec.queue == "ml"
        assert set(spec.services) == set(config.roles)


@pytest.mark.parametrize(("framework", "strategy"), COMBOS)
def test_kubernetes_job(framework: str, strategy: str, tmp_path: Path, schemas: Schemas,
                        secret_env: None) -> None:
    config = load_config(job_yaml(tmp_path, framework, strategy),
                         [f"engine.image={IMAGE}", "engine.namespace=ml"])
    files = render(config, engine="kubernetes", out_dir=tmp_path / "out")
    docs = check_kubernetes(schemas, files)
    for name, text in files.items():
        assert SECRET not in text
        assert (tmp_path / "out" / name).read_text() == text
    job = next(d for d in docs if d["kind"] != "ConfigMap")
    assert job["metadata"]["namespace"] == "ml"
    assert job["spec"]["runPolicy"] == {"backoffLimit": 4, "cleanPodPolicy": "Running"}
    specs = job["spec"]["pytorchReplicaSpecs" if framework == "torch" else "tfReplicaSpecs"]
    counts = {rtype: spec["replicas"] for rtype, spec in specs.items()}
    if framework == "torch":  # Master = rank 0, Worker = the other ranks (WORLD_SIZE = their sum)
        assert counts == {"Master": 1, "Worker": 2 if strategy == "allreduce" else 4}
    else:
        expected = {"Worker": 3, "Evaluator": 1}
        if strategy == "parameter_server":
            expected |= {"PS": 2, "Chief": 1}
        assert counts == expected
    worker = specs["Worker"]["template"]["spec"]["containers"][0]
    assert worker["image"] == IMAGE
    assert worker["command"][-2:] == ["-m", "shardkit.cluster.render.entry"]
    if (framework, strategy) == ("torch", "parameter_server"):  # ps 1 shares the Worker pods: the larger
        assert worker["resources"]["requests"] == {"cpu": 2, "memory": "4Gi"}
        assert specs["Master"]["template"]["spec"]["containers"][0]["resources"]["limits"] == {
            "cpu": 2, "memory": "4Gi"}
    else:
        assert worker["resources"] == {"requests": {"cpu": "500m", "memory": "1536Mi"},
                                       "limits": {"cpu": "500m", "memory": "1536Mi", "nvidia.com/gpu": 1}}
    env = {e["name"]: e for e in worker["env"]}
    assert env["SHARDKIT_JOB_CONFIG"]["value"] == "/etc/shardkit/job.json"
    assert env["OMP_NUM_THREADS"] == {"name": "OMP_NUM_THREADS", "value": "1"}
    for key in ("AWS_SECRET_ACCESS_KEY", "TOKEN"):
        ref = {"secretKeyRef": {"name": f"{config.name}-secrets", "key": key}}
        assert env[key] == {"name": key, "valueFrom": ref}
    configmap = next(d for d in docs if d["kind"] == "ConfigMap")
    job_json = json.loads(configmap["data"]["job.json"])
    assert job_json["secrets"] == ["AWS_SECRET_ACCESS_KEY", "TOKEN"]
    assert job_json["entrypoint"] == "/workspace/train.py"
    assert (job_json["data"]["url"], job_json["checkpoint"]["dir"]) == ("s3://bucket/digits", "s3://bucket/ckpt")


@pytest.mark.parametrize(("framework", "strategy"), COMBOS)
def test_skein_spec(framework: str, strategy: str, tmp_path: Path, secret_env: None) -> None:
    config = load_config(job_yaml(tmp_path, framework, strategy),
                         ["engine.queue=ml", "engine.environment=hdfs:///envs/train.tar.gz"])
    files = render(config, engine="yarn", out_dir=tmp_path / "out")
    for text in files.values():
        assert SECRET not in text
    spec = check_skein(files)
    from_file = skein.ApplicationSpec.from_file(str(tmp_path / "out" / f"{config.name}-skein.yaml"))
    assert Path(from_file.services["worker"].files["shardkit-job.json"].source.removeprefix("file://")).is_file()
    assert spec.queue == "ml"
    assert spec.name == config.name
    expected_roles = set(config.roles)
    assert set(spec.services) == expected_roles
    worker = spec.services["worker"]
    assert worker.instances == 3
    assert worker.max_restarts == 0
    assert (worker.resources.vcores, worker.resources.memory, worker.resources.gpus) == (1, 1536, 1)
    assert worker.env[p.ENV_JOB_CONFIG] == "shardkit-job.json"
    assert worker.env["SHARDKIT_YARN_SECRETS"] == "AWS_SECRET_ACCESS_KEY,TOKEN"
    assert "./environment/bin/python -u -m shardkit.cluster.render.entry" in worker.script
    assert "--yarn-master" in spec.master.script
    assert str(worker.files["environment"].type) == "ARCHIVE"


def test_container_config_reads_back(tmp_path: Path, secret_env: None) -> None:
    """The job.json a pod gets is a valid config there: the script and python at their container paths."""
    config = load_config(job_yaml(tmp_path, "torch", "allreduce"),
                         [f"engine.image={IMAGE}", f"engine.workdir={tmp_path}",
                          f"engine.python={sys.executable}"])
    files = render(config, engine="kubernetes")
    configmap = yaml.safe_load(files[f"{config.name}-config.yaml"])
    inside = JobConfig.from_redacted(json.loads(configmap["data"]["job.json"]))
    assert inside.entrypoint == str(tmp_path / "train.py")
    assert inside.engine.name == "kubernetes"
    assert inside.roles == config.roles
    assert inside.data == config.data


def test_validators_catch_mistakes(tmp_path: Path, schemas: Schemas, secret_env: None) -> None:
    """The checks can fail: a misspelled field, a bad quantity, a wrong type, Master replicas 2."""
    config = load_config(job_yaml(tmp_path, "torch", "allreduce"), [f"engine.image={IMAGE}"])
    job = yaml.safe_load(render(config, engine="kubernetes")[f"{config.name}-pytorchjob.yaml"])
    validator = schemas.crds["PyTorchJob"]
    assert validator.is_valid(job)
    container = ["spec", "pytorchReplicaSpecs", "Worker", "template", "spec", "containers", 0]
    for path, value in [(["spec", "pytorchReplicaSpecs", "Worker", "restartpolicy"], "OnFailure"),
                        ([*container, "resources", "limits", "memory"], "2 GB"),
                        ([*container, "env", 0, "valueFrom"], {"secretRef": {"name": "x"}}),
                        (["spec", "runPolicy", "backoffLimit"], "3"),
                        ([*container, "ports", 0, "containerPort"], 2**40),
                        ([*container, "imagePullPolicy"], ["Always"])]:
        bad = copy.deepcopy(job)
        node = bad
        for key in path[:-1]:
            node = node[key]
        node[path[-1]] = value
        assert not validator.is_valid(bad), path
    bad = copy.deepcopy(job)
    bad["spec"]["pytorchReplicaSpecs"]["Master"]["replicas"] = 2
    bad["spec"]["pytorchReplicaSpecs"]["Worker"]["template"]["spec"]["containers"][0]["name"] = "main"
    assert len(webhook_problems(bad)) == 2
    with pytest.raises(ValueError, match="memroy"):  # Skein refuses unknown keys itself
        skein.ApplicationSpec.from_yaml("name: x\nservices:\n  worker:\n    instances: 1\n    script: x\n"
                                        "    resources: {vcores: 1, memroy: 1 GiB}\n")


def test_restart_policy_and_quantities(tmp_path: Path, schemas: Schemas, secret_env: None) -> None:
    config = load_config(job_yaml(tmp_path, "tensorflow", "parameter_server"),
                         [f"engine.image={IMAGE}", "engine.restart_policy=ExitCode",
                          "roles.ps.resources={cpus: 1.25, memory: 1000000}"])
    docs = check_kubernetes(schemas, render(config, engine="kubernetes"))
    specs = next(d for d in docs if d["kind"] == "TFJob")["spec"]["tfReplicaSpecs"]
    assert {s["restartPolicy"] for s in specs.values()} == {"ExitCode"}
    ps = specs["PS"]["template"]["spec"]["containers"][0]
    assert ps["resources"]["requests"] == {"cpu": "1250m", "memory": "1000000"}
    assert "nvidia.com/gpu" not in ps["resources"]["limits"]
    assert "memory" not in specs["Evaluator"]["template"]["spec"]["containers"][0]["resources"]["limits"]


# -- bad inputs ------------------------------------------------------------------------------------


def test_missing_image(tmp_path: Path, secret_env: None) -> None:
    config = load_config(job_yaml(tmp_path, "torch", "allreduce"))
    with pytest.raises(ConfigError, match=r"engine\.image.*required option is missing.*--set engine\.image"):
        render(config, engine="kubernetes")


def test_unknown_and_bad_options(tmp_path: Path, secret_env: None) -> None:
    path = job_yaml(tmp_path, "torch", "allreduce")
    unknown = r"engine\.imagee = 'x'.*not an option of the kubernetes renderer.*did you mean 'image'"
    with pytest.raises(ConfigError, match=unknown):
        render(load_config(path, ["engine.imagee=x"]), engine="kubernetes")
    with pytest.raises(ConfigError, match=r"engine\.restart_policy = 'Always'"):
        render(load_config(path, [f"engine.image={IMAGE}", "engine.restart_policy=Always"]),
               engine="kubernetes")
    with pytest.raises(ConfigError, match=r"engine\.image = .*not an option of the yarn renderer.*queue"):
        render(load_config(path, [f"engine.image={IMAGE}"]), engine="yarn")


@pytest.mark.parametrize("engine", ["local", "ray", "nonsense"])
def test_engine_that_cannot_render(engine: str, tmp_path: Path, secret_env: None) -> None:
    config = load_config(job_yaml(tmp_path, "torch", "allreduce"))
    with pytest.raises(ConfigError, match=rf"engine '{engine}'.*nothing to render.*--engine kubernetes"):
        render(config, engine=engine)
    with pytest.raises(ConfigError, match=r"engine 'local' \(engine.name in the job config\)"):
        render(config)  # the config's engine: local


def test_names_and_paths_a_cluster_cannot_take(tmp_path: Path, secret_env: None) -> None:
    path = job_yaml(tmp_path, "torch", "allreduce")
    with pytest.raises(ConfigError, match=r"DNS-1035 label.*--set name=job-9lives"):
        render(load_config(path, ["name=9lives", f"engine.image={IMAGE}"]), engine="kubernetes")
    assert "my-job-1-skein.yaml" in render(load_config(path, ["name=My_Job.1"]), engine="yarn")
    outside = tmp_path / "elsewhere"
    outside.mkdir()
    text = path.read_text().replace("entrypoint: train.py", "entrypoint: ../train.py")
    (outside / "job.yaml").write_text(text)
    (outside / "token.txt").write_text(SECRET)
    with pytest.raises(ConfigError, match=r"outside the config file's folder"):
        render(load_config(outside / "job.yaml", [f"engine.image={IMAGE}"]), engine="kubernetes")
    with pytest.raises(ConfigError, match=r"cannot write the manifests"):
        render(load_config(path, [f"engine.image={IMAGE}"]), engine="kubernetes", out_dir=path)
    # all or none: a name taken by a folder left the manifests before it written
    names = list(render(load_config(path, [f"engine.image={IMAGE}"]), engine="kubernetes"))
    out = tmp_path / "out-taken"
    (out / names[-1]).mkdir(parents=True)
    with pytest.raises(ConfigError, match=r"is a folder\); none was written"):
        render(load_config(path, [f"engine.image={IMAGE}"]), engine="kubernetes", out_dir=out)
    assert sorted(p.name for p in out.iterdir()) == [names[-1]]


def _replica_names(job: dict[str, Any]) -> list[str]:
    """The pod and Service names the Kubeflow operator gives the replicas (GenGeneralName in
    kubeflow/training-operator pkg/core: ``<job>-<replica type lower-cased>-<index>``)."""
    specs = job["spec"]["pytorchReplicaSpecs" if job["kind"] == "PyTorchJob" else "tfReplicaSpecs"]
    return [f"{job['metadata']['name']}-{rtype.lower()}-{i}" for rtype, spec in specs.items()
            for i in range(spec["replicas"])]


def _suggested_name(error: ConfigError) -> str:
    match = re.search(r"--set name=([^\s)]+)", str(error))
    assert match is not None, str(error)
    return match.group(1)


@pytest.mark.parametrize(("framework", "strategy", "workers", "longest"),
                         [("torch", "allreduce", 3, "-master-0"), ("torch", "allreduce", 12, "-worker-10"),
                          ("tensorflow", "parameter_server", 3, "-evaluator-0")])
def test_a_name_too_long_for_the_replicas_names(framework: str, strategy: str, workers: int, longest: str,
                                                 tmp_path: Path, schemas: Schemas, secret_env: None) -> None:
    """A job name fits when its longest replica name is a DNS label (<= 63); the fix names one that fits."""
    path = job_yaml(tmp_path, framework, strategy)
    room = 63 - len(longest)
    kind = "pytorchjob" if framework == "torch" else "tfjob"
    options = [f"engine.image={IMAGE}", f"roles.worker.count={workers}"]
    for name in ("a" * 63, "a" * (room + 1)):
        with pytest.raises(ConfigError) as info:
            render(load_config(path, [f"name={name}", *options]), engine="kubernetes")
        message = str(info.value)
        for words in (f"'{name}{longest}', has {len(name) + len(longest)} characters", "more than the 63",
                      f"Fix: a job name of at most {room} characters", f"--set name={'a' * room}"):
            assert words in message, (words, message)
    fits = "a" * room
    files = render(load_config(path, [f"name={fits}", *options]), engine="kubernetes")
    job = yaml.safe_load(files[f"{fits}-{kind}.yaml"])
    check_kubernetes(schemas, files)
    assert max(len(n) for n in _replica_names(job)) == 63
    # YARN documents no such limit (Skein takes any application name): a 63-character name renders there
    assert f"{'a' * 63}-skein.yaml" in render(load_config(path, [f"name={'a' * 63}"]), engine="yarn")


@settings(max_examples=60, deadline=None)
@given(name=st.from_regex(r"[A-Za-z0-9][A-Za-z0-9._-]{0,62}", fullmatch=True),
       framework=st.sampled_from(["torch", "tensorflow"]), workers=st.integers(1, 120))
def test_every_replica_name_fits_or_the_fix_does(script_dir: Path, name: str, framework: str,
                                                  workers: int) -> None:
    """For any job name the config takes: either every replica's pod/Service name is a DNS-1035 label,
    or rendering fails with a fix (``--set name=...``) that the config takes and that renders."""
    base = {"name": name, "entrypoint": "train.py", "framework": framework,
            "roles": {"worker": {"count": workers}}, "engine": {"name": "kubernetes", "image": IMAGE}}
    path = script_dir / "names.yaml"
    path.write_text(yaml.safe_dump(base))
    try:
        files = render(load_config(path))
    except ConfigError as e:
        fixed = _suggested_name(e)
        files = render(load_config(path, [f"name={json.dumps(fixed)}"]))  # the config takes it, and it fits
    (job_file,) = [f for f in files if not f.endswith("-config.yaml")]
    for replica in _replica_names(yaml.safe_load(files[job_file])):
        assert DNS_1035.match(replica), replica
        assert len(replica) <= 63, replica


@pytest.mark.parametrize("name", ["job_", "9lives", "a.b_", "x--", "0", "9" * 63, "a" * 62 + "_"])
def test_the_suggested_name_is_valid(name: str, tmp_path: Path, secret_env: None) -> None:
    path = job_yaml(tmp_path, "torch", "allreduce")
    with pytest.raises(ConfigError, match="must start with a letter and end with a letter or digit") as info:
        render(load_config(path, [f"name={json.dumps(name)}", f"engine.image={IMAGE}"]), engine="kubernetes")
    fixed = _suggested_name(info.value)  # fits the replica names as well: rendering it succeeds
    assert DNS_1035.match(fixed), fixed
    assert f"{fixed}-pytorchjob.yaml" in render(load_config(path, [f"name={fixed}", f"engine.image={IMAGE}"]),
                                                engine="kubernetes")


def test_the_namespace_is_a_dns_label(tmp_path: Path, schemas: Schemas, secret_env: None) -> None:
    path = job_yaml(tmp_path, "torch", "allreduce")
    def config(namespace: str) -> JobConfig:
        return load_config(path, [f"engine.image={IMAGE}", f"engine.namespace={namespace}"])

    for good in ("ml", "team-1", "0abc", "n" * 63):
        docs = check_kubernetes(schemas, render(config(good), engine="kubernetes"))
        assert {d["metadata"]["namespace"] for d in docs} == {good}
    for bad, fix in (("My_NS", "my-ns"), ("-ml", "ml"), ("ml.prod", "ml-prod"), ("n" * 64, "n" * 63),
                     ("'_'", "job")):
        with pytest.raises(ConfigError) as info:
            render(config(bad), engine="kubernetes")
        message = str(info.value)
        assert "engine.namespace = " in message, message
        assert "not a Kubernetes namespace name" in message, message
        assert f"Fix: --set engine.namespace={fix}." in message, message
        render(config(fix), engine="kubernetes")


# -- inside the containers: render_entry -----------------------------------------------------------


@pytest.fixture(scope="module")
def script_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    folder = tmp_path_factory.mktemp("jobs")
    (folder / "train.py").write_text("")
    return folder


def _config(folder: Path, framework: str, strategy: str, workers: int, ps: int, chief: bool,
            evaluator: bool) -> JobConfig:
    roles: dict[str, Any] = {"worker": {"count": workers}}
    if strategy == "parameter_server":
        roles["ps"] = {"count": ps}
    if chief and framework == "tensorflow":
        roles["chief"] = {"count": 1}
    if evaluator:
        roles["evaluator"] = {"count": 1}
    return JobConfig.from_dict({"name": "job", "entrypoint": "train.py", "framework": framework,
                                "strategy": strategy, "roles": roles,
                                "engine": {"name": "kubernetes", "image": IMAGE}}, base_dir=folder)


@settings(max_examples=60, deadline=None)
@given(framework=st.sampled_from(["torch", "tensorflow"]),
       strategy=st.sampled_from(["allreduce", "parameter_server"]),
       workers=st.integers(1, 5), ps=st.integers(1, 3), chief=st.booleans(), evaluator=st.booleans())
def test_every_pod_finds_exactly_one_process(script_dir: Path, framework: str, strategy: str, workers: int,
                                             ps: int, chief: bool, evaluator: bool) -> None:
    """For all jobs: the pods of the rendered job, with the env the Kubeflow operator gives them
    (pkg/controller.v1/pytorch/envvar.go: RANK = index, +1 for Workers; TF_CONFIG task = the replica
    type in lower case and its index), map one-to-one onto the processes of `layout`."""
    if framework == "torch" and evaluator:
        evaluator = False
    config = _config(script_dir, framework, strategy, workers, ps, chief, evaluator)
    kind = "pytorchjob" if framework == "torch" else "tfjob"
    job = yaml.safe_load(render(config)[f"job-{kind}.yaml"])
    places = []
    specs = job["spec"]["pytorchReplicaSpecs" if framework == "torch" else "tfReplicaSpecs"]
    for rtype, spec in specs.items():
        for i in range(spec["replicas"]):
            if framework == "torch":
                env = {p.RANK: str(i + (1 if rtype == "Worker" else 0))}
            else:
                env = {p.TF_CONFIG: json.dumps({"cluster": {}, "task": {"type": rtype.lower(), "index": i}})}
            places.append(place(config, env))
    assert sorted(places) == sorted((s.role, s.index) for s in layout(config))
    for role, index in places:
        env = role_env(config, role, index)
        slot = next(s for s in layout(config) if (s.role, s.index) == (role, index))
        assert env.get(p.RANK) == (None if slot.rank is None else str(slot.rank))
        assert env.get(p.ENV_DATA_SHARD) == (None if slot.data_shard is None else str(slot.data_shard))


def test_place_errors(script_dir: Path) -> None:
    config = _config(script_dir, "torch", "allreduce", 2, 0, False, False)
    assert place(config, {"SKEIN_CONTAINER_ID": "worker_1"}) == ("worker", 1)
    with pytest.raises(ConfigError, match=r"worker\[2\] is not a process"):
        place(config, {"SKEIN_CONTAINER_ID": "worker_2"})  # a container YARN restarted
    with pytest.raises(ConfigError, match=r"RANK=5 is not a rank"):
        place(config, {p.RANK: "5"})
    with pytest.raises(ConfigError, match=r"cannot tell this container's place.*KeyError"):
        place(config, {})


class FakeKV:
    """Skein's key-value store for threads of one test: put, and a blocking wait (the thing under test
    is the exchange protocol; Skein itself needs a YARN cluster)."""

    def __init__(self) -> None:
        self.data: dict[str, bytes] = {}
        self.cond = threading.Condition()

    def __setitem__(self, key: str, value: bytes) -> None:
        with self.cond:
            self.data[key] = value
            self.cond.notify_all()

    def wait(self, key: str) -> bytes:
        with self.cond:
            assert self.cond.wait_for(lambda: key in self.data, timeout=10), key
            return self.data[key]


@pytest.mark.parametrize("framework", ["torch", "tensorflow"])
def test_yarn_address_exchange(framework: str, script_dir: Path) -> None:
    config = _config(script_dir, framework, "parameter_server", 2, 2, True, framework == "tensorflow")
    kv, results = FakeKV(), {}
    ports = iter(range(40000, 40100))

    def run(slot: Any) -> None:
        results[(slot.role, slot.index)] = yarn_addresses(config, slot.role, slot.index, kv,
                                                          host=f"node-{slot.role}-{slot.index}",
                                                          ports=lambda n: [next(ports) for _ in range(n)])

    threads = [threading.Thread(target=run, args=(s,)) for s in reversed(layout(config))]  # readers first
    for t in threads:
        t.start()
    for t in threads:
        t.join(20)
    assert len(results) == len(layout(config))
    if framework == "torch":
        assert {r[p.MASTER_ADDR] for r in results.values()} == {"node-ps-0"}
        assert len({r[p.MASTER_PORT] for r in results.values()}) == 1
    else:
        configs = {key: json.loads(r[p.TF_CONFIG]) for key, r in results.items()}
        clusters = {json.dumps(c["cluster"], sort_keys=True) for c in configs.values()}
        assert len(clusters) == 1
        cluster = json.loads(clusters.pop())
        assert set(cluster) == {"chief", "ps", "worker"}
        assert cluster["worker"][1].startswith("node-worker-1:")
        assert all(c["task"] == {"type": role, "index": i} for (role, i), c in configs.items())
    kv["shardkit/secret/TOKEN"] = b"abc"
    assert yarn_secrets("TOKEN", kv) == {"TOKEN": "abc"}
    assert yarn_secrets("", kv) == {}


class FakeApp:
    """The part of ``skein.ApplicationClient`` the master loop uses: containers finishing over time."""

    def __init__(self, rounds: list[list[tuple[str, int, str]]]) -> None:
        self.rounds = rounds

    def get_containers(self, services: list[str], states: list[str]) -> list[skein.model.Container]:
        done = self.rounds.pop(0) if len(self.rounds) > 1 else self.rounds[0]
        assert set(states) == {"SUCCEEDED", "FAILED", "KILLED"}
        return [skein.model.Container(service, i, state, f"container_{i}", "node:8042", None, None, "")
                for service, i, state in done if service in services]


def test_yarn_master(script_dir: Path) -> None:
    tf_ps = _config(script_dir, "tensorflow", "parameter_server", 2, 1, True, False)
    sleeps: list[float] = []
    app = FakeApp([[], [("worker", 0, "SUCCEEDED")], [("chief", 0, "SUCCEEDED")]])
    assert yarn_master(tf_ps, app, poll=0.5, sleep=sleeps.append) == 0  # the chief drives a TF ps job
    assert sleeps == [0.5, 0.5]
    allreduce = _config(script_dir, "torch", "allreduce", 2, 0, False, False)
    app = FakeApp([[("worker", 0, "SUCCEEDED")], [("worker", 0, "SUCCEEDED"), ("worker", 1, "FAILED")]])
    assert yarn_master(allreduce, app, sleep=lambda s: None) == 1


# -- the rendered PyTorchJob's container command, run as the operator would ------------------------


@pytest.mark.slow
@pytest.mark.distributed
@pytest.mark.timeout(240)
def test_pytorchjob_command_trains(tmp_path: Path) -> None:
    """Two "pods" on this machine: the container command of the rendered digits PyTorchJob, with the
    job.json of its ConfigMap and the environment the Kubeflow operator injects (envvar.go:
    MASTER_ADDR, MASTER_PORT, WORLD_SIZE, RANK, PYTHONUNBUFFERED), trains and checkpoints."""
    from shardkit.job.layout import free_ports

    subprocess.run([sys.executable, str(ROOT / "examples" / "make_digits.py"), str(tmp_path / "digits")],
                   check=True, capture_output=True, timeout=120)
    config = load_config(ROOT / "examples" / "digits.yaml", [
        f"engine.image={IMAGE}", f"engine.workdir={ROOT / 'examples'}", f"engine.python={sys.executable}",
        f"data.url={tmp_path / 'digits'}", "data.num_epochs=1", f"checkpoint.dir={tmp_path / 'ckpt'}",
        "checkpoint.every_steps=10"])
    files = render(config, engine="kubernetes")
    job = yaml.safe_load(files["digits-pytorchjob.yaml"])
    configmap = yaml.safe_load(files["digits-config.yaml"])
    (tmp_path / "job.json").write_text(configmap["data"]["job.json"])
    port = free_ports(1)[0]
    procs = []
    try:
        for rtype, spec in job["spec"]["pytorchReplicaSpecs"].items():
            for i in range(spec["replicas"]):
                container = spec["template"]["spec"]["containers"][0]
                env = {**os.environ, **{e["name"]: e["value"] for e in container["env"]},
                       "SHARDKIT_JOB_CONFIG": str(tmp_path / "job.json"), "PYTHONUNBUFFERED": "0",
                       "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port), "WORLD_SIZE": "2",
                       "RANK": str(i + (1 if rtype == "Worker" else 0))}
                procs.append(subprocess.Popen(container["command"], cwd=container["workingDir"], env=env,
                                              stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                                              start_new_session=True))
        outputs = [proc.communicate(timeout=200)[0].decode() for proc in procs]
    finally:
        for proc in procs:
            if proc.poll() is None:
                os.killpg(proc.pid, signal.SIGKILL)
                proc.wait()
    assert [proc.returncode for proc in procs] == [0, 0], outputs
    assert "rank 0/2" in outputs[0]
    assert "rank 1/2" in outputs[1]
    assert "test accuracy" in outputs[0]
    assert any((tmp_path / "ckpt").glob("step-*/COMMIT"))
