"""Test helper: check a custom object against a CRD the way the API server would, without an API server.

``validate_custom_object(obj, crd)`` follows the API server's order for a create
(https://kubernetes.io/docs/tasks/extend-kubernetes/custom-resources/custom-resource-definitions/):
1. apiVersion/kind must name the CRD's group, a served version and its kind;
2. pruning: explicit nulls are dropped silently (as the API server does for non-nullable fields); unknown fields are
   REPORTED as "would be pruned". Kubernetes drops them without an error, but in a manifest they are almost always a
   typo (``replica:``) that silently does nothing, and spec.py's models forbid extra fields, so a sample carrying one
   is a bug we want a test to see. ``metadata`` (ObjectMeta, validated by the API server itself) and subtrees marked
   ``x-kubernetes-preserve-unknown-fields`` are not pruned;
3. defaulting from the schema's ``default`` values;
4. OpenAPI validation with ``jsonschema`` (Draft 4, the dialect of OpenAPI v3 schemas), after translating
   ``x-kubernetes-int-or-string`` to ``anyOf: [integer, string]`` and dropping other ``x-kubernetes-*`` keywords;
5. every ``x-kubernetes-validations`` CEL rule on a node present in the object, evaluated with cel-python
   (``celpy``); a failing rule reports its ``messageExpression`` (else ``message``), like the API server.

Not modelled: CEL cost limits, transition rules (``oldSelf``), list-type uniqueness (``x-kubernetes-list-type``),
ObjectMeta validation (name format) beyond what root CEL rules check.
"""

from __future__ import annotations

import copy
from typing import Any

import celpy
import jsonschema

_NOT_PRUNED_AT_ROOT = ("apiVersion", "kind", "metadata")


def _path(parts: list[Any]) -> str:
    """Kubernetes-style field path: spec.placement.tolerations[0].key."""
    out = ""
    for part in parts:
        out += f"[{part}]" if isinstance(part, int) else (f".{part}" if out else str(part))
    return out or "<root>"


def _prune(value: Any, schema: dict[str, Any], parts: list[Any], pruned: list[str]) -> Any:
    """Drop nulls and unknown fields (recording the unknown ones in ``pruned``); returns the pruned copy."""
    if schema.get("x-kubernetes-preserve-unknown-fields"):
        return value
    if isinstance(value, dict):
        out = {}
        props = schema.get("properties")
        extra = schema.get("additionalProperties")
        for key, item in value.items():
            if item is None:
                continue
            if not parts and key in _NOT_PRUNED_AT_ROOT:
                out[key] = item  # ObjectMeta is the API server's own business
            elif props is not None and key in props:
                out[key] = _prune(item, props[key], [*parts, key], pruned)
            elif isinstance(extra, dict):
                out[key] = _prune(item, extra, [*parts, key], pruned)
            else:
                pruned.append(_path([*parts, key]))
        return out
    if isinstance(value, list) and isinstance(schema.get("items"), dict):
        return [_prune(item, schema["items"], [*parts, i], pruned) for i, item in enumerate(value) if item is not None]
    return value


def apply_defaults(value: Any, schema: dict[str, Any]) -> None:
    """Fill missing properties that have a schema default, in place (the API server defaults before validating)."""
    if isinstance(value, dict):
        for key, prop in (schema.get("properties") or {}).items():
            if key not in value and "default" in prop:
                value[key] = copy.deepcopy(prop["default"])
            if key in value:
                apply_defaults(value[key], prop)
        extra = schema.get("additionalProperties")
        if isinstance(extra, dict):
            for item in value.values():
                apply_defaults(item, extra)
    elif isinstance(value, list) and isinstance(schema.get("items"), dict):
        for item in value:
            apply_defaults(item, schema["items"])


def to_jsonschema(schema: dict[str, Any]) -> dict[str, Any]:
    """Translate a structural openAPIV3Schema into plain JSON Schema (Draft 4) for ``jsonschema``."""
    out: dict[str, Any] = {}
    for key, value in schema.items():
        if key == "x-kubernetes-int-or-string" and value:
            out["anyOf"] = [{"type": "integer"}, {"type": "string"}]
        elif key.startswith("x-kubernetes-"):
            continue
        elif key == "properties":
            out[key] = {k: to_jsonschema(v) for k, v in value.items()}
        elif key in ("items", "additionalProperties") and isinstance(value, dict):
            out[key] = to_jsonschema(value)
        elif key == "nullable":
            continue  # handled by pruning nulls before validation (this CRD has no nullable fields)
        else:
            out[key] = value
    return out


def _cel_errors(value: Any, schema: dict[str, Any], parts: list[Any], env: celpy.Environment) -> list[str]:
    """Evaluate every x-kubernetes-validations rule on nodes present in ``value``."""
    errors: list[str] = []
    for rule in schema.get("x-kubernetes-validations", []):
        where = _path(parts) + rule.get("fieldPath", "")
        activation = {"self": celpy.json_to_cel(value)}
        try:
            ok = env.program(env.compile(rule["rule"])).evaluate(activation)
        except celpy.CELEvalError as exc:
            errors.append(f"{where}: rule {rule['rule']!r} could not be evaluated: {exc.args[0]}")
            continue
        if not isinstance(ok, celpy.celtypes.BoolType):
            errors.append(f"{where}: rule {rule['rule']!r} returned {ok!r}, not a bool")
        elif not ok:
            message = rule.get("message") or f"failed rule: {rule['rule']}"
            if "messageExpression" in rule:
                try:
                    message = str(env.program(env.compile(rule["messageExpression"])).evaluate(activation))
                except celpy.CELEvalError:
                    pass  # the API server also falls back to message
            errors.append(f"{where}: Invalid value: {message}")
    if isinstance(value, dict):
        props = schema.get("properties") or {}
        extra = schema.get("additionalProperties")
        for key, item in value.items():
            sub = props.get(key) if key in props else (extra if isinstance(extra, dict) else None)
            if sub is not None:
                errors += _cel_errors(item, sub, [*parts, key], env)
    elif isinstance(value, list) and isinstance(schema.get("items"), dict):
        for i, item in enumerate(value):
            errors += _cel_errors(item, schema["items"], [*parts, i], env)
    return errors


def _version(obj: dict[str, Any], crd: dict[str, Any]) -> tuple[dict[str, Any] | None, list[str]]:
    spec = crd["spec"]
    group, kind = spec["group"], spec["names"]["kind"]
    api_version = obj.get("apiVersion", "")
    obj_group, _, version = api_version.rpartition("/")
    errors = []
    if obj.get("kind") != kind:
        errors.append(f"kind: {obj.get('kind')!r} is not {kind!r}")
    if obj_group != group:
        errors.append(f"apiVersion: {api_version!r} is not in group {group!r}")
    served = {v["name"]: v for v in spec["versions"] if v.get("served")}
    if version not in served:
        errors.append(f"apiVersion: version {version!r} is not served (served: {sorted(served)})")
        return None, errors
    return served[version], errors


def validate_custom_object(obj: dict[str, Any], crd: dict[str, Any]) -> list[str]:
    """Errors the API server would report for creating ``obj`` under ``crd``, plus fields it would prune.

    Returns a list of messages, each starting with the field path (e.g. ``spec.router.loadFactor: ...``);
    empty means valid. ``obj`` is not modified.
    """
    version, errors = _version(obj, crd)
    if version is None:
        return errors
    schema = version["schema"]["openAPIV3Schema"]
    if not isinstance(obj.get("metadata"), dict) or not obj["metadata"].get("name"):
        errors.append("metadata.name: Required value")
        return errors

    pruned: list[str] = []
    value = _prune(copy.deepcopy(obj), schema, [], pruned)
    errors += [f"{p}: unknown field, would be pruned by the API server" for p in pruned]
    apply_defaults(value, schema)

    validator = jsonschema.Draft4Validator(to_jsonschema(schema))
    schema_errors: list[str] = []
    for err in sorted(validator.iter_errors(value), key=lambda e: [str(p) for p in e.absolute_path]):
        parts = list(err.absolute_path)
        if err.validator == "required":
            # Like the API server: name the missing field itself ("spec.autoscaling.maxReplicas: Required value").
            for name in err.validator_value:
                message = f"{_path([*parts, name])}: Required value"
                if name not in err.instance and message not in schema_errors:
                    schema_errors.append(message)
        else:
            schema_errors.append(f"{_path(parts)}: {err.message}")
    if schema_errors:
        # The API server skips CEL when the object has blocking (type) errors; this helper skips it on any.
        return errors + schema_errors
    return errors + _cel_errors(value, schema, [], celpy.Environment())
