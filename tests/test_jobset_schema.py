"""The Kubernetes recipe (cluster/kubernetes/jobset.yaml) against the JobSet v1alpha2 schema,
and its meshtrain command and variables against meshtrain's own parser. No cluster runs.

Two checks, because the API server does two things with a custom resource: it validates the
object against the CRD's structural schema (types, ``required``, ``enum``), and it silently
drops every field the schema does not know (pruning). A misspelt key passes the first check
and is then lost, so `unknown_keys` walks the recipe beside the schema to catch it.
"""

import copy
import json
import pathlib

import jsonschema
import pytest
import yaml

from meshtrain import cli
from meshtrain.cli import parsing
from meshtrain.cli import train as train_cli
from meshtrain.distributed import ENV_VARS
from meshtrain.mesh import MeshConfig, host_layout
from meshtrain.train.events import RESTART_VAR

ROOT = pathlib.Path(__file__).resolve().parents[1]
RECIPE = ROOT / "cluster" / "kubernetes" / "jobset.yaml"
SCHEMA = ROOT / "tests" / "fixtures" / "jobset_v1alpha2_schema.json"
# The root metadata is ObjectMeta, which the API server checks itself (the CRD says only
# "object"): the fields of it a recipe may set.
_STRING = {"type": "string"}
_STRING_MAP = {"type": "object", "additionalProperties": _STRING}
OBJECT_META = {
    "type": "object",
    "properties": {
        "name": _STRING,
        "namespace": _STRING,
        "generateName": _STRING,
        "labels": _STRING_MAP,
        "annotations": _STRING_MAP,
    },
}
PRESERVE = "x-kubernetes-preserve-unknown-fields"


def _schema() -> dict:
    """The fixture, with ObjectMeta's fields in place of the root's bare ``metadata``."""
    schema = json.loads(SCHEMA.read_text())
    schema["properties"]["metadata"] = OBJECT_META
    return schema


def _without_extensions(node):
    """A schema without the ``x-kubernetes-*`` markers (CEL rules, list types) jsonschema
    does not know."""
    if isinstance(node, dict):
        return {k: _without_extensions(v) for k, v in node.items() if not k.startswith("x-")}
    if isinstance(node, list):
        return [_without_extensions(v) for v in node]
    return node


def _recipe() -> dict:
    """The recipe, freshly read (each test may change its copy)."""
    return yaml.safe_load(RECIPE.read_text())


def schema_errors(doc: dict, schema: dict) -> list[str]:
    """Where `doc` breaks the structural schema (types, required, enum), one line each.

    Kubernetes' structural schemas are OpenAPI 3.0 schema objects, whose validation keywords
    are JSON Schema draft 4's (``exclusiveMinimum`` a boolean, no ``const``)."""
    validator = jsonschema.Draft4Validator(_without_extensions(schema))
    errors = sorted(validator.iter_errors(doc), key=lambda e: list(e.absolute_path))
    return [f"{'.'.join(map(str, e.absolute_path))}: {e.message}" for e in errors]


def unknown_keys(doc, schema: dict, path: str = "") -> list[str]:
    """The paths of the keys in `doc` that the schema does not know at their position, which
    the API server would silently drop."""
    if schema.get(PRESERVE):
        return []
    if isinstance(doc, list):
        item = schema.get("items", {})
        return [k for i, v in enumerate(doc) for k in unknown_keys(v, item, f"{path}[{i}]")]
    if not isinstance(doc, dict):
        return []
    found = []
    for key, value in doc.items():
        where = f"{path}.{key}" if path else key
        child = schema.get("properties", {}).get(key)
        if child is None and isinstance(schema.get("additionalProperties"), dict):
            child = schema["additionalProperties"]
        if child is None:
            found.append(where)
        else:
            found += unknown_keys(value, child, where)
    return found


def _named_keys(doc, schema: dict, path: tuple = ()):
    """Every key path in `doc` that the schema names in ``properties`` (not map entries)."""
    if isinstance(doc, list):
        for i, v in enumerate(doc):
            yield from _named_keys(v, schema.get("items", {}), (*path, i))
    elif isinstance(doc, dict):
        for key, value in doc.items():
            child = schema.get("properties", {}).get(key)
            if child is not None:
                yield (*path, key), schema["properties"]
                yield from _named_keys(value, child, (*path, key))


def _misspelt(doc: dict, path: tuple, known) -> tuple[dict, str]:
    """A copy of `doc` with the key at `path` misspelt (last letter dropped, or one added)."""
    bad = copy.deepcopy(doc)
    *head, key = path
    parent = bad
    for step in head:
        parent = parent[step]
    wrong = key[:-1] if key[:-1] not in known else key + "s"
    parent[wrong] = parent.pop(key)
    return bad, _dotted((*head, wrong))


def _dotted(path: tuple) -> str:
    """``("spec", "containers", 0, "name")`` as `unknown_keys` writes it:
    ``spec.containers[0].name``."""
    return "".join(f"[{s}]" if isinstance(s, int) else f".{s}" for s in path).lstrip(".")


def _container(doc: dict) -> dict:
    """The recipe's one container."""
    (job,) = doc["spec"]["replicatedJobs"]
    (container,) = job["template"]["spec"]["template"]["spec"]["containers"]
    return container


def test_fixture_is_the_jobset_v1alpha2_schema():
    schema = _schema()
    jsonschema.Draft4Validator.check_schema(_without_extensions(schema))
    assert "kubernetes-sigs/jobset v0.12.0" in schema["$comment"]
    spec = schema["properties"]["spec"]["properties"]
    assert spec["failurePolicy"]["properties"]["maxRestarts"]["type"] == "integer"
    assert SCHEMA.stat().st_size < 1_000_000


def test_recipe_validates_and_every_key_is_known():
    doc, schema = _recipe(), _schema()
    assert doc["apiVersion"] == "jobset.x-k8s.io/v1alpha2" and doc["kind"] == "JobSet"
    assert schema_errors(doc, schema) == []
    assert unknown_keys(doc, schema) == []


def test_every_misspelt_key_is_found():
    doc, schema = _recipe(), _schema()
    paths = list(_named_keys(doc, schema))
    assert len(paths) > 40  # the walk reaches the container's fields
    for path, known in paths:
        bad, where = _misspelt(doc, path, known)
        assert unknown_keys(bad, schema) == [where]
    # The schema alone lets a misspelt optional key through: the walk is what catches it.
    bad, _ = _misspelt(doc, ("spec", "failurePolicy", "maxRestarts"), {})
    assert bad["spec"]["failurePolicy"]["maxRestart"] == 3
    assert schema_errors(bad, schema) == []
    # A misspelt required key fails both checks.
    path = ("spec", "replicatedJobs", 0, "template", "spec", "template", "spec", "containers", 0)
    bad, _ = _misspelt(doc, (*path, "name"), {})
    assert unknown_keys(bad, schema) and any(
        "'name' is a required" in e for e in schema_errors(bad, schema)
    )


@pytest.mark.parametrize(
    "where, value",
    [
        (("spec", "failurePolicy", "maxRestarts"), "3"),
        (("spec", "failurePolicy", "restartStrategy"), "Restart"),
        (("spec", "network", "enableDNSHostnames"), "true"),
        (("spec", "replicatedJobs", 0, "template", "spec", "completions"), "4"),
        (("spec", "replicatedJobs", 0, "template", "spec", "template", "spec", "containers"), {}),
    ],
    ids=["maxRestarts-string", "restartStrategy-enum", "dns-string", "completions", "containers"],
)
def test_a_wrong_type_or_value_fails_the_schema(where, value):
    doc, schema = _recipe(), _schema()
    parent = doc
    for step in where[:-1]:
        parent = parent[step]
    parent[where[-1]] = value
    errors = schema_errors(doc, schema)
    assert len(errors) == 1 and errors[0].startswith(".".join(map(str, where)) + ":"), errors


def test_recipe_command_parses_and_fits_its_pods():
    doc = _recipe()
    (job,) = doc["spec"]["replicatedJobs"]
    pods = job["template"]["spec"]
    container = _container(doc)
    command = container["command"] + container.get("args", [])
    assert command[:2] == ["meshtrain", "train"]
    train = cli.parse(command[1:])
    train_cli.check(train, parsing.given(command[2:], train_cli.TrainJob))
    env = {e["name"]: e for e in container["env"]}
    nproc = int(env["MESHTRAIN_NUM_PROCESSES"]["value"])
    assert nproc == pods["completions"] == pods["parallelism"] and job["replicas"] == 1
    gpus = int(container["resources"]["limits"]["nvidia.com/gpu"])
    assert train.devices == 0  # the pod's GPUs, not simulated devices
    host_layout(MeshConfig.parse(train.mesh).sizes(nproc * gpus), nproc, gpus)  # raises if not
    # Every attempt resumes the same run on the shared volume.
    (mount,) = container["volumeMounts"]
    assert train.checkpoint.resume and train.train.run_dir.startswith(mount["mountPath"] + "/")
    pod = pods["template"]["spec"]
    (volume,) = [v for v in pod["volumes"] if v["name"] == mount["name"]]
    assert volume["persistentVolumeClaim"]["claimName"]
    # A pod never restarts alone: one failure fails the Job, and the JobSet restarts them all.
    assert pod["restartPolicy"] == "Never" and pods["backoffLimit"] == 0
    assert doc["spec"]["failurePolicy"]["maxRestarts"] > 0
    assert pod["terminationGracePeriodSeconds"] > 30  # Kubernetes' default is 30 s


def test_recipe_variables_are_the_ones_meshtrain_reads():
    doc = _recipe()
    env = {e["name"]: e for e in _container(doc)["env"]}
    assert set(env) <= {*ENV_VARS.values(), RESTART_VAR}, set(env)
    name, job = doc["metadata"]["name"], doc["spec"]["replicatedJobs"][0]["name"]
    subdomain = doc["spec"]["network"].get("subdomain", name)
    assert doc["spec"]["network"]["enableDNSHostnames"] is True
    host, port = env["MESHTRAIN_COORDINATOR"]["value"].rsplit(":", 1)
    assert host == f"{name}-{job}-0-0.{subdomain}" and port.isdigit()

    def annotation(var):
        return env[var]["valueFrom"]["fieldRef"]["fieldPath"]

    index = "metadata.annotations['batch.kubernetes.io/job-completion-index']"
    assert annotation("MESHTRAIN_PROCESS_ID") == index
    assert annotation(RESTART_VAR) == "metadata.annotations['jobset.sigs.k8s.io/restart-attempt']"
